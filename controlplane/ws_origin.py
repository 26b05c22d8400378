"""Which pages may open the live-view websockets: the cross-site check for websockets.

Browsers send cookies with a websocket opened from any site, so the ``Origin`` header is the
only thing that tells our pages from another site's script riding an operator's session.
With ``ALLOWED_HOSTS`` listing hosts, an origin must match one of them (Channels' own rule).
With ``ALLOWED_HOSTS=*`` (the development default) Channels would accept every origin; here
the origin must then be the host the socket was opened on: our own pages, nobody else's.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import ParseResult, urlparse

from asgiref.typing import ASGI3Application, ASGIReceiveCallable, ASGISendCallable, Scope
from channels.security.websocket import OriginValidator, WebsocketDenier
from django.conf import settings

DEFAULT_PORTS = {"http": "80", "ws": "80", "https": "443", "wss": "443"}


def _headers(scope: Scope) -> Iterable[tuple[bytes, bytes]]:
    return scope["headers"] if scope["type"] != "lifespan" else ()


def _origin(scope: Scope) -> ParseResult | None:
    for name, value in _headers(scope):
        if name == b"origin":
            try:
                return urlparse(value.decode("latin-1"))
            except (UnicodeDecodeError, ValueError):
                return None
    return None


def _host(scope: Scope) -> str:
    for name, value in _headers(scope):
        if name == b"host":
            return str(value.decode("latin-1")).lower()
    return ""


def same_origin(origin: ParseResult | None, host: str) -> bool:
    """Whether ``origin`` names ``host`` (the Host header; a default port may be left out)."""
    if origin is None or not origin.hostname or not host:
        return False
    netloc = origin.netloc.lower()
    port = DEFAULT_PORTS.get(origin.scheme)
    return (
        netloc == host
        or (port is not None and f"{netloc}:{port}" == host)
        or (port is not None and netloc == f"{host}:{port}")
    )


def websocket_origin_checked(app: ASGI3Application) -> ASGI3Application:
    """Wrap the websocket app: a socket from another origin is denied before it is accepted."""
    allowed = list(settings.ALLOWED_HOSTS)
    if settings.DEBUG and not allowed:
        allowed = ["localhost", "127.0.0.1", "[::1]"]
    any_host = "*" in allowed
    listed = OriginValidator(app, [p for p in allowed if p != "*"])

    async def check(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        origin = _origin(scope)
        ok = same_origin(origin, _host(scope)) if any_host else listed.valid_origin(origin)
        if ok:
            await app(scope, receive, send)
        else:
            await WebsocketDenier()(scope, receive, send)

    return check
