"""The pure decision loop that ``bench/instructions.py`` counts under cachegrind.

    python bench/support/decide_loop.py ROOT MODE REQUESTS LOOPS TRACE

Imports the routing core and ``bench/router_pure.py``'s fleet from the checkout at ROOT (the
working tree or a worktree of another commit), builds the requests as router_pure does, then,
by MODE: ``none`` (set-up only, the baseline subtracted), ``single`` (``route_decide`` on each
request, LOOPS times) or ``batch`` (``route_decide_many`` on batches of 100, LOOPS times).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path


def main() -> None:
    root, mode, requests, loops, trace = sys.argv[1:6]
    sys.path.insert(0, root)
    import bench.router_pure as rp  # the checkout's own, hence imported here

    # The requests are built here, as router_pure's main() builds them, rather than by a
    # function of its: the commit compared against must have what this script calls.
    rng = random.Random(1)
    topology, policy, live = rp.build_fleet(rng)
    index = rp.SimulatedIndex(topology)
    built = []
    for n, (prompt, hashes) in enumerate(rp.load_requests(Path(trace), int(requests))):
        request = rp.RouteRequest(rp.PD, prompt, index.matches(hashes, prompt), request_id=f"r{n}")
        decision = rp.route_decide(request, policy, topology, live)
        index.store(hashes, decision.prefill.instance)
        built.append(request)
    if mode == "none":
        return
    for _ in range(int(loops)):
        if mode == "single":
            for request in built:
                rp.route_decide(request, policy, topology, live)
        elif mode == "batch":
            for i in range(0, len(built), 100):
                rp.route_decide_many(built[i : i + 100], policy, topology, live)
        else:
            raise SystemExit(f"unknown mode {mode!r} (none, single or batch)")


if __name__ == "__main__":
    main()
