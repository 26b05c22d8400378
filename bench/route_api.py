"""Route API throughput, latency and CPU, beside a bare ASGI endpoint and sglang-router (Rust,
PD mode), under the same load generator, in one run.

In one run it:

1. makes a private database (SQLite in a temporary directory unless ``BENCH_DATABASE_URL``)
   with the paper's case-study topology (``scenarios/paper-case-study.yaml``) and a
   router+agent token; Redis is a private embedded one (or ``BENCH_REDIS_URL``);
2. serves the real app (2 workers) as deployed (``python -m controlplane.serve``: uvicorn
   workers on listening sockets of their own, SO_REUSEPORT), and for comparison under
   ``uvicorn --workers 2`` (one shared socket; batches) and granian (32 in flight, batches),
   a bare ASGI app (uvicorn, 2 workers) that parses the same JSON and answers a
   fixed decision (the floor of "HTTP + JSON in Python"), and sglang-router 0.3.2 in PD mode
   (``bench/support/sglang_router.py``: PyPI, its own cached venv) in front of two fake
   workers (``fleet.fake_engine``, one prefill and one decode process, granian), a whole
   proxied request with two upstream calls;
3. keeps live state fresh (telemetry every 2 s through the API) and registers the prefix
   blocks of part of the trace on instances (KV events), so lookups find cache hits;
4. replays Mooncake conversation requests (prompt length, 512-token prefix-block hash ids,
   output length) against the app and the bare endpoint, single requests at several levels in
   flight, then batches; sglang-router gets short completions (64-1,024-word prompts, 16
   tokens) at the same levels;
5. prints each one's rate, p50/p99 per HTTP call, CPU per request (user + system of the
   server processes, from /proc: the app's workers, and Redis apart) and the busiest worker's
   share of it (50%: an even split; workers that share one listening socket can leave a
   burst of new connections all to one of them), the ratios, and as the LAST line one JSON
   object. Batches run ``--batch-rounds`` times per server, each round on new connections;
   the JSON gives the median round.

The load comes from a few processes of raw keep-alive HTTP/1.1 connections (pre-built
request bytes, ``bench/support/load.py``), not from an HTTP client library. Loopback only,
bounded by ``--requests``/``--batches`` (a few minutes). It measures; it never gates.
Targets (issue 16): at 32 in flight the app's rate >= sglang-router's and its p99 <= 1.5x;
batches of 500 >= 30,000 decisions/s; CPU per single decision <= 0.3 ms.

    python bench/route_api.py [--requests 4000] [--concurrency 8,16,32]
                                        [--batches 40] [--batch-size 500] [--batch-rounds 5]
                                        [--no-router]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.support.load import cpu_seconds, drive, process_tree  # noqa: E402
from bench.support.setup import bench_token, free_port, manage  # noqa: E402
from controlplane.embedded_redis import EmbeddedRedis  # noqa: E402

TRACE = ROOT / "traces" / "mooncake" / "conversation_trace.jsonl"
SCENARIO = ROOT / "scenarios" / "paper-case-study.yaml"
PY = str(ROOT / ".venv" / "bin" / "python")
UVICORN = str(ROOT / ".venv" / "bin" / "uvicorn")
GRANIAN = str(ROOT / ".venv" / "bin" / "granian")

# --- the bare endpoint (imported by its uvicorn workers as route_api:bare_app) -------------------

_FIXED: dict[str, Any] = {
    "request_id": None,
    "route": "local",
    "prefill": {"cluster": "pd", "instance": "p0", "endpoint": "http://10.0.0.1:8000"},
    "decode": {"cluster": "pd", "instance": "d0", "endpoint": "http://10.0.0.2:8000"},
    "incremental_tokens": 0,
    "cached_tokens": 0,
    "threshold": 8192,
    "policy_version": 0,
    "reason": "below_threshold",
    "ttft_estimate_s": {"local": 1.0, "prfaas": None},
    "cache_transfer": None,
    "reservation": None,
    "kv_bytes": 0,
    "stale": False,
}


async def bare_app(scope: dict[str, Any], receive: Callable[[], Awaitable[Any]], send: Any) -> None:
    """Parse the JSON body and answer a fixed decision (one per request in a batch)."""
    if scope["type"] != "http":
        return
    body = b""
    more = True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    data = json.loads(body or b"{}")
    if "requests" in data:
        out = {
            "decisions": [dict(_FIXED, request_id=r.get("request_id")) for r in data["requests"]]
        }
    else:
        out = dict(_FIXED, request_id=data.get("request_id"))
    payload = json.dumps(out).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


# --- set-up ------------------------------------------------------------------------------------------


def serve(
    env: dict[str, str], app: str, port: int, app_dir: Path, server: str = "uvicorn"
) -> subprocess.Popen[bytes]:
    """``app`` with 2 worker processes under ``server`` (serve: the project's launcher,
    uvicorn, or granian)."""
    if server == "serve":
        argv = [PY, "-m", "controlplane.serve", app, "--workers", "2", "--host", "127.0.0.1",
                "--port", str(port), "--log-level", "warning", "--no-access-log"]  # fmt: skip
    elif server == "granian":
        # asginl: ASGI without lifespan (Django's ASGI app has none).
        argv = [GRANIAN, "--interface", "asginl", "--workers", "2", "--loop", "uvloop",
                "--host", "127.0.0.1", "--port", str(port), "--no-log",
                "--working-dir", str(app_dir), app]  # fmt: skip
    else:
        argv = [UVICORN, app, "--workers", "2", "--host", "127.0.0.1", "--port", str(port),
                "--log-level", "warning", "--no-access-log", "--app-dir", str(app_dir)]  # fmt: skip
    return subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip


def stop(proc: subprocess.Popen[bytes]) -> None:
    """TERM, then KILL, by process id."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


