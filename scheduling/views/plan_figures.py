"""The figures of a plan's page, like with like: every row one quantity in one clock, its
predicted, simulated and observed values each over a stated window.

* **Predicted**: the throughput model's figures for the proposed setting, for the traffic of
  the rebalancer's window (``plan.inputs["window"]``: its start, end and requests; the
  offered rate is what the planner planned for).
* **Simulated**: the proposal check's run of the proposed setting at that traffic's rate
  (``plan.simulated``; a run at a rate neither setting carries says so).
* **Observed**: what the fleet did after the apply (``rebalance.plan_observed``: the traffic
  store from the first whole minute after it; the engines' service counters for what was
  served and its TTFTs), shown once the window holds enough to mean something.

Rates are per second of the fleet's clock (``FLEET_CLOCK_SPEED``); the windows are
wall-clock times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.conf import settings

from scheduling import alerts, rebalance
from scheduling.core.simulator.verify import (
    SettingRun,
    overloaded,
    overloaded_detail,
    run_from_dict,
)
from scheduling.models import Plan

# An observed figure means something once its window holds this much: a whole minute of the
# traffic store and this many requests for rates and shares (a share of 100 requests is
# within about +-10 points), this many first tokens for a TTFT P90 (its tenth-from-top
# request is then one of at least ten).
OBSERVED_MIN_S = 60.0
OBSERVED_MIN_REQUESTS = 100
OBSERVED_MIN_FIRST_TOKENS = 100

NOT_ENOUGH = "not enough data"
NOT_APPLIED = "not applied"
NOT_SIMULATED = "not simulated"
NOT_PREDICTED = "not predicted"
NONE = "\u2013"  # an en dash: a figure that does not exist


@dataclass(frozen=True)
class Cell:
    """One figure, or why there is none (``note``)."""

    value: float | None
    note: str = ""
    flag: str = ""


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    unit: str
    digits: int
    predicted: Cell
    simulated: Cell
    observed: Cell


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _cell(value: Any, note: str) -> Cell:
    number = _num(value)
    return Cell(number) if number is not None else Cell(None, note)


def _utc(ts: float | None) -> str:
    if ts is None:
        return NONE
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


def planned_window(plan: Plan) -> dict[str, Any] | None:
    """The rebalancer's window the plan was made for: start, end, requests, offered rate."""
    window = plan.inputs.get("window") if isinstance(plan.inputs, dict) else None
    if not isinstance(window, dict):
        return None
    start, end = _num(window.get("start_s")), _num(window.get("end_s"))
    arrivals = int(window.get("arrivals") or 0)
    clock = _num(window.get("clock_speed")) or 1.0
    if start is None or end is None or end <= start:
        return None
    return {
        "start": start,
        "end": end,
        "start_utc": _utc(start),
        "end_utc": _utc(end),
        "arrivals": arrivals,
        "offered_rps": arrivals / (end - start) / clock,
    }


def simulated_runs(plan: Plan) -> dict[str, tuple[SettingRun, SettingRun]]:
    """The proposal check's runs, by situation: (current, proposed)."""
    sim = plan.simulated or {}
    out = {}
    for situation in ("observed", "stress"):
        pair = sim.get(situation)
        if isinstance(pair, dict) and pair.get("current") and pair.get("proposed"):
            out[situation] = (run_from_dict(pair["current"]), run_from_dict(pair["proposed"]))
    return out


def _at_planned_rate(
    runs: dict[str, tuple[SettingRun, SettingRun]],
) -> tuple[SettingRun, SettingRun] | None:
    """The run at the planned offered rate: the observed-rate one; without it, the stress
    one, which the check runs alone exactly when the stress rate is within 5% of the observed
    rate (or below it: then at the observed rate)."""
    return runs.get("observed") or runs.get("stress")


