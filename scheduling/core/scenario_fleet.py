"""A scenario as the planner's fleet: the pools, links and traffic shares a scenario describes,
and its workload as the planner's length distributions.
Pure Python: no Django import here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scheduling.core.fleet import FleetSpec, PdPool, PrfaasPool
from scheduling.core.operating import WorkloadWindow
from scheduling.core.performance import (
    MIB,
    LengthDistribution,
    Table,
    kv_bytes,
    length_distribution,
)
from scheduling.core.prefix_cache import HybridPrefixCache, prefix_block_bytes, prefix_replay
from scheduling.core.queueing import moments
from scheduling.core.scenario import (
    Scenario,
    ScenarioError,
    empirical_from_lengths,
    workload_length_distributions,
)
from scheduling.core.trace import TraceError, TraceRow, trace_dequantize, trace_read

_GIB = float(1 << 30)


def fleet_from_scenario(scenario: Scenario) -> FleetSpec:
    """The fleet a scenario describes, with each PD cluster's traffic share."""
    origins = scenario.workload.origins if scenario.workload is not None else {}

    def cost(acc: str) -> float:
        return scenario.accelerator(acc).gpu_hour_cost

    prfaas = []
    pd = []
    for c in scenario.clusters:
        prof = scenario.profile_for(c.accelerator)
        table = Table.from_points(prof.prefill_seconds)
        if c.kind == "prfaas":
            prfaas.append(
                PrfaasPool(
                    c.name, c.prefill_instances, table, prof.gpus_per_instance, cost(c.accelerator)
                )
            )
        else:
            assert prof.decode is not None  # the reader guarantees it for pd clusters
            share = origins.get(c.name, 1.0 if len(scenario.pd_clusters) == 1 else 0.0)
            pd.append(
                PdPool(
                    c.name,
                    c.instances,
                    table,
                    prof.decode.max_batch,
                    prof.decode.step_seconds,
                    share,
                    prof.gpus_per_instance,
                    cost(c.accelerator),
                )
            )
    workload = scenario.workload
    # A trace's lengths are planned whole (its prefixes are hashed blocks, not a share).
    hit = workload.prefix_hit_fraction if workload is not None and workload.trace is None else 0
    return FleetSpec(
        Table.from_points(scenario.model.kv_cache_mib),
        tuple(prfaas),
        tuple(pd),
        scenario.links,
        prefix_hit=min(float(hit or 0.0), 1.0),
    )


#: A trace is planned in this many consecutive windows (of equal request counts) ...
TRACE_WINDOWS = 8
#: ... each of at least this many requests (fewer windows for a short trace): a window must
#: be long enough for its queues to settle, so that it can be predicted as a steady state.
TRACE_WINDOW_MIN_REQUESTS = 500


@dataclass(frozen=True)
class PlannedWorkload:
    """A scenario's workload as the planner plans it: the uncached input lengths and the
    outputs (mean, squared coefficient of variation) of all its requests, for which the
    setting is chosen; for a trace, the same per window (:data:`TRACE_WINDOWS`), for the
    capacity and prediction of a workload whose mix changes as it is replayed."""

    lengths: LengthDistribution
    output_tokens: float
    output_scv: float
    windows: tuple[WorkloadWindow, ...] = ()


def workload_planned(scenario: Scenario, *, skip_bad: bool = False) -> PlannedWorkload:
    """:class:`PlannedWorkload` of a scenario (``skip_bad``: a trace's unreadable rows are
    left out, as the simulator does when told to; else the first is named)."""
    workload = scenario.workload
    if workload is None:
        raise ScenarioError("workload", "required key is missing (the planner needs the traffic)")
    if workload.trace is not None:
        return trace_workload(scenario, trace_rows(scenario, skip_bad=skip_bad))
    inp, out = workload_length_distributions(workload, bin_tokens=16)
    hit = workload.prefix_hit_fraction or 0.0
    if hit >= 1.0:
        raise ScenarioError(
            "workload.prefix_hit_fraction", "every token cached leaves nothing to plan"
        )
    output = length_distribution(out)
    x, w = output.nodes()
    return PlannedWorkload(length_distribution(inp, scale=1.0 - hit), output.mean, moments(x, w)[1])


def workload_lengths(scenario: Scenario) -> tuple[LengthDistribution, float]:
    """The uncached input-length distribution and the mean output length of a scenario's
    workload (:func:`workload_planned`)."""
    planned = workload_planned(scenario)
    return planned.lengths, planned.output_tokens


