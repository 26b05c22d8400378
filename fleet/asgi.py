"""The little ASGI the fleet's HTTP programs share (the gateway, the fake engine): whole
responses, JSON responses, and the types of an ASGI callable. No framework: these programs
sit on the request path, where a framework's per-request work is measurable."""

from __future__ import annotations

from typing import Any

import orjson
from asgiref.typing import ASGIReceiveCallable as Receive
from asgiref.typing import ASGISendCallable as Send
from asgiref.typing import HTTPResponseBodyEvent, HTTPResponseStartEvent, HTTPScope, Scope

__all__ = ["HTTPScope", "Receive", "Scope", "Send"]


def start_event(status: int, headers: list[tuple[bytes, bytes]]) -> HTTPResponseStartEvent:
    return {"type": "http.response.start", "status": status, "headers": headers, "trailers": False}


def body_event(body: bytes, more: bool = False) -> HTTPResponseBodyEvent:
    return {"type": "http.response.body", "body": body, "more_body": more}


async def response_send(
    send: Send,
    status: int,
    payload: bytes,
    content_type: bytes = b"application/json",
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """A whole response: status, content type and length, any other ``headers``, body."""
    length = str(len(payload)).encode()
    own = [(b"content-type", content_type), (b"content-length", length)]
    await send(start_event(status, [*own, *(headers or ())]))
    await send(body_event(payload))


async def json_send(send: Send, status: int, data: Any) -> None:
    await response_send(send, status, orjson.dumps(data))


async def disconnect_wait(receive: Receive) -> None:
    """Until the client goes away (after the body, ASGI servers say so on receive)."""
    while (await receive())["type"] != "http.disconnect":
        pass
