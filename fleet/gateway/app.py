"""The OpenAI-compatible PD gateway: an ASGI app that carries PrfaaS decisions out on engines.

Endpoints: ``POST /v1/completions`` and ``/v1/chat/completions`` (streaming and not),
``GET /v1/models``, ``GET /health``, ``GET /metrics``.

Per request:

1. admit it (room among the admitted requests and in the body budget, its declared size)
   before reading any of the body; read the body within ``body_timeout_s``; check the OpenAI
   fields the gateway acts on; take the prompt's token ids (a completion prompt given as ids)
   or have an engine of the origin tokenize it (``POST /tokenize``, text or chat messages);
2. refuse a prompt over ``max_prompt_tokens``; compute vLLM's block hashes of the tokens
   (:mod:`fleet.blockhash`, the model's block size), in slices with the event loop free
   between them;
3. decide (:class:`fleet.gateway.control.ControlPlane`: in process with the policy snapshot
   and bounded-age live state, the link reservation taken atomically on the control plane for
   an offload; or ``POST /route``);
4. carry it out with vLLM's disaggregated protocol of the prefill cluster's connector
   (:mod:`fleet.gateway.protocol`): any cache transfer, the prefill step, the decode step,
   streamed back;
5. report the outcome (served route and instances, observed TTFT, transfer result), which
   releases the reservation on the control plane.

Failures: a prefill instance that fails, or has not answered by its first-byte deadline (a
multiple of its predicted time), is retried once on another prefill instance of its cluster;
an offload with no other PrfaaS instance (or whose other fails too) falls back to local
prefill (reason ``prfaas_unavailable``, header ``x-prfaas-fallback: prefill_failed``); a
decode instance that fails before answering (a streamed one: before its head, within
``first_byte_timeout_s``) is retried once on another decode instance. An engine that fails
or hangs is ejected for a while and the control plane told (:class:`control.Outliers`). A 4xx
from an engine is the client's and is passed on unchanged. A client that disconnects cancels
the upstream calls (closing their connections, which makes vLLM abort the request). At most
``max_inflight`` requests are served at once and ``max_waiting`` more admitted; beyond that
the answer is 503 at once. Errors have OpenAI's shape plus the project's
``{"detail", "code"}``, always JSON. docs/gateway.md lists every limit and timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import orjson
from asgiref.typing import ASGISendEvent
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from fleet.asgi import (
    HTTPScope,
    Receive,
    Scope,
    Send,
    body_event,
    disconnect_wait,
    json_send,
    response_send,
    start_event,
)
from fleet.blockhash import block_hash_chain, block_key, block_keys
from fleet.client import RouterUnavailableError
from fleet.gateway import metrics
from fleet.gateway.config import GatewayConfig, config_load
from fleet.gateway.control import ControlPlane, Decided
from fleet.gateway.http import header_timeout_set
from fleet.gateway.protocol import (
    AnswerTooLarge,
    Engines,
    StreamedResponse,
    UpstreamError,
    decode_body,
    prefill_body,
)
from scheduling.core.routing import (
    Reason,
    RouteDecision,
    RouteError,
    RouteRequest,
    RouteUnavailable,
    decision_to_dict,
)

log = logging.getLogger(__name__)


# A body this small is read without taking from the body budget (see BodyBudget).
SMALL_BODY_BYTES = 64 << 10
# The control plane's bound on a request's output tokens (POST /route): more is not a request.
MAX_OUTPUT_TOKENS = 10_000_000
# Where ``gateway_from_env`` (the factory of each uvicorn worker) finds the configuration.
CONFIG_ENV = "PRFAAS_GATEWAY_CONFIG"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# The offload failed on its PrfaaS prefill instance: served locally, as when none is usable.
FALLBACK_REASON = Reason.PRFAAS_UNAVAILABLE


class ClientError(Exception):
    """An answer to send as is: status, OpenAI error type, message, code; ``param``: the
    request field at fault; ``close``: the connection is closed after it (its body was not
    read whole, so it cannot carry another request)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        raw: bytes = b"",
        param: str | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.raw = raw
        self.param = param
        self.close = close


def error_body(status: int, code: str, message: str, param: str | None = None) -> bytes:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return orjson.dumps(
        {
            "error": {"message": message, "type": kind, "param": param, "code": code},
            "detail": message,
            "code": code,
        }
    )


