"""Serve the control plane with uvicorn workers that each listen on a socket of their own.

    python -m controlplane.serve [--host 127.0.0.1] [--port 8000] [--workers N] [options]

Why not ``uvicorn --workers N``: its workers share one listening socket, and the first to wake
accepts every connection that is waiting (uvloop's accept loop drains the queue). A router
that opens its keep-alive pool in one burst then lands all of it on one worker, which serves
that router's traffic for as long as the connections live while the other workers idle
(measured by ``bench/route_api.py``: batches at about 60% of the rate of an even split).
Here, on Linux, every worker binds its own socket to the same address with ``SO_REUSEPORT``,
and the kernel spreads new connections over the workers' sockets by a hash of each
connection's addresses, so a burst of connections is shared whoever is awake. Elsewhere
(no such balancing, e.g. macOS) the workers share one socket, as under ``uvicorn --workers``.

The supervisor (this process) holds the address while it runs (one socket bound, never
listening, so it takes no connections), starts the workers, replaces one that dies, stops
every worker on SIGTERM or SIGINT (each finishes its requests within
``--timeout-graceful-shutdown``, then is killed), and exits 3 when a worker fails to start
(the app or its settings are broken: restarting would fail the same way), as uvicorn does.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from multiprocessing.process import BaseProcess
from typing import Any

import uvicorn
from uvicorn.config import STARTUP_FAILURE

log = logging.getLogger("controlplane.serve")

APP = "controlplane.asgi:application"
HTTP = "controlplane.http_protocol:HeaderDeadlineProtocol"
# Spread by the kernel only where SO_REUSEPORT balances connections over a group of sockets.
BALANCED = sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")
# A worker that dies this soon after the previous replacement waits before the next one.
RESTART_PAUSE_S = 1.0


@dataclass(frozen=True)
class Options:
    """What each worker's uvicorn is given (picklable: workers are spawned)."""

    app: str = APP
    host: str = "127.0.0.1"
    port: int = 8000
    http: str = HTTP
    proxy_headers: bool = True
    forwarded_allow_ips: str | None = None
    timeout_keep_alive: int = 5
    timeout_graceful_shutdown: int = 10
    log_level: str = "info"
    access_log: bool = True
    backlog: int = 2048

    def uvicorn_kwargs(self) -> dict[str, Any]:
        kwargs = asdict(self)
        del kwargs["app"]
        return kwargs


def listening_socket(host: str, port: int, *, listen: bool, backlog: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with SO_REUSEPORT (where balanced) and
    SO_REUSEADDR; listening when ``listen``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if BALANCED:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if listen:
            sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def worker_run(options: Options) -> None:
    """One worker process: its own listening socket, one uvicorn server on it."""
    config = uvicorn.Config(options.app, **options.uvicorn_kwargs())
    try:
        sock = listening_socket(options.host, options.port, listen=True, backlog=options.backlog)
    except OSError as exc:
        logging.getLogger("uvicorn.error").error("cannot listen: %s", exc)
        sys.exit(STARTUP_FAILURE)
    server = uvicorn.Server(config)
    server.run(sockets=[sock])
    if not server.started:
        sys.exit(STARTUP_FAILURE)


class Supervisor:
    """Starts ``workers`` worker processes and keeps that many running until told to stop."""

    def __init__(self, options: Options, workers: int) -> None:
        self.options = options
        self.workers = workers
        self.context = multiprocessing.get_context("spawn")
        self.processes: list[BaseProcess] = []
        self.stopping = threading.Event()
        self.exit_code = 0

    def _start(self) -> BaseProcess:
        proc = self.context.Process(target=worker_run, args=(self.options,), daemon=False)
        proc.start()
        log.info("started worker [%s]", proc.pid)
        return proc

    def stop(self, *_: Any) -> None:
        self.stopping.set()

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.stop)
        self.processes = [self._start() for _ in range(self.workers)]
        last_restart = 0.0
        while not self.stopping.wait(0.25):
            for i, proc in enumerate(self.processes):
                if proc.is_alive():
                    continue
                proc.join()
                if proc.exitcode == STARTUP_FAILURE:
                    log.error("worker [%s] failed to start; stopping", proc.pid)
                    self.exit_code = STARTUP_FAILURE
                    self.stopping.set()
                    break
                log.warning("worker [%s] died (exit %s); replacing it", proc.pid, proc.exitcode)
                pause = last_restart + RESTART_PAUSE_S - time.monotonic()
                if pause > 0 and self.stopping.wait(pause):
                    break
                last_restart = time.monotonic()
                self.processes[i] = self._start()
        self._stop_all()
        return self.exit_code

    def _stop_all(self) -> None:
        for proc in self.processes:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.options.timeout_graceful_shutdown + 5
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                log.warning("worker [%s] did not stop in time; killing it", proc.pid)
                proc.kill()
                proc.join()


def serve(options: Options, workers: int) -> int:
    """Serve until SIGTERM or SIGINT; the exit status."""
    if workers == 1 or not BALANCED:
        if workers > 1:
            log.warning("SO_REUSEPORT does not balance here: the workers share one socket")
        uvicorn.run(options.app, workers=workers, **options.uvicorn_kwargs())
        return 0
    try:
        # Held, not listening: the address is ours (and a taken one is reported here, once)
        # while workers come and go; connections go to the workers' listening sockets only.
        holder = listening_socket(options.host, options.port, listen=False, backlog=0)
    except OSError as exc:
        print(f"serve: cannot bind {options.host}:{options.port}: {exc}", file=sys.stderr)
        return 1
    try:
        return Supervisor(options, workers).run()
    finally:
        holder.close()


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"a TCP port is 1 to 65535, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m controlplane.serve", description=__doc__)
    parser.add_argument("app", nargs="?", default=APP, help=f"ASGI app (default {APP})")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=_port, default=8000)
    parser.add_argument("--workers", type=_positive, default=1)
    parser.add_argument("--http", default=HTTP, help=f"uvicorn HTTP protocol (default {HTTP})")
    parser.add_argument(
        "--forwarded-allow-ips",
        default=None,
        help="proxies whose X-Forwarded-* headers are trusted (uvicorn's option)",
    )
    parser.add_argument("--no-proxy-headers", dest="proxy_headers", action="store_false")
    parser.add_argument("--timeout-keep-alive", type=_positive, default=5)
    parser.add_argument("--timeout-graceful-shutdown", type=_positive, default=10)
    parser.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    parser.add_argument("--no-access-log", dest="access_log", action="store_false")
    parser.add_argument("--backlog", type=_positive, default=2048)
    args = vars(parser.parse_args(argv))
    workers = args.pop("workers")
    logging.basicConfig(
        level=args["log_level"].upper(), format="%(levelname)s %(name)s %(message)s"
    )
    return serve(Options(**args), workers)


if __name__ == "__main__":
    sys.exit(main())
