"""ASGI entry point: HTTP through Django, websockets through Channels (authenticated). Every
server process loads this module once, so the process-wide tuning is said here, once."""

import gc
import os
from typing import cast

from asgiref.typing import ASGI3Application
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

# Django types its handler with plain dicts; it is an ASGI 3 application.
django_http = cast(ASGI3Application, django_asgi_app)
application = ProtocolTypeRouter(
    {
        # Bodies are bounded before anyone reads them (controlplane.request_limits); bearer-token
        # route calls then skip Django's sync middleware (see scheduling.fastpath).
        "http": request_body_bounded(route_fast_path(django_http)),
        # Only our own pages may open a socket (controlplane.ws_origin), then the session.
        "websocket": websocket_origin_checked(
            AuthMiddlewareStack(URLRouter(websocket_urlpatterns))
        ),
    }
)

# A route call allocates many short-lived objects, all acyclic and freed by reference counting:
# with the default gen-0 threshold (700) the collector ran every few decisions, and its older
# generations scanned the whole Django heap each time (docs/performance.md has the measurement).
# So the heap built at start-up (apps, URL conf, models) is moved out of the collector's sight,
# and young objects are collected less often.
GC_THRESHOLDS = (20_000, 20, 20)
gc.collect()
gc.freeze()
gc.set_threshold(*GC_THRESHOLDS)
