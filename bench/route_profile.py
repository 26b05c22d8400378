"""Where a route call's time goes: cProfile of the real ASGI fast path, in one process.

Sets up what ``bench/route_api.py`` sets up (a private SQLite database with the paper's
case-study topology, a private embedded Redis, telemetry and KV events of part of the Mooncake
trace), then calls the ASGI route door (:func:`scheduling.fastpath.route_fast_path`) directly,
without a server or sockets: single requests, then batches, each under cProfile. Prints the
wall time per call and the functions that take the most of it (own time and cumulative), so
the HTTP server's share is what ``bench/route_api.py`` adds on top.

    python bench/route_profile.py [--requests 3000] [--batches 20] [--top 25]
                                            [--concurrency 1] [--repeat 1] [--redis]

``--top -1`` times without cProfile (to run under ``py-spy record -- ...``); with
``--repeat N`` it prints the best and the median of N runs of each part. ``--redis`` adds
Redis's own time per decision, per request-path script and per command.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.support.setup import bench_token, manage  # noqa: E402
from controlplane.embedded_redis import EmbeddedRedis  # noqa: E402
from controlplane.redis_connection import redis_sync  # noqa: E402
from controlplane.redis_scripts import lua_scripts  # noqa: E402

TRACE = ROOT / "traces" / "mooncake" / "conversation_trace.jsonl"
SCENARIO = ROOT / "scenarios" / "paper-case-study.yaml"


async def call(app: Any, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    """One POST through the ASGI app; the response body."""
    sent: list[dict[str, Any]] = []
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    await app(scope, receive, send)
    if sent[0]["status"] != 200:
        raise SystemExit(f"{path} answered {sent[0]['status']}: {sent[1]['body'][:300]!r}")
    return bytes(sent[1]["body"])


def profiled(label: str, n_calls: int, per_call: int, run: Any, top: int, repeat: int = 1) -> None:
    profile = cProfile.Profile()
    if top < 0:  # timing only (e.g. under py-spy), best and median of ``repeat`` runs
        loop = asyncio.get_event_loop()
        walls, cpus = [], []
        for _ in range(repeat):
            started, cpu = time.perf_counter(), time.process_time()
            loop.run_until_complete(run())
            walls.append((time.perf_counter() - started) / n_calls * 1e3)
            cpus.append((time.process_time() - cpu) / n_calls * 1e3)
        print(
            f"== {label}: {min(walls):.3f} ms wall, {min(cpus):.3f} ms CPU a call (best of "
            f"{repeat}; median {statistics.median(walls):.3f} and "
            f"{statistics.median(cpus):.3f})"
        )
        return
    loop = asyncio.get_event_loop()
    started, cpu = time.perf_counter(), time.process_time()
    loop.run_until_complete(run())
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    print(
        f"\n== {label}: {n_calls} calls; without the profiler {wall / n_calls * 1e3:.3f} ms wall"
        f" and {cpu / n_calls * 1e3:.3f} ms CPU of this process a call,"
        f" {n_calls * per_call / cpu:.0f} decisions per CPU second =="
    )
    started = time.perf_counter()
    profile.enable()
    loop.run_until_complete(run())
    profile.disable()
    wall = time.perf_counter() - started
    print(f"   under the profiler: {wall / n_calls * 1e3:.3f} ms a call")
    if not top:
        return
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(key).print_stats(top)
        text = out.getvalue()
        print(text[text.find("   ncalls") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="single calls in flight (as route_api.py's levels: concurrent calls share Redis "
        "round trips)",
    )
    parser.add_argument("--top", type=int, default=25, help="-1: time only, no cProfile")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="with --top -1: runs of each part, the best and the median printed (this machine "
        "is noisy: compare the best of several runs)",
    )
    parser.add_argument(
        "--redis",
        action="store_true",
        help="print Redis's own time per decision, per script and per command (the Lua "
        "commands are counted inside their script too)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="route-profile-") as tmp:
        server = EmbeddedRedis(Path(tmp))
        server.start()
        try:
            os.environ.update(
                DATABASE_URL=f"sqlite:///{tmp}/bench.sqlite3",
                REDIS_URL=server.url,
                VAR_DIR=tmp,
                LOG_LEVEL="WARNING",
                DJANGO_SETTINGS_MODULE="controlplane.settings",
            )
            env = dict(os.environ)
            manage(env, "migrate", "-v", "0")
            manage(env, "topology", "apply", str(SCENARIO))
            secret = bench_token(env, "router", "agent")
            run(args, secret)
        finally:
            server.stop()


def run(args: argparse.Namespace, secret: str) -> None:
    import django

    django.setup()
    from scheduling.fastpath import route_fast_path
    from scheduling.snapshot import snapshot_refresh

    async def django_side(scope: Any, receive: Any, send: Any) -> None:
        raise SystemExit("the fast path passed a route call on to Django")

    app = route_fast_path(django_side)
    snap = snapshot_refresh(force=True)
    pd = snap.pd_clusters[0]
    rows = []
    with TRACE.open() as fh:
        for line in fh:
            rows.append(json.loads(line))
            if len(rows) >= max(args.requests, args.batches * args.batch_size):
                break
    requests = [
        {
            "origin": pd,
            "prompt_tokens": max(1, int(r["input_length"])),
            "block_hashes": r["hash_ids"],
            "expected_output_tokens": int(r["output_length"]),
            "request_id": f"mc-{k}",
        }
        for k, r in enumerate(rows)
    ]
    headers = [(b"authorization", f"Bearer {secret}".encode()), (b"host", b"127.0.0.1")]
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    loop.run_until_complete(_live_state(snap, rows))

    singles = [json.dumps(r).encode() for r in requests[: args.requests]]
    size = args.batch_size
    batches = [
        json.dumps({"requests": requests[i * size : (i + 1) * size]}).encode()
        for i in range(args.batches)
    ]

    reasons: Counter[str] = Counter()

    async def warm() -> None:
        await _telemetry_fresh(snap)
        for body in singles[:200]:
            reasons[json.loads(await call(app, "/api/v1/route", body, headers))["reason"]] += 1

    # Telemetry is sent again before each run: older than the policy's stale_after_s (5 s),
    # the calls would be decided by the static rule, another path than the one to profile.
    async def single_run() -> None:
        await _telemetry_fresh(snap)
        n = max(1, args.concurrency)

        async def caller(share: list[bytes]) -> None:
            for body in share:
                await call(app, "/api/v1/route", body, headers)

        await asyncio.gather(*(caller(singles[k::n]) for k in range(n)))

    async def batch_run() -> None:
        await _telemetry_fresh(snap)
        for body in batches:
            await call(app, "/api/v1/route/batch", body, headers)

    loop.run_until_complete(warm())
    print(f"decisions by reason (the first {sum(reasons.values())} calls): {dict(reasons)}")
    label = f"single requests, {max(1, args.concurrency)} in flight"
    parts = [
        (label, len(singles), 1, single_run),
        (f"batches of {size}", len(batches), size, batch_run),
    ]
    for name, n_calls, per_call, go in parts:
        if args.redis:
            redis_watch_start()
        profiled(name, n_calls, per_call, go, args.top, args.repeat)
        if args.redis:
            redis_watch_print(n_calls * per_call * (args.repeat if args.top < 0 else 2))


def redis_watch_start() -> None:
    """Log every command's server time from now on (SLOWLOG with a threshold of 0)."""
    client = redis_sync()
    client.config_set("slowlog-log-slower-than", 0)
    client.config_set("slowlog-max-len", 1_000_000)
    client.slowlog_reset()
    client.config_resetstat()


