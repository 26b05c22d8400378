"""The cross-datacenter link as a shared fluid resource.

Concurrent transfers share the capacity fairly (processor sharing, max-min fair): a transfer
whose prefill is still running cannot send faster than its prefill produces KV (layer-wise
pipelining: ``size / prefill_seconds``), and what it leaves unused goes to the others. A
transfer therefore never ends before its prefill; after the last byte leaves, the data needs
one round-trip time to be acknowledged at the decode side. Bytes sent are accumulated into
fixed-width buckets for the utilisation time series.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scheduling.core.link import link_key

_EPS_BYTES = 1e-3


@dataclass(slots=True, eq=False)
class Flow:
    """One transfer on a link: a request's KVCache, or a prefix moved between clusters."""

    owner: object
    size_bytes: float
    remaining_bytes: float
    cap_bps: float  # bytes/s while producing (prefill running); math.inf once produced
    producing: bool
    kind: str = "kv"  # "kv": a prefill's KVCache for decode; "cache": a prefix moved for reuse
    rate: float = 0.0


@dataclass(slots=True, eq=False)
class FluidLink:
    """A directed link between a PrfaaS cluster and a PD cluster."""

    source: str
    target: str
    capacity_bps: float  # bytes per second
    rtt_s: float
    bucket_s: float = 1.0
    flows: list[Flow] = field(default_factory=list)
    last_s: float = 0.0
    version: int = 0
    sent_bytes: float = 0.0
    delivered_bytes: float = 0.0
    buckets: list[float] = field(default_factory=list)
    reserved_bytes: float = 0.0  # KV of offloaded requests not yet delivered (queued or flowing)
    aborted_bytes: float = 0.0  # sent for transfers cut off by a failed instance

    @property
    def key(self) -> str:
        return link_key(self.source, self.target)

    def utilisation(self) -> float:
        if self.capacity_bps <= 0:
            return 1.0 if self.flows else 0.0
        return min(1.0, sum(f.rate for f in self.flows) / self.capacity_bps)

    def in_flight_bytes(self) -> float:
        return sum(f.remaining_bytes for f in self.flows)

    def advance(self, now: float) -> None:
        """Move every flow forward to ``now`` at its current rate."""
        dt = now - self.last_s
        if dt <= 0:
            return
        total = 0.0
        for flow in self.flows:
            if flow.rate > 0:
                sent = min(flow.remaining_bytes, flow.rate * dt)
                flow.remaining_bytes -= sent
                total += sent
        if total > 0:
            self._record(self.last_s, now, total)
            self.sent_bytes += total
        self.last_s = now

    def _record(self, start: float, end: float, total: float) -> None:
        width = self.bucket_s
        buckets = self.buckets
        first = int(start / width)
        last = int(end / width)
        if last >= len(buckets):
            buckets.extend([0.0] * (last + 1 - len(buckets)))
        if first == last:
            buckets[first] += total
            return
        per_s = total / (end - start)
        buckets[first] += per_s * ((first + 1) * width - start)
        for index in range(first + 1, last):
            buckets[index] += per_s * width
        buckets[last] += per_s * (end - last * width)

    def reshare(self) -> None:
        """Max-min fair rates: capped flows get their cap when it is below the fair share."""
        flows = self.flows
        if not flows:
            return
        spare = self.capacity_bps
        if len(flows) == 1:
            only = flows[0]
            only.rate = min(only.cap_bps, spare)
            return
        ordered = sorted(flows, key=_cap)
        left = len(ordered)
        for flow in ordered:
            share = spare / left
            if flow.cap_bps <= share:
                flow.rate = flow.cap_bps
                spare -= flow.cap_bps
            else:
                flow.rate = share
                spare -= share
            left -= 1

    def next_completion(self) -> float:
        """Time from ``last_s`` until the first fully produced flow sends its last byte."""
        best = math.inf
        for flow in self.flows:
            if not flow.producing and flow.rate > 0:
                wait = flow.remaining_bytes / flow.rate
                if wait < best:
                    best = wait
        return best

    def abort(self, flow: Flow) -> None:
        """Drop a transfer whose producer failed; what it already sent is counted as aborted."""
        if flow in self.flows:
            self.flows.remove(flow)
            self.aborted_bytes += flow.size_bytes - flow.remaining_bytes

    def finished(self) -> list[Flow]:
        """Remove and return produced flows with nothing left to send."""
        # A residue the clock cannot resolve (under a nanosecond of sending) counts as sent.
        done = [
            f
            for f in self.flows
            if not f.producing and f.remaining_bytes <= max(_EPS_BYTES, f.rate * 1e-9)
        ]
        if done:
            self.flows = [f for f in self.flows if f not in done]
            for flow in done:
                self.delivered_bytes += flow.size_bytes
        return done


def _cap(flow: Flow) -> float:
    return flow.cap_bps