def workload_output_scv(scenario: Scenario) -> float:
    """Squared coefficient of variation of the output lengths (decode times vary with them)."""
    if scenario.workload is None:
        return 0.0
    return workload_planned(scenario).output_scv


def trace_rows(scenario: Scenario, *, skip_bad: bool = False) -> Sequence[TraceRow]:
    """The rows of a scenario's trace, as the simulator replays them (``skip_bad``: skip the
    rows it cannot read, else name the first)."""
    if scenario.workload is None or scenario.workload.trace is None:
        raise ScenarioError("workload.trace", "the scenario has no trace")
    trace = scenario.workload.trace
    try:
        read = trace_read(
            trace.path, trace.format, skip_bad=skip_bad, block_tokens=scenario.model.block_tokens
        )
    except TraceError as exc:
        raise ScenarioError("workload.trace.path", str(exc)) from None
    return read.rows


def trace_workload(scenario: Scenario, rows: Sequence[TraceRow]) -> PlannedWorkload:
    """A trace as the planner plans it (:class:`PlannedWorkload`).

    A prompt's uncached length is what the fleet's prefix caches leave of it when the trace
    is replayed in order through one cache as large as all of them together (LRU, the
    hybrid model's checkpoint rule, :func:`scheduling.core.prefix_cache.prefix_replay`): the
    router sends each prompt where its prefix is cached, so the fleet hits what one pooled
    cache would. Counting every block seen before as cached instead ignores the checkpoint
    rule and plans a capacity the fleet does not reach. Rows without hash ids are planned
    whole.

    The windows are consecutive stretches of the replay: a trace's mix drifts (the Mooncake
    traces' early requests have longer outputs and colder caches than their late ones), and a
    rate the whole trace's mix sustains can overload its heaviest stretch."""
    if not rows or scenario.workload is None or scenario.workload.trace is None:
        raise ScenarioError("workload.trace.path", "the trace has no usable rows")
    block = scenario.model.block_tokens
    gib = sum(
        cluster.instances * spec.gib_per_instance
        for cluster in scenario.clusters
        if (spec := scenario.caches.get(cluster.name)) is not None
    )
    inputs = [row.input_tokens for row in rows]
    if gib > 0 and any(row.hash_ids for row in rows):
        kv_mib = Table.from_points(scenario.model.kv_cache_mib)
        state = scenario.model.linear_state_mib
        state_bytes = (max(0.0, float(kv_mib(0.0))) if state is None else state) * MIB

        def prefix_bytes(tokens: int) -> float:
            return max(0.0, float(kv_bytes(kv_mib, tokens)) - state_bytes) if tokens > 0 else 0.0

        blocks = max(inputs) // block + 1
        cache = HybridPrefixCache(
            gib * _GIB, prefix_block_bytes(prefix_bytes, block, blocks), state_bytes
        )
        inputs = prefix_replay(((r.input_tokens, r.hash_ids) for r in rows), cache, block)
    outputs = np.array([row.output_tokens for row in rows], dtype=float)
    arrivals = np.array(
        trace_dequantize([row.arrival_s for row in rows], scenario.workload.trace.dequantize)
    )
    span = float(arrivals[-1] - arrivals[0])
    count = max(1, min(TRACE_WINDOWS, len(rows) // TRACE_WINDOW_MIN_REQUESTS))
    windows = []
    for part in np.array_split(np.arange(len(rows)), count):
        lengths, output, scv = _lengths_of(np.asarray(inputs)[part], outputs[part])
        # Each window's own arrival rate against the trace's (1 where time does not tell).
        within = float(arrivals[part[-1]] - arrivals[part[0]])
        factor = (len(part) / within) / (len(rows) / span) if within > 0 and span > 0 else 1.0
        windows.append(
            WorkloadWindow(len(part) / len(rows), factor, lengths, output, scv, len(part))
        )
    lengths, output, scv = _lengths_of(np.asarray(inputs), outputs)
    return PlannedWorkload(lengths, output, scv, tuple(windows))


def _lengths_of(inputs: np.ndarray, outputs: np.ndarray) -> tuple[LengthDistribution, float, float]:
    output = float(outputs.mean())
    scv = float(outputs.var() / output**2) if output > 0 else 0.0
    return length_distribution(empirical_from_lengths(inputs, bin_tokens=16)), output, scv