class BodyBudget:
    """Bytes of request bodies this process holds at once (``body_buffer_bytes``): a body is
    read only with room for it, so slow or huge uploads cannot grow the gateway's memory past
    its configuration. Bodies up to ``SMALL_BODY_BYTES`` are not counted (uvicorn buffers that
    much per connection anyway; admission bounds how many)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0

    def take(self, n: int) -> bool:
        if n <= SMALL_BODY_BYTES:
            return True
        if self.used + n > self.capacity:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        if n > SMALL_BODY_BYTES:
            self.used -= n


@dataclass
class Served:
    """What was carried out for one request (the outcome's body, less the decision)."""

    decision: RouteDecision
    decided_by: str
    route: str
    reason: str
    prefill: tuple[str, str]
    decode: tuple[str, str]
    incremental_tokens: int
    cached_tokens: int
    transfer: str = "none"
    transfer_bytes: int = 0
    ttft_s: float | None = None
    output_tokens: int = 0
    status: str = "ok"
    error: str | None = None
    fallback: str | None = None
    # The outcome's idempotency key: the request id and this gateway's attempt at it.
    key: str = ""


class Gateway:
    """The ASGI application (one per process)."""

    def __init__(self, config: GatewayConfig, control: ControlPlane | None = None) -> None:
        self.config = config
        self.control = control or ControlPlane(config)
        self.engines = Engines(config.connect_timeout_s)
        self._slots: asyncio.Semaphore | None = None
        self._admitted = 0
        self._bodies = BodyBudget(config.body_buffer_bytes)
        self._lag_task: asyncio.Task[None] | None = None
        # The largest /tokenize answer read: max_prompt_tokens ids of up to 10 digits and a
        # comma, and room for the rest; a longer prompt is refused without parsing it.
        self._tokenize_max_bytes = config.max_prompt_tokens * 11 + 4096
        self._tokenize_rr = itertools.count()
        # Request ids of this process: a random prefix, then a counter (unique enough across
        # gateways, and cheaper than a uuid per request).
        self._id_prefix = f"gw-{os.urandom(6).hex()}-"
        self._ids = itertools.count()

    # -- ASGI -------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        started = False

        async def tracked(message: ASGISendEvent) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self._route(scope, receive, tracked, path, method)
        except ClientError as exc:
            if started:
                return
            extra = [(b"connection", b"close")] if exc.close else []
            await response_send(
                send,
                exc.status,
                exc.raw or error_body(exc.status, exc.code, exc.message, exc.param),
                headers=extra,
            )
        except Exception:
            # A bug here: the client still gets an answer in the API's shape, never uvicorn's
            # text/plain 500.
            log.exception("unhandled error on %s %s", method, path)
            metrics.ERRORS.labels("internal").inc()
            if not started:
                await response_send(
                    send,
                    500,
                    error_body(500, "internal_error", "the gateway failed on this request"),
                    headers=[(b"connection", b"close")],
                )

    async def _route(
        self, scope: HTTPScope, receive: Receive, send: Send, path: str, method: str
    ) -> None:
        if path in (COMPLETIONS, CHAT):
            if method != "POST":
                raise ClientError(405, "method_not_allowed", f"{path} takes POST", close=True)
            await self._admit(scope, receive, send, chat=path == CHAT)
        elif path == "/v1/models" and method == "GET":
            await json_send(send, 200, self._models())
        elif path == "/health" and method == "GET":
            await self._health(send)
        elif path == "/metrics" and method == "GET":
            await self._metrics(send)
        else:
            raise ClientError(404, "not_found", f"no route {method} {path}", close=True)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    _large_allocations_returned()
                    self._slots = asyncio.Semaphore(self.config.max_inflight)
                    await self.engines.start()
                    await self.control.start()
                    self._lag_task = asyncio.create_task(_loop_lag_watch())
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._lag_task is not None:
                    self._lag_task.cancel()
                await self.control.close()
                await self.engines.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _models(self) -> dict[str, Any]:
        snap = self.control.client.policy_snapshot
        name = self.config.model or (snap.topology.model.name if snap else "")
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": 0, "owned_by": "prfaas"}],
        }

    async def _health(self, send: Send) -> None:
        """200 ``ok``; 200 ``degraded`` while the control plane refuses the gateway's token
        (it serves, from the cached policy, but reserves nothing and its outcomes are lost:
        ``problems`` says which calls); 503 ``starting`` before the first policy snapshot."""
        snap = self.control.client.policy_snapshot
        problems = [f"{what}: {why}" for what, why in sorted(self.control.refusals.items())]
        metrics.DEGRADED.set(1 if problems else 0)
        status = "starting" if snap is None else "degraded" if problems else "ok"
        body = {
            "status": status,
            "problems": problems,
            "origin": self.config.origin,
            "decide": self.config.decide,
            "policy_version": snap.policy.version if snap else None,
            "live_state_age_s": self.control.client.live_age_s,
            "outcomes_pending": self.control.outcomes_pending,
        }
        await json_send(send, 200 if snap is not None else 503, body)

    async def _metrics(self, send: Send) -> None:
        age = self.control.client.live_age_s
        metrics.LIVE_AGE.set(-1 if age is None else age)
        metrics.OUTCOMES_PENDING.set(self.control.outcomes_pending)
        await response_send(
            send, 200, generate_latest(metrics.REGISTRY), CONTENT_TYPE_LATEST.encode()
        )

    # -- admission and cancellation ---------------------------------------------------------

    async def _admit(self, scope: HTTPScope, receive: Receive, send: Send, *, chat: bool) -> None:
        """Admission before any of the body is read: its declared size within
        ``max_body_bytes``, room among the admitted requests (``max_inflight`` served plus
        ``max_waiting`` reading their body or queued for a slot) and in the body budget;
        otherwise 413 or 503 at once, and the connection closed. The body is then read within
        ``body_timeout_s``, checked, and the request waits for a serving slot."""
        cfg = self.config
        length = _content_length(scope)
        if length is not None and length > cfg.max_body_bytes:
            metrics.ERRORS.labels("body_too_large").inc()
            raise ClientError(
                413, "body_too_large", f"the body exceeds {cfg.max_body_bytes} bytes", close=True
            )
        if self._admitted >= cfg.max_inflight + cfg.max_waiting:
            metrics.ERRORS.labels("queue_full").inc()
            raise ClientError(
                503, "overloaded", "the gateway is at its queue limit; retry later", close=True
            )
        held = [length or 0]  # bytes held in the budget for this body (grows if chunked)
        if not self._bodies.take(held[0]):
            metrics.ERRORS.labels("body_buffer_full").inc()
            raise ClientError(
                503,
                "overloaded",
                "the gateway holds as many request bodies as it may; retry later",
                close=True,
            )
        self._admitted += 1
        metrics.WAITING.inc()
        try:
            body = await self._body_read(receive, length, held)
            _openai_check(body, chat)
            slots = self._slots
            assert slots is not None
            await slots.acquire()
        except BaseException:
            metrics.WAITING.dec()
            self._admitted -= 1
            self._bodies.give(held[0])
            raise
        metrics.WAITING.dec()
        metrics.INFLIGHT.inc()
        try:
            await self._serve_cancellable(scope, receive, send, body, chat)
        finally:
            slots.release()
            metrics.INFLIGHT.dec()
            self._admitted -= 1
            self._bodies.give(held[0])

    async def _body_read(
        self, receive: Receive, length: int | None, held: list[int]
    ) -> dict[str, Any]:
        """The body as a JSON object (``held``: the bytes held for it in the budget; a body of
        unknown length takes room as it arrives)."""
        cfg = self.config
        try:
            async with asyncio.timeout(cfg.body_timeout_s):
                raw = await _body_receive(receive, length, held, cfg, self._bodies)
        except TimeoutError:
            metrics.ERRORS.labels("body_timeout").inc()
            raise ClientError(
                408,
                "body_timeout",
                f"the request body did not arrive within {cfg.body_timeout_s:g} s",
                close=True,
            ) from None
        return _json_object(raw)

    async def _serve_cancellable(
        self, scope: HTTPScope, receive: Receive, send: Send, body: dict[str, Any], chat: bool
    ) -> None:
        """Serve, and cancel everything upstream the moment the client goes away (one watcher
        task that cancels this one: a cancelled upstream call closes its connection)."""
        me = asyncio.current_task()
        assert me is not None
        state = {"serving": True, "gone": False}

        async def watch() -> None:
            await disconnect_wait(receive)
            if state["serving"]:
                state["gone"] = True
                me.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await self._serve(scope, send, body, chat)
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            me.uncancel()
            metrics.ERRORS.labels("client_disconnect").inc()
        finally:
            state["serving"] = False
            watcher.cancel()

    # -- one request ------------------------------------------------------------------------

    async def _serve(self, scope: HTTPScope, send: Send, body: dict[str, Any], chat: bool) -> None:
        started = time.perf_counter()
        endpoint = "chat" if chat else "completions"
        attempt = f"{self._id_prefix}{next(self._ids)}"
        rid = _header(scope, b"x-request-id") or attempt
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        prompt_tokens, chain = await self._prompt(body, chat, rid)
        request = RouteRequest(
            origin=self.config.origin,
            prompt_tokens=prompt_tokens,
            block_hashes=chain,
            request_id=rid,
            expected_output_tokens=max_tokens if isinstance(max_tokens, int) else None,
        )
        try:
            decided = await self.control.decide(request)
        except RouteUnavailable as exc:
            raise ClientError(503, exc.code, exc.detail) from None
        except RouteError as exc:
            raise ClientError(500, exc.code, f"gateway misconfigured: {exc.detail}") from None
        except RouterUnavailableError as exc:
            raise ClientError(503, "control_plane_unavailable", str(exc)) from None
        served = _served_of(decided)
        served.key = rid if rid == attempt else f"{rid}/{attempt}"
        try:
            # Counted on its decode instance from the decision on (the next decisions, made
            # before this one's decode starts, see it there), until the answer ends.
            decoding = self.control.dispatches.begin(served.decode[1], "decode")
            try:
                await self._carry_out(send, body, chat, rid, request, chain, served, started)
            finally:
                self.control.dispatches.end(decoding)
        except asyncio.CancelledError:
            served.status, served.error = "cancelled", "client_disconnect"
            raise
        except ClientError as exc:
            served.status, served.error = "failed", exc.code
            raise
        finally:
            metrics.REQUESTS.labels(endpoint, served.route, served.status).inc()
            metrics.DECISIONS.labels(served.route, served.reason).inc()
            if served.ttft_s is not None:
                metrics.TTFT.labels(served.route).observe(served.ttft_s)
            metrics.DURATION.labels(served.route).observe(time.perf_counter() - started)
            notable = (
                served.status != "ok"
                or served.fallback is not None
                or served.transfer != "none"
                or served.decision.reservation is not None
            )
            self.control.outcome_add(self._outcome(served, request, len(chain)), notable=notable)

    async def _prompt(
        self, body: dict[str, Any], chat: bool, rid: str
    ) -> tuple[int, tuple[int, ...]]:
        """The prompt's length in tokens and its block-hash chain (none when estimated)."""
        prompt = body.get("prompt")
        given = isinstance(prompt, list)  # token ids (checked by _openai_check)
        if self.config.tokenizer == "estimate" and not given:
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise ClientError(
                        400, "invalid_messages", "messages: a non-empty list is required"
                    )
                size = sum(
                    len(str(m.get("content") or "")) for m in messages if isinstance(m, dict)
                )
            elif isinstance(prompt, str) and prompt:
                size = len(prompt.encode())
            else:
                raise ClientError(
                    400, "invalid_prompt", "prompt: one string or one list of token ids"
                )
            n = max(1, round(size / self.config.chars_per_token))
            self._length_check(n)
            return n, ()
        tokens = await self._tokens(body, chat, rid)
        self._length_check(len(tokens))
        if len(tokens) > IDS_CHECKED_AT_ONCE:
            await ids_check_async(tokens)
        block_tokens = self.control.snapshot.topology.model.block_tokens
        return max(1, len(tokens)), await block_keys_async(tokens, block_tokens)

    def _length_check(self, n: int) -> None:
        """A prompt longer than ``max_prompt_tokens`` is refused before any hashing."""
        if n > self.config.max_prompt_tokens:
            metrics.ERRORS.labels("prompt_too_long").inc()
            raise ClientError(
                400,
                "prompt_too_long",
                f"prompt: {n} tokens, more than the {self.config.max_prompt_tokens} this "
                "gateway takes",
                param="prompt",
            )

    async def _tokens(self, body: dict[str, Any], chat: bool, rid: str) -> list[int]:
        """The prompt's token ids: given (a completion prompt of ids), or from an engine."""
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ClientError(400, "invalid_messages", "messages: a non-empty list is required")
            ask: dict[str, Any] = {"model": body.get("model"), "messages": messages}
            ask["add_generation_prompt"] = body.get("add_generation_prompt", True)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list):  # token ids (checked by _openai_check)
                return prompt
            if not isinstance(prompt, str) or not prompt:
                raise ClientError(
                    400,
                    "invalid_prompt",
                    "prompt: one string or one list of token ids (batched prompts are not "
                    "supported by the gateway)",
                )
            ask = {"model": body.get("model"), "prompt": prompt}
        pool = self.control.instances(self.config.origin, "prefill") or self.control.instances(
            self.config.origin, "decode"
        )
        if not pool:
            raise ClientError(503, "origin_unavailable", "no active instance to tokenize on")
        first = next(self._tokenize_rr)
        last: UpstreamError | None = None
        for k in range(min(2, len(pool))):
            inst = pool[(first + k) % len(pool)]
            try:
                answer = await self.engines.call_json(
                    self.control.endpoint(inst.name),
                    "/tokenize",
                    ask,
                    rid,
                    self.config.first_byte_timeout_s,
                    max_bytes=self._tokenize_max_bytes,
                )
            except AnswerTooLarge:
                self._length_check(self.config.max_prompt_tokens + 1)
                raise
            except UpstreamError as exc:
                if not exc.retryable:
                    raise ClientError(
                        exc.status, "invalid_request", str(exc), raw=exc.body
                    ) from None
                self.control.engine_failed(inst.name, f"tokenize: {exc}")
                last = exc
                continue
            tokens = answer.get("tokens")
            if isinstance(tokens, list):
                return tokens
        raise ClientError(502, "tokenize_failed", f"no engine could tokenize the prompt: {last}")

    async def _carry_out(
        self,
        send: Send,
        body: dict[str, Any],
        chat: bool,
        rid: str,
        request: RouteRequest,
        chain: tuple[int, ...],
        served: Served,
        started: float,
    ) -> None:
        path = CHAT if chat else COMPLETIONS
        d = served.decision
        if d.cache_transfer is not None:
            await self._cache_transfer(d, body, chat, request, rid, served)
        connector = self.control.connector_of(served.prefill[0])
        try:
            kv = await self._prefill(
                served.prefill[1],
                path,
                body,
                connector,
                rid,
                served.incremental_tokens,
                self._prefill_deadline_s(served),
            )
        except UpstreamError as exc:
            if not exc.retryable:
                raise ClientError(exc.status, "invalid_request", str(exc), raw=exc.body) from None
            metrics.ERRORS.labels("prefill_failed").inc()
            served.error = f"prefill_failed:{served.prefill[1]}"
            kv = await self._prefill_elsewhere(path, body, rid, request, served, exc)
            connector = self.control.connector_of(served.prefill[0])
        if not body.get("stream"):
            served.ttft_s = time.perf_counter() - started
        self.control.prefixes.add(chain, served.prefill[1], served.prefill[0])
        resp = await self._decode_open(path, body, connector, kv, rid, request, served)
        try:
            await self._relay(send, resp, body, served, started)
        finally:
            resp.close()
        if served.route == "prfaas":
            served.transfer = "finished"
            served.transfer_bytes += served.decision.kv_bytes

    async def _prefill(
        self,
        instance: str,
        path: str,
        body: dict[str, Any],
        connector: str,
        rid: str,
        tokens: int = 0,
        deadline_s: float | None = None,
    ) -> dict[str, Any] | None:
        """The prefill step on ``instance``, answered within ``deadline_s`` (default
        ``prefill_timeout_s``); a failure or time-out counts against the instance (ejection)."""
        t = time.perf_counter()
        prefilling = self.control.dispatches.begin(instance, "prefill", tokens)
        try:
            answer = await self.engines.call_json(
                self.control.endpoint(instance),
                path,
                prefill_body(body, connector),
                rid,
                self.config.prefill_timeout_s if deadline_s is None else deadline_s,
            )
        except UpstreamError as exc:
            if exc.retryable:
                self.control.engine_failed(instance, f"prefill: {exc}")
            raise
        finally:
            self.control.dispatches.end(prefilling)
        self.control.engine_answered(instance)
        metrics.STEP.labels("prefill").observe(time.perf_counter() - t)
        params = answer.get("kv_transfer_params")
        return params if isinstance(params, dict) else None

    async def _prefill_elsewhere(
        self,
        path: str,
        body: dict[str, Any],
        rid: str,
        request: RouteRequest,
        served: Served,
        first: UpstreamError,
    ) -> dict[str, Any] | None:
        """The prefill instance failed: retried once on another prefill instance of its
        cluster (an offload keeps its reservation: the link is the same); an offload whose
        PrfaaS cluster has no other (or whose other fails too) falls back to local prefill."""
        failed = served.prefill[1]
        cluster = served.prefill[0]
        others = [i.name for i in self.control.instances(cluster, "prefill") if i.name != failed]
        if others:
            target = others[0]
            metrics.ERRORS.labels("retried").inc()
            served.prefill, served.fallback = (cluster, target), "prefill_retried"
            try:
                return await self._prefill(
                    target,
                    path,
                    body,
                    self.control.connector_of(cluster),
                    rid,
                    served.incremental_tokens,
                    self._prefill_deadline_s(served),
                )
            except UpstreamError as exc:
                if not exc.retryable:
                    raise ClientError(
                        exc.status, "invalid_request", str(exc), raw=exc.body
                    ) from None
                metrics.ERRORS.labels("prefill_failed").inc()
                if served.route != "prfaas":
                    raise ClientError(
                        502, "prefill_failed", f"prefill failed on {failed} and {target}: {exc}"
                    ) from None
                failed, first = f"{failed} and {target}", exc
        if served.route != "prfaas":
            raise ClientError(502, "prefill_failed", f"prefill failed on {failed}: {first}")
        fb = self.control.fallback_local(request, served.decision, FALLBACK_REASON)
        metrics.ERRORS.labels("fallback_local").inc()
        served.route, served.reason = "local", FALLBACK_REASON
        served.prefill = (fb.prefill.cluster, fb.prefill.instance)
        served.decode = (fb.decode.cluster, fb.decode.instance)
        served.incremental_tokens, served.cached_tokens = fb.incremental_tokens, fb.cached_tokens
        served.transfer, served.fallback = "failed", "prefill_failed"
        target = served.prefill[1]
        try:
            return await self._prefill(
                target,
                path,
                body,
                self.control.connector_of(served.prefill[0]),
                rid,
                served.incremental_tokens,
                self._prefill_deadline_s(served),
            )
        except UpstreamError as exc:
            if not exc.retryable:
                raise ClientError(exc.status, "invalid_request", str(exc), raw=exc.body) from None
            metrics.ERRORS.labels("prefill_failed").inc()
            raise ClientError(
                502, "prefill_failed", f"prefill failed on {failed} and {target}: {exc}"
            ) from None

    def _prefill_deadline_s(self, served: Served) -> float:
        """How long a prefill may take to answer: ``first_byte_timeout_s`` plus
        ``first_byte_factor`` times the decision's prediction for the route served (a hung
        engine is found out in seconds, not at ``prefill_timeout_s``), within
        ``prefill_timeout_s``."""
        cfg = self.config
        est = served.decision.ttft_estimate_s
        predicted = est.prfaas if served.route == "prfaas" else est.local
        if predicted is None or not math.isfinite(predicted) or predicted < 0:
            return cfg.prefill_timeout_s
        return min(
            cfg.prefill_timeout_s, cfg.first_byte_timeout_s + cfg.first_byte_factor * predicted
        )

    async def _decode_open(
        self,
        path: str,
        body: dict[str, Any],
        connector: str,
        kv: dict[str, Any] | None,
        rid: str,
        request: RouteRequest,
        served: Served,
    ) -> StreamedResponse:
        """Open the decode step; a failed decode instance is retried once on another."""
        dbody = decode_body(body, connector, kv)
        streamed = bool(body.get("stream"))
        tried: list[str] = []
        instance = served.decode[1]
        while True:
            tried.append(instance)
            t = time.perf_counter()
            try:
                resp = await self.engines.open(
                    self.control.endpoint(instance),
                    path,
                    dbody,
                    rid,
                    self.config.decode_timeout_s,
                    # A streamed answer starts at once (vLLM sends its head before the first
                    # token); one answered whole starts only when it is all generated.
                    first_byte_s=self.config.first_byte_timeout_s if streamed else None,
                    idle_s=self.config.stream_idle_timeout_s if streamed else None,
                )
            except UpstreamError as exc:
                if not exc.retryable:
                    raise ClientError(
                        exc.status, "invalid_request", str(exc), raw=exc.body
                    ) from None
                self.control.engine_failed(instance, f"decode: {exc}")
                metrics.ERRORS.labels("decode_failed").inc()
                others = [
                    i.name
                    for i in self.control.instances(served.decode[0], "decode")
                    if i.name not in tried
                ]
                if len(tried) > 1 or not others:
                    if served.route == "prfaas":
                        served.transfer = "failed"
                    raise ClientError(
                        502, "decode_failed", f"decode failed on {', '.join(tried)}: {exc}"
                    ) from None
                metrics.ERRORS.labels("retried").inc()
                served.fallback = served.fallback or "decode_retried"
                instance = others[0]
                continue
            self.control.engine_answered(instance)
            metrics.STEP.labels("decode").observe(time.perf_counter() - t)
            served.decode = (served.decode[0], instance)
            return resp

    async def _relay(
        self,
        send: Send,
        resp: StreamedResponse,
        body: dict[str, Any],
        served: Served,
        started: float,
    ) -> None:
        headers = [
            (b"content-type", resp.content_type.encode()),
            (b"x-prfaas-route", served.route.encode()),
            (b"x-prfaas-reason", served.reason.encode()),
            (b"x-prfaas-prefill", served.prefill[1].encode()),
            (b"x-prfaas-decode", served.decode[1].encode()),
        ]
        if served.fallback:
            headers.append((b"x-prfaas-fallback", served.fallback.encode()))
        if not body.get("stream"):
            try:
                raw = await resp.read()
            except (OSError, TimeoutError) as exc:
                self.control.engine_failed(served.decode[1], f"decode answer: {exc!r}")
                metrics.ERRORS.labels("decode_failed").inc()
                if served.route == "prfaas":
                    served.transfer = "failed"
                raise ClientError(502, "decode_failed", f"decode answer broke: {exc!r}") from None
            try:
                usage = orjson.loads(raw).get("usage") or {}
                served.output_tokens = int(usage.get("completion_tokens") or 0)
            except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
                pass
            headers.append((b"content-length", str(len(raw)).encode()))
            await send(start_event(resp.status, headers))
            await send(body_event(raw))
            return
        await send(start_event(resp.status, headers))
        events = 0
        last = 0.0
        usage_event = bool((body.get("stream_options") or {}).get("include_usage"))
        try:
            async for chunk in resp.chunks():
                now = time.perf_counter()
                if served.ttft_s is None:
                    served.ttft_s = now - started
                else:
                    metrics.ITL.observe(now - last)
                last = now
                events += chunk.count(b"data: ")
                await send(body_event(chunk, more=True))
        except (OSError, TimeoutError) as exc:
            # The stream broke (or stalled past stream_idle_timeout_s) after it started:
            # nothing can be retried, the client sees the stream end without [DONE].
            self.control.engine_failed(served.decode[1], f"decode stream: {exc!r}")
            metrics.ERRORS.labels("decode_failed").inc()
            served.status, served.error = "failed", f"decode_interrupted:{type(exc).__name__}"
            if served.route == "prfaas" and served.ttft_s is None:
                served.transfer = "failed"
        await send(body_event(b""))
        served.output_tokens = max(0, events - 1 - (1 if usage_event else 0))

    async def _cache_transfer(
        self,
        d: RouteDecision,
        body: dict[str, Any],
        chat: bool,
        request: RouteRequest,
        rid: str,
        served: Served,
    ) -> None:
        """Move the cached prefix to the prefill instance (see :mod:`protocol`): the prefix
        as a prefill on its holder, then as a one-token "decode" on the target. A failure
        only costs the cache hit: prefill then computes the whole prompt."""
        ct = d.cache_transfer
        assert ct is not None
        source = ct.source_instance or next(
            (i.name for i in self.control.instances(ct.source_cluster, "prefill")), None
        )
        if source is None or chat:
            # A chat prompt's prefix has no text form of its own: only completions move it.
            return
        prompt = body.get("prompt")
        if not isinstance(prompt, list):
            return
        prefix = {"model": body.get("model"), "prompt": prompt[: ct.tokens], "max_tokens": 1}
        connector = self.control.connector_of(ct.source_cluster)
        t = time.perf_counter()
        try:
            kv = await self._prefill(source, COMPLETIONS, prefix, connector, rid + "-ct")
            resp = await self.engines.open(
                self.control.endpoint(ct.target_instance),
                COMPLETIONS,
                decode_body(prefix, connector, kv),
                rid + "-ct",
                self.config.prefill_timeout_s,
            )
            try:
                await resp.read()
            finally:
                resp.close()
        except (UpstreamError, OSError, TimeoutError) as exc:
            metrics.ERRORS.labels("cache_transfer_failed").inc()
            log.warning("cache transfer %s -> %s failed: %s", source, ct.target_instance, exc)
            served.transfer = "failed"
            return
        metrics.STEP.labels("cache_transfer").observe(time.perf_counter() - t)
        served.transfer, served.transfer_bytes = "finished", ct.bytes

    def _outcome(self, served: Served, request: RouteRequest, n_hashes: int) -> dict[str, Any]:
        return {
            "decision": decision_to_dict(served.decision),
            "decided_by": served.decided_by,
            "origin": request.origin,
            "prompt_tokens": request.prompt_tokens,
            "route": served.route,
            "reason": served.reason,
            "prefill": {"cluster": served.prefill[0], "instance": served.prefill[1]},
            "decode": {"cluster": served.decode[0], "instance": served.decode[1]},
            "incremental_tokens": served.incremental_tokens,
            "cached_tokens": served.cached_tokens,
            "output_tokens": served.output_tokens,
            "observed_ttft_s": served.ttft_s,
            "transfer": served.transfer,
            "transfer_bytes": served.transfer_bytes,
            "status": served.status,
            "error": served.error,
            "ts": time.time(),
            "request_id": request.request_id,
            "block_hashes": n_hashes,
            "idempotency_key": served.key,
        }


