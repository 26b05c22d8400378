"""A fake vLLM engine: the OpenAI API and the disaggregated KV protocols, without a model.

For tests, benches and the demo, where a real vLLM is too heavy. It speaks what a PD gateway
relies on, the way vLLM 0.32 does (``tests/fixtures/vllm-0.32-cpu/SOURCE.md``):

* ``POST /v1/completions`` and ``/v1/chat/completions``, streaming (SSE ``data:`` chunks, then
  ``data: [DONE]``) and not; prompts as text or token ids; ``max_tokens``; ``stream_options.
  include_usage``; the ``X-Request-Id`` header becomes the response id;
* **NixlConnector**: a request with ``kv_transfer_params.do_remote_decode`` is a prefill whose
  KV stays held for a remote decoder; the answer carries ``kv_transfer_params``
  (``do_remote_prefill``, ``remote_engine_id``, ``remote_block_ids``, ``remote_request_id``,
  ``remote_host``, ``remote_port``, ``tp_size``). A request with ``do_remote_prefill`` pulls that
  KV from the producer named there (``GET /fake/kv/{remote_request_id}`` on ``remote_host:
  remote_port``, which frees it, as a NIXL read does) and then decodes;
* **shared storage** (ExampleConnector, LMCache): a producer writes the KV of the prompt's
  block-aligned tokens (ExampleConnector's key: ``align(len - 1)`` tokens) into a shared
  directory; a consumer that finds it there loads it instead of computing;
* ``POST /tokenize``, ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (vLLM's names).

Output is "greedy" and deterministic: token ``i`` of the answer is a function of the prompt's
tokens and ``i`` only, so a prompt gives the same text on any instance, split or not.
``/fake/stats`` counts what happened (KV produced, pulled, loaded, computed; cancellations);
``POST /fake/fault`` makes the next requests fail (500), hang, drop the connection, stall after
the answer's head, or stops the instance (``exit``: connections refused from then on).
Timing: ``prefill_s_per_1k`` seconds per 1,000 computed prompt tokens, ``token_s`` between
output tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

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

VOCAB = 1024
ROLES = ("prefill", "decode", "both")
CONNECTORS = ("nixl", "shared_storage")
# error: 500; hang: no answer until the client goes; drop: the connection closed; stall: the
# answer's head, then nothing (a hung stream); exit: the instance stops serving at once (its
# port then refuses connections, as a killed engine's does).
FAULTS = ("error", "hang", "drop", "stall", "exit")


@dataclass
class EngineConfig:
    """One fake instance. ``kv_role``: ``kv_producer`` (prefill), ``kv_consumer`` (decode) or
    ``kv_both``; ``storage``: the shared directory of the shared-storage connector."""

    name: str
    port: int
    host: str = "127.0.0.1"
    model: str = "tiny"
    connector: str = "nixl"
    kv_role: str = "kv_both"
    storage: str = ""
    block_size: int = 32
    max_model_len: int = 8192
    prefill_s_per_1k: float = 0.0
    token_s: float = 0.0


@dataclass
class EngineStats:
    requests: int = 0
    prefills_held: int = 0  # NIXL: prefills whose KV was kept for a remote decoder
    kv_pulled: int = 0  # NIXL: transfers this instance pulled as a decoder
    kv_served: int = 0  # NIXL: held KV a decoder pulled from here
    kv_pull_failed: int = 0
    kv_stored: int = 0  # shared storage: prompts whose KV this instance wrote
    kv_loaded: int = 0  # shared storage: prompts whose KV this instance read
    computed_tokens: int = 0
    external_tokens: int = 0
    cancelled: int = 0
    faults: int = 0
    running: int = 0
    request_ids: list[str] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


def tokenize(text: str) -> list[int]:
    """A byte-level tokenizer (one token per UTF-8 byte, as a 256-entry BPE would start)."""
    return list(text.encode())


def chat_render(messages: list[dict[str, Any]]) -> str:
    """A minimal chat template (role, content per line, then the assistant's turn)."""
    lines = [f"<|{m.get('role', 'user')}|>{m.get('content') or ''}" for m in messages]
    return "\n".join(lines) + "\n<|assistant|>"


def answer_tokens(prompt: list[int], n: int) -> list[int]:
    """The deterministic "greedy" continuation of ``prompt``."""
    seed = int.from_bytes(hashlib.sha256(orjson.dumps(prompt)).digest()[:8], "big")
    return [(seed + 7919 * i) % VOCAB for i in range(n)]


def detokenize(tokens: list[int]) -> str:
    return "".join(f" t{t}" for t in tokens)


def storage_key(tokens: list[int], block_size: int) -> str | None:
    """ExampleConnector's key: the prompt's tokens aligned down to a block, last one excluded."""
    n = (len(tokens) - 1) // block_size * block_size
    if n <= 0:
        return None
    return hashlib.sha256(orjson.dumps(tokens[:n])).hexdigest()


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


class FakeEngine:
    """The ASGI app of one instance."""

    def __init__(self, config: EngineConfig) -> None:
        if config.connector not in CONNECTORS:
            raise ValueError(f"connector must be one of {', '.join(CONNECTORS)}")
        if config.kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError("kv_role must be kv_producer, kv_consumer or kv_both")
        if config.connector == "shared_storage" and not config.storage:
            raise ValueError("the shared-storage connector needs a storage directory")
        self.config = config
        self.engine_id = f"{config.name}-{uuid.uuid4().hex[:8]}"
        self.stats = EngineStats()
        self._held: dict[str, list[int]] = {}
        self._block_ids = itertools.count(1)
        self._faults: list[str] = []
        self._http: httpx.AsyncClient | None = None
        # Stops this instance's server (set by whoever serves it; fault mode "exit").
        self.exit: Callable[[], None] | None = None

    # -- ASGI -------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        try:
            if path == "/health":
                await json_send(send, 200, {})
            elif path == "/v1/models":
                await json_send(send, 200, self._models())
            elif path == "/metrics":
                await response_send(
                    send, 200, self._metrics().encode(), b"text/plain; version=0.0.4"
                )
            elif path == "/fake/stats":
                await json_send(send, 200, self.stats.as_dict())
            elif path == "/fake/fault" and method == "POST":
                body = await _body(receive)
                mode = str(body.get("mode", "error"))
                if mode not in FAULTS:
                    raise HttpError(400, f"mode must be one of {', '.join(FAULTS)}")
                if mode == "exit":
                    if self.exit is None:
                        raise HttpError(400, "this instance cannot be stopped")
                    await json_send(send, 200, {"faults": 0})
                    self.exit()
                    return
                self._faults = [mode] * int(body.get("count", 1))
                await json_send(send, 200, {"faults": len(self._faults)})
            elif path.startswith("/fake/kv/") and method == "GET":
                await self._kv_serve(path.removeprefix("/fake/kv/"), send)
            elif path == "/tokenize" and method == "POST":
                body = await _body(receive)
                tokens = self._prompt_tokens(body, chat="messages" in body)
                await json_send(
                    send,
                    200,
                    {
                        "count": len(tokens),
                        "max_model_len": self.config.max_model_len,
                        "tokens": tokens,
                    },
                )
            elif path in ("/v1/completions", "/v1/chat/completions") and method == "POST":
                await self._generate(scope, receive, send, chat=path.endswith("chat/completions"))
            else:
                raise HttpError(404, f"no route {method} {path}", "NotFoundError")
        except HttpError as exc:
            await json_send(
                send,
                exc.status,
                {"error": {"message": exc.message, "type": exc.code, "code": exc.status}},
            )

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._http = httpx.AsyncClient(timeout=10)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._http is not None:
                    await self._http.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- generation -----------------------------------------------------------------------

    def _prompt_tokens(self, body: dict[str, Any], *, chat: bool) -> list[int]:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise HttpError(400, "messages: a non-empty list is required")
            return tokenize(chat_render(messages))
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return tokenize(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise HttpError(400, "prompt: a string or a list of token ids is required")

    async def _generate(
        self, scope: HTTPScope, receive: Receive, send: Send, *, chat: bool
    ) -> None:
        body = await _body(receive)
        cfg = self.config
        st = self.stats
        st.requests += 1
        st.bodies = [*st.bodies[-49:], body]
        headers = dict(scope["headers"])
        request_id = headers.get(b"x-request-id", b"").decode() or uuid.uuid4().hex
        st.request_ids = [*st.request_ids[-49:], request_id]
        if self._faults:
            fault = self._faults.pop(0)
            st.faults += 1
            if fault == "error":
                raise HttpError(500, "injected fault", "InternalServerError")
            if fault == "hang":
                await disconnect_wait(receive)
                st.cancelled += 1
                return
            if fault == "drop":
                raise ConnectionResetError("injected drop")  # uvicorn closes the connection
            if fault == "stall":
                await send(
                    start_event(200, [(b"content-type", b"text/event-stream; charset=utf-8")])
                )
                await disconnect_wait(receive)
                st.cancelled += 1
                return
        tokens = self._prompt_tokens(body, chat=chat)
        if len(tokens) >= cfg.max_model_len:
            raise HttpError(400, f"prompt of {len(tokens)} tokens exceeds max_model_len")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise HttpError(400, "max_tokens must be a positive integer")
        params = body.get("kv_transfer_params") or {}
        st.running += 1
        try:
            external = await self._kv_in(tokens, params)
            computed = len(tokens) - external
            st.computed_tokens += computed
            st.external_tokens += external
            if cfg.prefill_s_per_1k > 0 and computed > 0:
                await asyncio.sleep(cfg.prefill_s_per_1k * computed / 1000)
            out_params = self._kv_out(tokens, params, request_id)
            answer = answer_tokens(tokens, max_tokens)
            if body.get("stream"):
                await self._stream(send, receive, body, request_id, answer, len(tokens), chat)
            else:
                if cfg.token_s > 0 and len(answer) > 1:
                    await asyncio.sleep(cfg.token_s * (len(answer) - 1))
                await json_send(
                    send,
                    200,
                    self._response(body, request_id, answer, len(tokens), chat, out_params),
                )
        finally:
            st.running -= 1

    async def _kv_in(self, tokens: list[int], params: dict[str, Any]) -> int:
        """Prompt tokens whose KV comes from elsewhere (not computed here)."""
        cfg = self.config
        if cfg.kv_role == "kv_producer":
            return 0
        if cfg.connector == "nixl":
            if not params.get("do_remote_prefill"):
                return 0
            url = (
                f"http://{params.get('remote_host')}:{params.get('remote_port')}"
                f"/fake/kv/{params.get('remote_request_id')}"
            )
            assert self._http is not None
            try:
                got = await self._http.get(url)
            except httpx.HTTPError as exc:
                self.stats.kv_pull_failed += 1
                raise HttpError(
                    500, f"KV pull from {url} failed: {exc}", "KVTransferError"
                ) from None
            # (orjson: the standard library took 0.3 s to read a 1M-token prompt's KV here)
            held = orjson.loads(got.content) if got.status_code == 200 else {}
            if held.get("tokens") != tokens:
                self.stats.kv_pull_failed += 1
                raise HttpError(500, f"KV pull from {url}: no such blocks", "KVTransferError")
            self.stats.kv_pulled += 1
            # vLLM recomputes the last prompt token on the decoder (it needs its logits).
            return len(tokens) - 1
        key = storage_key(tokens, cfg.block_size)
        if key is not None and (Path(cfg.storage) / key).exists():
            self.stats.kv_loaded += 1
            return (len(tokens) - 1) // cfg.block_size * cfg.block_size
        return 0

    def _kv_out(
        self, tokens: list[int], params: dict[str, Any], request_id: str
    ) -> dict[str, Any] | None:
        """Keep or write this prompt's KV for a decoder; the params the answer carries."""
        cfg = self.config
        if cfg.kv_role == "kv_consumer":
            return None
        if cfg.connector == "nixl":
            if not params.get("do_remote_decode"):
                return None
            blocks = -(-len(tokens) // cfg.block_size)
            remote_id = f"{request_id}-{uuid.uuid4().hex[:6]}"
            self._held[remote_id] = tokens
            self.stats.prefills_held += 1
            return {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [next(self._block_ids) for _ in range(blocks)],
                "remote_engine_id": self.engine_id,
                "remote_request_id": remote_id,
                "remote_host": cfg.host,
                "remote_port": cfg.port,
                "tp_size": 1,
            }
        key = storage_key(tokens, cfg.block_size)
        if key is not None:
            path = Path(cfg.storage) / key
            if not path.exists():
                path.write_bytes(orjson.dumps(tokens))
                self.stats.kv_stored += 1
        return None

    async def _kv_serve(self, remote_id: str, send: Send) -> None:
        tokens = self._held.pop(remote_id, None)
        if tokens is None:
            raise HttpError(404, f"no held KV for {remote_id}", "NotFoundError")
        self.stats.kv_served += 1
        await json_send(send, 200, {"tokens": tokens})

    def _response(
        self,
        body: dict[str, Any],
        request_id: str,
        answer: list[int],
        prompt_len: int,
        chat: bool,
        kv_params: dict[str, Any] | None,
    ) -> dict[str, Any]:
        text = detokenize(answer)
        choice: dict[str, Any]
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_logprobs": None,
            }
        return {
            "id": ("chatcmpl-" if chat else "cmpl-") + request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or self.config.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_len,
                "total_tokens": prompt_len + len(answer),
                "completion_tokens": len(answer),
                "prompt_tokens_details": None,
            },
            "kv_transfer_params": kv_params,
        }

    async def _stream(
        self,
        send: Send,
        receive: Receive,
        body: dict[str, Any],
        request_id: str,
        answer: list[int],
        prompt_len: int,
        chat: bool,
    ) -> None:
        await send(start_event(200, [(b"content-type", b"text/event-stream; charset=utf-8")]))
        disconnected = asyncio.Event()

        async def watch() -> None:
            await disconnect_wait(receive)
            disconnected.set()

        watcher = asyncio.create_task(watch())
        created = int(time.time())
        model = body.get("model") or self.config.model
        rid = ("chatcmpl-" if chat else "cmpl-") + request_id
        obj = "chat.completion.chunk" if chat else "text_completion"
        try:
            for i, token in enumerate(answer):
                if i and self.config.token_s > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(disconnected.wait(), self.config.token_s)
                if disconnected.is_set():
                    self.stats.cancelled += 1
                    return
                last = i == len(answer) - 1
                text = detokenize([token])
                if chat:
                    delta: dict[str, Any] = {"content": text}
                    if i == 0:
                        delta["role"] = "assistant"
                    choice: dict[str, Any] = {
                        "index": 0,
                        "delta": delta,
                        "logprobs": None,
                        "finish_reason": "length" if last else None,
                    }
                else:
                    choice = {
                        "index": 0,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": "length" if last else None,
                        "stop_reason": None,
                    }
                chunk = {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [choice],
                }
                await _sse(send, chunk)
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {
                    "prompt_tokens": prompt_len,
                    "total_tokens": prompt_len + len(answer),
                    "completion_tokens": len(answer),
                }
                await _sse(
                    send,
                    {"id": rid, "object": obj, "created": created, "model": model,
                     "choices": [], "usage": usage},
                )  # fmt: skip
            await send(body_event(b"data: [DONE]\n\n"))
        except OSError:
            self.stats.cancelled += 1
        finally:
            watcher.cancel()

    def _models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.config.model,
                    "object": "model",
                    "created": 0,
                    "owned_by": "vllm",
                    "max_model_len": self.config.max_model_len,
                }
            ],
        }

    def _metrics(self) -> str:
        labels = f'{{engine="0",model_name="{self.config.model}"}}'
        st = self.stats
        return (
            f"vllm:num_requests_running{labels} {st.running}\n"
            f"vllm:num_requests_waiting{labels} 0\n"
            f"vllm:prompt_tokens_total{labels} {st.computed_tokens + st.external_tokens}\n"
        )


async def _body(receive: Receive) -> dict[str, Any]:
    chunks = []
    more = True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            break  # the client went away
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    raw = b"".join(chunks)
    try:
        data = orjson.loads(raw or b"{}")
    except orjson.JSONDecodeError as exc:
        raise HttpError(400, f"body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise HttpError(400, "body must be a JSON object")
    return data


async def _sse(send: Send, data: Any) -> None:
    await send(body_event(b"data: " + orjson.dumps(data) + b"\n\n", more=True))


#: For a server that imports its app by name (granian): the EngineConfig fields as JSON.
CONFIG_ENV = "FAKE_ENGINE_CONFIG"


def engine_from_env() -> FakeEngine:
    """The app factory of ``python -m fleet.fake_engine --server granian``."""
    return FakeEngine(EngineConfig(**orjson.loads(os.environ[CONFIG_ENV])))
