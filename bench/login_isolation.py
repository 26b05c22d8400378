"""Does password hashing slow routing? ``/route`` latency without and with concurrent bad logins.

In one run it:

1. makes a private database (SQLite in a temporary directory unless ``BENCH_DATABASE_URL``)
   with the paper's case-study topology, a router+agent token and an operator account;
   Redis is a private embedded one (or ``BENCH_REDIS_URL``);
2. serves the real app (uvicorn, ``--workers``) with the login lockout raised out of reach
   (``LOGIN_FAILURE_LIMIT=1000``: every bad login really hashes a password, the worst case for
   routing) and a 1 s token cache (``API_TOKEN_CACHE_S=1``: route calls keep needing the
   database for their credential check, as they do every few seconds in production);
3. measures ``POST /api/v1/route`` (closed loop, ``--concurrency`` in flight) alone, then while
   ``--logins`` threads post wrong passwords to the login page in a loop;
4. prints p50/p99 of both phases, the bad logins served, and the ratios loaded/alone.

Loopback only, bounded by ``--requests``. It measures; it never gates (issue 13: before the
route path had its own database thread, 8 bad logins raised /route p50 from 8.5 to 87 ms).

    python bench/login_isolation.py [--requests 3000] [--concurrency 4] [--logins 8]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.support.load import drive  # noqa: E402
from bench.support.setup import bench_token, free_port, manage  # noqa: E402
from controlplane.embedded_redis import EmbeddedRedis  # noqa: E402

SCENARIO = ROOT / "scenarios" / "paper-case-study.yaml"
UVICORN = str(ROOT / ".venv" / "bin" / "uvicorn")
PASSWORD = "bench-correct-horse-battery"


def serve(env: dict[str, str], port: int, workers: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [UVICORN, "controlplane.asgi:application", "--workers", str(workers),
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--no-access-log"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def wait_up(base: str, timeout_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/api/v1/health/live", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    sys.exit(f"server at {base} did not come up")


def bad_logins(base: str, stop: threading.Event, counts: list[int]) -> None:
    """Wrong passwords for the real account, one after the other, until ``stop``."""
    import httpx

    with httpx.Client(base_url=base, timeout=60) as client:
        while not stop.is_set():
            page = client.get("/accounts/login/").text
            found = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
            if found is None:
                sys.exit("the login page has no CSRF token")
            answer = client.post(
                "/accounts/login/",
                data={
                    "username": "ops",
                    "password": "wrong",
                    "csrfmiddlewaretoken": found.group(1),
                },
            )
            if answer.status_code not in (200, 429):
                sys.exit(f"a bad login got {answer.status_code}")
            counts.append(answer.status_code)


def phase(base: str, bodies: list[bytes], headers: dict[str, str], level: int) -> dict[str, Any]:
    drive(base, "/api/v1/route", bodies[: min(200, len(bodies))], headers, level)  # warm
    return drive(base, "/api/v1/route", bodies, headers, level)


def run(args: argparse.Namespace, env: dict[str, str], secret: str) -> None:
    import httpx

    port = args.port or free_port()
    proc = serve(env, port, args.workers)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_up(base)
        headers = {"Authorization": f"Bearer {secret}"}
        policy = httpx.get(f"{base}/api/v1/policy", headers=headers, timeout=30).json()
        pd = next(c["name"] for c in policy["clusters"] if c["kind"] == "pd")
        bodies = [
            json.dumps({"origin": pd, "prompt_tokens": 1000 + 37 * (k % 500)}).encode()
            for k in range(args.requests)
        ]
        alone = phase(base, bodies, headers, args.concurrency)

        stop = threading.Event()
        counts: list[int] = []
        threads = [
            threading.Thread(target=bad_logins, args=(base, stop, counts), daemon=True)
            for _ in range(args.logins)
        ]
        for t in threads:
            t.start()
        time.sleep(1.0)  # every login thread is hashing by now
        before = len(counts)
        started = time.monotonic()
        loaded = phase(base, bodies, headers, args.concurrency)
        served = len(counts) - before
        elapsed = time.monotonic() - started
        stop.set()
        for t in threads:
            t.join(timeout=120)

        print(f"\n/route, {args.requests} calls, concurrency {args.concurrency}, "
              f"{args.workers} uvicorn workers")  # fmt: skip
        print(f"  {'':28} {'p50 ms':>8} {'p99 ms':>8}  errors")
        for label, r in (("alone", alone), (f"with {args.logins} bad-login loops", loaded)):
            print(f"  {label:28} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f}  {r['errors'] or '-'}")
        print(
            f"  bad logins answered meanwhile: {served} in {elapsed:.1f} s "
            f"({served / elapsed:.1f}/s; {counts.count(429)} of all {len(counts)} were 429)"
        )
        print(
            f"  ratio loaded/alone: p50 {loaded['p50_ms'] / alone['p50_ms']:.2f}, "
            f"p99 {loaded['p99_ms'] / alone['p99_ms']:.2f}"
        )
        print(
            f"machine: {os.cpu_count()} CPUs (load, login threads, server workers, Redis share them)"
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--logins", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--port", type=int, default=0, help="the app's port (default: a free one)")
    args = parser.parse_args()
    for name in ("requests", "concurrency", "logins", "workers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")

    with tempfile.TemporaryDirectory(prefix="login-bench-") as tmp:
        env = dict(os.environ)
        env["DATABASE_URL"] = os.environ.get("BENCH_DATABASE_URL", f"sqlite:///{tmp}/bench.sqlite3")
        env.pop("REDIS_URL", None)
        server = None
        if os.environ.get("BENCH_REDIS_URL"):
            env["REDIS_URL"] = os.environ["BENCH_REDIS_URL"]
        else:
            server = EmbeddedRedis(Path(tmp))
            server.start()
            env["REDIS_URL"] = server.url
        env.update(
            VAR_DIR=tmp,
            LOG_LEVEL="WARNING",
            LOGIN_FAILURE_LIMIT="1000",
            API_TOKEN_CACHE_S="1",
            DJANGO_SUPERUSER_PASSWORD=PASSWORD,
        )
        env.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
        try:
            manage(env, "migrate", "-v", "0")
            manage(env, "topology", "apply", str(SCENARIO))
            manage(
                env,
                "createsuperuser",
                "--noinput",
                "--username",
                "ops",
                "--email",
                "ops@example.com",
            )
            secret = bench_token(env, "router", "agent")
            run(args, env, secret)
        finally:
            if server is not None:
                server.stop()


if __name__ == "__main__":
    main()
