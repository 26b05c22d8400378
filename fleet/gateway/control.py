"""The gateway's side of the control plane: decisions, reservations, outcomes.

One :class:`fleet.client.RouterClient` does every call (its sync HTTP runs in worker
threads, off the event loop). Decisions (``decide: local``, the default) are made in process
by the same pure function the control plane uses, from:

* the **policy snapshot** (``GET /policy`` with its ETag, every ``policy_refresh_s``);
* the **live state** (``GET /route/live`` every ``live_refresh_s``); state older than
  ``live_max_age_s`` is not used: the decision then follows the policy's static rule and says
  ``telemetry_stale``, as the control plane itself does;
* the **served-prefix index**: which prefill instance recently prefilled which block chain
  (this gateway's own record, so a match is reported as inexact: the engine may have evicted
  it since).

An offload or cache transfer decided in process must still hold its bytes on the link
atomically against every other router: :meth:`ControlPlane.decide` takes the reservation
(``POST /reservations``) before the request goes anywhere; refused, the request stays local
(``link_congested``); with the control plane unreachable nothing can be reserved, so it stays
local too (``telemetry_stale``). ``decide: remote`` asks ``POST /route`` instead (which
reserves), falling back to the in-process decision when the control plane is away.

Outcomes are queued (bounded; the oldest are dropped and counted when the control plane is
away that long) and sent in batches; they release the reservations.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from fleet.client import RouterApiError, RouterClient, RouterUnavailableError
from fleet.gateway import metrics
from fleet.gateway.config import GatewayConfig
from scheduling.core.routing import (
    InstanceLoad,
    InstanceSpec,
    LinkReservation,
    LiveState,
    PolicySnapshot,
    PrefixMatch,
    Reason,
    RouteDecision,
    RouteRequest,
    route_fallback_local,
)

log = logging.getLogger(__name__)

# A reservation is held at most this long past its predicted end without an outcome.
HOLD_MARGIN_S = 30.0
OUTCOME_BATCH_BYTES = 192 * 1024
# Plain outcomes sent whole per flush (for the control plane's recent list); the others are
# summed into groups, so that thousands of requests a second cost the control plane little.
OUTCOME_SAMPLE = 8
# The codes POST /outcomes refuses an item with (anything else is counted as "other").
REJECT_CODES = frozenset({"invalid", "unknown_cluster", "unknown_reason"})


def _predicted(outcome: dict[str, Any]) -> float | None:
    d = outcome["decision"]
    if outcome["route"] != d["route"]:
        return None
    value = d["ttft_estimate_s"].get("prfaas" if d["route"] == "prfaas" else "local")
    return float(value) if value is not None else None


class _Groups:
    """Plain outcomes summed by (origin, route, reason, prefill cluster, decided by, status,
    transfer) until the next flush (``POST /outcomes`` ``groups``). Each group taken gets an
    idempotency key of its own, so a batch sent again is applied once."""

    def __init__(self, key_prefix: str = "") -> None:
        self.by_key: dict[tuple[str, ...], dict[str, Any]] = {}
        self.requests = 0
        self._key_prefix = key_prefix or f"gw-{os.urandom(6).hex()}-"
        self._taken = itertools.count()

    def add(self, o: dict[str, Any]) -> None:
        key = (
            o["origin"],
            o["route"],
            o["reason"],
            o["prefill"]["cluster"],
            o["decided_by"],
            o["status"],
            o["transfer"],
        )
        g = self.by_key.get(key)
        if g is None:
            g = self.by_key[key] = {
                "origin": key[0],
                "route": key[1],
                "reason": key[2],
                "prefill_cluster": key[3],
                "decided_by": key[4],
                "status": key[5],
                "transfer": key[6],
                "incremental_tokens": [],
                "cached_tokens": 0,
                "output_tokens": 0,
                "observed_ttft_s": [],
                "predicted_ttft_s": [],
            }
        g["incremental_tokens"].append(o["incremental_tokens"])
        g["cached_tokens"] += o["cached_tokens"]
        g["output_tokens"] += o["output_tokens"]
        predicted = _predicted(o)
        if o["observed_ttft_s"] is not None and predicted is not None:
            g["observed_ttft_s"].append(o["observed_ttft_s"])
            g["predicted_ttft_s"].append(predicted)
        self.requests += 1

    def take(self) -> list[bytes]:
        now = time.time()
        out = [
            orjson.dumps(
                {**g, "ts": now, "idempotency_key": f"{self._key_prefix}g{next(self._taken)}"}
            )
            for g in self.by_key.values()
        ]
        self.by_key = {}
        self.requests = 0
        return out


class ServedPrefixIndex:
    """Block hash -> prefill instances that prefilled it last (bounded, least recent out)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._holders: collections.OrderedDict[int | str, dict[str, str]] = (
            collections.OrderedDict()
        )

    def matches(self, chain: Sequence[int | str], block_tokens: int) -> tuple[PrefixMatch, ...]:
        """The longest chain prefix each instance holds, as inexact prefix matches."""
        if not chain or not self.capacity:
            return ()
        first = self._holders.get(chain[0])
        if not first:
            return ()
        alive = dict(first)
        depth = {name: 1 for name in alive}
        for h in chain[1:]:
            holders = self._holders.get(h)
            if not holders:
                break
            alive = {n: c for n, c in alive.items() if n in holders}
            if not alive:
                break
            for n in alive:
                depth[n] += 1
        return tuple(
            PrefixMatch(cluster=first[n], tokens=d * block_tokens, instance=n, exact=False)
            for n, d in depth.items()
        )

    def add(self, chain: Sequence[int | str], instance: str, cluster: str) -> None:
        if not self.capacity:
            return
        for h in chain:
            holders = self._holders.get(h)
            if holders is None:
                self._holders[h] = {instance: cluster}
            else:
                holders[instance] = cluster
                self._holders.move_to_end(h)
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)


