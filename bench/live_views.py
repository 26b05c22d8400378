"""Live views under load: N websocket clients on the overview, M frames a second published.

Serves the real ASGI application (Django + Channels, the Redis channel layer) with uvicorn in a
thread, logs N browser-like clients in (session cookie over the websocket, as a page does), then
publishes link samples through :func:`controlplane.live.live_apublish` at a fixed rate. Every
client checks the sequence numbers it receives. Prints the publish-to-receive latency
percentiles over all deliveries and the number of gaps (a frame whose number does not follow
the last, or a resync snapshot). Target (issue 7): p99 <= 250 ms with 50 clients at 10/s.
Measures; does not gate.

    python bench/live_views.py [--clients 50] [--rate 10] [--seconds 10]

Uses ``REDIS_URL`` (embedded Redis when unset) and a throw-away SQLite database for the one
user the clients log in as, unless ``DATABASE_URL`` is set.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import websockets

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from controlplane.embedded_redis import EmbeddedRedis  # noqa: E402


def _django_setup() -> EmbeddedRedis | None:
    """Django on a throw-away database and, without ``REDIS_URL``, an embedded Redis of its own
    (returned, for the caller to stop). Only the parent process sets up Django: the clients
    need none."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-live-"))
    os.environ.setdefault("DATABASE_URL", f"sqlite:///{tmp}/bench.sqlite3")
    server = None
    if not os.environ.get("REDIS_URL"):
        os.environ["VAR_DIR"] = str(tmp)
        server = EmbeddedRedis(tmp)
        server.start()
        os.environ["REDIS_URL"] = server.url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    import django

    django.setup()
    return server


LINK = "bench-prfaas->bench-pd"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _session_cookie() -> str:
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group
    from django.core.management import call_command
    from django.test import Client

    call_command("migrate", verbosity=0, interactive=False)
    user_model = get_user_model()
    user, _ = user_model.objects.get_or_create(username="bench-live-views")
    user.groups.add(Group.objects.get(name="viewer"))  # the live views need the read role
    client = Client()
    client.force_login(user)
    return f"sessionid={client.cookies['sessionid'].value}"


def _serve(port: int) -> tuple[Any, threading.Thread]:
    import uvicorn

    from controlplane.asgi import application

    server = uvicorn.Server(
        uvicorn.Config(
            application, host="127.0.0.1", port=port, log_level="warning", lifespan="off"
        )
    )
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return server, thread
        time.sleep(0.05)
    raise SystemExit(f"the server did not start on port {port}")


class Client_:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.gaps = 0
        self.frames = 0
        self.seq = 0
        self.epoch = ""


async def _client(
    url: str, cookie: str, stats: Client_, ready: asyncio.Event, stop: asyncio.Event
) -> None:
    # The page's own origin (scheme, host and port), as a browser sends it: the server refuses
    # a live-view socket from any other (controlplane/ws_origin.py).
    origin = "http://" + url.removeprefix("ws://").split("/", 1)[0]
    async with websockets.connect(
        url, additional_headers={"Cookie": cookie, "Origin": origin}, max_size=None
    ) as ws:
        first = json.loads(await ws.recv())
        stats.epoch, stats.seq = first["epoch"], first["seq"]
        ready.set()
        while not stop.is_set():
            try:
                raw = await asyncio.wait_for(ws.recv(), timeout=0.5)
            except TimeoutError:
                continue
            now = time.time()
            msg = json.loads(raw)
            if msg["type"] == "snapshot":
                stats.gaps += 1  # the server resynced this client
                stats.epoch, stats.seq = msg["epoch"], msg["seq"]
                continue
            if msg["epoch"] != stats.epoch or msg["seq"] != stats.seq + 1:
                stats.gaps += 1
            stats.seq = msg["seq"]
            stats.frames += 1
            if msg["type"] == "link_samples":
                for sample in msg["data"]["samples"]:
                    if sample["link"] == LINK:
                        stats.latencies.append(now - sample["ts"])


async def _clients_run(
    url: str, cookie: str, clients: int, connected: Any, stop: Any
) -> list[dict[str, Any]]:
    stats = [Client_() for _ in range(clients)]
    readies = [asyncio.Event() for _ in range(clients)]
    local_stop = asyncio.Event()
    tasks = [
        asyncio.create_task(_client(url, cookie, s, r, local_stop))
        for s, r in zip(stats, readies, strict=True)
    ]
    await asyncio.wait_for(asyncio.gather(*(r.wait() for r in readies)), timeout=60)
    connected.set()
    while not stop.is_set():
        await asyncio.sleep(0.1)
    local_stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    return [{"latencies": s.latencies, "gaps": s.gaps} for s in stats]


def _clients_process(
    url: str, cookie: str, clients: int, connected: Any, stop: Any, out: Any
) -> None:
    # A process of its own, so that the clients do not share the server's interpreter lock.
    out.put(asyncio.run(_clients_run(url, cookie, clients, connected, stop)))


async def _run(clients: int, rate: float, seconds: float) -> None:
    from controlplane import live

    cookie = await asyncio.to_thread(_session_cookie)
    port = _free_port()
    server, thread = await asyncio.to_thread(_serve, port)
    url = f"ws://127.0.0.1:{port}/ws/live/{live.OVERVIEW}/"
    ctx = multiprocessing.get_context("spawn")
    connected, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_clients_process, args=(url, cookie, clients, connected, stop, out))
    child.start()
    if not await asyncio.to_thread(connected.wait, 60):
        raise SystemExit("the clients did not connect")
    await asyncio.sleep(0.5)

    published = 0
    start = time.monotonic()
    interval = 1.0 / rate
    while time.monotonic() - start < seconds:
        await live.live_apublish(
            live.OVERVIEW,
            live.LinkSamples(samples=(live.LinkEgress(link=LINK, ts=time.time(), gbps=1.0),)),
        )
        published += 1
        next_at = start + published * interval
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    await asyncio.sleep(1.0)  # let the last frames arrive
    stop.set()
    results = await asyncio.to_thread(out.get, True, 60)
    await asyncio.to_thread(child.join, 10)
    server.should_exit = True
    await asyncio.to_thread(thread.join, 10)

    latencies = sorted(x for r in results for x in r["latencies"])
    expected = published * clients
    gaps = sum(r["gaps"] for r in results)

    def pct(q: float) -> float:
        if not latencies:
            return float("nan")
        return 1000 * latencies[min(len(latencies) - 1, int(q * len(latencies)))]

    print(f"clients {clients}, rate {rate:g}/s, {seconds:g} s: published {published} frames")
    print(f"delivered {len(latencies)} of {expected} ({len(latencies) / max(expected, 1):.1%})")
    print(
        f"publish-to-receive latency ms: p50 {pct(0.50):.1f}  p90 {pct(0.90):.1f}  "
        f"p99 {pct(0.99):.1f}  max {1000 * latencies[-1] if latencies else float('nan'):.1f}"
    )
    print(f"gaps {gaps}")
    print(f"p99 / target (250 ms): {pct(0.99) / 250:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    if args.clients < 1 or args.rate <= 0 or args.seconds <= 0:
        parser.error("--clients must be at least 1; --rate and --seconds must be positive")
    server = _django_setup()
    try:
        asyncio.run(_run(args.clients, args.rate, args.seconds))
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
