"""Websocket URL patterns of every app, gathered in one place."""

from django.urls import URLPattern, URLResolver, re_path

from scheduling.consumers import LiveConsumer

websocket_urlpatterns: list[URLPattern | URLResolver] = [
    re_path(r"^ws/live/(?P<group>[A-Za-z0-9_.-]{1,80})/$", LiveConsumer.as_asgi()),
]
