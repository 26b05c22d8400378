"""Where live state lives in Redis: every key spelled here, once, with its hash tag.

Redis Cluster runs a script on one node and refuses keys of another slot, so every key a
script touches shares the script's hash tag (the part of a key in ``{}``; docs/operations.md,
"Redis"). The tags are chosen per concept, by what one script must see at once:

* **the prefix index by instance group**: an instance's entries, its meta hash, and the
  buckets its records sit in. A bucket holds the records of every instance of its group, so
  a lookup walks a chain once per group, not once per instance (decision cost grows with the
  groups, not with the fleet). An instance's group is a hash of its name, modulo
  ``PREFIX_INDEX_GROUPS`` (1 on a single Redis: one walk, as before sharding; on a cluster
  the number of masters: one walk per master);
* **reservations by link**: a link's in-flight bytes, their ends and their sum;
* **traffic windows by cluster**: a cluster's per-minute counters (the rebalancer reads one
  cluster's windows at a time). Counters of several slots (a flush of many clusters' windows,
  the metrics) are written by one script call per slot (:func:`slot_groups`).

A single Redis sees the same keys: one spelling, one code path for both.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

T = TypeVar("T")


@functools.cache
def _group_tags(groups: int) -> tuple[str, ...]:
    """A tag per group whose slot lies in the group's even share of the slot range: a cluster
    made by ``redis-cli --cluster create`` gives each master a contiguous, even range, so with
    groups a multiple of the masters every master holds as many groups (a hashed tag per group
    would put two of three on one master by chance)."""
    tags = []
    for g in range(groups):
        low = g * REDIS_CLUSTER_HASH_SLOTS // groups
        high = (g + 1) * REDIS_CLUSTER_HASH_SLOTS // groups
        n = 0
        while not low <= key_slot(f"pfx.{g}.{n}".encode()) < high:
            n += 1
        tags.append(f"pfx.{g}.{n}")
    return tuple(tags)


def prefix_group_of(instance: str, groups: int) -> int:
    """The index group of ``instance`` (stable across processes and restarts)."""
    if groups == 1:
        return 0
    return zlib.crc32(instance.encode()) % groups


def prefix_group_prefix(group: int, groups: int) -> str:
    """The prefix of every key of an index group, ``pfx:{tag}:``; the scripts take it as
    ``KEYS[1]`` and build the group's keys from it (layout in :mod:`clusters.live.prefix_index`)."""
    return f"pfx:{{{_group_tags(groups)[group]}}}:"


def prefix_group_prefixes(groups: int) -> list[str]:
    return [prefix_group_prefix(g, groups) for g in range(groups)]


def prefix_instance_prefix(instance: str, groups: int) -> str:
    return prefix_group_prefix(prefix_group_of(instance, groups), groups)


def reservation_keys(link: str) -> list[str]:
    """A link's reservations: ZSET id -> end, HASH id -> bytes, the bytes' sum (one tag)."""
    z = reservation_key(link)
    return [z, z + ":b", z + ":sum"]


def reservation_key(link: str) -> str:
    return f"live:resv:{{{link}}}"


def traffic_key(cluster: str, minute: int) -> str:
    """A cluster's traffic counters of one minute (``scheduling.traffic``)."""
    return f"traffic:{{{cluster}}}:{minute}"


def key_slot_of(key: str | bytes) -> int:
    return int(key_slot(key.encode() if isinstance(key, str) else key))


def slot_groups(
    items: Sequence[T], key_of: Callable[[T], str | bytes], cluster: bool
) -> list[list[T]]:
    """``items`` split by the hash slot of their key, in first-seen order and each group in
    the items' order; one group on a single Redis (one script call, as before sharding)."""
    if not cluster:
        return [list(items)] if items else []
    groups: dict[Hashable, list[T]] = {}
    for item in items:
        groups.setdefault(key_slot_of(key_of(item)), []).append(item)
    return list(groups.values())
