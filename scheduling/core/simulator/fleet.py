"""The simulated fleet: prefill instances with FCFS queues, decode instances with continuous
batching, and the requests flowing through them.

Every PD instance has a prefill and a decode personality sharing one name; its role says which
one is active, so the long-term loop can flip roles (drain, then flip) without renaming.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduling.core.prefix_cache import HybridPrefixCache

ACTIVE = "active"
DRAINING = "draining"
DOWN = "down"


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request's journey; times are seconds on the simulated clock (NaN until reached)."""

    index: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    origin: str
    hash_ids: tuple[int, ...] | None = None
    hinted_cached_tokens: int = 0
    route: str = ""
    reason: str = ""
    threshold: float = math.nan
    cached_tokens: int = 0
    incremental_tokens: int = 0
    prefill_instance: PrefillInstance | None = None
    decode_instance: DecodeInstance | None = None
    service_s: float = 0.0
    kv_bytes: float = 0.0
    cache_transfer_bytes: float = 0.0
    prefill_start_s: float = math.nan
    prefill_end_s: float = math.nan
    kv_ready_s: float = math.nan
    first_token_s: float = math.nan
    finish_s: float = math.nan
    dropped: str = ""
    link_key: str = ""
    cache_link_key: str = ""
    flow: object = None
    assigned_decode: DecodeInstance | None = None  # whose load counts it until decode starts


@dataclass(slots=True, eq=False)
class PrefillInstance:
    """A prefill-capable instance (PrfaaS, or the prefill side of a PD instance)."""

    name: str
    cluster: str
    kind: str  # "prfaas" or "pd"
    prefill_seconds: Callable[[float], float]
    cache: HybridPrefixCache | None
    state: str = ACTIVE
    queue: deque[SimRequest] = field(default_factory=deque)
    current: SimRequest | None = None
    busy_until: float = 0.0
    queued_work_s: float = 0.0
    busy_s: float = 0.0
    served: int = 0

    def backlog_s(self, now: float) -> float:
        """Seconds of work ahead of a request that joins the queue now."""
        remaining = self.busy_until - now if self.current is not None else 0.0
        return self.queued_work_s + max(0.0, remaining)

    def depth(self) -> int:
        return len(self.queue) + (self.current is not None)

    @property
    def idle(self) -> bool:
        return self.current is None and not self.queue


@dataclass(slots=True, eq=False)
class DecodeInstance:
    """A decode instance: up to ``max_batch`` requests decode together, one token per step."""

    name: str
    cluster: str
    max_batch: int
    step_s: float
    cache: HybridPrefixCache | None
    state: str = ACTIVE
    running: int = 0
    waiting: deque[SimRequest] = field(default_factory=deque)
    busy_slot_s: float = 0.0
    served: int = 0
    running_requests: set[SimRequest] = field(default_factory=set)
    # Requests routed here that have not started decoding (prefilling, in transfer, waiting):
    # what the engine reports as waiting, since it holds them from the decision on.
    assigned: int = 0

    def load(self) -> float:
        """Occupied share of the batch, counting requests waiting for a slot."""
        return (self.running + len(self.waiting)) / self.max_batch if self.max_batch else math.inf

    @property
    def idle(self) -> bool:
        return self.running == 0 and not self.waiting
