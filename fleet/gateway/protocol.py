"""vLLM's disaggregated prefill protocols, as request bodies and two upstream calls.

A request is served in two steps, on the instances the decision names (local requests too:
a PD cluster is itself disaggregated into prefill and decode instances):

1. **prefill**: the client's request with ``max_tokens`` 1, not streamed, to the prefill
   instance. With NixlConnector it also carries ``kv_transfer_params`` asking the engine to
   keep the KV for a remote decoder (``do_remote_decode: true``); the answer's
   ``kv_transfer_params`` say where the KV is (engine id, block ids, host, port). With a
   shared-storage connector (ExampleConnector, LMCache) the engine writes the KV to the shared
   store by itself and the answer carries nothing for decode.
2. **decode**: the client's request unchanged, to the decode instance, with the
   ``kv_transfer_params`` prefill returned (NixlConnector: the decoder pulls the KV) or as is
   (shared storage: the decoder finds the KV by the prompt's tokens). Streamed back.

Both steps carry the same ``X-Request-Id``. This is what vLLM's own proxies do
(``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``,
``examples/online_serving/disaggregated_serving/``): ``min_tokens`` and ``stream_options`` are
not sent to prefill, ``max_completion_tokens`` is set to 1 when present.

A **cache transfer** (the decision moves a cached prefix from another cluster's instance to
the prefill instance) is one more handoff of the same kind, for the prefix's tokens only: the
prefix as a prefill to the holder, then as a "decode" of one token to the prefill instance,
which thereby holds the prefix in its prefix cache before step 1.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson

from fleet.gateway.upstream import Response, TooLarge, Upstream

NIXL = "nixl"
SHARED_STORAGE = "shared_storage"

# What vLLM's NixlConnector reads on a prefill that keeps its KV for a remote decoder.
NIXL_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_NOT_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_body(body: Mapping[str, Any], connector: str) -> dict[str, Any]:
    """Step 1's body: one token, not streamed, KV kept for the decoder."""
    out = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    if connector == NIXL:
        out["kv_transfer_params"] = dict(NIXL_PREFILL_PARAMS)
    else:
        out.pop("kv_transfer_params", None)
    return out


def decode_body(
    body: Mapping[str, Any], connector: str, kv_params: Mapping[str, Any] | None
) -> dict[str, Any]:
    """Step 2's body: the client's request, with where to find the KV (NixlConnector)."""
    out = dict(body)
    if connector == NIXL and kv_params:
        out["kv_transfer_params"] = dict(kv_params)
    else:
        out.pop("kv_transfer_params", None)
    return out


class UpstreamError(Exception):
    """An engine call that failed. ``retryable``: the instance failed (connection, timeout,
    5xx), so another instance may succeed; otherwise the request itself was refused (4xx),
    and ``status``/``body`` are the engine's answer to pass on."""

    def __init__(self, message: str, *, retryable: bool, status: int = 502, body: bytes = b""):
        super().__init__(message)
        self.retryable = retryable
        self.status = status
        self.body = body


