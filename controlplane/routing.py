"""Websocket URL patterns of every app, gathered in one place."""

from django.urls import URLPattern, URLResolver

websocket_urlpatterns: list[URLPattern | URLResolver] = []
