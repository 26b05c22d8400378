"""The gateway's side of the control plane: decisions, reservations, outcomes.

One :class:`scheduling.client.RouterClient` does every call (its sync HTTP runs in worker
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
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fleet.gateway import metrics
from fleet.gateway.config import GatewayConfig
from scheduling.client import RouterApiError, RouterClient, RouterUnavailableError
from scheduling.router import (
    Decision,
    InstanceSpec,
    LinkReservation,
    LiveState,
    PolicySnapshot,
    PrefixMatch,
    Reason,
    RouteRequest,
    route_fallback_local,
)

log = logging.getLogger(__name__)

# A reservation is held at most this long past its predicted end without an outcome.
HOLD_MARGIN_S = 30.0


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


@dataclass(frozen=True)
class Decided:
    """A decision and how it was made (``decided_by``: gateway | control_plane)."""

    decision: Decision
    decided_by: str


class ControlPlane:
    def __init__(self, config: GatewayConfig, client: RouterClient | None = None) -> None:
        self.config = config
        self.client = client or RouterClient(
            config.control_plane_url,
            config.token,
            timeout_s=config.control_plane_timeout_s,
            retries=1,
            cooldown_s=1.0,
        )
        self.prefixes = ServedPrefixIndex(config.prefix_index_blocks)
        self._outcomes: collections.deque[dict[str, Any]] = collections.deque()
        self._tasks: list[asyncio.Task[None]] = []
        self._flush_now = asyncio.Event()

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Fetch the policy snapshot (retried until it comes: nothing can be decided before),
        then keep it, the live state and the outcomes moving in the background."""
        while True:
            try:
                await asyncio.to_thread(self.client.refresh_policy)
                break
            except (RouterUnavailableError, RouterApiError) as exc:
                log.warning("waiting for the control plane's policy snapshot: %s", exc)
                await asyncio.sleep(1.0)
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

    async def _refresh_policy(self) -> None:
        try:
            await asyncio.to_thread(self.client.refresh_policy)
        except (RouterUnavailableError, RouterApiError) as exc:
            metrics.ERRORS.labels("control_plane_unreachable").inc()
            log.warning("policy snapshot refresh failed: %s", exc)

    async def _refresh_live(self) -> None:
        try:
            await asyncio.to_thread(self.client.refresh_live)
        except (RouterUnavailableError, RouterApiError) as exc:
            metrics.ERRORS.labels("control_plane_unreachable").inc()
            log.warning("live state refresh failed: %s", exc)

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
            try:
                d = await asyncio.to_thread(
                    self.client.route,
                    request.origin,
                    request.prompt_tokens,
                    block_hashes=request.block_hashes,
                    request_id=request.request_id,
                    expected_output_tokens=request.expected_output_tokens,
                )
            except RouterUnavailableError:
                raise
            by = "gateway" if d.stale and self.client.local_decisions else "control_plane"
            if by == "control_plane":
                return Decided(d, by)
            # The client answered locally (server away): nothing is reserved, keep it local.
            return Decided(self._without_offload(request, d, Reason.TELEMETRY_STALE), "gateway")
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
        live = self.client.live_state(self.config.live_max_age_s)
        d = self.client.decide_locally(request, live)
        rv = d.reservation
        if rv is None or rv.bytes <= 0:
            return Decided(d, "gateway")
        try:
            taken = await asyncio.to_thread(self.client.link_reserve, rv, self._hold_s(d))
        except (RouterUnavailableError, RouterApiError) as exc:
            metrics.ERRORS.labels("reservation_unavailable").inc()
            log.warning("no reservation possible, keeping the request local: %s", exc)
            return Decided(self._without_offload(request, d, Reason.TELEMETRY_STALE), "gateway")
        if taken is None:
            metrics.ERRORS.labels("reservation_refused").inc()
            return Decided(self._without_offload(request, d, Reason.LINK_CONGESTED), "gateway")
        return Decided(_with_reservation(d, taken), "gateway")

    def _without_offload(self, request: RouteRequest, d: Decision, reason: str) -> Decision:
        if d.reservation is None or d.reservation.bytes <= 0:
            return d
        snap = self.snapshot
        live = self.client.live_state(self.config.live_max_age_s)
        return route_fallback_local(
            request,
            snap.policy,
            snap.topology,
            live if live is not None else _stale(),
            reason=reason,
            original=d,
        )

    def fallback_local(self, request: RouteRequest, d: Decision, reason: str) -> Decision:
        """The local decision for a request whose offload failed on the way (prefill
        instance down): same origin, no transfer, ``reason`` as given."""
        snap = self.snapshot
        live = self.client.live_state(self.config.live_max_age_s)
        return route_fallback_local(
            request,
            snap.policy,
            snap.topology,
            live if live is not None else _stale(),
            reason=reason,
            original=d,
        )

    def _hold_s(self, d: Decision) -> float:
        """How long the reservation may live without an outcome: the predicted end of its
        transfer, plus a margin for a slow engine; the outcome releases it sooner."""
        ttft = d.ttft_estimate_s.prfaas if d.route == "prfaas" else d.ttft_estimate_s.local
        head = ttft if ttft is not None and math.isfinite(ttft) else 0.0
        return min(600.0, head + HOLD_MARGIN_S)

    def instances(self, cluster: str, role: str) -> tuple[InstanceSpec, ...]:
        """Active instances of ``cluster`` in ``role`` (for retries elsewhere)."""
        topo = self.snapshot.topology
        pool = topo.prefill_by_cluster if role == "prefill" else topo.decode_by_cluster
        return tuple(i for i in pool.get(cluster, ()) if i.state == "active")

    def connector_of(self, cluster: str) -> str:
        spec = self.snapshot.topology.cluster_by_name.get(cluster)
        return spec.kv_connector if spec is not None else "nixl"

    def endpoint(self, instance: str) -> str:
        spec = self.snapshot.topology.instance_by_name.get(instance)
        return self.config.endpoint_of(instance, spec.endpoint if spec else "")

    # -- outcomes -------------------------------------------------------------------------

    def outcome_add(self, outcome: dict[str, Any]) -> None:
        if len(self._outcomes) >= self.config.outcome_buffer:
            self._outcomes.popleft()
            metrics.OUTCOMES_DROPPED.inc()
        self._outcomes.append(outcome)
        if len(self._outcomes) >= self.config.outcome_batch:
            self._flush_now.set()

    @property
    def outcomes_pending(self) -> int:
        return len(self._outcomes)

    async def flush(self) -> int:
        """Send what is queued, one batch after another; returns how many went. Raises
        RouterUnavailableError when the control plane is away (they stay queued)."""
        sent = 0
        while self._outcomes:
            batch = [
                self._outcomes[i]
                for i in range(min(self.config.outcome_batch, len(self._outcomes)))
            ]
            try:
                await asyncio.to_thread(self.client.outcomes_report, batch)
            except RouterApiError as exc:
                # The control plane refused the batch as malformed: a bug here, not a reason
                # to block the queue behind it forever.
                metrics.OUTCOMES_DROPPED.inc(len(batch))
                log.error("outcomes refused by the control plane (%s); dropped", exc)
            for _ in batch:
                self._outcomes.popleft()
            sent += len(batch)
        return sent

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


def _stale() -> LiveState:
    return LiveState(now=time.time(), stale=True)


def _with_reservation(d: Decision, taken: LinkReservation) -> Decision:
    return dataclasses.replace(d, reservation=taken)