class AnswerTooLarge(UpstreamError):
    """An answer longer than the caller takes (not read past that)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False, status=400)


class StreamedResponse:
    """A decode answer being read: status, content type, the body whole or in chunks, all
    within the step's deadline, and chunks at most ``idle_s`` apart (a hung stream); a
    time-out raises TimeoutError."""

    def __init__(self, response: Response, deadline: float, idle_s: float | None = None) -> None:
        self.response = response
        self.status = response.status
        self.content_type = response.content_type
        self._deadline = deadline
        self._idle_s = idle_s

    async def chunks(self) -> AsyncIterator[bytes]:
        if self._idle_s is None:
            async with asyncio.timeout_at(self._deadline):
                async for chunk in self.response.chunks():
                    yield chunk
            return
        loop = asyncio.get_running_loop()
        source = aiter(self.response.chunks())
        while True:
            # (one timer per chunk: streams are paced by tokens, tens of ms apart at least)
            async with asyncio.timeout_at(min(self._deadline, loop.time() + self._idle_s)):
                try:
                    chunk = await anext(source)
                except StopAsyncIteration:
                    return
            yield chunk

    async def read(self) -> bytes:
        async with asyncio.timeout_at(self._deadline):
            return await self.response.read()

    def close(self) -> None:
        # Closing the connection is how vLLM learns the client is gone: it aborts the request.
        self.response.close()


_ERRORS = (OSError, TimeoutError, ValueError)


class Engines:
    """Pooled keep-alive HTTP to the engines (:mod:`fleet.gateway.upstream`), one per
    gateway process."""

    def __init__(self, connect_timeout_s: float) -> None:
        self._upstream = Upstream(connect_timeout_s)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        self._upstream.close()

    async def call_json(
        self,
        url: str,
        path: str,
        body: Mapping[str, Any],
        request_id: str,
        timeout_s: float,
        *,
        max_bytes: int | None = None,
    ) -> dict[str, Any]:
        """POST ``body``, read the whole JSON answer (the prefill step, /tokenize); an answer
        longer than ``max_bytes`` raises AnswerTooLarge without being read further."""
        where = url + path
        try:
            async with asyncio.timeout(timeout_s):
                resp = await self._upstream.request(
                    url, path, orjson.dumps(body), _id_header(request_id)
                )
                try:
                    raw = await resp.read(max_bytes)
                finally:
                    resp.close()  # a no-op once read whole; else frees its engine slot
        except TooLarge:
            raise AnswerTooLarge(f"{where}: answer longer than {max_bytes} bytes") from None
        except _ERRORS as exc:
            raise UpstreamError(f"{where}: {type(exc).__name__} {exc}", retryable=True) from None
        if resp.status >= 400:
            raise UpstreamError(
                f"{where}: HTTP {resp.status}",
                retryable=resp.status >= 500,
                status=resp.status,
                body=raw,
            )
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise UpstreamError(f"{where}: answer is not JSON", retryable=True) from None
        if not isinstance(data, dict):
            raise UpstreamError(f"{where}: answer is not a JSON object", retryable=True)
        return data

    async def open(
        self,
        url: str,
        path: str,
        body: Mapping[str, Any],
        request_id: str,
        timeout_s: float,
        *,
        first_byte_s: float | None = None,
        idle_s: float | None = None,
    ) -> StreamedResponse:
        """POST ``body`` and return as soon as the headers are in (the decode step), within
        ``first_byte_s`` when given; the rest to be read within ``timeout_s`` of now, its
        chunks at most ``idle_s`` apart. A 4xx or 5xx is read whole and raised as
        UpstreamError."""
        where = url + path
        now = asyncio.get_running_loop().time()
        deadline = now + timeout_s
        head_by = deadline if first_byte_s is None else min(deadline, now + first_byte_s)
        try:
            async with asyncio.timeout_at(head_by):
                resp = await self._upstream.request(
                    url, path, orjson.dumps(body), _id_header(request_id)
                )
        except _ERRORS as exc:
            raise UpstreamError(f"{where}: {type(exc).__name__} {exc}", retryable=True) from None
        if resp.status >= 400:
            try:
                async with asyncio.timeout_at(deadline):
                    raw = await resp.read()
            except _ERRORS:
                raw = b""
            finally:
                resp.close()
            raise UpstreamError(
                f"{where}: HTTP {resp.status}",
                retryable=resp.status >= 500,
                status=resp.status,
                body=raw,
            )
        return StreamedResponse(resp, deadline, idle_s)


def _id_header(request_id: str) -> bytes:
    # A request id is the client's or ours; keep it to header-safe characters.
    safe = "".join(c for c in request_id if c.isalnum() or c in "-_.:")[:128]
    return b"X-Request-Id: " + safe.encode() + b"\r\n"
