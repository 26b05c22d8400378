"""The counters script: a call's hash counters and its capped recent-entries list in ONE
command (run like every script, :mod:`controlplane.redis_scripts`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from clusters.live.keys import slot_groups
from controlplane.redis_connection import live_store_is_cluster
from controlplane.redis_scripts import lua_script

# Hash counters and a capped list in ONE command: a call's traffic and metrics counters and
# its recent-decisions entries, instead of one HINCRBY/EXPIRE/LPUSH each (redis-py's
# per-command cost dominated the route call). ARGV: list key, list cap, the number of integer
# rows, the number of float rows, then the rows (key, field, incr, ttl_s or 0), then the
# entries to push in order.
_COUNTERS_LUA = """
local list_key, list_cap = ARGV[1], tonumber(ARGV[2])
local n_int, n_float = tonumber(ARGV[3]), tonumber(ARGV[4])
local pos = 5
for i = 1, n_int + n_float do
  local key, field, incr, ttl = ARGV[pos], ARGV[pos + 1], ARGV[pos + 2], tonumber(ARGV[pos + 3])
  if i <= n_int then
    redis.call('HINCRBY', key, field, incr)
  else
    redis.call('HINCRBYFLOAT', key, field, incr)
  end
  if ttl > 0 then redis.call('EXPIRE', key, ttl) end
  pos = pos + 4
end
if pos <= #ARGV then
  for i = pos, #ARGV do redis.call('LPUSH', list_key, ARGV[i]) end
  redis.call('LTRIM', list_key, 0, list_cap - 1)
end
return 0
"""
COUNTERS_SCRIPT = lua_script(_COUNTERS_LUA, "counters")

Increment = tuple[str, str, Any, int]


def counters_queue(
    pipe: Any,
    ints: Sequence[Increment],
    floats: Sequence[Increment] = (),
    list_key: str = "",
    list_cap: int = 1,
    entries: Sequence[str] = (),
) -> None:
    """Queue one EVALSHA applying ``(key, field, incr, ttl_s or 0)`` hash increments (integer
    ones, then float ones) and pushing ``entries`` (in order) onto the capped ``list_key``;
    on a cluster one per hash slot the keys fall in (a script runs in one slot), each naming
    a key of its slot as ``KEYS[1]`` so that it is sent to that slot's node."""
    if not ints and not floats and not entries:
        return
    # (kind, key, field, incr, ttl): kind 0 integer, 1 float, 2 the list's entries
    rows: list[tuple[int, str, Any, Any, int]] = [(0, *row) for row in ints]
    rows += [(1, *row) for row in floats]
    if entries:
        rows.append((2, list_key, "", 0, 0))
    for group in slot_groups(rows, lambda row: row[1], live_store_is_cluster()):
        pushes = any(row[0] == 2 for row in group)
        g_ints = [row[1:] for row in group if row[0] == 0]
        g_floats = [row[1:] for row in group if row[0] == 1]
        args: list[Any] = [
            list_key if pushes else "live:nolist",
            list_cap,
            len(g_ints),
            len(g_floats),
        ]
        for key, name, incr, ttl in g_ints:
            args += [key, name, int(incr), ttl]
        for key, name, incr, ttl in g_floats:
            args += [key, name, repr(float(incr)), ttl]
        if pushes:
            args += entries
        COUNTERS_SCRIPT.queue(pipe, [group[0][1]], args)