class Outliers:
    """Engines that fail or hang are ejected for a while, as Envoy's outlier detection does:
    ``eject_failures`` failures in a row (a connection refused or reset, a 5xx, a deadline
    passed) eject an instance for ``eject_base_s``, doubled for each ejection that follows
    without a success between, up to ``eject_max_s``. An ejected instance is not decided onto
    (its load says ``down``) nor retried on; when its time is up it is tried again."""

    def __init__(self, failures: int, base_s: float, max_s: float) -> None:
        self.failures = failures
        self.base_s = base_s
        self.max_s = max_s
        self._in_a_row: dict[str, int] = {}
        self._times: dict[str, int] = {}  # ejections since the last success
        self._until: dict[str, float] = {}  # monotonic time an ejection ends

    def failed(self, instance: str, may_eject: bool = True) -> float | None:
        """Count a failure; the ejection's length when this one ejects the instance
        (``may_eject`` False: the last of its pool is never ejected, as Envoy's
        max_ejection_percent keeps some hosts whatever they do)."""
        n = self._in_a_row.get(instance, 0) + 1
        self._in_a_row[instance] = n
        if n < self.failures or not may_eject or self.ejected(instance):
            return None
        times = self._times.get(instance, 0) + 1
        self._times[instance] = times
        self._in_a_row[instance] = 0
        length = min(self.max_s, self.base_s * 2 ** (times - 1))
        self._until[instance] = time.monotonic() + length
        return length

    def succeeded(self, instance: str) -> None:
        if instance in self._in_a_row or instance in self._times:
            self._in_a_row.pop(instance, None)
            self._times.pop(instance, None)

    def ejected(self, instance: str) -> bool:
        until = self._until.get(instance)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        del self._until[instance]
        return False

    def now(self) -> frozenset[str]:
        """The instances ejected now."""
        return frozenset(name for name in list(self._until) if self.ejected(name))


