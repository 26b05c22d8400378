"""Scheduling pages (the REST API is in scheduling/api.py)."""

from django.urls import path

from scheduling import views
from scheduling.views import whatif

urlpatterns = [
    path("decisions/", views.decision_list_page, name="decision-list"),
    path("policies/", views.policy_list_page, name="policy-list"),
    path("kv/", views.kv_calculator_page, name="kv-calculator"),
    path("whatif/", whatif.whatif_page, name="whatif"),
    path("whatif/run/", whatif.whatif_start_page, name="whatif-start"),
    path("whatif/<int:run_id>/", whatif.whatif_run_page, name="whatif-run"),
]
