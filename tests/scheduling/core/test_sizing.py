"""Sizing advice: which change raises a fleet's rate, by how much."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduling.core.performance import LengthDistribution
from scheduling.core.planner import FleetSpec, plan_fleet
from scheduling.core.sizing import Sizing, sizing_advice

#: The case study's fleet, prompt lengths and output tokens (the ``case`` fixture, conftest).
Case = tuple[FleetSpec, LengthDistribution, float]


def test_more_prfaas_instances_raise_a_compute_bound_plan_and_more_gbps_does_not(
    case: Case,
) -> None:
    fleet, lengths, out = case

    def planned(f: FleetSpec) -> Sizing:
        return Sizing(plan_fleet(f, lengths, out).throughput_rps, 0.0)

    base, advice = sizing_advice(fleet, planned)
    assert base.rate_rps == pytest.approx(planned(fleet).rate_rps)
    kinds = {a.kind for a in advice}
    assert kinds == {"prfaas_instances"}  # the case study's link carries 13% of 100 Gbps
    gains = {a.amount: a.gain for a in advice}
    assert 0 < gains[1] < gains[2] < gains[4]
    assert all(a.rate_rps > base.rate_rps for a in advice)


def test_a_thin_link_is_where_the_advice_points(case: Case) -> None:
    fleet, lengths, out = case
    thin = replace(fleet, links=tuple(replace(link, gbps=10.0) for link in fleet.links))

    def planned(f: FleetSpec) -> Sizing:
        return Sizing(plan_fleet(f, lengths, out).throughput_rps, 0.0)

    _, advice = sizing_advice(thin, planned)
    assert advice and advice[0].kind == "link_gbps"