class Dispatches:
    """This gateway's requests on each engine now: prefills (with their uncached tokens) and
    decodes, with when each started (unix time, as the engines' samples are stamped)."""

    def __init__(self) -> None:
        self._by: dict[str, dict[int, tuple[float, str, int]]] = {}
        self._ids = itertools.count()

    def begin(self, instance: str, role: str, tokens: int = 0) -> tuple[str, int]:
        """A dispatch starts; :meth:`end` it with what this returns (plain calls, not a
        context manager: two of them per request, on the hot path)."""
        key = next(self._ids)
        mine = self._by.get(instance)
        if mine is None:
            mine = self._by[instance] = {}
        mine[key] = (time.time(), role, tokens)
        return instance, key

    def end(self, handle: tuple[str, int]) -> None:
        mine = self._by.get(handle[0])
        if mine is not None:
            mine.pop(handle[1], None)

    def count(self, instance: str) -> int:
        return len(self._by.get(instance, ()))

    def unseen(self, loads: Mapping[str, InstanceLoad]) -> tuple[tuple[str, int, int, int], ...]:
        """Per instance, the dispatches its sample in ``loads`` cannot have seen yet (started
        after it): ``(instance, prefills, their tokens, decodes)``, those with any."""
        out = []
        for name, mine in self._by.items():
            if not mine:
                continue
            load = loads.get(name)
            since = load.updated_at if load is not None and load.updated_at else 0.0
            depth = tokens = running = 0
            for started, role, n in mine.values():
                if started <= since:
                    continue
                if role == "prefill":
                    depth += 1
                    tokens += n
                else:
                    running += 1
            if depth or running:
                out.append((name, depth, tokens, running))
        return tuple(out)


def _loads_over(
    loads: Mapping[str, InstanceLoad],
    unseen: tuple[tuple[str, int, int, int], ...],
    ejected: frozenset[str],
) -> dict[str, InstanceLoad]:
    """``loads`` with the unseen dispatches added (a prefill to the queue, a decode to the
    running requests) and the ejected instances down."""
    out = dict(loads)
    empty = InstanceLoad()
    for name, depth, tokens, running in unseen:
        x = out.get(name) or empty
        out[name] = InstanceLoad(
            x.queue_depth + depth,
            x.queued_prefill_tokens + tokens,
            x.queued_prefill_s,
            x.running + running,
            x.waiting,
            x.kv_usage,
            x.updated_at,
            x.state,
        )
    for name in ejected:
        x = out.get(name) or empty
        out[name] = InstanceLoad(
            x.queue_depth,
            x.queued_prefill_tokens,
            x.queued_prefill_s,
            x.running,
            x.waiting,
            x.kv_usage,
            x.updated_at,
            "down",
        )
    return out


@dataclass(frozen=True)
class Decided:
    """A decision and how it was made (``decided_by``: gateway | control_plane)."""

    decision: RouteDecision
    decided_by: str


