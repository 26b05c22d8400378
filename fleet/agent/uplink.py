"""Posting to the control plane: bounded buffers, batching, back-off, counted drops.

Contract: producers call :meth:`Uplink.kv_batch_put` (one engine batch) and
:meth:`Uplink.telemetry_put` (one sample batch) and never block; :meth:`Uplink.flush` posts what
is buffered (called by the agent's uplink thread every ``flush_s``, or directly by the
emulator). While the control plane is unreachable, posts are retried at growing intervals
capped at ``backoff_max_s`` (2 s, jittered: the first post after an outage goes within about
that of the control plane answering again); while it answers 429 or 5xx (busy or failing),
the cap is ``overload_backoff_max_s`` (30 s). The buffers fill up to their bounds meanwhile;
past them the oldest items are dropped and counted (``prfaas_agent_dropped_total``). A dropped
KV batch leaves a sequence gap the control plane sees (the instance goes ``degraded``), so
nothing is silently wrong. Telemetry posts carry an idempotency key, so a retried post after a
lost answer is stored once.

Refusals are per instance: a post refused because of one instance or link (404
``unknown_instance``/``unknown_link``: not in the inventory; 403 ``outside_binding``: the token
is not bound to it) is split into one post per sample to find which, and that name is
*refused*: logged once, shown by ``prfaas_agent_refused{name, code}``, its samples and KV
batches dropped (counted) while the others go on; it is tried again every
``refused_retry_s``. Any other refused post (a 4xx other than 401) is dropped and counted,
never retried for ever; a 401 (a bad token: nothing can go) is retried like an overload.

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
from scheduling.core.link import link_key

log = logging.getLogger(__name__)

KV_PATH = "/api/v1/kv-events/msgpack"
KV_STATE_PATH = "/api/v1/kv-events/state"
TELEMETRY_PATH = "/api/v1/telemetry"
_ENCODER = msgspec.msgpack.Encoder()
# The codes by which the control plane refuses a post because of one name in it.
NAME_CODES = frozenset({"unknown_instance", "unknown_link", "outside_binding"})


@dataclass(frozen=True)
class UplinkLimits:
    max_kv_batches: int = 50_000  # per instance
    max_telemetry: int = 600  # sample batches (10 min at 1 s)
    max_post_batches: int = 2_000
    max_post_bytes: int = 200_000
    backoff_min_s: float = 0.5
    backoff_max_s: float = 2.0  # control plane unreachable
    overload_backoff_max_s: float = 30.0  # 429, 5xx, 401
    timeout_s: float = 10.0
    refused_retry_s: float = 300.0


@dataclass(frozen=True)
class IndexState:
    """What the control plane's index holds for an instance: its last applied sequence and
    when it last applied a batch (unix seconds); None for what it does not know."""

    last_seq: int | None = None
    updated_at: float | None = None


@dataclass(frozen=True)
class _Answer:
    outcome: str  # ok | retry | overload | refused | name
    code: str = ""
    detail: str = ""


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
        self._kv: OrderedDict[str, deque[tuple[int | None, bytes]]] = OrderedDict()
        self._telemetry: deque[dict[str, Any]] = deque()
        self._lock = threading.Lock()
        self._telemetry_n = 0
        self._backoff_s = 0.0
        self._retry_at = 0.0
        # name (instance, or link as source->target) -> (code, monotonic time of the next try)
        self._refused: dict[str, tuple[str, float]] = {}
        self.wake = threading.Event()

    # -- producers --------------------------------------------------------------------------

    def kv_batch_put(self, instance: str, seq: int | None, payload: bytes, blocks: int = 0) -> None:
        with self._lock:
            if self._refused_now(instance):
                self.metrics.dropped.labels("kv_batch", "refused_name").inc()
                return
            queue = self._kv.setdefault(instance, deque())
            if len(queue) >= self.limits.max_kv_batches:
                queue.popleft()
                self.metrics.dropped.labels("kv_batch", "buffer_full").inc()
            queue.append((seq, payload))
            self._gauges()
        self.wake.set()

    def telemetry_put(
        self,
        instances: list[dict[str, Any]],
        links: list[dict[str, Any]],
        clusters: list[dict[str, Any]] | None = None,
    ) -> None:
        """Queue one telemetry batch (``clusters``: per PD cluster service counters); samples
        of a refused instance or link are left out (counted)."""
        with self._lock:
            kept_instances = [s for s in instances if not self._refused_now(s["instance"])]
            kept_links = [
                s for s in links if not self._refused_now(link_key(s["source"], s["target"]))
            ]
            left_out = len(instances) - len(kept_instances) + len(links) - len(kept_links)
            if left_out:
                self.metrics.dropped.labels("telemetry_sample", "refused_name").inc(left_out)
            if not kept_instances and not kept_links and not clusters:
                return
            self._telemetry_n += 1
            key = f"{self.agent_id}/{self._telemetry_n}"
            if len(self._telemetry) >= self.limits.max_telemetry:
                self._telemetry.popleft()
                self.metrics.dropped.labels("telemetry", "buffer_full").inc()
            body: dict[str, Any] = {
                "idempotency_key": key,
                "instances": kept_instances,
                "links": kept_links,
            }
            if clusters:
                body["clusters"] = clusters
            self._telemetry.append(body)
            self._gauges()
        self.wake.set()

    def buffered(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._kv.values()) + len(self._telemetry)

    def refused(self) -> dict[str, str]:
        """The names the control plane refuses now, with its code."""
        with self._lock:
            return {name: code for name, (code, _) in self._refused.items()}

    def _gauges(self) -> None:
        """The buffered-items gauge from the buffers themselves (under the lock)."""
        self.metrics.buffered.labels("kv_batch").set(sum(len(q) for q in self._kv.values()))
        self.metrics.buffered.labels("telemetry").set(len(self._telemetry))

    def _refused_now(self, name: str) -> bool:
        """Whether ``name``'s items are dropped now; a refusal whose retry time came lets one
        item through (the try) and waits again."""
        got = self._refused.get(name)
        if got is None:
            return False
        code, retry_at = got
        now = time.monotonic()
        if now < retry_at:
            return True
        self._refused[name] = (code, now + self.limits.refused_retry_s)
        return False

    # -- the control plane ------------------------------------------------------------------

    def kv_index_state(self, instance: str) -> IndexState:
        """Where the control plane's index stands for ``instance`` (nothing known when the
        control plane is away: the stream then starts from what the engine sends)."""
        try:
            response = self.http.get(KV_STATE_PATH, params={"instance": instance})
        except httpx.HTTPError as exc:
            log.warning("%s: index state not read: %s", instance, exc)
            return IndexState()
        if response.status_code != 200:
            log.warning("%s: index state: %s %s", instance, response.status_code, response.text)
            return IndexState()
        body = response.json()
        last, at = body.get("last_seq"), body.get("updated_at")
        return IndexState(
            int(last) if last is not None else None, float(at) if at is not None else None
        )

    def kv_last_seq(self, instance: str) -> int | None:
        """The last sequence number the index applied for ``instance`` (None: unknown)."""
        return self.kv_index_state(instance).last_seq

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
            answer = self._post(kind, body, content_type)
            with self._lock:
                if answer.outcome == "name" and kind == "telemetry" and not instance:
                    self._telemetry_split()
                elif answer.outcome == "name":
                    # That one name is refused: its items go, the others' stay.
                    if kind == "kv_batch":
                        count = len(self._kv.get(instance) or ())
                    self._pop(kind, instance, count)
                    self.metrics.dropped.labels(kind, "refused_name").inc(count)
                    self._refuse(instance, answer)
                elif answer.outcome in ("ok", "refused"):
                    if answer.outcome == "ok":
                        # Whatever was refused and went through this time is accepted again.
                        names = [instance] if kind == "kv_batch" else _names(self._telemetry[0])
                        for name in names:
                            self._refused_lift(name)
                        if kind == "kv_batch":
                            self.metrics.posted_batches.labels(instance).inc(count)
                    self._pop(kind, instance, count)
                    if answer.outcome == "refused":
                        self.metrics.dropped.labels(kind, "refused").inc(count)
                self._gauges()
            if answer.outcome in ("retry", "overload"):
                self._backoff(answer.outcome == "overload")
                return False
            if answer.outcome == "ok":
                self._backoff_s = 0.0

    def _next_kv(self) -> tuple[str, str, int, bytes, str] | None:
        for instance, queue in self._kv.items():
            if not queue:
                continue
            batches: list[tuple[int | None, bytes]] = []
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
        head = self._telemetry[0]
        name = _single_name(head)
        body = msgspec.json.encode(head)
        return ("telemetry", name or "", 1, body, "application/json")

    def _telemetry_split(self) -> None:
        """The head batch was refused because of one name in it: one post per sample (and
        one for the clusters' counters) instead, so the others go through and the refused
        name is found."""
        head = self._telemetry.popleft()
        key = head["idempotency_key"]
        parts: list[dict[str, Any]] = []
        for i, sample in enumerate(head["instances"]):
            parts.append({"idempotency_key": f"{key}/i{i}", "instances": [sample], "links": []})
        for i, sample in enumerate(head["links"]):
            parts.append({"idempotency_key": f"{key}/l{i}", "instances": [], "links": [sample]})
        if head.get("clusters"):
            parts.append(
                {
                    "idempotency_key": f"{key}/c",
                    "instances": [],
                    "links": [],
                    "clusters": head["clusters"],
                }
            )
        self._telemetry.extendleft(reversed(parts))

    def _refuse(self, name: str, answer: _Answer) -> None:
        if not name:
            return
        first = name not in self._refused
        self._refused[name] = (answer.code, time.monotonic() + self.limits.refused_retry_s)
        self.metrics.refused.labels(name, answer.code).set(1)
        if first:
            log.error(
                "%s refused by the control plane (%s: %s): its samples and KV batches are "
                "dropped, the others go on; tried again every %.0f s",
                name,
                answer.code,
                answer.detail,
                self.limits.refused_retry_s,
            )

    def _refused_lift(self, name: str) -> None:
        got = self._refused.pop(name, None)
        if got is not None:
            self.metrics.refused.labels(name, got[0]).set(0)
            log.warning("%s accepted by the control plane again", name)

    def _pop(self, kind: str, instance: str, count: int) -> None:
        if kind == "kv_batch":
            queue = self._kv.get(instance)
            for _ in range(min(count, len(queue or ()))):
                assert queue is not None
                queue.popleft()
        else:
            self._telemetry.popleft()

    def _post(self, kind: str, body: bytes, content_type: str) -> _Answer:
        path = KV_PATH if kind == "kv_batch" else TELEMETRY_PATH
        try:
            response = self.http.post(path, content=body, headers={"Content-Type": content_type})
        except httpx.HTTPError as exc:
            self.metrics.posts.labels(path, "unreachable").inc()
            log.warning("POST %s failed: %s", path, exc)
            return _Answer("retry")
        status = response.status_code
        if status < 300:
            self.metrics.posts.labels(path, "ok").inc()
            return _Answer("ok")
        self.metrics.posts.labels(path, str(status)).inc()
        code, detail = _error_of(response)
        if status in (403, 404) and code in NAME_CODES:
            return _Answer("name", code, detail)
        if status in (401, 403, 429) or status >= 500:
            # a bad token (an operator must fix it), overload or a server fault: keep the
            # items and try again later.
            log.warning("POST %s: %s %s", path, status, response.text[:300])
            return _Answer("overload", code, detail)
        log.error("POST %s refused: %s %s (dropped)", path, status, response.text[:300])
        return _Answer("refused", code, detail)

    def _backoff(self, overload: bool) -> None:
        cap = self.limits.overload_backoff_max_s if overload else self.limits.backoff_max_s
        self._backoff_s = min(cap, max(self.limits.backoff_min_s, self._backoff_s * 2))
        self._retry_at = time.monotonic() + self._backoff_s * random.uniform(0.8, 1.2)

    def retry_in(self) -> float:
        """Seconds until posting may resume (0: now)."""
        return max(0.0, self._retry_at - time.monotonic())

    def close(self) -> None:
        self.http.close()


def _names(body: dict[str, Any]) -> list[str]:
    """The instances and links a telemetry batch has samples of."""
    out = [str(s["instance"]) for s in body["instances"]]
    return out + [link_key(s["source"], s["target"]) for s in body["links"]]


def _single_name(body: dict[str, Any]) -> str | None:
    """The one instance or link a telemetry batch is about, if it holds exactly one sample."""
    instances, links = body["instances"], body["links"]
    if len(instances) + len(links) != 1 or body.get("clusters"):
        return None
    if instances:
        return str(instances[0]["instance"])
    return link_key(links[0]["source"], links[0]["target"])


def _error_of(response: httpx.Response) -> tuple[str, str]:
    try:
        body = response.json()
        return str(body.get("code", "")), str(body.get("detail", ""))[:300]
    except (ValueError, AttributeError):
        return "", response.text[:300]
