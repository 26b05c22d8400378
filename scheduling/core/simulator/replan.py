"""The long-term loop of ``prfaas-dual`` on the simulated clock.

:class:`PlannerReplanner` is the default :class:`~scheduling.core.simulator.routing.Replanner`: at
every tick it hands the rebalancer's pure decision (:func:`scheduling.core.rebalancer.rebalance_decide`,
with its guards: dead band, bounded steps, persistence, cool-down, reversal limit) the traffic
window the simulated route path observed, and the rebalancer's own planner port
(:class:`scheduling.core.rebalancer.FleetPlanner`, the one the Celery tick uses), which evaluates
settings with the project's planner on the window's empirical incremental-length distribution.
Its answer (new threshold, roles to flip) is applied through drain-then-flip by the engine.

With several PD clusters each is planned on its own (with the PrfaaS pools linked to it, in
full), a simplification of the joint plan that the per-request controller corrects at run time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scheduling.core import rebalancer
from scheduling.core.kinds import InstanceRole
from scheduling.core.planner import fleet_from_scenario
from scheduling.core.scenario import Scenario, empirical_from_lengths
from scheduling.core.simulator.routing import Replan, ReplanInput


@dataclass(eq=False)
class PlannerReplanner:
    """Re-plans each PD cluster from the observed window with the rebalancer's decision."""

    scenario: Scenario
    guards: rebalancer.RebalanceGuards = field(default_factory=rebalancer.RebalanceGuards)
    histogram_bin_tokens: float = 256.0
    history: dict[str, rebalancer.History] = field(default_factory=dict)
    # Every tick's decision, held or proposed, for reports and tests: (time, cluster, decision).
    decisions: list[tuple[float, str, rebalancer.RebalanceDecision]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._fleet = fleet_from_scenario(self.scenario)

    def window(self, inp: ReplanInput) -> rebalancer.TrafficSummary:
        requests = inp.requests
        lengths = [r.incremental_tokens or r.input_tokens for r in requests if r.route]
        points = (
            empirical_from_lengths(lengths, bin_tokens=self.histogram_bin_tokens).points
            if lengths
            else ()
        )
        outputs = [r.output_tokens for r in requests]
        duration = max(inp.now - inp.window_start_s, 1e-9)
        return rebalancer.TrafficSummary(
            start_s=inp.window_start_s,
            end_s=inp.now,
            arrivals=len(requests),
            offloads=sum(1 for r in requests if r.route == "prfaas"),
            incremental_tokens=tuple(points),
            output_tokens_mean=sum(outputs) / len(outputs) if outputs else None,
            cache_hit_tokens=float(sum(r.cached_tokens for r in requests)),
            prompt_tokens=float(sum(r.input_tokens for r in requests)),
            samples=max(1, int(duration // 60)),
            bucket_s=60.0,
            recorder_seen_at=inp.now,
        )

    def replan(self, inp: ReplanInput) -> Replan | None:
        instances = tuple(
            rebalancer.InstanceView(
                name, InstanceRole.PREFILL, "active", load=inp.loads.get(name, 0.0), seen_at=inp.now
            )
            for name in inp.prefill
        ) + tuple(
            rebalancer.InstanceView(
                name, InstanceRole.DECODE, "active", load=inp.loads.get(name, 0.0), seen_at=inp.now
            )
            for name in inp.decode
        )
        history = self.history.get(inp.cluster, rebalancer.History())
        threshold = inp.threshold if math.isfinite(inp.threshold) else 0.0
        decision = rebalancer.rebalance_decide(
            rebalancer.RebalanceInput(
                cluster=inp.cluster,
                now=inp.now,
                window=self.window(inp),
                instances=instances,
                threshold=threshold,
                guards=self.guards,
                history=history,
            ),
            rebalancer.FleetPlanner(self._fleet, inp.cluster, at_rate=False),
        )
        applied = decision.action == "propose"
        self.history[inp.cluster] = rebalancer.history_after(history, decision, inp.now, applied)
        self.decisions.append((inp.now, inp.cluster, decision))
        if not applied or decision.proposed is None:
            return None
        return Replan(
            threshold=decision.proposed.setting.threshold,
            flips=tuple((c.instance, c.to_role) for c in decision.role_changes),
        )
