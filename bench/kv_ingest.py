"""KV-event ingest at fleet scale: block events/s into the prefix index, and bytes per entry.

In one run it:

1. makes a private database (SQLite in a temporary directory) with the paper's case-study
   topology and an agent token, and a private ``redis-server`` (defaults, no persistence);
2. serves the real app (uvicorn, 2 workers, as deployed);
3. builds, per engine instance, the stream a vLLM engine publishes: each step a ``BlockStored``
   of 16 blocks (30 % of them from prefixes shared across instances) and, once the instance
   holds its share, one ``BlockRemoved`` per evicted block (as vLLM sends them), encoded as vLLM
   does and compacted as the agent forwards them (:func:`fleet.agent.kv.compact`);
4. **baseline**: posts 16-hash batches as JSON to ``/api/v1/kv-events``, one batch per call;
5. **fill**: posts the streams through ``/api/v1/kv-events/msgpack`` in agent-sized posts
   (:class:`fleet.agent.uplink.Uplink` limits: up to 2,000 batches / 200 KB), from one
   thread per group of instances (one agent per host), until every instance holds
   ``--blocks`` entries; then measures Redis memory per (block, instance) entry, beside the
   same entries written in the previous layout (a SET per block, a ZSET per instance);
6. **steady**: the same with stores and evictions (the index size stays constant).

Bodies are encoded before the clock starts: the servers are measured, not the load generator.
Loopback only, bounded by the arguments. It measures; it never gates. Targets (issue 14):
>= 50,000 block events/s, <= 150 bytes per entry. The last line is one JSON object.

    python bench/kv_ingest.py [--blocks 40000] [--steady-steps 600] [--agents 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import msgspec  # noqa: E402
import redis  # noqa: E402

from bench.support.setup import bench_token, free_port, manage  # noqa: E402
from clusters.live.keys import prefix_group_prefix, prefix_instance_prefix  # noqa: E402
from fleet.agent.kv import compact  # noqa: E402
from fleet.agent.uplink import UplinkLimits  # noqa: E402
from scheduling.core.kv_events import BlocksRemoved, BlocksStored, EventBatch, KvEvent  # noqa: E402

SCENARIO = ROOT / "scenarios" / "paper-case-study.yaml"
UVICORN = str(ROOT / ".venv" / "bin" / "uvicorn")
STEP_BLOCKS = 16
SHARED_FRACTION = 0.3
TARGET_EVENTS_PER_S = 50_000
TARGET_BYTES_PER_ENTRY = 150


def wait_up(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{url}: server exited with {proc.returncode}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    sys.exit(f"{url} did not come up")


class EngineStream:
    """One instance's published batches: stores of new (or shared) blocks, evictions FIFO."""

    def __init__(self, name: str, rng: random.Random, shared: list[list[int]], block: int):
        self.name = name
        self.rng = rng
        self.shared = shared
        self.block = block
        self.seq = -1
        self.held: deque[int] = deque()
        self.held_set: set[int] = set()

    def step(self, capacity: int | None) -> tuple[int, list[KvEvent], int]:
        """The next batch: (seq, events, block events in it)."""
        if self.rng.random() < SHARED_FRACTION:
            chain = self.rng.choice(self.shared)
            start = self.rng.randrange(0, len(chain) - STEP_BLOCKS + 1)
            hashes = [h for h in chain[start : start + STEP_BLOCKS] if h not in self.held_set]
        else:
            hashes = [self.rng.getrandbits(64) for _ in range(STEP_BLOCKS)]
        events: list[KvEvent] = []
        if capacity is not None:
            while len(self.held) + len(hashes) > capacity:
                gone = self.held.popleft()
                self.held_set.discard(gone)
                events.append(BlocksRemoved([gone], "GPU", 0))
        if hashes:
            stored: list[int | bytes] = list(hashes)
            events.append(BlocksStored(stored, self.block, medium="GPU", group=0))
            self.held.extend(hashes)
            self.held_set.update(hashes)
        self.seq += 1
        removed = sum(isinstance(ev, BlocksRemoved) for ev in events)
        return self.seq, events, removed + len(hashes)


def agent_posts(
    instance: str, batches: list[tuple[int, bytes]], limits: UplinkLimits
) -> list[bytes]:
    """The bodies the agent's uplink would send for these batches (same limits)."""
    out: list[bytes] = []
    current: list[tuple[int, bytes]] = []
    size = 0
    for seq, payload in batches:
        if current and (
            len(current) >= limits.max_post_batches or size + len(payload) > limits.max_post_bytes
        ):
            out.append(msgspec.msgpack.encode({"instance": instance, "batches": current}))
            current, size = [], 0
        current.append((seq, payload))
        size += len(payload) + 12
    if current:
        out.append(msgspec.msgpack.encode({"instance": instance, "batches": current}))
    return out