LAG_PERIOD_S = 0.02


async def _loop_lag_watch() -> None:
    """How late a timer due every LAG_PERIOD_S runs: the longest stretch of work that held
    the event loop, as every request in this process felt it."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + LAG_PERIOD_S
        await asyncio.sleep(LAG_PERIOD_S)
        metrics.LOOP_LAG.observe(max(0.0, loop.time() - due))


# Token ids checked in one go; a longer list is checked in slices (ids_check_async).
IDS_CHECKED_AT_ONCE = 4096


def _ids(tokens: list[Any]) -> bool:
    return all(type(t) is int and t >= 0 for t in tokens)


async def ids_check_async(tokens: list[Any]) -> None:
    """Every one a token id (a non-negative integer), checked in slices with the loop free
    between them; 400 naming the prompt otherwise."""
    for at in range(0, len(tokens), IDS_CHECKED_AT_ONCE):
        if not _ids(tokens[at : at + IDS_CHECKED_AT_ONCE]):
            metrics.ERRORS.labels("bad_request").inc()
            raise ClientError(
                400,
                "invalid_prompt",
                "prompt: one string or one list of token ids (non-negative integers)",
                param="prompt",
            )
        if at:
            await asyncio.sleep(0)


# Blocks hashed between two yields to the event loop (~1-2 ms of work): a 1M-token prompt's
# chain took 170 ms here, which every other request waited behind when hashed in one go.
HASH_SLICE_BLOCKS = 32


async def block_keys_async(tokens: list[int], block_tokens: int) -> tuple[int, ...]:
    """The prompt's block keys, hashed in slices with the loop free between them."""
    t = time.perf_counter()
    if len(tokens) // block_tokens <= HASH_SLICE_BLOCKS:
        keys = tuple(block_keys(tokens, block_tokens))
    else:
        out: list[int] = []
        for digest in block_hash_chain(tokens, block_tokens):
            out.append(block_key(digest))
            if len(out) % HASH_SLICE_BLOCKS == 0:
                await asyncio.sleep(0)
        keys = tuple(out)
    metrics.STEP.labels("hash").observe(time.perf_counter() - t)
    return keys


