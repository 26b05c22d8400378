"""Time the pure routing decision on a 64 prefill + 64 decode PD cluster.

Standalone: sets up nothing Django, no Redis. Builds the paper's hardware at a larger scale
(one PD cluster of 64 prefill + 64 decode H20 instances, two PrfaaS H200 clusters of 16 and
8 instances over 100 and 40 Gbps links), replays Mooncake conversation requests (prompt
lengths and prefix-block hash ids, 512-token blocks) through
:func:`scheduling.core.routing.route_decide`, and prints p50/p99 per decision and decisions/s.

The prefix index is simulated outside the timed region (the server reads it from Redis): each
decision's prefill instance is recorded as holding the request's blocks, so later turns of
a conversation find their prefix where it was computed. Loads are random but fixed per run.

In the same run it times a baseline: a bare threshold comparison returning a tuple (what a
router without any of this would do), called the same way, so the ratio says what the
decision costs relative to the cheapest possible Python call on this machine. It also times
``route_decide_many`` (batches of 100 against one snapshot).

Target (issue 16): p99 <= 100 us for 64 prefill + 64 decode instances. This script reports;
it does not gate.

    python bench/router_pure.py [--requests N] [--trace PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduling.core.routing import (  # noqa: E402
    ClusterSpec,
    ControlState,
    DecodeProfile,
    InstanceLoad,
    InstanceSpec,
    Link,
    LinkLoad,
    LiveState,
    ModelSpec,
    PrefixMatch,
    RouteRequest,
    RoutingPolicy,
    Topology,
    route_decide,
    route_decide_many,
)

TRACE = ROOT / "traces" / "mooncake" / "conversation_trace.jsonl"
BLOCK = 512
H200 = ((1024, 0.44), (8192, 0.72), (32768, 1.84), (131072, 7.40))
H20 = (
    (1024, 0.603),
    (4096, 1.007),
    (8192, 1.554),
    (16384, 2.679),
    (24576, 3.842),
    (32768, 5.046),
    (49152, 7.571),
    (65536, 10.254),
    (98304, 16.094),
    (131072, 22.565),
)
KV_MIB = ((1024, 190.8), (8192, 308.9), (32768, 701.3), (131072, 2316.3))
PD = "pd-h20"
PRFAAS = {"prfaas-a": (16, 100.0), "prfaas-b": (8, 40.0)}
THRESHOLD = 19400


def build_fleet(rng: random.Random) -> tuple[Topology, RoutingPolicy, LiveState]:
    clusters = [ClusterSpec(PD, "pd", H20, "H20", decode=DecodeProfile(20, 0.025))]
    instances: list[InstanceSpec] = []
    links: list[Link] = []
    for name, (count, gbps) in PRFAAS.items():
        clusters.append(ClusterSpec(name, "prfaas", H200, "H200"))
        instances += [
            InstanceSpec(f"{name}-{i}", name, "prefill", endpoint=f"http://{name}-{i}:8000")
            for i in range(count)
        ]
        links.append(Link(name, PD, gbps, 10.0))
    for i in range(64):
        # A few draining/down instances, as in a fleet that is being rebalanced.
        state = "draining" if i % 29 == 5 else "down" if i % 31 == 7 else "active"
        instances.append(InstanceSpec(f"pd-p{i}", PD, "prefill", state, f"http://pd-p{i}:8000"))
        instances.append(InstanceSpec(f"pd-d{i}", PD, "decode", state, f"http://pd-d{i}:8000"))
    topology = Topology(
        ModelSpec("internal-1t-hybrid", BLOCK, KV_MIB),
        tuple(clusters),
        tuple(instances),
        tuple(links),
    )
    loads = {
        inst.name: InstanceLoad(
            queue_depth=rng.randint(0, 4),
            queued_prefill_tokens=rng.randint(0, 80000),
            running=rng.randint(0, 20),
            waiting=rng.randint(0, 3),
            kv_usage=rng.random(),
            updated_at=999.0,
        )
        for inst in instances
    }
    link_loads = {
        link.pair: LinkLoad(egress_gbps=link.gbps * rng.uniform(0.1, 0.7), inflight_bytes=0)
        for link in links
    }
    live = LiveState(
        now=1000.0,
        instances=loads,
        links=link_loads,
        control={PD: ControlState(updated_at=999.0)},
        telemetry_at=999.5,
    )
    return topology, RoutingPolicy(1, {PD: THRESHOLD}), live


def load_requests(path: Path, limit: int) -> list[tuple[int, list[int]]]:
    rows: list[tuple[int, list[int]]] = []
    with path.open() as fh:
        for line in fh:
            row = json.loads(line)
            rows.append((int(row["input_length"]), list(row["hash_ids"])))
            if len(rows) >= limit:
                break
    return rows


class SimulatedIndex:
    """Where each prefix block was computed: block hash id -> instances holding it."""

    def __init__(self, topology: Topology) -> None:
        self.holders: dict[int, set[str]] = {}
        self.cluster_of = {i.name: i.cluster for i in topology.instances}

    def matches(self, hash_ids: list[int], prompt: int) -> tuple[PrefixMatch, ...]:
        best: dict[str, int] = {}
        alive: set[str] | None = None
        for n, h in enumerate(hash_ids):
            holders = self.holders.get(h)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for inst in alive:
                best[inst] = (n + 1) * BLOCK
        return tuple(
            PrefixMatch(self.cluster_of[inst], min(tokens, prompt), inst)
            for inst, tokens in best.items()
        )

    def store(self, hash_ids: list[int], instance: str) -> None:
        for h in hash_ids:
            self.holders.setdefault(h, set()).add(instance)


def baseline(request: RouteRequest, threshold: int) -> tuple[str, int]:
    return ("prfaas" if request.prompt_tokens > threshold else "local", request.prompt_tokens)


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=12031)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    topology, policy, live = build_fleet(rng)
    rows = load_requests(args.trace, args.requests)
    index = SimulatedIndex(topology)

    # Build the requests (with prefix matches from the simulated index) outside the timing.
    requests: list[RouteRequest] = []
    for n, (prompt, hashes) in enumerate(rows):
        request = RouteRequest(PD, prompt, index.matches(hashes, prompt), request_id=f"r{n}")
        decision = route_decide(request, policy, topology, live)
        index.store(hashes, decision.prefill.instance)
        requests.append(request)

    # Wall time per call, plus thread CPU time per call: on a shared machine other processes
    # preempt this one, which inflates wall-clock tails but not the CPU the call itself used.
    perf = time.perf_counter_ns
    cpu = time.thread_time_ns
    gc.collect()
    times_us: list[float] = []
    cpu_us: list[float] = []
    reasons: Counter[str] = Counter()
    for request in requests:
        c0 = cpu()
        t0 = perf()
        decision = route_decide(request, policy, topology, live)
        t1 = perf()
        c1 = cpu()
        times_us.append((t1 - t0) / 1000.0)
        cpu_us.append((c1 - c0) / 1000.0)
        reasons[decision.reason] += 1
    base_us: list[float] = []
    for request in requests:
        t0 = perf()
        baseline(request, THRESHOLD)
        base_us.append((perf() - t0) / 1000.0)
    batch_size = 100
    t0 = perf()
    for i in range(0, len(requests), batch_size):
        route_decide_many(requests[i : i + batch_size], policy, topology, live)
    batch_s = (perf() - t0) / 1e9

    times_us.sort()
    cpu_us.sort()
    base_us.sort()
    p50, p99 = percentile(times_us, 0.50), percentile(times_us, 0.99)
    c50, c99 = percentile(cpu_us, 0.50), percentile(cpu_us, 0.99)
    b50, b99 = percentile(base_us, 0.50), percentile(base_us, 0.99)
    total_s = sum(times_us) / 1e6
    hits = sum(1 for r in requests if r.prefix_matches)
    print(f"fleet: {PD} 64 prefill + 64 decode; PrfaaS {dict(PRFAAS)} (instances, Gbps)")
    print(f"requests: {len(requests)} from {args.trace.name} ({hits} with a prefix match)")
    print(
        f"route_decide wall   p50 {p50:8.1f} us   p99 {p99:8.1f} us   "
        f"mean {statistics.fmean(times_us):7.1f} us   {len(requests) / total_s:10.0f} decisions/s"
    )
    print(f"route_decide cpu    p50 {c50:8.1f} us   p99 {c99:8.1f} us   (thread CPU time)")
    print(f"baseline threshold  p50 {b50:8.2f} us   p99 {b99:8.2f} us   (wall)")
    print(
        f"route_decide_many   batches of {batch_size}: {len(requests) / batch_s:10.0f} decisions/s"
    )
    print(f"ratio route_decide / baseline (wall): p50 {p50 / b50:.0f}x, p99 {p99 / b99:.0f}x")
    verdict = "met" if p99 <= 100 else "NOT met"
    print(f"target p99 <= 100 us (wall): {verdict} ({p99:.1f} us; cpu p99 {c99:.1f} us)")
    print("reasons: " + ", ".join(f"{k} {v}" for k, v in reasons.most_common()))


if __name__ == "__main__":
    main()