def simulation_verdict(plan: Plan) -> str:
    """What the simulation showed, in words that follow from its numbers."""
    sim = plan.simulated or {}
    if not sim:
        return "Not simulated."
    runs = simulated_runs(plan)
    for situation in ("observed", "stress"):
        pair = runs.get(situation)
        if pair is not None and overloaded(*pair):
            carried_now = pair[0].rate_rps * pair[0].sustained_fraction
            carried = pair[1].rate_rps * pair[1].sustained_fraction
            judged = (
                "so it carries more, but neither serves this load"
                if carried > carried_now
                else "no gain at this load"
            )
            return f"Overloaded: {overloaded_detail(*pair)}; {judged}."
    if sim.get("confirmed") is None:
        return f"Unconfirmed: {sim.get('detail', 'cut short')}."
    verdict = "Confirmed" if sim.get("confirmed") else "Not confirmed"
    return f"{verdict}: {sim.get('detail', '')}."


def outcome_rows(plan: Plan, observed: dict[str, Any] | None) -> list[Row]:
    """Predicted, simulated and observed-after-apply figures of the proposed setting."""
    proposed = plan.predictions.get("proposed") or {}
    planned = planned_window(plan)
    offered = planned["offered_rps"] if planned else None
    run = _at_planned_rate(simulated_runs(plan))
    sim = run[1] if run is not None else None
    sim_over = run is not None and overloaded(*run)
    service = None
    if observed is not None and observed.get("since_s", 0) > 0:
        service = alerts.service_between(plan.cluster.name, observed["start"], observed["end"])

    def seen(key: str) -> Cell:
        if observed is None:
            return Cell(None, NOT_APPLIED)
        enough = (
            observed["since_s"] >= OBSERVED_MIN_S and observed["arrivals"] >= OBSERVED_MIN_REQUESTS
        )
        return _cell(observed.get(key), NONE) if enough else Cell(None, NOT_ENOUGH)

    def served(value: float | None) -> Cell:
        if observed is None:
            return Cell(None, NOT_APPLIED)
        if service is None or service.first_tokens < OBSERVED_MIN_FIRST_TOKENS:
            return Cell(None, NOT_ENOUGH)
        return _cell(value, NONE)

    def simulated(value: float | None) -> Cell:
        if sim is None:
            return Cell(None, NOT_SIMULATED)
        cell = _cell(value, NONE)
        return Cell(cell.value, cell.note, "overloaded run" if sim_over else "")

    capacity = _num(proposed.get("capacity_rps"))
    at_rate_p90 = proposed.get("at_rate_ttft_p90_s")
    p90_note = (
        "overloaded: no steady state"
        if capacity is not None and offered is not None and offered >= capacity
        else NOT_PREDICTED
    )
    carried_sim = sim.rate_rps * sim.sustained_fraction if sim is not None else None
    speed = float(settings.FLEET_CLOCK_SPEED)
    first_tokens_rate = (
        service.first_tokens / (service.end - service.start) / speed
        if service is not None and service.end > service.start
        else None
    )
    predicted_refusal = rebalance.plan_predicted_refusal(plan)
    return [
        Row(
            "offered_rps",
            "Offered rate",
            "req/s",
            3,
            _cell(offered, NOT_PREDICTED),
            simulated(sim.rate_rps if sim else None),
            seen("offered_rps"),
        ),
        Row(
            "carried_rps",
            "Served rate (first tokens)",
            "req/s",
            3,
            _cell(proposed.get("throughput_rps"), NOT_PREDICTED),
            simulated(carried_sim),
            served(first_tokens_rate),
        ),
        Row(
            "ttft_p90_s",
            "TTFT P90 at the offered rate",
            "s",
            3,
            _cell(at_rate_p90, p90_note),
            simulated(sim.ttft_p90_s if sim else None),
            served(service.ttft_p90_s if service else None),
        ),
        Row(
            "offload_fraction",
            "Offloaded",
            "share of requests",
            3,
            _cell(proposed.get("offload_fraction"), NOT_PREDICTED),
            Cell(None, NOT_SIMULATED if sim is None else "not counted"),
            seen("offload_fraction"),
        ),
        Row(
            "link_congested",
            "link_congested decisions",
            "share of requests",
            3,
            Cell(None, NOT_PREDICTED),
            simulated(sim.link_congested if sim else None),
            seen("link_congested"),
        ),
        Row(
            "refused_share",
            "Offloads the link guard kept local",
            "share of offloads offered",
            3,
            _cell(predicted_refusal, NOT_PREDICTED),
            Cell(None, NOT_SIMULATED if sim is None else "not counted"),
            seen("refused_share"),
        ),
        Row(
            "egress_gbps",
            "Cross-DC egress",
            "Gbps, mean",
            2,
            _cell(proposed.get("egress_gbps"), NOT_PREDICTED),
            Cell(None, NOT_SIMULATED if sim is None else "not counted"),
            seen("egress_gbps"),
        ),
    ]


