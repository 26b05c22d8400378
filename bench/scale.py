"""How the live stores' cost grows: one Redis against a Redis Cluster of three masters.

Two cores cannot show three masters' throughput, so this measures what each master *spends*:
Redis CPU (``INFO cpu``, the main thread's user + system seconds) per 1,000 block events
ingested and per route lookup, memory per index entry, and how the keys spread over the
masters. Capacity per master follows: a core's second divided by the cost.

* **ingest**: ``--entries`` (block, instance) entries stored by ``--fill-instances`` instances
  in script calls of 200 blocks (the ingest path's slices), single Redis (one index group) and
  the cluster (``PREFIX_INDEX_GROUPS`` = masters); per master: its events, CPU, memory, keys;
* **lookups**: fleets of 12, 128 and 1,024 instances, each holding 4 of 64 shared 32-block
  prefixes; ``--lookups`` route lookups of one chain each through the route path's index read
  (:func:`clusters.live.prefix_index.prefix_matches_bounded_async`: one scripted call per
  group, pipelined per master, the masters in parallel); client CPU and wall p99 per lookup,
  Redis CPU per lookup on each master. Both stores run side by side and take turns, fleet by
  fleet, for ``--rounds`` rounds: the ratio reported is the median round's, so a load that
  moves on this shared machine weighs on both alike. (Redis's own ``commandstats`` time is no
  help here: it is wall time, and three masters and the client on two cores are preempted
  inside their scripts far more than one Redis is.)

Every server is started here (``redis-server`` on free ports, no persistence) and stopped at
the end. The last line printed is the JSON of every figure.

    python bench/scale.py [--entries 1000000] [--lookups 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import django  # noqa: E402
from django.conf import settings  # noqa: E402

settings.configure(REDIS_URL="redis://127.0.0.1:1/0", REDIS_CLUSTER_URL="", PREFIX_INDEX_GROUPS=1)
django.setup()

import redis  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402

from clusters.live import prefix_index as px  # noqa: E402
from clusters.live.keys import prefix_instance_prefix  # noqa: E402
from controlplane.redis_connection import redis_cluster_async, redis_cluster_sync  # noqa: E402
from tests.support.processes import free_port, redis_executable, redis_ping  # noqa: E402
from tests.support.redis_cluster import ThrowawayRedisCluster  # noqa: E402

BLOCK = 512
CHAIN = 32
PREFIXES = 64
FLEETS = (12, 128, 1024)
SLICE = 200


class Single:
    """One redis-server."""

    def __init__(self, root: Path) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                *(redis_executable(), "--port", str(self.port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no", "--dir", str(root)),
            ],
            stdout=subprocess.DEVNULL,
        )
        while not redis_ping(self.port):
            time.sleep(0.05)
        self.client = redis.Redis(port=self.port)
        self.ports = [self.port]

    def async_client(self) -> Any:
        return aioredis.Redis(port=self.port)

    def node_of(self, key: str) -> int:
        return self.port

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


class Cluster:
    """Three masters, no replicas (a replica's cost is its master's, copied)."""

    def __init__(self, root: Path, masters: int) -> None:
        self.cluster = ThrowawayRedisCluster(root, masters=masters, replicas=0)
        self.cluster.start()
        self.client = redis_cluster_sync(self.cluster.url)
        self.ports = self.cluster.master_ports()

    def async_client(self) -> Any:
        return redis_cluster_async(self.cluster.url)

    def node_of(self, key: str) -> int:
        node = self.client.get_node_from_key(key)  # type: ignore[attr-defined]
        return int(node.port)

    def stop(self) -> None:
        self.cluster.stop()


def node_stats(port: int) -> dict[str, float]:
    r = redis.Redis(port=port)
    cpu = r.info("cpu")
    mem = r.info("memory")
    out = {
        "cpu_s": float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"]),
        "memory": float(mem["used_memory"]),
        "keys": float(r.dbsize()),
    }
    r.close()
    return out


def stats(ports: list[int]) -> dict[int, dict[str, float]]:
    return {p: node_stats(p) for p in ports}


def idle_cpu_per_s(ports: list[int], seconds: float = 2.0) -> dict[int, float]:
    """Each node's own CPU rate with no client (its cron; on a cluster, the cluster bus too):
    subtracted from what a measurement costs, so the cost is the work's."""
    before = stats(ports)
    time.sleep(seconds)
    after = stats(ports)
    return {p: (after[p]["cpu_s"] - before[p]["cpu_s"]) / seconds for p in ports}


