"""The PD gateway against sglang-router (Rust, PD mode), same fake workers, same load, one run.

In one run it:

1. makes a private control plane (SQLite in a temporary directory, a private embedded Redis)
   with one PD cluster of one prefill and one decode instance and a router token, served by
   uvicorn;
2. starts the fake PD workers (``fleet.fake_engine``: one prefill, one decode, the
   shared-storage connector, one process each, served by uvicorn: measured here, it costs
   them less CPU per request than granian, which leaves the proxies more of the machine;
   ``--engine-server``), the gateway in front of them (``python -m fleet.gateway``, one
   uvicorn worker by default: measured here, one worker serves more than two on CPUs the fake
   workers and the load generator share, and uvicorn costs less CPU per request than
   granian; deciding in process, reporting outcomes to the control plane), and sglang-router
   0.3.2 in PD mode in front of the same workers (installed by the bench into its own cached
   venv, ``bench/support/sglang_router.py``);
3. drives each with the same load generator (``bench/support/load.py``): text prompts of
   ~64-1,024 tokens (sglang-router takes no token-id prompts; the gateway estimates their
   length, ``--tokenizer``), 16 output tokens, not streamed, a prompt set of its own per
   proxy (a prompt's KV is stored once);
   a. closed loop at ``--concurrency`` in flight: throughput, p50/p99, CPU per request of the
      proxy's processes (from /proc);
   b. open loop at ``--low-rate`` and ``--rate`` requests/s: p99 through the gateway,
      through sglang-router, and straight to the decode worker (the same body, one hop, no
      proxy): *added p99* is the proxy's p99 minus the direct p99. The same straight to the
      prefill worker, for context: vLLM's protocol calls prefill, then decode, so the
      gateway's added latency holds one whole prefill call (sglang-router sends both at once,
      SGLang's protocol);
4. prints both and the ratios; the last line is one JSON object
   ``{"gateway_rps", "router_rps", "added_p99_ms_at_1000", "router_added_p99_ms_at_1000"}``
   (the gateway's and sglang-router's added p99 at the same rate, ``--rate``).

Targets (issue 15): gateway throughput >= 50% of sglang-router's; added p99 <= 2 ms at 1,000
requests/s. Loopback only, bounded by ``--requests`` and ``--rate-seconds``; it measures, it
never gates.

    python bench/gateway.py [--requests 6000] [--concurrency 32] [--rate 1000]
                                      [--low-rate 300] [--rate-seconds 8] [--server granian]
                                      [--gateway-workers N] [--engine-server granian]
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
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import yaml  # noqa: E402

from bench.support.load import cpu_seconds, drive, drive_rate, process_tree  # noqa: E402
from bench.support.setup import free_port, manage  # noqa: E402
from bench.support.sglang_router import router_serve  # noqa: E402
from controlplane.embedded_redis import EmbeddedRedis  # noqa: E402
from fleet.fake_engine.launch import fake_engines_serve, gateway_serve, process_stop  # noqa: E402

PY = str(ROOT / ".venv" / "bin" / "python")
PD = "pd-bench"
JSON = {"Content-Type": "application/json"}
SCENARIO = {
    "version": 1,
    "name": "gateway-bench",
    "model": {"name": "tiny", "block_tokens": 32, "kv_cache_mib": [[32, 0.1], [8192, 25.0]]},
    "accelerators": [{"name": "CPU", "gpu_hour_cost": 1.0}],
    "profiles": [
        {
            "accelerator": "CPU",
            "gpus_per_instance": 1,
            "prefill_seconds": [[32, 0.001], [8192, 0.2]],
            "decode": {"max_batch": 256, "step_seconds": 0.01},
        }
    ],
    "clusters": [
        {
            "name": PD,
            "kind": "pd",
            "site": "here",
            "accelerator": "CPU",
            "prefill_instances": 1,
            "decode_instances": 1,
            "kv_connector": "shared_storage",
        }
    ],
}


def step_means(gateway: str) -> str:
    """The gateway's own account of where its time went (its /metrics), as means."""
    sums: dict[str, list[float]] = {}
    for raw in httpx.get(gateway + "/metrics", timeout=10).text.splitlines():
        for family in ("prfaas_gateway_step_seconds", "prfaas_gateway_request_seconds"):
            for suffix, at in (("_sum", 0), ("_count", 1)):
                if raw.startswith(family + suffix):
                    head, _, value = raw.rpartition(" ")
                    key = family.removeprefix("prfaas_gateway_") + head[len(family + suffix) :]
                    sums.setdefault(key, [0.0, 0.0])[at] += float(value)
    return ", ".join(f"{k} {v[0] / v[1] * 1e3:.2f} ms" for k, v in sorted(sums.items()) if v[1])


def bodies(n: int, seed: int = 7) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(64, 1024)
        # Text: sglang-router's /v1/completions takes no token-id prompts.
        prompt = " ".join(f"w{rng.randrange(1000)}" for _ in range(length // 2))
        out.append(json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 16}).encode())
    return out