def wait_up(url: str, timeout_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            httpx.post(url, content=b"{}", timeout=2)
            return
        except httpx.HTTPError:
            time.sleep(0.3)
    sys.exit(f"server at {url} did not come up")


_next_port = [0]


def port() -> int:
    """The next port of ``--port-base`` (0: any free port)."""
    if not _next_port[0]:
        return free_port()
    _next_port[0] += 1
    return _next_port[0] - 1


def load_trace(limit: int) -> list[dict[str, Any]]:
    if not TRACE.exists():
        sys.exit(f"Mooncake trace not found at {TRACE}")
    rows = []
    with TRACE.open() as fh:
        for line in fh:
            rows.append(json.loads(line))
            if len(rows) >= limit:
                break
    return rows


# --- load: bench/support/load.py (raw keep-alive HTTP/1.1 from several processes) ----------------


async def keep_fresh(
    base: str, headers: dict[str, str], policy: dict[str, Any], stop: asyncio.Event
) -> None:
    """Agents' telemetry every 2 s: idle-ish fleet, link at a few Gbps."""
    import httpx

    n = 0
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        while not stop.is_set():
            now = time.time()
            body = {
                "idempotency_key": f"bench-{os.getpid()}-{n}",
                "instances": [
                    {"instance": i["name"], "ts": now, "queue_depth": 1, "running": 8, "kv_usage": 0.4}
                    for i in policy["instances"]
                ],
                "links": [
                    {"source": lk["source"], "target": lk["target"], "ts": now,
                     "bytes_sent": int(5e9 / 8), "interval_s": 1.0}
                    for lk in policy["links"]
                ],
            }  # fmt: skip
            await client.post("/api/v1/telemetry", json=body, headers=headers)
            n += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 2.0)


def row(label: str, r: dict[str, Any], cpu_ms: float | None, extra: str = "") -> str:
    cpu = f"{cpu_ms:9.3f}" if cpu_ms is not None else "        -"
    busiest = f"{r['busiest_share']:8.0%}" if r.get("busiest_share") is not None else "       -"
    return (
        f"  {label:24} {r['decisions_per_s']:12.0f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f}"
        f" {cpu} {busiest}  {r['errors'] or '-'}{extra}"
    )


HEADER = (
    f"  {'':24} {'decisions/s':>12} {'p50 ms':>8} {'p99 ms':>8} {'CPU ms/dec':>9}"
    f" {'busiest':>8}  errors"
)


