"""Operator pages of the scheduling app: overview, fleet (clusters, instances, links),
decisions, policies, plans and what-if (the REST API is in scheduling/api/)."""

from django.urls import path, re_path

from scheduling import views
from scheduling.views import fleet, plans, whatif

urlpatterns = [
    path("", views.overview_page, name="overview"),
    path("clusters/", fleet.cluster_list_page, name="cluster-list"),
    path("clusters/<int:cluster_id>/", fleet.cluster_detail_page, name="cluster-detail"),
    re_path(
        r"^instances/(?P<instance_id>[0-9]+)/(?P<action>drain|activate)/$",
        fleet.instance_state_page,
        name="instance-state",
    ),
    path("links/", fleet.link_list_page, name="link-list"),
    path("links/<int:link_id>/", fleet.link_detail_page, name="link-detail"),
    path("decisions/", views.decision_list_page, name="decision-list"),
    path("alerts/", views.alert_list_page, name="alert-list"),
    path("policies/", views.policy_list_page, name="policy-list"),
    path("kv/", views.kv_calculator_page, name="kv-calculator"),
    path("plans/", plans.plan_list_page, name="plan-list"),
    path("plans/<int:plan_id>/", plans.plan_detail_page, name="plan-detail"),
    re_path(
        r"^plans/(?P<plan_id>[0-9]+)/(?P<action>approve|reject|rollback)/$",
        plans.plan_action_page,
        name="plan-action",
    ),
    path("whatif/", whatif.whatif_page, name="whatif"),
    path("whatif/run/", whatif.whatif_start_page, name="whatif-start"),
    path("whatif/<int:run_id>/", whatif.whatif_run_page, name="whatif-run"),
]