def cpu_per_request(pids: list[int], run: Any) -> tuple[dict[str, Any], float]:
    before = cpu_seconds(pids)
    result = run()
    used = cpu_seconds(pids) - before
    return result, used / max(1, result["calls"]) * 1e3


def line(name: str, r: dict[str, Any], cpu_ms: float | None = None) -> str:
    cpu = f"{cpu_ms:8.3f}" if cpu_ms is not None else "       -"
    return (
        f"  {name:16} {r['rate']:9.0f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {cpu}"
        f"  {r['errors'] or '-'}"
    )


def run(args: argparse.Namespace, env: dict[str, str], token: str, tmp: Path) -> dict[str, Any]:
    with ExitStack() as stack:
        cp_port = free_port()
        cp = subprocess.Popen(
            [PY, "-m", "uvicorn", "controlplane.asgi:application", "--port", str(cp_port),
             "--host", "127.0.0.1", "--log-level", "warning", "--no-access-log"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        stack.callback(process_stop, cp)
        base = f"http://127.0.0.1:{cp_port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/api/v1/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        # tmpfs when there is one: the fake connector's KV files are not what is measured.
        shm = Path("/dev/shm")
        storage = Path(tempfile.mkdtemp(prefix="gw-bench-kv-", dir=shm if shm.is_dir() else tmp))
        stack.callback(shutil.rmtree, storage, True)
        ports = {"prefill": free_port(), "decode": free_port()}
        workers: dict[str, str] = {}
        engine_pids: list[int] = []
        for role in ("prefill", "decode"):
            # One process per worker, as two engines would be.
            urls, proc = stack.enter_context(
                fake_engines_serve(
                    [(f"{PD}-{role}", ports[role], "kv_both")],
                    connector="shared_storage",
                    storage=str(storage),
                    server=args.engine_server,
                    python=PY,
                )
            )
            workers.update(urls)
            engine_pids.append(proc.pid)
        time.sleep(0.5)  # granian's worker processes are up (with --engine-server granian)
        prefill_pids = process_tree(engine_pids[0])  # prefill was started first
        decode_pids = process_tree(engine_pids[1])
        gw_port = free_port()
        config = {
            "listen": {"host": "127.0.0.1", "port": gw_port},
            "origin": PD,
            "control_plane": {"url": base, "token_env": "BENCH_GATEWAY_TOKEN", "timeout_s": 2},
            "endpoints": {
                f"{PD}-0": workers[f"{PD}-prefill"],
                f"{PD}-1": workers[f"{PD}-decode"],
            },
            "live_max_age_s": 10.0,
            "tokenizer": args.tokenizer,
            "workers": args.gateway_workers,
            "server": args.server,
        }
        (tmp / "gateway.yaml").write_text(yaml.safe_dump(config))
        gateway, gw_proc = stack.enter_context(
            gateway_serve(tmp / "gateway.yaml", gw_port, {"BENCH_GATEWAY_TOKEN": token}, python=PY)
        )
        rt_port = free_port()
        rt_proc = stack.enter_context(
            router_serve([(workers[f"{PD}-prefill"], None)], [workers[f"{PD}-decode"]], rt_port)
        )
        router = f"http://127.0.0.1:{rt_port}"

        # Each proxy gets prompts of its own (same lengths' distribution): a prompt's KV is
        # written to the shared storage once, so the first to send it would pay for both.
        loads = {"gateway": bodies(args.requests, 7), "sglang-router": bodies(args.requests, 8)}
        load = loads["gateway"]
        path = "/v1/completions"
        time.sleep(1.0)  # every worker up (uvicorn starts them after the supervisor)
        gw_pids = process_tree(gw_proc.pid)
        rt_pids = process_tree(rt_proc.pid)
        cp_pids = process_tree(cp.pid)

        check = httpx.post(gateway + path, content=load[0], headers=JSON, timeout=10)
        direct = httpx.post(
            workers[f"{PD}-decode"] + path, content=load[0], headers=JSON, timeout=10
        )
        via_router = httpx.post(router + path, content=load[0], headers=JSON, timeout=10)
        for name, got in (("gateway", check), ("sglang-router", via_router)):
            if got.status_code != 200 or got.json()["choices"] != direct.json()["choices"]:
                sys.exit(f"{name} does not answer like the engine: {got.status_code} {got.text}")

        print(f"\nclosed loop, {args.concurrency} in flight, {len(load)} requests each")
        print(f"  {'':16} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'CPU ms/req':>8}  errors")
        results: dict[str, Any] = {}
        for name, url, pids in (("gateway", gateway, gw_pids), ("sglang-router", router, rt_pids)):
            mine = loads[name]
            drive(url, path, mine[:500], {}, args.concurrency)
            cp_before = cpu_seconds(cp_pids)
            r, cpu_ms = cpu_per_request(
                pids, lambda u=url, m=mine: drive(u, path, m, {}, args.concurrency)
            )
            cp_ms = (cpu_seconds(cp_pids) - cp_before) / len(load) * 1e3
            results[name] = r
            print(line(name, r, cpu_ms))
            if name == "gateway":
                print(
                    f"  {'(control plane)':16} {'':>9} {'':>8} {'':>8} {cp_ms:8.3f}  outcomes, live state"
                )
        ratio = results["gateway"]["rate"] / results["sglang-router"]["rate"]
        print(f"  gateway / sglang-router throughput: {ratio:.2f} (target >= 0.50)")

        added_at: dict[float, tuple[float, float]] = {}
        targets = [
            ("direct (decode)", workers[f"{PD}-decode"], decode_pids),
            ("direct (prefill)", workers[f"{PD}-prefill"], prefill_pids),
            ("gateway", gateway, gw_pids),
            ("sglang-router", router, rt_pids),
        ]
        for rate in sorted({args.low_rate, args.rate}):
            added_at[rate] = open_loop_run(rate, args.rate_seconds, loads, targets)
        print(f"  the gateway's own means, whole run: {step_means(gateway)}")
        load_avg = os.getloadavg()
        print(f"\nmachine: {os.cpu_count()} CPUs, load average {load_avg[0]:.2f}; the load "
              "generator, the proxies, the fake workers and the control plane share them")  # fmt: skip
        return {
            "gateway_rps": round(results["gateway"]["rate"], 1),
            "router_rps": round(results["sglang-router"]["rate"], 1),
            "added_p99_ms_at_1000": round(added_at[args.rate][0], 3),
            "router_added_p99_ms_at_1000": round(added_at[args.rate][1], 3),
        }


def open_loop_run(
    rate: float,
    seconds: float,
    loads: dict[str, list[bytes]],
    targets: list[tuple[str, str, list[int]]],
) -> tuple[float, float]:
    """One open-loop level over ``targets`` (name, URL, pids): direct, gateway,
    sglang-router; prints them and returns the gateway's and sglang-router's added p99 over
    the direct call."""
    path = "/v1/completions"
    n = int(rate * seconds)
    # Prompts already sent (their KV stored): the open loop measures proxies, not writes.
    per = {k: (v * (n // len(v) + 1))[:n] for k, v in loads.items()}
    per["direct (decode)"] = per["direct (prefill)"] = per["gateway"]
    print(f"\nopen loop at {rate:.0f} requests/s for {seconds:.0f} s")
    print(f"  {'':16} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'CPU ms/req':>8}  errors")
    got: dict[str, Any] = {}
    for name, url, pids in targets:
        r, cpu_ms = cpu_per_request(
            pids, lambda u=url, m=per[name]: drive_rate(u, path, m, {}, rate)
        )
        got[name] = r
        print(line(name, r, cpu_ms))
    base = got["direct (decode)"]["p99_ms"]
    added = got["gateway"]["p99_ms"] - base
    router_added = got["sglang-router"]["p99_ms"] - base
    print(
        f"  added p99 over the direct call: gateway {added:.2f} ms (target <= 2 ms at 1,000/s), "
        f"sglang-router {router_added:.2f} ms"
    )
    return float(added), float(router_added)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--rate-seconds", type=float, default=8.0)
    parser.add_argument(
        "--low-rate", type=float, default=300.0, help="a second open-loop level, for context"
    )
    parser.add_argument(
        "--gateway-workers",
        type=int,
        default=1,
        help="gateway processes (one: the fake workers and the load generator share the CPUs)",
    )
    parser.add_argument("--server", choices=("uvicorn", "granian"), default="uvicorn")
    parser.add_argument(
        "--engine-server",
        choices=("uvicorn", "granian"),
        default="uvicorn",
        help="the fake workers' server (the harness: the cheaper one leaves the proxies more CPU)",
    )
    parser.add_argument(
        "--tokenizer",
        choices=("estimate", "engine"),
        default="estimate",
        help="the gateway's tokenizer setting (engine: one more upstream call per request)",
    )
    args = parser.parse_args()
    if args.requests < 10 or args.concurrency < 1 or args.rate <= 0 or args.rate_seconds <= 0:
        parser.error("--requests >= 10, --concurrency >= 1, --rate and --rate-seconds > 0")
    with tempfile.TemporaryDirectory(prefix="gateway-bench-") as tmp_name:
        tmp = Path(tmp_name)
        env = dict(os.environ)
        env["DATABASE_URL"] = f"sqlite:///{tmp}/bench.sqlite3"
        # A private embedded Redis, supervised by this bench: no mixing with a deployment.
        redis_server = EmbeddedRedis(tmp)
        redis_server.start()
        env["REDIS_URL"] = redis_server.url
        env["VAR_DIR"] = str(tmp)
        env["LOG_LEVEL"] = "WARNING"
        env.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
        scenario = tmp / "scenario.yaml"
        scenario.write_text(yaml.safe_dump(SCENARIO))
        try:
            manage(env, "migrate", "-v", "0")
            manage(env, "topology", "apply", str(scenario))
            token = manage(env, "token", "create", "--name", "bench-gw", "--scope", "router")
            summary = run(args, env, token, tmp)
        finally:
            redis_server.stop()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