def measured(pids: list[int], go: Callable[[], dict[str, Any]], per_call: int = 1) -> Any:
    """``go()`` and the CPU ms its servers (``pids``) spent per decision; ``go()``'s result
    also says which share of that CPU its busiest process spent (``busiest_share``: 50% is
    an even split over 2 workers; a server whose workers share one listening socket can leave
    most connections to one of them)."""
    before = {pid: cpu_seconds([pid]) for pid in pids}
    r = go()
    spent = {pid: cpu_seconds([pid]) - before[pid] for pid in pids}
    total = sum(spent.values())
    r["busiest_share"] = max(spent.values()) / total if total > 0 else None
    return r, total / max(1, r["calls"] * per_call) * 1e3


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def router_bodies(n: int, seed: int = 8) -> list[bytes]:
    """Short completions for sglang-router (it takes no token-id prompts)."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = rng.randint(64, 1024) // 2
        prompt = " ".join(f"w{rng.randrange(1000)}" for _ in range(words))
        out.append(json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 16}).encode())
    return out


@contextlib.contextmanager
def sglang_router_pd(tmp: Path) -> Any:
    """sglang-router in PD mode before one fake prefill and one fake decode worker, or None
    (said loudly) when it cannot be installed or started."""
    from bench.support.sglang_router import router_serve
    from fleet.fake_engine.launch import fake_engines_serve

    with contextlib.ExitStack() as stack:
        try:
            shm = Path("/dev/shm")
            storage = Path(
                tempfile.mkdtemp(prefix="route-bench-kv-", dir=shm if shm.is_dir() else tmp)
            )
            stack.callback(lambda: subprocess.run(["rm", "-rf", str(storage)], check=False))
            workers: dict[str, str] = {}
            pids: list[int] = []
            for role in ("prefill", "decode"):
                urls, proc = stack.enter_context(
                    fake_engines_serve(
                        [(f"pd-{role}", port(), "kv_both")], connector="shared_storage",
                        storage=str(storage), server="granian", python=PY,
                    )
                )  # fmt: skip
                workers.update(urls)
                pids.append(proc.pid)
            rt_port = port()
            proc = stack.enter_context(
                router_serve([(workers["pd-prefill"], None)], [workers["pd-decode"]], rt_port)
            )
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            print(f"\n!!! sglang-router NOT measured: {type(exc).__name__}: {exc}\n!!!", flush=True)
            yield None
            return
        time.sleep(1.0)  # granian's worker processes are up
        workers_pids = [p for pid in pids for p in process_tree(pid)]
        yield f"http://127.0.0.1:{rt_port}", process_tree(proc.pid), workers_pids


async def run(
    args: argparse.Namespace, env: dict[str, str], secret: str, tmp: Path
) -> dict[str, Any]:
    import httpx

    ports = {name: port() for name in ("serve", "uvicorn", "granian", "bare")}
    procs = {
        "serve": serve(env, "controlplane.asgi:application", ports["serve"], ROOT, "serve"),
        "uvicorn": serve(env, "controlplane.asgi:application", ports["uvicorn"], ROOT),
        "bare": serve(env, "route_api:bare_app", ports["bare"], ROOT / "bench"),
    }
    if args.granian:
        procs["granian"] = serve(
            env, "controlplane.asgi:application", ports["granian"], ROOT, server="granian"
        )
    redis_pid = int(env.get("BENCH_REDIS_PID") or 0)
    try:
        bases = {name: f"http://127.0.0.1:{ports[name]}" for name in procs}
        for name in procs:
            wait_up(f"{bases[name]}/api/v1/health" if name != "bare" else f"{bases[name]}/")
        app_base, bare_base = bases["serve"], bases["bare"]
        headers = {"Authorization": f"Bearer {secret}"}
        policy = httpx.get(f"{app_base}/api/v1/policy", headers=headers, timeout=30).json()
        pd = next(c["name"] for c in policy["clusters"] if c["kind"] == "pd")
        prefill = [i["name"] for i in policy["instances"] if i["role"] == "prefill"]

        wanted = max(args.requests, args.batches * args.batch_size)
        rows = load_trace(wanted)
        # The trace is replayed from the start again when more requests are wanted than it has.
        requests = [
            {
                "origin": pd,
                "prompt_tokens": max(1, int(r["input_length"])),
                "block_hashes": r["hash_ids"],
                "expected_output_tokens": int(r["output_length"]),
                "request_id": f"mc-{k}",
            }
            for k, r in ((k, rows[k % len(rows)]) for k in range(wanted))
        ]
        # Part of the trace's blocks are cached somewhere (round robin over prefill instances).
        async with httpx.AsyncClient(base_url=app_base, timeout=30) as client:
            for k, r in enumerate(rows[: len(rows) // 3]):
                batch = [time.time(), [["BlockStored", r["hash_ids"], None, [], 512]]]
                body = {"instance": prefill[k % len(prefill)], "batches": [{"batch": batch}]}
                await client.post("/api/v1/kv-events", json=body, headers=headers)

        stop_fresh = asyncio.Event()
        fresh = asyncio.create_task(keep_fresh(app_base, headers, policy, stop_fresh))
        await asyncio.sleep(0.5)
        pids = {name: process_tree(p.pid) for name, p in procs.items()}
        redis_pids = [redis_pid] if redis_pid else []

        router = None
        if args.router:
            router_ctx = sglang_router_pd(tmp)
            router = router_ctx.__enter__()
        singles = [json.dumps(r).encode() for r in requests[: args.requests]]
        rbodies = router_bodies(args.requests)
        warm = singles[: min(400, len(singles))]
        out: dict[str, Any] = {}
        for level in args.concurrency:
            print(f"\nsingle requests, {level} in flight, {len(singles)} calls each")
            print(HEADER)
            for name in ("serve", "bare"):
                await asyncio.to_thread(
                    drive, bases[name], "/api/v1/route", warm, headers, level, 1
                )
            redis_before = cpu_seconds(redis_pids)
            app, app_cpu = await asyncio.to_thread(
                measured,
                pids["serve"],
                partial(drive, app_base, "/api/v1/route", singles, headers, level, 1),
            )
            redis_ms = (cpu_seconds(redis_pids) - redis_before) / len(singles) * 1e3
            bare, bare_cpu = await asyncio.to_thread(
                measured,
                pids["bare"],
                partial(drive, bare_base, "/api/v1/route", singles, headers, level, 1),
            )
            print(row("app (serve)", app, app_cpu, f"   + Redis {redis_ms:.3f} ms/dec"))
            print(row("bare ASGI (uvicorn)", bare, bare_cpu))
            results = {"app": app, "bare": bare}
            if level == 32 and args.granian:
                await asyncio.to_thread(
                    drive, bases["granian"], "/api/v1/route", warm, headers, level, 1
                )
                gr, gr_cpu = await asyncio.to_thread(
                    measured,
                    pids["granian"],
                    partial(drive, bases["granian"], "/api/v1/route", singles, headers, 32, 1),
                )
                print(row("app (granian)", gr, gr_cpu))
                results["granian"] = gr
            if router is not None:
                rt_url, rt_pids, wk_pids = router
                path = "/v1/completions"
                await asyncio.to_thread(drive, rt_url, path, rbodies[:400], {}, level, 1)
                wk_before = cpu_seconds(wk_pids)
                rt, rt_cpu = await asyncio.to_thread(
                    measured,
                    rt_pids,
                    partial(drive, rt_url, path, rbodies, {}, level, 1),
                )
                wk_ms = (cpu_seconds(wk_pids) - wk_before) / len(rbodies) * 1e3
                print(
                    row(
                        "sglang-router PD (Rust)",
                        rt,
                        rt_cpu,
                        f"   + fake workers {wk_ms:.3f} ms/req",
                    )
                )
                results["router"] = rt
            print(
                f"  ratios app/bare: rate {ratio(app['rate'], bare['rate'])}, "
                f"p99 {ratio(app['p99_ms'], bare['p99_ms'])}"
                + (f"; app/sglang-router: rate {ratio(app['rate'], results['router']['rate'])}, "
                   f"p99 {ratio(app['p99_ms'], results['router']['p99_ms'])}" if "router" in results else "")
                + (f"; granian/serve rate {ratio(results['granian']['rate'], app['rate'])}"
                   if "granian" in results else "")
            )  # fmt: skip
            reasons = Counter(json.loads(a)["reason"] for a in app["answers"])
            print(f"  app decisions by reason (first {sum(reasons.values())}): {dict(reasons)}")
            if level == 32:
                out.update(
                    single32_rps=round(app["rate"], 1),
                    single32_p99_ms=round(app["p99_ms"], 2),
                    cpu_ms_per_decision=round(app_cpu, 4),
                )
                if "router" in results:
                    out.update(
                        router_pd_rps=round(results["router"]["rate"], 1),
                        router_pd_p99_ms=round(results["router"]["p99_ms"], 2),
                    )
        if router is not None:
            router_ctx.__exit__(None, None, None)

        size = args.batch_size
        batches = [
            json.dumps({"requests": requests[i * size : (i + 1) * size]}).encode()
            for i in range(args.batches)
        ]
        bconc = args.batch_concurrency
        path = "/api/v1/route/batch"
        rounds = args.batch_rounds

        async def batch_rounds(name: str) -> list[tuple[dict[str, Any], float, float]]:
            """``rounds`` runs of every batch, each on fresh connections (which worker
            accepts them is the server's, and can differ run to run); with Redis's CPU."""
            base = bases[name]
            await asyncio.to_thread(drive, base, path, batches[:4], headers, bconc, size)
            got = []
            for _ in range(rounds):
                redis_before = cpu_seconds(redis_pids)
                r, cpu = await asyncio.to_thread(
                    measured,
                    pids[name],
                    partial(drive, base, path, batches, headers, bconc, size),
                    size,
                )
                redis_ms = (cpu_seconds(redis_pids) - redis_before) / (len(batches) * size) * 1e3
                got.append((r, cpu, redis_ms))
            return got

        servers = ["serve", "uvicorn", "granian"] if args.granian else ["serve", "uvicorn"]
        by_server = {name: await batch_rounds(name) for name in servers}
        bare_b, bare_b_cpu = await asyncio.to_thread(
            measured,
            pids["bare"],
            partial(drive, bare_base, path, batches, headers, bconc, size),
            size,
        )
        print(
            f"\nbatches of {size}, {bconc} in flight, {len(batches)} calls a round, "
            f"{rounds} rounds on fresh connections"
        )
        print(HEADER)
        medians: dict[str, float] = {}
        for name, got in by_server.items():
            for k, (r, cpu, redis_ms) in enumerate(got, start=1):
                print(row(f"app ({name}) round {k}", r, cpu, f"   + Redis {redis_ms:.3f} ms/dec"))
            medians[name] = statistics.median(r["decisions_per_s"] for r, _, _ in got)
        print(row("bare ASGI (uvicorn)", bare_b, bare_b_cpu))
        print(
            "  medians: "
            + ", ".join(f"{name} {rate:.0f}/s" for name, rate in medians.items())
            + f"; ratio app (serve)/bare: rate "
            f"{ratio(medians['serve'], bare_b['decisions_per_s'])}; serve/uvicorn (shared "
            f"socket): {ratio(medians['serve'], medians['uvicorn'])}"
        )
        out["batch_rps"] = round(medians["serve"], 1)
        out["batch_rps_uvicorn_shared"] = round(medians["uvicorn"], 1)
        if "granian" in medians:
            out["batch_rps_granian"] = round(medians["granian"], 1)

        stop_fresh.set()
        await fresh
        load = os.getloadavg()
        print(
            f"\nmachine: {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} "
            f"{load[2]:.2f} at the end (the load generator, every server, the fake workers and "
            "Redis share them)"
        )
        return out
    finally:
        for p in procs.values():
            stop(p)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument(
        "--concurrency",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[8, 16, 32],
        help="single-request levels in flight, comma-separated (default 8,16,32)",
    )
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--batch-concurrency", type=int, default=4)
    parser.add_argument(
        "--batch-rounds", type=int, default=5, help="batch runs per server, each on new connections"
    )
    parser.add_argument(
        "--no-router", dest="router", action="store_false", help="skip sglang-router"
    )
    parser.add_argument(
        "--no-granian", dest="granian", action="store_false", help="skip the app under granian"
    )
    parser.add_argument(
        "--port-base", type=int, default=0, help="take ports from here on (default: any free)"
    )
    args = parser.parse_args()
    _next_port[0] = args.port_base
    if not 1 <= args.batch_size <= 1000:
        parser.error("--batch-size must be between 1 and 1000 (the API's batch limit)")
    if min(args.concurrency) < 1:
        parser.error("--concurrency levels must be at least 1")
    for name in ("requests", "batches", "batch_concurrency", "batch_rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")

    with tempfile.TemporaryDirectory(prefix="route-bench-") as tmp:
        env = dict(os.environ)
        env["DATABASE_URL"] = os.environ.get("BENCH_DATABASE_URL", f"sqlite:///{tmp}/bench.sqlite3")
        # Live state of a bench must not mix with a running deployment's: a private embedded
        # Redis unless BENCH_REDIS_URL names one.
        env.pop("REDIS_URL", None)
        server = None
        if os.environ.get("BENCH_REDIS_URL"):
            env["REDIS_URL"] = os.environ["BENCH_REDIS_URL"]
        else:
            server = EmbeddedRedis(Path(tmp))
            server.start()
            env["REDIS_URL"] = server.url
        env["VAR_DIR"] = tmp
        env["LOG_LEVEL"] = "WARNING"
        env.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
        try:
            manage(env, "migrate", "-v", "0")
            manage(env, "topology", "apply", str(SCENARIO))
            secret = bench_token(env, "router", "agent")
            print(f"topology: {SCENARIO.name}; Redis: {'embedded' if server else env['REDIS_URL']}")
            if server is not None and server.proc is not None:
                env["BENCH_REDIS_PID"] = str(server.proc.pid)
            out = asyncio.run(run(args, env, secret, Path(tmp)))
            keys = ("single32_rps", "single32_p99_ms", "router_pd_rps", "router_pd_p99_ms",
                    "batch_rps", "cpu_ms_per_decision", "batch_rps_uvicorn_shared",
                    "batch_rps_granian")  # fmt: skip
            print(json.dumps({k: out.get(k) for k in keys}))
        finally:
            if server is not None:
                server.stop()


if __name__ == "__main__":
    main()