def post_all(
    base: str, token: str, bodies_by_agent: list[list[bytes]], path: str, content_type: str
) -> float:
    """Post every agent's bodies (one thread per agent, in order); returns the wall seconds."""
    errors: list[str] = []

    def run(bodies: list[bytes]) -> None:
        with httpx.Client(
            base_url=base,
            timeout=120,
            headers={"Authorization": f"Bearer {token}", "Content-Type": content_type},
        ) as client:
            for body in bodies:
                response = client.post(path, content=body)
                if response.status_code != 200:
                    errors.append(f"{response.status_code} {response.text[:300]}")
                    return

    threads = [threading.Thread(target=run, args=(b,)) for b in bodies_by_agent]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    if errors:
        sys.exit(f"POST {path} failed: {errors[0]}")
    return elapsed


def old_layout_bytes(r: redis.Redis, entries: dict[str, list[int]]) -> float:
    """Memory per entry of the previous layout for the same entries (db 1 of the same server):
    ``pfx:b:{hash}`` SET of instance names, ``pfx:i:{inst}:b`` ZSET hash -> store order."""
    r.select(1)
    r.flushdb()
    before = int(r.info("memory")["used_memory"])
    n = 0
    for inst, hashes in entries.items():
        pipe = r.pipeline(transaction=False)
        for order, h in enumerate(hashes):
            key = f"{h:016x}"
            pipe.sadd(f"pfx:b:{key}", inst)
            pipe.zadd(f"pfx:i:{inst}:b", {key: order})
            n += 1
            if len(pipe) >= 20_000:
                pipe.execute()
        pipe.execute()
    after = int(r.info("memory")["used_memory"])
    r.flushdb()
    r.select(0)
    return (after - before) / max(1, n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=40_000, help="entries per instance")
    parser.add_argument("--steady-steps", type=int, default=600, help="steps per instance")
    parser.add_argument("--agents", type=int, default=4, help="concurrent posting agents")
    parser.add_argument("--baseline-posts", type=int, default=300)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    for name in ("blocks", "steady_steps", "agents", "baseline_posts"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if shutil.which("redis-server") is None:
        sys.exit("redis-server not found (apt-get install redis-server)")

    with tempfile.TemporaryDirectory(prefix="kv-bench-") as tmp:
        redis_port, app_port = free_port(), free_port()
        redis_proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(redis_port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                tmp,
            ],
            stdout=subprocess.DEVNULL,
        )
        app: subprocess.Popen[bytes] | None = None
        try:
            env = dict(os.environ)
            env.update(
                DATABASE_URL=f"sqlite:///{tmp}/bench.sqlite3",
                REDIS_URL=f"redis://127.0.0.1:{redis_port}/0",
                VAR_DIR=tmp,
                LOG_LEVEL="WARNING",
                DJANGO_SETTINGS_MODULE="controlplane.settings",
                API_MAX_BODY_BYTES=str(256 * 1024),
            )
            manage(env, "migrate", "-v", "0")
            manage(env, "topology", "apply", str(SCENARIO))
            token = bench_token(env, "agent", "router")
            app = subprocess.Popen(
                [
                    UVICORN,
                    "controlplane.asgi:application",
                    "--port",
                    str(app_port),
                    "--workers",
                    "2",
                    "--log-level",
                    "warning",
                ],
                cwd=ROOT,
                env=env,
            )
            base = f"http://127.0.0.1:{app_port}"
            wait_up(f"{base}/api/v1/health", app)
            policy = httpx.get(
                f"{base}/api/v1/policy", headers={"Authorization": f"Bearer {token}"}, timeout=30
            ).json()
            block = int(policy["model"]["block_tokens"])
            instances = sorted(i["name"] for i in policy["instances"])
            r = redis.Redis(host="127.0.0.1", port=redis_port)
            print(
                f"topology: {SCENARIO.name}, {len(instances)} instances, block {block} tokens; "
                f"{args.agents} agents; redis-server {r.info()['redis_version']} (defaults)"
            )
            run(args, base, token, instances, block, r)
        finally:
            if app is not None:
                app.terminate()
                app.wait(timeout=20)
            redis_proc.terminate()
            redis_proc.wait(timeout=20)


