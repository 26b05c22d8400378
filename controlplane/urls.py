"""URL map: pages, admin, the versioned API and its docs."""

from django.contrib import admin
from django.urls import path
from django.views.generic import RedirectView

from controlplane.api import api
from scheduling.metrics import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", api.urls),
    path("metrics", metrics_view, name="metrics"),
    path("api/docs", RedirectView.as_view(url="/api/v1/docs", permanent=False)),
]
