"""The prefix index's read path under two key layouts: today's, and fewer, larger buckets.

Most of Redis's time in a batch of route calls is the prefix-match script's walk: one
``redis.call('HGET', ...)`` per walked block, each block in a bucket of its own among 65,536
(``clusters/live/prefix_index.py``). The obvious alternative is fewer, larger buckets, so that
a batch's blocks can be gathered by bucket and read with one ``HMGET`` each. This bench answers
whether that pays, in one run against a private embedded Redis:

- layout ``walk``: today's keys (``pfx:h:`` + the block key's last 2 bytes, field = its first
  6 bytes, listpack-encoded small hashes); each chain is walked block by block up to its first
  miss, as the match script does;
- layout ``gather``: 256 buckets (``pfx:H:`` + the last byte, field = the first 7 bytes: large,
  hashtable-encoded hashes); every block of every chain is gathered by bucket and read with
  one ``HMGET`` per bucket, then each chain is walked in a Lua table.

Both hold ``--entries`` random 8-byte block keys with one 5-byte holder record each, and read
``--chains`` chains of ``--blocks`` blocks whose first ``--held`` are stored (the Mooncake batch
in ``bench/route_profile.py --redis`` walks about 12 blocks per request). The scripts model
each layout's read path (holder intersection left out: it is the same for both). Prints the
bytes of Redis memory per entry and Redis's own time per batch (INFO commandstats: inside the
server, I/O excluded), best and median of ``--rounds``; the last line is one JSON object.

    python bench/prefix_layout.py [--entries 300000] [--chains 500] [--blocks 20]
                                            [--held 12] [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from controlplane.embedded_redis import EmbeddedRedis  # noqa: E402

RECORD = b"\x00\x00\x01\x01\x00"  # instance id 1, full attention on GPU, epoch 0

WALK_LUA = """
local sub, call = string.sub, redis.call
local walked = 0
for c = 1, #ARGV do
  local packed = ARGV[c]
  for q = 1, #packed, 8 do
    local val = call('HGET', 'pfx:h:' .. sub(packed, q + 6, q + 7), sub(packed, q, q + 5))
    if not val then break end
    walked = walked + 1
  end
end
return walked
"""

GATHER_LUA = """
local sub, call = string.sub, redis.call
local by_bucket, order = {}, {}
for c = 1, #ARGV do
  local packed = ARGV[c]
  for q = 1, #packed, 8 do
    local b = sub(packed, q + 7, q + 7)
    local fields = by_bucket[b]
    if not fields then
      fields = {}
      by_bucket[b] = fields
      order[#order + 1] = b
    end
    fields[#fields + 1] = sub(packed, q, q + 6)
  end
end
local found = {}
for _, b in ipairs(order) do
  local fields = by_bucket[b]
  local vals = call('HMGET', 'pfx:H:' .. b, unpack(fields))
  for i, f in ipairs(fields) do found[f .. b] = vals[i] end
end
local walked = 0
for c = 1, #ARGV do
  local packed = ARGV[c]
  for q = 1, #packed, 8 do
    if not found[sub(packed, q, q + 7)] then break end
    walked = walked + 1
  end
end
return walked
"""

LAYOUTS = {"walk": WALK_LUA, "gather": GATHER_LUA}


def fill(client: redis.Redis, layout: str, keys: list[bytes]) -> float:
    """Store every key under ``layout``; Redis memory per entry (bytes)."""
    client.flushdb()
    before = int(client.info("memory")["used_memory"])
    pipe = client.pipeline(transaction=False)
    for i, k in enumerate(keys, start=1):
        if layout == "walk":
            pipe.hset(b"pfx:h:" + k[6:8], k[:6], RECORD)
        else:
            pipe.hset(b"pfx:H:" + k[7:8], k[:7], RECORD)
        if i % 5000 == 0:
            pipe.execute()
    pipe.execute()
    return (int(client.info("memory")["used_memory"]) - before) / len(keys)


def measure(client: redis.Redis, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    rng = random.Random(7)
    keys = [rng.randbytes(8) for _ in range(args.entries)]
    chains = [
        b"".join(
            [keys[rng.randrange(len(keys))] for _ in range(args.held)]
            + [rng.randbytes(8) for _ in range(args.blocks - args.held)]
        )
        for _ in range(args.chains)
    ]
    out: dict[str, dict[str, Any]] = {}
    for layout, source in LAYOUTS.items():
        per_entry = fill(client, layout, keys)
        sha = client.script_load(source)
        spent: list[float] = []
        walked = 0
        for _ in range(args.rounds):
            client.config_resetstat()
            walked = int(client.evalsha(sha, 0, *chains))
            spent.append(float(client.info("commandstats")["cmdstat_evalsha"]["usec"]))
        out[layout] = {
            "bytes_per_entry": round(per_entry, 1),
            "walked": walked,
            "best_ms": round(min(spent) / 1e3, 2),
            "median_ms": round(statistics.median(spent) / 1e3, 2),
        }
    client.flushdb()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=300_000)
    parser.add_argument("--chains", type=int, default=500)
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--held", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if min(args.entries, args.chains, args.blocks, args.rounds) < 1:
        parser.error("--entries, --chains, --blocks and --rounds must be at least 1")
    if not 0 <= args.held <= args.blocks:
        parser.error("--held must be between 0 and --blocks")
    with tempfile.TemporaryDirectory(prefix="prefix-layout-bench-") as tmp:
        server = EmbeddedRedis(Path(tmp))
        server.start()
        try:
            got = measure(redis.Redis.from_url(server.url), args)
        finally:
            server.stop()
    if got["walk"]["walked"] != got["gather"]["walked"]:
        raise SystemExit(f"the two layouts walked different blocks: {got}")
    for layout, row in got.items():
        print(
            f"{layout:7s} {row['bytes_per_entry']:6.1f} bytes per entry, Redis time per batch "
            f"of {args.chains} chains: best {row['best_ms']:.2f} ms, median {row['median_ms']:.2f}"
            f" ms ({row['walked']} blocks walked)"
        )
    ratio = got["gather"]["best_ms"] / got["walk"]["best_ms"]
    print(
        f"gather / walk: time {ratio:.2f} (best), memory "
        f"{got['gather']['bytes_per_entry'] / got['walk']['bytes_per_entry']:.2f}"
    )
    print(json.dumps({**got, "ratio_time_best": round(ratio, 3)}))


if __name__ == "__main__":
    main()
