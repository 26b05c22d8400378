"""Inventory pages (the REST API is in clusters/api)."""

from django.urls import path, re_path

from clusters import views

urlpatterns = [
    path("clusters/", views.cluster_list_page, name="cluster-list"),
    path("clusters/<int:cluster_id>/", views.cluster_detail_page, name="cluster-detail"),
    re_path(
        r"^instances/(?P<instance_id>[0-9]+)/(?P<action>drain|activate)/$",
        views.instance_state_page,
        name="instance-state",
    ),
    path("links/", views.link_list_page, name="link-list"),
    path("links/<int:link_id>/", views.link_detail_page, name="link-detail"),
]