class ControlPlane:
    def __init__(self, config: GatewayConfig, client: RouterClient | None = None) -> None:
        self.config = config
        self.client = client or RouterClient(
            config.control_plane.url,
            config.token,
            timeout_s=config.control_plane.timeout_s,
            retries=1,
            cooldown_s=config.control_plane.cooldown_s,
        )
        self.prefixes = ServedPrefixIndex(config.prefix_index_blocks)
        self.dispatches = Dispatches()
        self.outliers = Outliers(config.eject_failures, config.eject_base_s, config.eject_max_s)
        self._overlaid: tuple[Mapping[str, InstanceLoad], Any, LiveState] | None = None
        # What the control plane refuses this gateway (401/403: its token), by call, for
        # /health; cleared when that call succeeds again.
        self.refusals: dict[str, str] = {}
        self._reports: set[asyncio.Task[None]] = set()
        self._outcomes: collections.deque[bytes] = collections.deque()
        self._groups = _Groups()
        self._pending_groups: list[bytes] = []
        self._sampled = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._flush_now = asyncio.Event()
        # One flush at a time: the background loop and a caller (shutdown, a test) may both
        # flush, and two flushes would send the same head of the queue and pop it twice.
        self._flush_lock = asyncio.Lock()
        self._in_flight = 0  # outcomes taken off the queue by the flush now sending them

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Fetch the policy snapshot (retried until it comes: nothing can be decided before),
        then keep it, the live state and the outcomes moving in the background."""
        while True:
            try:
                await asyncio.to_thread(self.client.refresh_policy)
                break
            except (RouterUnavailableError, RouterApiError) as exc:
                self._refused("policy snapshot", exc)
                log.warning("waiting for the control plane's policy snapshot: %s", exc)
                await asyncio.sleep(1.0)
        self._refused("policy snapshot", None)
        self._tasks = [
            asyncio.create_task(self._every(self.config.policy_refresh_s, self._refresh_policy)),
            asyncio.create_task(self._outcomes_loop()),
        ]
        if self.config.decide == "local":
            await self._refresh_live()
            self._tasks.append(
                asyncio.create_task(self._every(self.config.live_refresh_s, self._refresh_live))
            )

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await asyncio.wait_for(self.flush(), 5.0)
        except (TimeoutError, RouterUnavailableError, RouterApiError) as exc:
            log.warning("outcomes not delivered at shutdown: %s", exc)
        self.client.close()

    async def _every(self, period_s: float, step: Any) -> None:
        while True:
            await asyncio.sleep(period_s)
            await step()

    async def _refresh(self, what: str, fetch: Callable[[], object]) -> None:
        try:
            await asyncio.to_thread(fetch)
        except (RouterUnavailableError, RouterApiError) as exc:
            self._refused(what, exc)
            metrics.ERRORS.labels("control_plane_unreachable").inc()
            log.warning("%s refresh failed: %s", what, exc)
        else:
            self._refused(what, None)

    def _refused(self, what: str, exc: BaseException | None) -> None:
        """Keep /health's account of what the control plane refuses this gateway."""
        if isinstance(exc, RouterApiError) and exc.status in (401, 403):
            self.refusals[what] = str(exc)
        elif exc is None:
            self.refusals.pop(what, None)

    async def _refresh_policy(self) -> None:
        await self._refresh("policy snapshot", self.client.refresh_policy)

    async def _refresh_live(self) -> None:
        await self._refresh("live state", self.client.refresh_live)

    @property
    def snapshot(self) -> PolicySnapshot:
        snap = self.client.policy_snapshot
        assert snap is not None, "start() fetches the snapshot first"
        return snap

    # -- decisions ------------------------------------------------------------------------

    async def decide(self, request: RouteRequest) -> Decided:
        """Decide ``request`` (see the module docstring); raises the pure router's
        RouteError when the origin cannot serve it at all."""
        if self.config.decide == "remote":
            local_before = self.client.local_decisions
            try:
                d = await asyncio.to_thread(
                    self.client.route,
                    request.origin,
                    request.prompt_tokens,
                    block_hashes=request.block_hashes,
                    request_id=request.request_id,
                    expected_output_tokens=request.expected_output_tokens,
                )
            except RouterApiError as exc:
                # Refused (the token, or input the gateway let through): served all the same,
                # decided here and kept local (nothing was reserved).
                self._refused("route", exc)
                metrics.ERRORS.labels("control_plane_refused").inc()
                log.warning("POST /route refused, deciding locally: %s", exc)
                d = self.client.decide_locally(request, None)
                return Decided(self._without_offload(request, d, Reason.TELEMETRY_STALE), "gateway")
            self._refused("route", None)
            rv = d.reservation
            if rv is not None and rv.bytes > 0 and not rv.id:
                # Answered by the client itself (control plane away): nothing is reserved (a
                # reservation the control plane took always has its id), so keep it local.
                return Decided(self._without_offload(request, d, Reason.TELEMETRY_STALE), "gateway")
            # Who decided, for the traffic store (approximate under concurrent calls).
            by = "control_plane" if self.client.local_decisions == local_before else "gateway"
            return Decided(d, by)
        snap = self.snapshot
        block_tokens = snap.topology.model.block_tokens
        request = RouteRequest(
            origin=request.origin,
            prompt_tokens=request.prompt_tokens,
            prefix_matches=self.prefixes.matches(request.block_hashes, block_tokens),
            block_hashes=request.block_hashes,
            request_id=request.request_id,
            expected_output_tokens=request.expected_output_tokens,
        )
        d = self.client.decide_locally(request, self.live_state())
        rv = d.reservation
        if rv is None or rv.bytes <= 0:
            return Decided(d, "gateway")
        try:
            if not self.client.server_usable():
                # Within the cooldown after a failed call: nothing is tried (and no thread is
                # waited for), so a dead control plane costs one timeout, then none.
                raise RouterUnavailableError("the control plane is away (cooldown)")
            taken = await asyncio.to_thread(self.client.link_reserve, rv, self._hold_s(d))
        except (RouterUnavailableError, RouterApiError) as exc:
            self._refused("reservations", exc)
            metrics.ERRORS.labels("reservation_unavailable").inc()
            log.debug("no reservation possible, keeping the request local: %s", exc)
            return Decided(self._without_offload(request, d, Reason.TELEMETRY_STALE), "gateway")
        self._refused("reservations", None)
        if taken is None:
            metrics.ERRORS.labels("reservation_refused").inc()
            return Decided(self._without_offload(request, d, Reason.LINK_CONGESTED), "gateway")
        return Decided(_with_reservation(d, taken), "gateway")

    def _without_offload(
        self, request: RouteRequest, d: RouteDecision, reason: str
    ) -> RouteDecision:
        if d.reservation is None or d.reservation.bytes <= 0:
            return d
        return self.fallback_local(request, d, reason)

    def fallback_local(self, request: RouteRequest, d: RouteDecision, reason: str) -> RouteDecision:
        """The local decision for a request whose offload failed on the way (prefill
        instance down): same origin, no transfer, ``reason`` as given."""
        snap = self.snapshot
        return route_fallback_local(
            request, snap.policy, snap.topology, self.live_state(), reason=reason, original=d
        )

    def live_state(self) -> LiveState:
        """The live state decisions use: the control plane's (stale past ``live_max_age_s``),
        with this gateway's own knowledge over it: its dispatches since each instance's last
        sample (the engines' next samples will show them; until then every request would
        see the same idle instance and go there), and the engines it has ejected."""
        base = self.client.live_state(self.config.live_max_age_s) or _stale()
        unseen = self.dispatches.unseen(base.instances)
        ejected = self.outliers.now()
        if not unseen and not ejected:
            return base
        # The same view as the last decision's while nothing in it changed: a new LiveState
        # loses what decisions memoise on it (each pool's least loaded entry), which cost as
        # much again as the decision itself.
        key = (unseen, ejected)
        cached = self._overlaid
        if cached is not None and cached[0] is base.instances and cached[1] == key:
            return cached[2]
        live = LiveState(
            now=base.now,
            instances=_loads_over(base.instances, unseen, ejected),
            links=base.links,
            control=base.control,
            stale=base.stale,
            telemetry_at=base.telemetry_at,
        )
        self._overlaid = (base.instances, key, live)
        return live

    def _hold_s(self, d: RouteDecision) -> float:
        """How long the reservation may live without an outcome: the predicted end of its
        transfer, plus a margin for a slow engine; the outcome releases it sooner."""
        ttft = d.ttft_estimate_s.prfaas if d.route == "prfaas" else d.ttft_estimate_s.local
        head = ttft if ttft is not None and math.isfinite(ttft) else 0.0
        return min(600.0, head + HOLD_MARGIN_S)

    def instances(self, cluster: str, role: str) -> tuple[InstanceSpec, ...]:
        """Active instances of ``cluster`` in ``role`` that this gateway has not ejected (for
        retries elsewhere)."""
        topo = self.snapshot.topology
        pool = topo.prefill_by_cluster if role == "prefill" else topo.decode_by_cluster
        return tuple(
            i
            for i in pool.get(cluster, ())
            if i.state == "active" and not self.outliers.ejected(i.name)
        )

    def engine_failed(self, instance: str, why: str) -> None:
        """An engine call failed (``why``: what happened): counted, and past
        ``eject_failures`` in a row the instance is ejected and the control plane told, so
        that its decisions (and other gateways', through the live state) avoid it too."""
        spec = self.snapshot.topology.instance_by_name.get(instance)
        others = (
            [i for i in self.instances(spec.cluster, spec.role) if i.name != instance]
            if spec is not None
            else []
        )
        length = self.outliers.failed(instance, may_eject=bool(others))
        if length is None:
            return
        metrics.EJECTIONS.labels(instance).inc()
        log.warning("engine %s ejected for %.0f s: %s", instance, length, why)
        if self.client.server_usable():
            task = asyncio.create_task(self._ejection_report(instance, length, why))
            self._reports.add(task)
            task.add_done_callback(self._reports.discard)

    def engine_answered(self, instance: str) -> None:
        self.outliers.succeeded(instance)

    async def _ejection_report(self, instance: str, length: float, why: str) -> None:
        try:
            await asyncio.to_thread(self.client.instance_eject, instance, length, why)
        except (RouterUnavailableError, RouterApiError) as exc:
            log.warning("ejection of %s not reported: %s", instance, exc)

    def connector_of(self, cluster: str) -> str:
        spec = self.snapshot.topology.cluster_by_name.get(cluster)
        return spec.kv_connector if spec is not None else "nixl"

    def endpoint(self, instance: str) -> str:
        spec = self.snapshot.topology.instance_by_name.get(instance)
        return self.config.endpoint_of(instance, spec.endpoint if spec else "")

    # -- outcomes -------------------------------------------------------------------------

    def outcome_add(self, outcome: dict[str, Any], *, notable: bool) -> None:
        """Queue one request's outcome: whole when ``notable`` (it holds a reservation,
        failed, fell back) or among the first few of this flush, else summed in a group."""
        if not notable and self._sampled >= OUTCOME_SAMPLE:
            if self.outcomes_pending >= self.config.outcome_buffer:
                metrics.OUTCOMES_DROPPED.inc()
                return
            self._groups.add(outcome)
            return
        self._sampled += 1
        if len(self._outcomes) >= self.config.outcome_buffer:
            self._outcomes.popleft()
            metrics.OUTCOMES_DROPPED.inc()
        self._outcomes.append(orjson.dumps(outcome))
        if len(self._outcomes) >= self.config.outcome_batch:
            self._flush_now.set()

    @property
    def outcomes_pending(self) -> int:
        return len(self._outcomes) + self._in_flight + self._groups.requests

    async def flush(self) -> int:
        """Send what is queued: whole outcomes first (they release reservations), then the
        summed groups, in batches within the control plane's body limit; returns how many
        requests went. Raises RouterUnavailableError when the control plane is away (they
        stay queued)."""
        async with self._flush_lock:
            sent = 0
            self._sampled = 0
            self._pending_groups += self._groups.take()
            while self._outcomes:
                # Taken off the queue before the await: outcome_add may drop the oldest while
                # this batch is on its way, and must not drop (or we pop) the wrong ones.
                batch = _batch(self._outcomes, self.config.outcome_batch)
                for _ in batch:
                    self._outcomes.popleft()
                self._in_flight = len(batch)
                try:
                    await self._report(batch, [])
                except BaseException:  # away, or cancelled at shutdown: they stay queued
                    self._outcomes.extendleft(reversed(batch))
                    raise
                finally:
                    self._in_flight = 0
                sent += len(batch)
            while self._pending_groups:
                batch = _batch(self._pending_groups, 1000)
                await self._report([], batch)
                del self._pending_groups[: len(batch)]
                sent += len(batch)
            return sent

    async def _report(self, outcomes: list[bytes], groups: list[bytes]) -> None:
        try:
            answer = await asyncio.to_thread(self.client.outcomes_report, outcomes, groups)
        except RouterApiError as exc:
            # The whole body refused (its shape, or the token): not a reason to block the
            # queue behind it.
            self._refused("outcomes", exc)
            metrics.OUTCOMES_DROPPED.inc(len(outcomes) + len(groups))
            log.error("outcomes refused by the control plane (%s); dropped", exc)
            return
        self._refused("outcomes", None)
        rejected = answer.get("rejected") or []
        for item in rejected:
            code = str(item.get("code")) if isinstance(item, dict) else ""
            metrics.OUTCOMES_REJECTED.labels(code if code in REJECT_CODES else "other").inc()
        if rejected:
            log.warning(
                "%d outcome(s) refused by the control plane, e.g. %s",
                len(rejected),
                rejected[0].get("detail") if isinstance(rejected[0], dict) else rejected[0],
            )

    async def _outcomes_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._flush_now.wait(), self.config.outcome_interval_s)
            self._flush_now.clear()
            try:
                await self.flush()
            except RouterUnavailableError as exc:
                metrics.ERRORS.labels("control_plane_unreachable").inc()
                log.warning("outcomes kept for later: %s", exc)
                await asyncio.sleep(self.config.outcome_interval_s)


def _batch(items: Iterable[bytes], limit: int) -> list[bytes]:
    """The first items, at most ``limit`` of them and ``OUTCOME_BATCH_BYTES`` (the control
    plane refuses bodies over its API_MAX_BODY_BYTES, 256 KiB by default)."""
    batch: list[bytes] = []
    size = 0
    for item in itertools.islice(items, limit):
        if batch and size + len(item) > OUTCOME_BATCH_BYTES:
            break
        batch.append(item)
        size += len(item) + 1
    return batch


def _stale() -> LiveState:
    return LiveState(now=time.time(), stale=True)


def _with_reservation(d: RouteDecision, taken: LinkReservation) -> RouteDecision:
    return dataclasses.replace(d, reservation=taken)