def work_cpu(
    before: dict[int, dict[str, float]],
    after: dict[int, dict[str, float]],
    idle: dict[int, float],
    wall: float,
) -> dict[int, float]:
    return {p: max(0.0, after[p]["cpu_s"] - before[p]["cpu_s"] - idle[p] * wall) for p in after}


def spread(values: list[float]) -> float:
    """How far the largest is above the smallest, as a fraction of the mean."""
    mean = statistics.fmean(values)
    return (max(values) - min(values)) / mean if mean else 0.0


def ingest(
    store: Any,
    groups: int,
    sizes: list[int],
    instances: int,
    rng: random.Random,
    idle: dict[int, float],
) -> list[dict[str, Any]]:
    """Fill the index to each of ``sizes`` entries in turn; per step and master: the step's
    events and Redis CPU, the memory and keys of everything stored so far."""
    settings.PREFIX_INDEX_GROUPS = groups
    names = [f"fill-{i}" for i in range(instances)]
    node_of = {n: store.node_of(prefix_instance_prefix(n, groups)) for n in names}
    empty = stats(store.ports)
    held = 0
    total_of = {p: 0 for p in store.ports}
    out = []
    for size in sizes:
        per = (size - held) // instances
        events_of = {p: 0 for p in store.ports}
        for name in names:
            events_of[node_of[name]] += per
            total_of[node_of[name]] += per
        before = stats(store.ports)
        started = time.perf_counter()
        for name in names:
            keys = rng.randbytes(8 * per)
            for at in range(0, per, SLICE):
                chunk = keys[8 * at : 8 * min(per, at + SLICE)]
                px.kv_batch_apply(name, None, [px.StoredBlocks(chunk)], 1 << 30, store.client)
        wall = time.perf_counter() - started
        held += per * instances
        after = stats(store.ports)
        cpu = work_cpu(before, after, idle, wall)
        masters = []
        for p in store.ports:
            mem = after[p]["memory"] - empty[p]["memory"]
            masters.append(
                {
                    "events": events_of[p],
                    "cpu_us_per_1000_events": round(cpu[p] / events_of[p] * 1e9, 1),
                    "entries": total_of[p],
                    "bytes_per_entry": round(mem / total_of[p], 1),
                    "memory_mb": round(mem / 2**20, 1),
                    "keys": int(after[p]["keys"]),
                }
            )
        out.append(
            {
                "entries": held,
                "client_events_per_s": round(per * instances / wall),
                "masters": masters,
                "spread_entries": round(spread([m["entries"] for m in masters]), 3),
                "spread_memory": round(spread([m["memory_mb"] for m in masters]), 3),
            }
        )
    return out