def _served_of(decided: Decided) -> Served:
    d = decided.decision
    return Served(
        decision=d,
        decided_by=decided.decided_by,
        route=d.route,
        reason=d.reason,
        prefill=(d.prefill.cluster, d.prefill.instance),
        decode=(d.decode.cluster, d.decode.instance),
        incremental_tokens=d.incremental_tokens,
        cached_tokens=d.cached_tokens,
    )


def _header(scope: HTTPScope, name: bytes) -> str:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))[:128]
    return ""


# glibc's M_MMAP_THRESHOLD (mallopt's parameter number).
_M_MMAP_THRESHOLD = -3


def _large_allocations_returned() -> None:
    """Allocations of 1 MiB or more (request bodies, long prompts) mapped on their own and so
    given back to the system when freed. glibc raises its mmap threshold after each such free
    (up to 32 MiB), after which a 15 MiB body stayed in the process heap once freed: 100 of them
    kept the gateway at 1.5 GB. A fixed threshold turns that adjustment off."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 1 << 20)


def _content_length(scope: HTTPScope) -> int | None:
    for key, value in scope["headers"]:
        if key == b"content-length":
            try:
                n = int(value)
            except ValueError:
                n = -1
            if n < 0:
                raise ClientError(400, "bad_request", "content-length: not a size", close=True)
            return n
    return None


async def _body_receive(
    receive: Receive, length: int | None, held: list[int], cfg: GatewayConfig, budget: BodyBudget
) -> bytes | bytearray:
    """The body's bytes as they arrive: into one buffer of the declared length (one
    allocation, given back to the system whole when freed), else chunk by chunk, each taking
    its room in the budget first."""
    if length is not None:
        buf = bytearray(length)
        at = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                raise ClientError(400, "client_disconnect", "the client went away", close=True)
            chunk = message.get("body", b"")
            if at + len(chunk) > length:
                raise ClientError(
                    400, "bad_request", "the body is longer than its content-length", close=True
                )
            buf[at : at + len(chunk)] = chunk
            at += len(chunk)
            more = message.get("more_body", False)
        if at != length:
            raise ClientError(
                400, "bad_request", "the body is shorter than its content-length", close=True
            )
        return buf
    chunks: list[bytes] = []
    size = 0
    more = True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientError(400, "client_disconnect", "the client went away", close=True)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > cfg.max_body_bytes:
            metrics.ERRORS.labels("body_too_large").inc()
            raise ClientError(
                413, "body_too_large", f"the body exceeds {cfg.max_body_bytes} bytes", close=True
            )
        if size > SMALL_BODY_BYTES and size > held[0]:
            want = min(max(size, 2 * held[0], SMALL_BODY_BYTES + 1), cfg.max_body_bytes)
            budget.give(held[0])
            held[0] = 0
            if not budget.take(want):
                metrics.ERRORS.labels("body_buffer_full").inc()
                raise ClientError(
                    503,
                    "overloaded",
                    "the gateway holds as many request bodies as it may; retry later",
                    close=True,
                )
            held[0] = want
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)


def _json_object(raw: bytes | bytearray) -> dict[str, Any]:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        metrics.ERRORS.labels("bad_request").inc()
        raise ClientError(400, "invalid_json", f"the body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        metrics.ERRORS.labels("bad_request").inc()
        raise ClientError(400, "invalid_json", "the body must be a JSON object")
    return data


def _openai_check(body: dict[str, Any], chat: bool) -> None:
    """The OpenAI fields the gateway acts on, checked before anything is decided or sent: a
    bad value is the client's 400 naming the field, never an engine's refusal after a prefill
    (or a control plane's after a reservation)."""

    def bad(param: str, message: str) -> ClientError:
        metrics.ERRORS.labels("bad_request").inc()
        code = {"prompt": "invalid_prompt", "messages": "invalid_messages"}.get(
            param, "invalid_value"
        )
        return ClientError(400, code, f"{param}: {message}", param=param)

    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if type(value) is not int or not 1 <= value <= MAX_OUTPUT_TOKENS:
            raise bad(name, f"an integer from 1 to {MAX_OUTPUT_TOKENS}, not {value!r}")
    for name in ("stream",):
        value = body.get(name)
        if value is not None and type(value) is not bool:
            raise bad(name, f"true or false, not {value!r}")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options", "an object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "a string")
    n = body.get("n")
    if n is not None and n != 1:
        raise bad("n", "only 1 choice per request is served")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad("messages", "a non-empty list is required")
        if not all(isinstance(m, dict) for m in messages):
            raise bad("messages", "each message is an object")
        return
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return
    # (a long list of ids is checked later, in slices, once its length is known to be allowed)
    if isinstance(prompt, list) and prompt and (len(prompt) > IDS_CHECKED_AT_ONCE or _ids(prompt)):
        return
    raise bad(
        "prompt",
        "one string or one list of token ids (batched prompts are not supported by the gateway)",
    )


def gateway_from_env() -> Gateway:
    """For ``uvicorn --factory`` (``workers`` > 1): the gateway of the file named by
    ``PRFAAS_GATEWAY_CONFIG``."""
    config = config_load(os.environ[CONFIG_ENV])
    header_timeout_set(config.header_timeout_s)
    return Gateway(config)
