"""Posting to the control plane: bounded buffers, batching, back-off, counted drops.

Contract: producers call :meth:`Uplink.kv_batch_put` (one engine batch) and
:meth:`Uplink.telemetry_put` (one sample batch) and never block; :meth:`Uplink.flush` posts what
is buffered (called by the agent's uplink thread every ``flush_s``, or directly by the
emulator). While the control plane is unreachable or failing (connection errors, 5xx, 429),
posts back off exponentially (with jitter, capped) and the buffers fill up to their bounds; past
them the oldest items are dropped and counted (``prfaas_agent_dropped_total``). A dropped KV
batch leaves a sequence gap the control plane sees (the instance goes ``degraded``), so nothing
is silently wrong. A batch the control plane refuses (4xx other than auth) is dropped and
counted, never retried for ever. Telemetry posts carry an idempotency key, so a retried post
after a lost answer is stored once.

KV batches go to ``POST /api/v1/kv-events/msgpack`` as ``{"instance", "batches": [[seq,
payload], ...]}`` (msgpack), at most ``max_post_batches`` batches and ``max_post_bytes`` bytes
per post (under the API's body limit); telemetry to ``POST /api/v1/telemetry`` (JSON).
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec

from fleet.agent.metrics import AgentMetrics

log = logging.getLogger(__name__)

KV_PATH = "/api/v1/kv-events/msgpack"
KV_STATE_PATH = "/api/v1/kv-events/state"
TELEMETRY_PATH = "/api/v1/telemetry"
_ENCODER = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class UplinkLimits:
    max_kv_batches: int = 50_000  # per instance
    max_telemetry: int = 600  # sample batches (10 min at 1 s)
    max_post_batches: int = 2_000
    max_post_bytes: int = 200_000
    backoff_min_s: float = 0.5
    backoff_max_s: float = 30.0
    timeout_s: float = 10.0


class Uplink:
    def __init__(
        self,
        base_url: str,
        token: str,
        metrics: AgentMetrics,
        limits: UplinkLimits | None = None,
        *,
        agent_id: str | None = None,
        client: httpx.Client | None = None,
    ) -> None:
        self.limits = limits or UplinkLimits()
        self.metrics = metrics
        self.agent_id = agent_id or uuid.uuid4().hex[:12]
        self.http = client or httpx.Client(
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {token}"},
            timeout=self.limits.timeout_s,
        )
        self._kv: OrderedDict[str, deque[tuple[int, bytes]]] = OrderedDict()
        self._telemetry: deque[dict[str, Any]] = deque()
        self._lock = threading.Lock()
        self._telemetry_n = 0
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self.wake = threading.Event()

    # -- producers --------------------------------------------------------------------------

    def kv_batch_put(self, instance: str, seq: int, payload: bytes, blocks: int = 0) -> None:
        with self._lock:
            queue = self._kv.setdefault(instance, deque())
            if len(queue) >= self.limits.max_kv_batches:
                queue.popleft()
                self.metrics.dropped.labels("kv_batch", "buffer_full").inc()
            queue.append((seq, payload))
            self.metrics.buffered.labels("kv_batch").inc()
        self.wake.set()

    def telemetry_put(
        self,
        instances: list[dict[str, Any]],
        links: list[dict[str, Any]],
        clusters: list[dict[str, Any]] | None = None,
    ) -> None:
        """Queue one telemetry batch (``clusters``: per PD cluster service counters)."""
        if not instances and not links and not clusters:
            return
        with self._lock:
            self._telemetry_n += 1
            key = f"{self.agent_id}/{self._telemetry_n}"
            if len(self._telemetry) >= self.limits.max_telemetry:
                self._telemetry.popleft()
                self.metrics.dropped.labels("telemetry", "buffer_full").inc()
            body: dict[str, Any] = {"idempotency_key": key, "instances": instances, "links": links}
            if clusters:
                body["clusters"] = clusters
            self._telemetry.append(body)
            self.metrics.buffered.labels("telemetry").inc()
        self.wake.set()

    def buffered(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._kv.values()) + len(self._telemetry)

    # -- the control plane ------------------------------------------------------------------

    def kv_last_seq(self, instance: str) -> int | None:
        """The last sequence number the index applied for ``instance`` (None: unknown, or the
        control plane is away: the stream then starts from what the engine sends)."""
        try:
            response = self.http.get(KV_STATE_PATH, params={"instance": instance})
        except httpx.HTTPError as exc:
            log.warning("%s: index state not read: %s", instance, exc)
            return None
        if response.status_code != 200:
            log.warning("%s: index state: %s %s", instance, response.status_code, response.text)
            return None
        value = response.json().get("last_seq")
        return int(value) if value is not None else None

    def flush(self, *, force: bool = False) -> bool:
        """Post what is buffered; False when it stopped early (backing off). ``force`` ignores
        the back-off clock (the emulator, a final flush)."""
        if not force and time.monotonic() < self._retry_at:
            return False
        while True:
            with self._lock:
                item = self._next_kv() or self._next_telemetry()
            if item is None:
                self._backoff_s = 0.0
                return True
            kind, instance, count, body, content_type = item
            outcome = self._post(kind, body, content_type)
            with self._lock:
                if outcome in ("ok", "refused"):
                    self._pop(kind, instance, count)
                    if outcome == "ok" and kind == "kv_batch":
                        self.metrics.posted_batches.labels(instance).inc(count)
                    if outcome == "refused":
                        self.metrics.dropped.labels(kind, "refused").inc(count)
            if outcome == "retry":
                self._backoff()
                return False

    def _next_kv(self) -> tuple[str, str, int, bytes, str] | None:
        for instance, queue in self._kv.items():
            if not queue:
                continue
            batches: list[tuple[int, bytes]] = []
            size = 0
            for seq, payload in queue:
                if batches and (
                    len(batches) >= self.limits.max_post_batches
                    or size + len(payload) > self.limits.max_post_bytes
                ):
                    break
                batches.append((seq, payload))
                size += len(payload) + 12
            # rotate, so one busy engine does not starve the others
            self._kv.move_to_end(instance)
            body = _ENCODER.encode({"instance": instance, "batches": batches})
            return ("kv_batch", instance, len(batches), body, "application/msgpack")
        return None

    def _next_telemetry(self) -> tuple[str, str, int, bytes, str] | None:
        if not self._telemetry:
            return None
        body = msgspec.json.encode(self._telemetry[0])
        return ("telemetry", "", 1, body, "application/json")

    def _pop(self, kind: str, instance: str, count: int) -> None:
        if kind == "kv_batch":
            queue = self._kv.get(instance)
            for _ in range(min(count, len(queue or ()))):
                assert queue is not None
                queue.popleft()
        else:
            self._telemetry.popleft()
        self.metrics.buffered.labels(kind).dec(count)

    def _post(self, kind: str, body: bytes, content_type: str) -> str:
        path = KV_PATH if kind == "kv_batch" else TELEMETRY_PATH
        try:
            response = self.http.post(path, content=body, headers={"Content-Type": content_type})
        except httpx.HTTPError as exc:
            self.metrics.posts.labels(path, "unreachable").inc()
            log.warning("POST %s failed: %s", path, exc)
            return "retry"
        status = response.status_code
        if status < 300:
            self.metrics.posts.labels(path, "ok").inc()
            return "ok"
        self.metrics.posts.labels(path, str(status)).inc()
        if status in (401, 403, 429) or status >= 500:
            # auth (an operator must fix the token), overload or a server fault: keep the
            # items and try again later. An unknown instance (404) is refused like bad input:
            # its batches are dropped and counted, the other engines' posts go on.
            log.warning("POST %s: %s %s", path, status, response.text[:300])
            return "retry"
        log.error("POST %s refused: %s %s (dropped)", path, status, response.text[:300])
        return "refused"

    def _backoff(self) -> None:
        self._backoff_s = min(
            self.limits.backoff_max_s, max(self.limits.backoff_min_s, self._backoff_s * 2)
        )
        self._retry_at = time.monotonic() + self._backoff_s * random.uniform(0.8, 1.2)

    def close(self) -> None:
        self.http.close()