def lookups(
    store: Any, groups: int, fleet: int, n: int, rng: random.Random, idle: dict[int, float]
) -> dict[str, Any]:
    settings.PREFIX_INDEX_GROUPS = groups
    store.client.flushall()
    prefixes = [[rng.getrandbits(64) for _ in range(CHAIN)] for _ in range(PREFIXES)]
    packed = [b"".join(h.to_bytes(8, "big") for h in chain) for chain in prefixes]
    for i in range(fleet):
        held = rng.sample(range(PREFIXES), 4)
        px.kv_batch_apply(
            f"inst-{i}", None, [px.StoredBlocks(packed[k]) for k in held], 10_000, store.client
        )
    chains = [[f"{h:016x}" for h in prefixes[rng.randrange(PREFIXES)]] for _ in range(n)]
    walls: list[float] = []

    async def run() -> tuple[float, float]:
        # The route path's read: its async client, one call per group pipelined per node.
        client = store.async_client()
        for chain in chains[:50]:  # connections opened, scripts loaded: not measured
            await px.prefix_matches_bounded_async(client, [chain], False, BLOCK, 10.0)
        cpu0 = time.process_time()
        started = time.perf_counter()
        for chain in chains:
            t = time.perf_counter()
            got = await px.prefix_matches_bounded_async(client, [chain], False, BLOCK, 10.0)
            walls.append(time.perf_counter() - t)
            assert not got[0].unavailable
        wall = time.perf_counter() - started
        cpu = time.process_time() - cpu0
        await client.aclose()
        return wall, cpu

    before = stats(store.ports)
    wall, client_cpu = asyncio.run(run())
    after = stats(store.ports)
    cpu = work_cpu(before, after, idle, wall)
    per_master = [cpu[p] / n * 1e6 for p in store.ports]
    walls.sort()
    return {
        "instances": fleet,
        "client_cpu_us": round(client_cpu / n * 1e6, 1),
        "redis_cpu_us_per_master": [round(x, 1) for x in per_master],
        "redis_cpu_us_total": round(sum(per_master), 1),
        "p50_ms": round(walls[len(walls) // 2] * 1e3, 3),
        "p99_ms": round(walls[int(len(walls) * 0.99)] * 1e3, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--entries",
        default="1000000,10000000",
        help="index sizes to fill to, in turn (comma-separated; the issue's: 1e6,1e7,5e7)",
    )
    parser.add_argument("--fill-instances", type=int, default=96)
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--masters", type=int, default=3)
    parser.add_argument("--seed", type=int, default=33)
    parser.add_argument(
        "--rounds", type=int, default=3, help="lookup rounds, each store in turn (median kept)"
    )
    args = parser.parse_args()
    sizes = [int(float(x)) for x in args.entries.split(",")]
    out: dict[str, Any] = {"entries": sizes, "masters": args.masters}
    with tempfile.TemporaryDirectory(prefix="prfaas-scale-") as tmp:
        stores: dict[str, Any] = {}
        try:
            stores["single"] = Single(Path(tmp))
            stores["cluster"] = Cluster(Path(tmp) / "cluster", args.masters)
            groups = {"single": 1, "cluster": args.masters}
            idle = {mode: idle_cpu_per_s(store.ports) for mode, store in stores.items()}
            # Lookups: each fleet measured on one store then the other, round after round, so
            # that a machine whose load moves (two cores, shared) weighs on both alike; each
            # round's ratio is taken, and the median round reported.
            rounds: dict[str, list[list[dict[str, Any]]]] = {mode: [] for mode in stores}
            for r in range(args.rounds):
                for mode in rounds:
                    rounds[mode].append([])
                for f in FLEETS:
                    for mode, store in stores.items():
                        rng = random.Random(args.seed * 1_000 + r * 10 + FLEETS.index(f))
                        found = lookups(store, groups[mode], f, args.lookups, rng, idle[mode])
                        rounds[mode][-1].append(found)
                        print(f"{mode:8} lookup, round {r + 1}: {json.dumps(found)}")
            for mode, store in stores.items():
                store.client.flushall()
                steps = ingest(
                    store,
                    groups[mode],
                    sizes,
                    args.fill_instances,
                    random.Random(args.seed),
                    idle[mode],
                )
                for step in steps:
                    print(f"{mode:8} ingest to {step['entries']:,}: {json.dumps(step['masters'])}")
                out[mode] = {"ingest": steps, "lookups": rounds[mode]}
                store.client.flushall()
        finally:
            for store in stores.values():
                store.stop()
    single, cluster = out["single"], out["cluster"]
    out["ratio_ingest_cpu_per_master"] = [
        round(
            max(m["cpu_us_per_1000_events"] for m in c["masters"])
            / s["masters"][0]["cpu_us_per_1000_events"],
            2,
        )
        for s, c in zip(single["ingest"], cluster["ingest"], strict=True)
    ]

    def lookup_ratio(key: str) -> dict[str, float]:
        """Per fleet: the median over rounds of the busiest master's cost over the single
        Redis's in the same round."""
        return {
            str(f): round(
                statistics.median(
                    max(c[i][key]) / s[i][key][0]
                    for s, c in zip(single["lookups"], cluster["lookups"], strict=True)
                ),
                2,
            )
            for i, f in enumerate(FLEETS)
        }

    out["ratio_lookup_cpu_per_master"] = lookup_ratio("redis_cpu_us_per_master")
    print(
        f"per master, cluster / single: ingest CPU x{out['ratio_ingest_cpu_per_master']} "
        f"lookup CPU {out['ratio_lookup_cpu_per_master']} "
        f"; entries spread "
        f"{cluster['ingest'][-1]['spread_entries']:.1%}, memory spread "
        f"{cluster['ingest'][-1]['spread_memory']:.1%}"
    )
    print(json.dumps(out))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
