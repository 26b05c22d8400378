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
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

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


@dataclass
class StreamedResponse:
    """A decode answer being streamed: status, content type, and the body's chunks."""

    status: int
    content_type: str
    response: aiohttp.ClientResponse

    async def chunks(self) -> AsyncIterator[bytes]:
        async for chunk in self.response.content.iter_any():
            yield chunk

    def close(self) -> None:
        # Closing the connection is how vLLM learns the client is gone: it aborts the request.
        self.response.close()


class Engines:
    """Pooled keep-alive HTTP to the engines (one aiohttp session per gateway process)."""

    def __init__(self, connect_timeout_s: float) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
        self._session = aiohttp.ClientSession(
            connector=connector, json_serialize=lambda x: orjson.dumps(x).decode()
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _timeout(self, total_s: float) -> aiohttp.ClientTimeout:
        timeout = self._timeouts.get(total_s)
        if timeout is None:
            timeout = aiohttp.ClientTimeout(total=total_s, sock_connect=self._connect_timeout_s)
            self._timeouts[total_s] = timeout
        return timeout

    async def call_json(
        self, url: str, body: Mapping[str, Any], request_id: str, timeout_s: float
    ) -> dict[str, Any]:
        """POST ``body``, read the whole JSON answer (the prefill step, /tokenize)."""
        assert self._session is not None
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        try:
            async with self._session.post(
                url, data=orjson.dumps(body), headers=headers, timeout=self._timeout(timeout_s)
            ) as resp:
                raw = await resp.read()
                if resp.status >= 400:
                    raise UpstreamError(
                        f"{url}: HTTP {resp.status}",
                        retryable=resp.status >= 500,
                        status=resp.status,
                        body=raw,
                    )
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:  # noqa: UP041
            raise UpstreamError(f"{url}: {type(exc).__name__} {exc}", retryable=True) from None
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise UpstreamError(f"{url}: answer is not JSON", retryable=True) from None
        if not isinstance(data, dict):
            raise UpstreamError(f"{url}: answer is not a JSON object", retryable=True)
        return data

    async def open(
        self, url: str, body: Mapping[str, Any], request_id: str, timeout_s: float
    ) -> StreamedResponse:
        """POST ``body`` and return as soon as the headers are in (the decode step). A 4xx
        or 5xx is read whole and raised as UpstreamError."""
        assert self._session is not None
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        try:
            resp = await self._session.post(
                url, data=orjson.dumps(body), headers=headers, timeout=self._timeout(timeout_s)
            )
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:  # noqa: UP041
            raise UpstreamError(f"{url}: {type(exc).__name__} {exc}", retryable=True) from None
        if resp.status >= 400:
            try:
                raw = await resp.read()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):  # noqa: UP041
                raw = b""
            finally:
                resp.release()
            raise UpstreamError(
                f"{url}: HTTP {resp.status}",
                retryable=resp.status >= 500,
                status=resp.status,
                body=raw,
            )
        return StreamedResponse(
            resp.status, resp.headers.get("Content-Type", "application/json"), resp
        )