def run(
    args: argparse.Namespace,
    base: str,
    token: str,
    instances: list[str],
    block: int,
    r: redis.Redis,
) -> None:
    rng = random.Random(args.seed)
    shared = [[rng.getrandbits(64) for _ in range(256)] for _ in range(64)]
    streams = {n: EngineStream(n, random.Random(rng.random()), shared, block) for n in instances}
    limits = UplinkLimits()
    agents = [instances[i :: args.agents] for i in range(args.agents)]

    # -- baseline: JSON, 16-hash batches, one per call (one stream, then reset) --------------
    probe = EngineStream("baseline", random.Random(1), shared, block)
    bodies = []
    events = 0
    for seq in range(args.baseline_posts):
        hashes = [probe.rng.getrandbits(64) for _ in range(STEP_BLOCKS)]
        event = {"type": "BlockStored", "block_hashes": hashes, "block_size": block}
        body = {"instance": instances[0], "batches": [{"seq": seq, "batch": [0.0, [event]]}]}
        bodies.append(json.dumps(body).encode())
        events += STEP_BLOCKS
    elapsed = post_all(base, token, [bodies], "/api/v1/kv-events", "application/json")
    baseline = events / elapsed
    print(f"baseline  JSON /kv-events, 16 hashes per call: {baseline:,.0f} block events/s")
    r.flushdb()

    # -- fill: every instance up to --blocks entries -----------------------------------------
    def encode(
        per_instance: dict[str, list[tuple[int, list[KvEvent], int]]],
    ) -> tuple[list[list[bytes]], int]:
        out, total = [], 0
        for group in agents:
            bodies: list[bytes] = []
            for name in group:
                batches = []
                for seq, evs, n in per_instance[name]:
                    batches.append((seq, compact(EventBatch(time.time(), evs, 0))))
                    total += n
                bodies += agent_posts(name, batches, limits)
            out.append(bodies)
        return out, total

    fill_steps = {
        n: [s.step(None) for _ in range(args.blocks // STEP_BLOCKS + 1)] for n, s in streams.items()
    }
    bodies_by_agent, fill_events = encode(fill_steps)
    mem_before = int(r.info("memory")["used_memory"])
    elapsed = post_all(
        base, token, bodies_by_agent, "/api/v1/kv-events/msgpack", "application/msgpack"
    )
    fill_rate = fill_events / elapsed
    mem_after = int(r.info("memory")["used_memory"])
    entries = sum(
        int(r.hget(f"{prefix_instance_prefix(n, 1)}i:{n}:m", "blocks") or 0) for n in instances
    )
    bytes_per_entry = (mem_after - mem_before) / max(1, entries)
    held = {n: list(s.held) for n, s in streams.items()}
    assert entries == sum(len(set(v)) for v in held.values()), "index entries != blocks stored"
    old_bytes = old_layout_bytes(r, held)
    print(
        f"fill      msgpack, agent-sized posts: {fill_rate:,.0f} block events/s "
        f"({fill_events:,} events, {elapsed:.1f} s; x{fill_rate / baseline:.1f} the baseline)"
    )
    print(
        f"memory    {entries:,} (block, instance) entries: {bytes_per_entry:.1f} bytes/entry "
        f"(previous layout, same entries: {old_bytes:.1f}; x{bytes_per_entry / old_bytes:.2f})"
    )

    # -- steady: stores and evictions at constant size ---------------------------------------
    capacity = args.blocks
    steady_steps = {
        n: [s.step(capacity) for _ in range(args.steady_steps)] for n, s in streams.items()
    }
    bodies_by_agent, steady_events = encode(steady_steps)
    elapsed = post_all(
        base, token, bodies_by_agent, "/api/v1/kv-events/msgpack", "application/msgpack"
    )
    steady_rate = steady_events / elapsed
    after = sum(
        int(r.hget(f"{prefix_instance_prefix(n, 1)}i:{n}:m", "blocks") or 0) for n in instances
    )
    degraded = r.scard(f"{prefix_group_prefix(0, 1)}degraded")
    print(
        f"steady    msgpack, stores + one BlockRemoved per eviction: {steady_rate:,.0f} block "
        f"events/s ({steady_events:,} events, {elapsed:.1f} s; x{steady_rate / baseline:.1f} "
        f"the baseline); entries {entries:,} -> {after:,}, degraded instances {degraded}"
    )
    rate = min(fill_rate, steady_rate)
    print(
        f"targets   >= {TARGET_EVENTS_PER_S:,} block events/s: {'met' if rate >= TARGET_EVENTS_PER_S else 'NOT met'}"
        f" ({rate:,.0f}); <= {TARGET_BYTES_PER_ENTRY} bytes/entry: "
        f"{'met' if bytes_per_entry <= TARGET_BYTES_PER_ENTRY else 'NOT met'} ({bytes_per_entry:.1f})"
    )
    print(
        json.dumps(
            {"block_events_per_s": round(rate), "bytes_per_entry": round(bytes_per_entry, 1)}
        )
    )


if __name__ == "__main__":
    main()
