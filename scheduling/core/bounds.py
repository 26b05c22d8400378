"""Physical bounds of every physical quantity in the inventory.

A number outside these is not a deployment but a typo or an attack: ``gbps: 1e308`` once made
the router's budget overflow (``int(inf)``) and took routing down in every process that
rebuilt its snapshot. The same bounds are used by the API schemas, the model validators, the
database CHECK constraints (migrations repeat the numbers), topology as code (the scenario
reader) and the snapshot builder, which leaves an out-of-bound row out instead of failing.

The limits are generous: an order of magnitude or more beyond today's hardware, so that no
real fleet hits them, and small enough that every product the router and the planner form
(bytes = Gbps x seconds, MiB x tokens, ...) stays a finite float and a 64-bit integer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MIB = 2**20


@dataclass(frozen=True)
class Bound:
    """``low <= value <= high`` (``low < value`` when ``low_open``), finite."""

    name: str
    low: float
    high: float
    unit: str
    low_open: bool = False

    def error(self, value: Any) -> str | None:
        """What is wrong with ``value``, or None when it is within the bound."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return "must be a number"
        if not math.isfinite(value):
            return "must be a finite number"
        if self.low_open and value <= self.low and self.low == 0:
            return "must be positive"
        if self.low_open and value <= self.low:
            return f"must be greater than {self.low:g} {self.unit}".rstrip()
        if value < self.low and self.low == 0:
            return "must not be negative"
        if value < self.low:
            return f"must be at least {self.low:g} {self.unit}".rstrip()
        if value > self.high:
            return f"must be at most {self.high:g} {self.unit}".rstrip()
        return None

    @property
    def schema(self) -> dict[str, float]:
        """The keyword arguments of a pydantic ``Field`` saying the same."""
        low = {"gt": self.low} if self.low_open else {"ge": self.low}
        return {**low, "le": self.high}


#: Link capacity: 0 (down) to 100 Tbit/s (ten 800G optics x 10 is still far below).
LINK_GBPS = Bound("gbps", 0.0, 100_000.0, "Gbps")
#: Round trip: 0 to 10 s (a geostationary hop is 0.6 s).
LINK_RTT_MS = Bound("rtt_ms", 0.0, 10_000.0, "ms")
#: In-flight KV budget of a link: up to 1 PiB.
LINK_KV_BUDGET_BYTES = Bound("kv_budget_bytes", 0.0, float(2**50), "bytes", low_open=True)
#: Same, as the scenario spells it.
LINK_KV_BUDGET_MIB = Bound("kv_budget_mib", 0.0, float(2**30), "MiB", low_open=True)
LINK_TARGET_UTILISATION = Bound("target_utilisation", 0.0, 1.0, "", low_open=True)
#: Relative price of a GPU-hour.
GPU_HOUR_COST = Bound("gpu_hour_cost", 0.0, 1e6, "", low_open=True)
#: Prefix-cache block: 1 to 64 Ki tokens.
BLOCK_TOKENS = Bound("block_tokens", 1, 65_536, "tokens")
#: Context length of a table row: 1 to 100 M tokens.
TABLE_TOKENS = Bound("tokens", 1, 100_000_000, "tokens")
#: KVCache of one prefill: up to 16 TiB.
KV_CACHE_MIB = Bound("kv_cache_mib", 0.0, float(2**24), "MiB", low_open=True)
LINEAR_STATE_MIB = Bound("linear_state_mib", 0.0, float(2**24), "MiB")
#: GPUs of one instance: 1 to 4096.
GPUS_PER_INSTANCE = Bound("gpus_per_instance", 1, 4096, "GPUs")
#: One prefill takes at most a day.
PREFILL_SECONDS = Bound("prefill_seconds", 0.0, 86_400.0, "s", low_open=True)
DECODE_MAX_BATCH = Bound("decode_max_batch", 1, 1_000_000, "requests")
DECODE_STEP_SECONDS = Bound("decode_step_seconds", 0.0, 60.0, "s", low_open=True)
#: Instances of one cluster in a scenario.
CLUSTER_INSTANCES = Bound("instances", 0, 100_000, "instances")


def table_bound_errors(table: Any, values: Bound) -> list[str]:
    """Bound problems of a ``[[tokens, value], ...]`` table, each naming the entry."""
    errors: list[str] = []
    if not isinstance(table, list | tuple):
        return errors
    for i, point in enumerate(table):
        if not isinstance(point, list | tuple) or len(point) != 2:
            continue
        for j, bound in ((0, TABLE_TOKENS), (1, values)):
            problem = bound.error(point[j])
            if problem is not None:
                errors.append(f"[{i}][{j}]: {problem}")
    return errors
