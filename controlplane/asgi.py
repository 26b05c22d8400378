"""ASGI entry point: HTTP through Django, websockets through Channels (authenticated)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
django_asgi_app = get_asgi_application()

# Imported after Django is set up: routing modules import models.
from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from controlplane.request_limits import request_body_bounded  # noqa: E402
from controlplane.ws_origin import websocket_origin_checked  # noqa: E402
from scheduling.fastpath import route_fast_path  # noqa: E402
from scheduling.ws_urls import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        # Bodies are bounded before anyone reads them (controlplane.request_limits); bearer-token
        # route calls then skip Django's sync middleware (see scheduling.fastpath).
        "http": request_body_bounded(route_fast_path(django_asgi_app)),
        # Only our own pages may open a socket (controlplane.ws_origin), then the session.
        "websocket": websocket_origin_checked(
            AuthMiddlewareStack(URLRouter(websocket_urlpatterns))
        ),
    }
)
