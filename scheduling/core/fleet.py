"""The fleet as the planner and its predictions see it: PrfaaS pools, PD pools and the links
between them, with each link's admission limits (:mod:`scheduling.core.link`).

Pure frozen dataclasses (no Django). :func:`scheduling.core.planner.fleet_from_scenario` builds one
from a scenario file, the rebalancer from the inventory; ``scheduling.core.planner`` re-exports
these names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import ArrayLike

from scheduling.core.link import Link
from scheduling.core.performance import FloatArray, LengthDistribution, Table


@dataclass(frozen=True)
class PrfaasPool:
    """A PrfaaS cluster as the planner sees it: prefill-only instances of one accelerator."""

    name: str
    instances: int
    prefill: Table
    gpus_per_instance: int = 8
    gpu_hour_cost: float = 1.0


@dataclass(frozen=True)
class PdPool:
    """A PD cluster as the planner sees it: ``instances`` to split between prefill and
    decode, and the share of the total traffic that arrives there."""

    name: str
    instances: int
    prefill: Table
    max_batch: int
    step_seconds: float
    share: float = 1.0
    gpus_per_instance: int = 8
    gpu_hour_cost: float = 1.0


@dataclass(frozen=True)
class FleetSpec:
    """Everything about the hardware the model needs, wherever it was read from."""

    kv_mib: Table
    prfaas: tuple[PrfaasPool, ...]
    pd: tuple[PdPool, ...]
    links: tuple[Link, ...] = ()
    #: Share of every prompt its origin PD cluster holds cached (the lengths the planner is
    #: given are the uncached rest): an offload's PrfaaS prefill needs that prefix, moved
    #: over the link when bandwidth is abundant, else prefilled again (the router's rule).
    prefix_hit: float = 0.0

    def prefix_tokens(self, uncached: ArrayLike) -> FloatArray:
        """The cached prefix of prompts whose uncached part is ``uncached`` tokens."""
        h = self.prefix_hit
        return np.asarray(uncached, dtype=float) * (h / (1.0 - h) if h < 1.0 else np.inf)

    def link_gbps(self, source: str, target: str) -> float:
        return sum(
            link.gbps for link in self.links if link.source == source and link.target == target
        )

    def usable_gbps(self, source: str, target: str) -> float:
        """Egress the planner may plan from ``source`` to ``target`` (each link's target share
        of its line rate)."""
        return sum(
            link.usable_gbps
            for link in self.links
            if link.source == source and link.target == target
        )

    def link(self, source: str, target: str) -> Link | None:
        """The link ``source -> target`` (the first listed, if several), or None."""
        for link in self.links:
            if link.source == source and link.target == target:
                return link
        return None

    def pd_pool(self, name: str) -> PdPool:
        for pool in self.pd:
            if pool.name == name:
                return pool
        raise KeyError(name)


#: One length distribution for every PD cluster, or one per PD cluster (by name).
Lengths = LengthDistribution | Mapping[str, LengthDistribution]


def lengths_of(lengths: Lengths, cluster: str) -> LengthDistribution:
    """The uncached length distribution of the traffic arriving at ``cluster``."""
    if isinstance(lengths, Mapping):
        try:
            return lengths[cluster]
        except KeyError:
            raise ValueError(f"no length distribution for {cluster}") from None
    return lengths


def reference_pd(fleet: FleetSpec) -> PdPool:
    return max(fleet.pd, key=lambda c: (c.instances, -fleet.pd.index(c)))


def fleet_gpus(fleet: FleetSpec) -> int:
    return sum(j.instances * j.gpus_per_instance for j in fleet.prfaas) + sum(
        c.instances * c.gpus_per_instance for c in fleet.pd
    )


def fleet_cost(fleet: FleetSpec) -> float:
    return sum(j.instances * j.gpus_per_instance * j.gpu_hour_cost for j in fleet.prfaas) + sum(
        c.instances * c.gpus_per_instance * c.gpu_hour_cost for c in fleet.pd
    )


def homogeneous_fleet(fleet: FleetSpec, instances: int) -> FleetSpec:
    """One PD cluster of the PD accelerator (that of the largest PD cluster) holding all the
    traffic: what the fleet would be without PrfaaS."""
    ref = reference_pd(fleet)
    pool = replace(ref, name="homogeneous", instances=instances, share=1.0)
    return FleetSpec(fleet.kv_mib, (), (pool,), ())