def outcome_windows(plan: Plan, observed: dict[str, Any] | None) -> dict[str, str]:
    """The window each column's figures cover, in words."""
    planned = planned_window(plan)
    run = _at_planned_rate(simulated_runs(plan))
    predicted = (
        f"for the traffic of {planned['start_utc']} to {planned['end_utc']} UTC "
        f"({planned['arrivals']} requests)"
        if planned
        else "for the rebalancer's window"
    )
    simulated = (
        f"{run[1].requests} requests drawn from that traffic, at its rate"
        if run is not None
        else "no run at that traffic's rate"
    )
    if observed is None:
        seen = "once the plan is applied"
    else:
        seen = (
            f"{_utc(observed['start'])} to {_utc(observed['end'])} UTC "
            f"({observed['since_s']:.0f} s from the first whole minute after the apply, "
            f"{observed['arrivals']} requests)"
        )
    return {"predicted": predicted, "simulated": simulated, "observed": seen}


def fleet_clock_note() -> str:
    speed = float(settings.FLEET_CLOCK_SPEED)
    if speed == 1:
        return "Rates per second; windows in UTC."
    return (
        f"Rates per second of the fleet's clock, which runs {speed:g}x the wall clock here "
        "(FLEET_CLOCK_SPEED: an emulated fleet); windows are wall-clock times in UTC."
    )


def simulated_rows(plan: Plan) -> list[dict[str, Any]]:
    """The simulation of both settings, per situation, next to the model's prediction of the
    same figure at the same rate where it has one (only at the planned rate)."""
    runs = simulated_runs(plan)
    current = plan.predictions.get("current") or {}
    proposed = plan.predictions.get("proposed") or {}
    at_planned = _at_planned_rate(runs)
    out = []
    for situation in ("observed", "stress"):
        pair = runs.get(situation)
        if pair is None:
            continue
        cur, new = pair
        at_rate = pair is at_planned
        title = (
            f"at the planned rate, {cur.rate_rps:.2f} req/s"
            if at_rate
            else f"near the current capacity, {cur.rate_rps:.2f} req/s"
        )
        if overloaded(cur, new):
            title += ": more than either setting carries"
        figures = (
            (
                "Sustained",
                "share of offered",
                3,
                cur.sustained_fraction,
                new.sustained_fraction,
                None,
            ),
            (
                "Served rate",
                "req/s",
                3,
                cur.rate_rps * cur.sustained_fraction,
                new.rate_rps * new.sustained_fraction,
                ("throughput_rps", "throughput_rps") if at_rate else None,
            ),
            (
                "TTFT P90",
                "s",
                3,
                cur.ttft_p90_s,
                new.ttft_p90_s,
                ("at_rate_ttft_p90_s", "at_rate_ttft_p90_s") if at_rate else None,
            ),
            (
                "link_congested",
                "share of requests",
                3,
                cur.link_congested,
                new.link_congested,
                None,
            ),
        )
        for label, unit, digits, now_value, new_value, predicted in figures:
            out.append(
                {
                    "situation": title,
                    "label": label,
                    "unit": unit,
                    "digits": digits,
                    "current": _num(now_value),
                    "proposed": _num(new_value),
                    "predicted_current": _num(current.get(predicted[0])) if predicted else None,
                    "predicted_proposed": _num(proposed.get(predicted[1])) if predicted else None,
                }
            )
    return out