def redis_watch_print(decisions: int) -> None:
    """Redis's own time (inside the server, network I/O excluded) per decision: each
    request-path script (SLOWLOG) and each command, those its scripts issued included (INFO
    commandstats)."""
    client = redis_sync()
    names = {sc.sha: sc.name for sc in lua_scripts()}
    spent: dict[str, list[int]] = {}
    for entry in client.slowlog_get(1_000_000):
        argv = entry["command"].split()
        if argv[0].upper() != b"EVALSHA":
            continue
        name = names.get(argv[1].decode(), argv[1].decode()[:12])
        got = spent.setdefault(name, [0, 0])
        got[0] += 1
        got[1] += entry["duration"]
    client.config_set("slowlog-log-slower-than", 10_000)
    print(f"   Redis time per decision ({decisions} decisions):")
    for name, (calls, us) in sorted(spent.items(), key=lambda kv: -kv[1][1]):
        print(
            f"     script {name}: {us / decisions:.1f} us ({calls} calls, {us / calls:.0f} us each)"
        )
    stats = client.info("commandstats")
    for key, row in sorted(stats.items(), key=lambda kv: -kv[1]["usec"])[:6]:
        if key in ("cmdstat_slowlog", "cmdstat_config"):  # this function's own
            continue
        print(
            f"     {key.removeprefix('cmdstat_')}: {row['usec'] / decisions:.1f} us "
            f"({row['calls'] / decisions:.3g} calls, {row['usec_per_call']:.2f} us each)"
        )


async def _telemetry_fresh(snap: Any) -> None:
    """A sample of every instance and link, stamped now."""
    from clusters.live import telemetry

    now = time.time()
    await telemetry.telemetry_batch_store_async(
        [telemetry.InstanceSample(n, now, 1, 8, 0, 0.4) for n in snap.instance_names],
        [telemetry.LinkSample(k, now, int(5e9 / 8), 1.0) for k in snap.link_keys],
    )


async def _live_state(snap: Any, rows: list[dict[str, Any]]) -> None:
    """Fresh telemetry of every instance and link, and a third of the trace's blocks cached
    (through the ingest services, as the API would)."""
    from scheduling.ingest import kv_events_ingest_async

    await _telemetry_fresh(snap)
    now = time.time()
    prefill = [i.name for i in snap.topology.instances if i.role == "prefill"]
    for k, r in enumerate(rows[: len(rows) // 3]):
        batch = [now, [["BlockStored", r["hash_ids"], None, [], snap.block_tokens]]]
        await kv_events_ingest_async(prefill[k % len(prefill)], [(None, batch)])


if __name__ == "__main__":
    main()
