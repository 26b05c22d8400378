"""The little ASGI the fleet's HTTP programs share (the gateway, the fake engine): whole
responses, JSON responses, and the types of an ASGI callable. No framework: these programs
sit on the request path, where a framework's per-request work is measurable."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


async def response_send(
    send: Send,
    status: int,
    payload: bytes,
    content_type: bytes = b"application/json",
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """A whole response: status, content type and length, any other ``headers``, body."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(payload)).encode()),
                *(headers or ()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


async def json_send(send: Send, status: int, data: Any) -> None:
    await response_send(send, status, orjson.dumps(data))


async def disconnect_wait(receive: Receive) -> None:
    """Until the client goes away (after the body, ASGI servers say so on receive)."""
    while (await receive())["type"] != "http.disconnect":
        pass
