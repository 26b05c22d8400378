"""Client CPU per Redis round trip: a one-command redis-py pipeline against the same command
sent alone (:func:`controlplane.redis_scripts.script_call_async`), as the route path sends its scripts.

Starts a private embedded Redis (Unix socket), loads a trivial script, and sends ``EVALSHA``
with a 200-byte argument ``--calls`` times each way, alternating the two ways ``--rounds``
times, in one asyncio loop. Prints this process's CPU per round trip (user + system: the
client's Python and its socket calls; Redis's own CPU is another process's) and the ratio of
the plain command to the pipeline, median of the rounds; the last line is one JSON object.

    python bench/redis_client.py [--calls 3000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import redis.asyncio as aioredis  # noqa: E402

from controlplane.embedded_redis import EmbeddedRedis  # noqa: E402
from controlplane.redis_scripts import script_call_async  # noqa: E402

ARG = b"x" * 200


async def _cpu_per_call(call: Callable[[], Awaitable[Any]], calls: int) -> float:
    for _ in range(min(200, calls)):
        await call()
    started = time.process_time()
    for _ in range(calls):
        await call()
    return (time.process_time() - started) / calls


async def measure(url: str, calls: int, rounds: int) -> dict[str, float]:
    client = aioredis.from_url(url)
    sha = await client.script_load("return ARGV[1]")

    async def pipeline() -> Any:
        pipe = client.pipeline(transaction=False)
        pipe.evalsha(sha, 0, ARG)
        return (await pipe.execute())[0]

    async def alone() -> Any:
        return await script_call_async(
            client, lambda pipe: pipe.execute_command("EVALSHA", sha, 0, ARG)
        )

    if await pipeline() != await alone():
        raise SystemExit("the two ways answered differently")
    piped: list[float] = []
    plain: list[float] = []
    for _ in range(rounds):
        piped.append(await _cpu_per_call(pipeline, calls))
        plain.append(await _cpu_per_call(alone, calls))
    await client.aclose()
    return {
        "pipeline_us": statistics.median(piped) * 1e6,
        "alone_us": statistics.median(plain) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.calls < 1 or args.rounds < 1:
        parser.error("--calls and --rounds must be at least 1")
    with tempfile.TemporaryDirectory(prefix="redis-client-bench-") as tmp:
        server = EmbeddedRedis(Path(tmp))
        server.start()
        try:
            got = asyncio.run(measure(server.url, args.calls, args.rounds))
        finally:
            server.stop()
    ratio = got["alone_us"] / got["pipeline_us"]
    print(f"one-command pipeline   {got['pipeline_us']:7.1f} us of client CPU per round trip")
    print(f"the command alone      {got['alone_us']:7.1f} us of client CPU per round trip")
    print(f"ratio alone / pipeline {ratio:7.2f}  (median of {args.rounds} alternating rounds)")
    print(json.dumps({**{k: round(v, 1) for k, v in got.items()}, "ratio": round(ratio, 3)}))


if __name__ == "__main__":
    main()
