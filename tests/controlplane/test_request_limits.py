"""Large uploads are refused before they are read: the attack of issue 13 (an unauthenticated
315 MB chunked upload was spooled to disk before the 403), played against the real ASGI app.

The client side is an endless chunked body (64 KiB a message, as a server hands it on) whose
consumption is counted: what the app pulled is what a server would have read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import orjson
import pytest
from django.conf import settings

from controlplane.asgi import application
from tests.factories import api_token

CHUNK = b"x" * 65536
ATTACK_BYTES = 315 * 2**20

pytestmark = pytest.mark.django_db(transaction=True)


async def upload(
    path: str, headers: list[tuple[bytes, bytes]], total: int = ATTACK_BYTES
) -> tuple[int, dict[str, Any], int]:
    """POST a chunked body of ``total`` bytes: (status, JSON answer, bytes the app pulled)."""
    pulled = 0
    sent: list[Mapping[str, Any]] = []

    async def receive() -> Mapping[str, Any]:
        nonlocal pulled
        if pulled >= total:
            await asyncio.Event().wait()  # a client that sent it all waits for the answer
        pulled += len(CHUNK)
        return {"type": "http.request", "body": CHUNK, "more_body": pulled < total}

    async def send(message: Mapping[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1"), (b"transfer-encoding", b"chunked"), *headers],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    await application(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], orjson.loads(body), pulled


async def test_an_unauthenticated_upload_is_refused_unread() -> None:
    status, answer, pulled = await upload("/api/v1/telemetry", [])
    assert (status, answer["code"]) == (401, "unauthorized")
    assert pulled == 0


async def test_an_upload_with_a_bad_token_to_the_route_fast_path_is_refused_unread() -> None:
    status, answer, pulled = await upload("/api/v1/route", [(b"authorization", b"Bearer nope")])
    assert (status, answer["code"]) == (401, "unauthorized")
    assert pulled == 0


async def test_a_declared_oversized_body_is_refused_unread() -> None:
    declared = [(b"content-length", str(ATTACK_BYTES).encode())]
    status, answer, pulled = await upload("/api/v1/telemetry", declared)
    assert (status, answer["code"]) == (413, "payload_too_large")
    assert pulled == 0


async def test_an_authenticated_chunked_upload_stops_being_read_at_the_limit() -> None:
    from asgiref.sync import sync_to_async

    _, secret = await sync_to_async(api_token)("agent")
    auth = [(b"authorization", f"Bearer {secret}".encode())]
    status, answer, pulled = await upload("/api/v1/telemetry", auth)
    assert (status, answer["code"]) == (413, "payload_too_large")
    assert pulled <= settings.API_MAX_BODY_BYTES + len(CHUNK)


async def test_a_page_upload_stops_being_read_at_djangos_form_limit() -> None:
    status, answer, pulled = await upload("/accounts/login/", [])
    assert (status, answer["code"]) == (413, "payload_too_large")
    assert pulled <= settings.DATA_UPLOAD_MAX_MEMORY_SIZE + len(CHUNK)


async def test_a_body_within_the_limit_reaches_the_api() -> None:
    # 128 KiB of non-JSON from an unknown token: the API's strict JSON check answers (400, in
    # the error shape), having read it all.
    status, answer, pulled = await upload(
        "/api/v1/telemetry", [(b"authorization", b"Bearer nope")], total=2 * len(CHUNK)
    )
    assert (status, answer["code"]) == (400, "http_400")
    assert pulled == 2 * len(CHUNK)


async def test_a_body_dripped_slower_than_its_deadline_gets_408_and_is_let_go(settings) -> None:
    settings.HTTP_BODY_TIMEOUT_S = 0.5
    pulled = 0
    sent: list[Mapping[str, Any]] = []

    async def receive() -> Mapping[str, Any]:
        nonlocal pulled
        await asyncio.sleep(0.2)  # one byte every 0.2 s, for ever
        pulled += 1
        return {"type": "http.request", "body": b"x", "more_body": True}

    async def send(message: Mapping[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/api/v1/telemetry",
        "headers": [(b"host", b"127.0.0.1"), (b"authorization", b"Bearer nope")],
        "query_string": b"",
        "scheme": "http",
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "root_path": "",
        "raw_path": b"/api/v1/telemetry",
    }
    await application(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 408
    assert (b"connection", b"close") in start["headers"]
    assert pulled < 10  # the app stopped reading at the deadline
