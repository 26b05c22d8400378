"""What the planner returns (:mod:`scheduling.core.planner`): one PD cluster at one setting,
the model at one setting, and a whole plan with its baselines. Frozen dataclasses, no logic
beyond lookups; the planner re-exports them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from scheduling.core.operating import OperatingPoint

#: The share of its capacity a fleet is planned to run at: link admission (budget refusals,
#: PrfaaS queueing of reserved bytes) is judged there, and ``at_load`` predicted there.
DEFAULT_LOAD = 0.8


@dataclass(frozen=True)
class ClusterResult:
    """One PD cluster at one setting. Thetas are absolute rates in req/s, as in the paper:
    ``theta_prfaas`` is what the PrfaaS stage can take of this cluster's offloaded traffic."""

    name: str
    share: float
    threshold_tokens: float
    offload_fraction: float
    l_long: float | None
    l_short: float | None
    n_p: int
    n_d: int
    theta_prfaas: float | None
    theta_pd_p: float | None
    theta_pd_d: float
    throughput_rps: float
    egress_gbps: float
    link_gbps: float
    ttft_mean_s: float
    ttft_p90_s: float
    #: share of its requests the links always refuse (no link may carry them): prefilled
    #: locally, each one a ``link_congested`` decision
    refused_fraction: float = 0.0


@dataclass(frozen=True)
class Evaluation:
    """The model at one setting: Lambda_max, every stage's bound on it and the bottleneck."""

    throughput_rps: float
    bottleneck: str
    bottleneck_at: str
    stage_bounds: Mapping[str, float]
    clusters: tuple[ClusterResult, ...]
    n_prfaas: int
    egress_gbps: float
    ttft_mean_s: float
    ttft_p90_s: float
    load: float = DEFAULT_LOAD

    def cluster(self, name: str) -> ClusterResult:
        for c in self.clusters:
            if c.name == name:
                return c
        raise KeyError(name)


@dataclass(frozen=True)
class PlanResult:
    """The optimum and the paper's three baselines, with the throughput gains over each."""

    prfaas: Evaluation
    homogeneous: Evaluation
    naive_heterogeneous: Evaluation
    equal_cost_homogeneous: Evaluation
    homogeneous_instances: int
    equal_cost_instances: int
    gains: Mapping[str, float | None]
    threshold_step: float
    output_tokens: float
    mean_input_tokens: float
    #: the optimum's queue-aware prediction at ``load`` x its Lambda_max (for a workload in
    #: windows, at ``load`` x ``window_capacity_rps``)
    at_load: OperatingPoint | None = None
    #: a workload in windows (a trace): the mean rate at which every window is sustained at
    #: the optimum's setting (its heaviest window bounds it)
    window_capacity_rps: float | None = None
