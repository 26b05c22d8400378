"""The benches' load generator, and CPU time of server processes from /proc.

The load generator must not be the bottleneck: an httpx client in one process tops out at a
few hundred calls/s, below what a bare uvicorn endpoint serves. So several processes, each
with raw keep-alive HTTP/1.1 connections on asyncio streams (pre-built request bytes, only
the status line and Content-Length / chunked framing parsed), drive the servers, either
closed-loop (:func:`drive`: a fixed number of calls in flight) or open-loop at a fixed rate
(:func:`drive_rate`: each call is sent at its scheduled time, on a free connection or a new
one, and its latency counts from that time, so a slow server cannot hide its queue).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

# Open-loop connections idle this long are not reused (uvicorn closes idle keep-alive
# connections after 5 s by default, and a request racing that close fails).
IDLE_REUSE_S = 2.0
LOAD_PROCESSES = max(1, min(4, (os.cpu_count() or 2) // 2))
# Open loop: a call not answered within this is an error (an overloaded server must not make
# the run last for minutes).
OPEN_LOOP_TIMEOUT_S = 10.0
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def requests_build(
    port: int, path: str, bodies: Sequence[bytes], headers: dict[str, str]
) -> list[bytes]:
    """POST requests as raw HTTP/1.1 bytes."""
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return [
        (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{head}"
            f"Content-Type: application/json\r\nContent-Length: {len(b)}\r\n\r\n"
        ).encode()
        + b
        for b in bodies
    ]


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length = -1
    chunked = False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value.strip())
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if not chunked:
        return status, await reader.readexactly(max(length, 0))
    parts: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return status, b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


_Result = tuple[list[float], dict[int, int], list[bytes], float, float]


async def _drive_slice(port: int, requests: list[bytes], connections: int, keep: int) -> _Result:
    latencies: list[float] = []
    errors: Counter[int] = Counter()
    answers: list[bytes] = []
    queue = list(reversed(requests))

    async def connection() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while queue:
                raw = queue.pop()
                started = time.perf_counter()
                writer.write(raw)
                status, body = await _read_response(reader)
                latencies.append(time.perf_counter() - started)
                if status != 200:
                    errors[status] += 1
                elif len(answers) < keep:
                    answers.append(body)
        finally:
            writer.close()

    began = time.perf_counter()
    await asyncio.gather(*(connection() for _ in range(connections)))
    return latencies, dict(errors), answers, began, time.perf_counter()


async def _rate_slice(port: int, requests: list[bytes], rate: float, keep: int) -> _Result:
    latencies: list[float] = []
    errors: Counter[int] = Counter()
    answers: list[bytes] = []
    # (reader, writer, idle since): last in, first out, so few connections stay in use
    free: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = []
    opened: list[asyncio.StreamWriter] = []

    async def one(raw: bytes, due: float) -> None:
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        while free and conn is None:
            reader, writer, since = free.pop()
            if time.perf_counter() - since < IDLE_REUSE_S:
                conn = reader, writer
            else:
                # the server may be closing it (keep-alive timeout): a request sent on it now
                # would fail for the harness's sake, not the server's
                writer.close()
        if conn is None:
            try:
                conn = await asyncio.open_connection("127.0.0.1", port)
            except OSError:  # the server's backlog is full: an error, not the end of the run
                errors[0] += 1
                return
            opened.append(conn[1])
        reader, writer = conn
        writer.write(raw)
        try:
            async with asyncio.timeout(OPEN_LOOP_TIMEOUT_S):
                status, body = await _read_response(reader)
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            # Counted as an error (status 0; 408 for no answer in time), the connection dropped.
            errors[408 if isinstance(exc, TimeoutError) else 0] += 1
            writer.close()
            return
        latencies.append(time.perf_counter() - due)
        if status != 200:
            errors[status] += 1
        elif len(answers) < keep:
            answers.append(body)
        free.append((reader, writer, time.perf_counter()))

    began = time.perf_counter()
    tasks = []
    for k, raw in enumerate(requests):
        due = began + k / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(raw, due)))
    await asyncio.gather(*tasks)
    end = time.perf_counter()
    for writer in opened:
        writer.close()
    return latencies, dict(errors), answers, began, end


def _drive_process(args: tuple[str, int, list[bytes], float, int, float]) -> _Result:
    mode, port, requests, level, keep, start_at = args
    # All processes start together so that the wall time covers one shared burst.
    time.sleep(max(0.0, start_at - time.time()))
    if mode == "rate":
        return asyncio.run(_rate_slice(port, requests, level, keep))
    return asyncio.run(_drive_slice(port, requests, int(level), keep))


def _run(mode: str, port: int, requests: list[bytes], level: float, procs: int) -> dict[str, Any]:
    procs = max(1, min(procs, len(requests)))
    slices = [requests[k::procs] for k in range(procs)]
    if mode == "rate":
        levels = [level / procs] * procs
    else:
        n = int(level)
        levels = [max(1, n // procs + (1 if k < n % procs else 0)) for k in range(procs)]
    start_at = time.time() + 0.3
    jobs = [
        (mode, port, s, lv, 2000 // procs, start_at) for s, lv in zip(slices, levels, strict=True)
    ]
    with ProcessPoolExecutor(procs) as pool:
        results = list(pool.map(_drive_process, jobs))
    latencies = [x for r in results for x in r[0]]
    errors: Counter[int] = Counter()
    for r in results:
        errors.update(r[1])
    wall = max(r[4] for r in results) - min(r[3] for r in results)
    return {
        "calls": len(requests),
        "wall_s": wall,
        "rate": len(requests) / wall,
        "p50_ms": percentile(latencies, 0.50) * 1e3,
        "p99_ms": percentile(latencies, 0.99) * 1e3,
        "mean_ms": statistics.fmean(latencies) * 1e3 if latencies else float("nan"),
        "errors": dict(errors),
        "answers": [a for r in results for a in r[2]],
    }


def drive(
    base: str,
    path: str,
    bodies: list[bytes],
    headers: dict[str, str],
    concurrency: int,
    per_call: int = 1,
) -> dict[str, Any]:
    """POST every body with ``concurrency`` in flight; latency per call, decisions per second
    (``per_call`` decisions in each call)."""
    port = int(base.rsplit(":", 1)[1])
    requests = requests_build(port, path, bodies, headers)
    out = _run("closed", port, requests, concurrency, min(LOAD_PROCESSES, concurrency))
    out["decisions_per_s"] = out["rate"] * per_call
    return out


def drive_rate(
    base: str, path: str, bodies: list[bytes], headers: dict[str, str], rate: float
) -> dict[str, Any]:
    """POST every body open-loop at ``rate`` calls/s in all (latency from the scheduled time)."""
    port = int(base.rsplit(":", 1)[1])
    requests = requests_build(port, path, bodies, headers)
    return _run("rate", port, requests, rate, LOAD_PROCESSES)


def process_tree(pid: int) -> list[int]:
    """``pid`` and every descendant, from /proc (e.g. a server and its workers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds used so far by ``pids`` (each with its threads)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / _CLK_TCK
