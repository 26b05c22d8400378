"""The emulator as the router: every request of the workload is decided by the control plane
(``POST /api/v1/route``, ``/route/batch`` for those arriving together) through
:class:`fleet.client.RouterClient`, and the decision is carried out on the simulated fleet."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from fleet.client import RouterApiError, RouterClient, RouterUnavailableError
from fleet.emulator.config import EmulatorConfig, EmulatorStats
from fleet.emulator.engines import decode_peer, prefill_peer
from fleet.emulator.workload import RequestStream
from scheduling.core import routing
from scheduling.core.simulator.engine import Assignment, Simulation
from scheduling.core.simulator.fleet import ACTIVE, SimRequest

log = logging.getLogger(__name__)

# Keep route request bodies under the API's body limit (default 256 KiB): hashes per call.
MAX_HASHES_PER_CALL = 6000
MAX_BATCH = 500


class EmulatorRouter:
    """Asks the control plane about requests just before they arrive, and keeps the answers
    until the simulation assigns them."""

    def __init__(
        self,
        client: RouterClient,
        stream: RequestStream,
        config: EmulatorConfig,
        stats: EmulatorStats,
    ) -> None:
        self.client = client
        self.stream = stream
        self.config = config
        self.stats = stats
        self.decisions: dict[int, routing.RouteDecision | None] = {}

    def route_upcoming(self, first: SimRequest) -> None:
        """Ask the control plane about ``first`` and the requests arriving just after it."""
        horizon = first.arrival_s + self.config.batch_window_s * self.config.speed
        batch = self.stream.upcoming(first.index, horizon, MAX_BATCH)
        chunks: list[list[SimRequest]] = [[]]
        hashes = 0
        for request in batch:
            n = len(request.hash_ids or ())
            if chunks[-1] and hashes + n > MAX_HASHES_PER_CALL:
                chunks.append([])
                hashes = 0
            chunks[-1].append(request)
            hashes += n
        for chunk in chunks:
            self._route_chunk(chunk)

    @staticmethod
    def _route_request(request: SimRequest) -> routing.RouteRequest:
        return routing.RouteRequest(
            origin=request.origin,
            prompt_tokens=request.input_tokens,
            block_hashes=tuple(request.hash_ids or ()),
            request_id=f"emu-{request.index}",
            expected_output_tokens=request.output_tokens,
        )

    def _route_chunk(self, chunk: Sequence[SimRequest]) -> None:
        before_local = self.client.local_decisions
        try:
            if len(chunk) == 1:
                r = self._route_request(chunk[0])
                decisions = [
                    self.client.route(
                        r.origin,
                        r.prompt_tokens,
                        block_hashes=r.block_hashes,
                        request_id=r.request_id,
                        expected_output_tokens=r.expected_output_tokens,
                    )
                ]
            else:
                decisions = self.client.route_batch([self._route_request(r) for r in chunk])
        except (RouterApiError, RouterUnavailableError, routing.RouteError) as exc:
            if len(chunk) > 1:
                for request in chunk:  # one unroutable request must not sink its neighbours
                    self._route_chunk([request])
                return
            log.warning("emulator: request %s not routed: %s", chunk[0].index, exc)
            self.stats.unroutable += 1
            self.decisions[chunk[0].index] = None
            return
        local = self.client.local_decisions - before_local
        self.stats.local += local
        self.stats.remote += len(decisions) - local
        for request, decision in zip(chunk, decisions, strict=True):
            self.decisions[request.index] = decision
            self.stats.routed += 1
            self.stats.reasons[decision.reason] += 1
            if decision.route == "prfaas":
                self.stats.offloaded += 1

    def assignment(
        self,
        sim: Simulation,
        request: SimRequest,
        decision: routing.RouteDecision,
        topology: routing.Topology,
    ) -> Assignment | None:
        """Carry a decision out on the simulated fleet; an instance that cannot take the work
        (down, or no longer in that role) hands it to the least-loaded peer of its cluster."""
        prefill = sim.prefill_by_name.get(decision.prefill.instance)
        if prefill is None or prefill.state not in (ACTIVE,):
            prefill = prefill_peer(sim, decision.prefill.cluster, request.origin)
            self.stats.replaced += 1
            if prefill is None:
                return None
        decode = sim.decode_by_name.get(decision.decode.instance)
        if decode is None or decode.state != ACTIVE:
            decode = decode_peer(sim, request.origin)
            if decode is None:
                return None
        link = None
        if prefill.cluster != decode.cluster:
            link = sim.link_between.get((prefill.cluster, decode.cluster))
        cached = sim.cluster_match(request, prefill.cluster)
        transfer_link = None
        transfer_bytes = 0.0
        moved = decision.cache_transfer
        if moved is not None and moved.bytes > 0:
            transfer_link = sim.link_joining(moved.source_cluster, moved.target_cluster)
            if transfer_link is not None:
                transfer_bytes = float(moved.bytes)
                cached = max(cached, moved.tokens)
        kv_bytes = 0.0
        if link is not None:
            held = sim.cluster_match(request, decode.cluster)
            kv_bytes = float(topology.kv_transfer_bytes(request.input_tokens, held))
        return Assignment(
            route="prfaas" if link is not None else "local",
            prefill=prefill,
            decode=decode,
            cached_tokens=cached,
            reason=decision.reason,
            threshold=decision.threshold,
            link=link,
            kv_bytes=kv_bytes,
            cache_transfer_link=transfer_link,
            cache_transfer_bytes=transfer_bytes,
        )
