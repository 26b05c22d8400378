"""The requests a simulation replays: Poisson arrivals drawn from a scenario's distributions,
or the rows of a trace.

Randomness comes from one ``numpy.random.Generator`` seeded by the caller. Arrival times are
drawn as unit-rate exponential gaps mapped through the inverse of the cumulative arrival
intensity, and lengths by inverse-transform sampling (the distributions' own quantile
functions), so runs that differ only in rate reuse the same random numbers (common random
numbers): a capacity search then compares like with like.

Phases change the rate and the length distributions; a ``ramp`` phase moves linearly from the
previous phase's values: the rate is interpolated, and lengths interpolate the two quantile
functions at the same uniform draw. ``{cluster, rate_scale}`` events scale one origin's
traffic from their time on. ``prefix_hit_fraction`` (distributions only) marks that share of
each prompt as already cached in its origin PD cluster.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scheduling.core.performance import LengthDistribution, length_distribution
from scheduling.core.scenario import RateEvent, Scenario, ScenarioError, WorkloadSpec
from scheduling.core.trace import trace_dequantize, trace_read


class WorkloadError(ValueError):
    """The scenario's workload cannot be simulated as asked (message says why)."""


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to replay: when and where it arrives, its lengths and prefix blocks."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    origin: str
    hash_ids: tuple[int, ...] | None = None
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests sorted by arrival, and what the reader had to skip (trace line numbers)."""

    requests: tuple[RequestSpec, ...]
    skipped_lines: tuple[int, ...] = ()
    base_rate_per_s: float = 0.0

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0


@dataclass(frozen=True, slots=True)
class _Segment:
    """A stretch of the arrival schedule with linear rate and length interpolation."""

    start_s: float
    end_s: float
    rate_from: float
    rate_to: float
    input_from: LengthDistribution
    input_to: LengthDistribution
    output_from: LengthDistribution
    output_to: LengthDistribution
    hit_from: float
    hit_to: float

    def share(self, t: float) -> float:
        if not math.isfinite(self.end_s) or self.end_s <= self.start_s:
            return 1.0
        return min(1.0, max(0.0, (t - self.start_s) / (self.end_s - self.start_s)))

    def rate(self, t: float) -> float:
        return self.rate_from + (self.rate_to - self.rate_from) * self.share(t)

    def mass(self, a: float, b: float) -> float:
        """Integral of the rate over [a, b] (trapezoid: exact for a linear rate)."""
        return (b - a) * (self.rate(a) + self.rate(b)) / 2.0


def _segments(workload: WorkloadSpec, base_rate: float) -> list[_Segment]:
    if workload.input_tokens is None or workload.output_tokens is None:
        raise WorkloadError("workload: distributions are needed (or give workload.trace)")
    rate = base_rate
    inp = length_distribution(workload.input_tokens)
    out = length_distribution(workload.output_tokens)
    hit = workload.prefix_hit_fraction or 0.0
    scenario_base = workload.arrival.rate_per_s
    segments: list[_Segment] = []
    start = 0.0
    for phase in workload.phases:
        new_rate = rate
        if phase.arrival is not None and phase.arrival.rate_per_s is not None:
            # Phase rates keep their ratio to the scenario's base rate when --rate rescales it.
            ratio = base_rate / scenario_base if scenario_base else 1.0
            new_rate = phase.arrival.rate_per_s * ratio
        new_inp = length_distribution(phase.input_tokens) if phase.input_tokens else inp
        new_out = length_distribution(phase.output_tokens) if phase.output_tokens else out
        new_hit = phase.prefix_hit_fraction if phase.prefix_hit_fraction is not None else hit
        end = start + phase.duration_s
        if phase.ramp:
            segments.append(
                _Segment(start, end, rate, new_rate, inp, new_inp, out, new_out, hit, new_hit)
            )
        else:
            segments.append(
                _Segment(
                    start,
                    end,
                    new_rate,
                    new_rate,
                    new_inp,
                    new_inp,
                    new_out,
                    new_out,
                    new_hit,
                    new_hit,
                )
            )
        rate, inp, out, hit, start = new_rate, new_inp, new_out, new_hit, end
    segments.append(_Segment(start, math.inf, rate, rate, inp, inp, out, out, hit, hit))
    return segments


def _origin_scales(
    scenario: Scenario, origins: Sequence[str]
) -> list[tuple[float, dict[str, float]]]:
    """Breakpoints of per-origin rate multipliers from ``{cluster, rate_scale}`` events."""
    scales = dict.fromkeys(origins, 1.0)
    steps: list[tuple[float, dict[str, float]]] = [(0.0, dict(scales))]
    events = sorted((e for e in scenario.events if isinstance(e, RateEvent)), key=lambda e: e.at_s)
    for event in events:
        if event.cluster in scales:
            scales[event.cluster] = event.rate_scale
            steps.append((event.at_s, dict(scales)))
    return steps


def workload_poisson(
    scenario: Scenario,
    *,
    rate_per_s: float | None,
    seed: int,
    requests: int | None = None,
    duration_s: float | None = None,
) -> Workload:
    """Poisson arrivals from the scenario's distributions, phases and events.

    ``rate_per_s`` is the first phase's rate (the scenario's own when None). Stops after
    ``requests`` arrivals or at ``duration_s``, whichever is given (both: the first reached).
    """
    workload = scenario.workload
    if workload is None:
        raise WorkloadError("the scenario has no workload section")
    base = rate_per_s if rate_per_s is not None else workload.arrival.rate_per_s
    if base is None or not base > 0 or not math.isfinite(base):
        raise WorkloadError(
            "an arrival rate is needed: give --rate, or workload.arrival.rate_per_s"
        )
    if requests is None and duration_s is None:
        raise WorkloadError("give a number of requests or a duration")
    segments = _segments(workload, base)
    origins = list(workload.origins) or [c.name for c in scenario.pd_clusters]
    shares = [workload.origins.get(o, 1.0 / len(origins)) for o in origins]
    steps = _origin_scales(scenario, origins)
    step_times = [s[0] for s in steps]
    rng = np.random.default_rng(seed)
    limit = requests if requests is not None else math.inf
    horizon = duration_s if duration_s is not None else math.inf
    block = scenario.model.block_tokens

    times: list[float] = []
    seg_of: list[int] = []
    origin_of: list[int] = []
    t = 0.0
    seg_index = 0
    batch = 4096
    done = False
    while not done:
        gaps = rng.standard_exponential(batch)
        u_origin = rng.random(batch)
        for k in range(batch):
            # Advance the clock until the integrated (scaled) intensity reaches the gap.
            need = float(gaps[k])
            while True:
                seg = segments[seg_index]
                at = bisect_right(step_times, t)
                scales = steps[at - 1][1]
                scale = sum(sh * scales[o] for o, sh in zip(origins, shares, strict=True))
                end = min(seg.end_s, step_times[at] if at < len(step_times) else math.inf)
                rate_t = seg.rate(t) * scale
                if not math.isfinite(end):
                    if rate_t <= 0:
                        raise WorkloadError("the arrival rate drops to zero for good")
                    t += need / rate_t
                    break
                rate_end = seg.rate(end) * scale
                mass = (end - t) * (rate_t + rate_end) / 2.0
                if mass >= need and end > t:
                    t = _solve_linear(t, rate_t, (rate_end - rate_t) / (end - t), need)
                    break
                need -= mass
                t = end
                if t >= seg.end_s:
                    seg_index += 1
            if t > horizon or len(times) >= limit:
                done = True
                break
            scales = steps[bisect_right(step_times, t) - 1][1]
            weights = [sh * scales[o] for o, sh in zip(origins, shares, strict=True)]
            pick = float(u_origin[k]) * sum(weights)
            chosen = len(origins) - 1
            for i, weight in enumerate(weights):
                if pick < weight:
                    chosen = i
                    break
                pick -= weight
            times.append(t)
            seg_of.append(seg_index)
            origin_of.append(chosen)
    count = len(times)
    # Lengths: inverse-transform sampling, vectorised per segment, from a separate stream so
    # that the lengths of the first n requests do not depend on the rate.
    length_rng = np.random.default_rng([seed, 1])
    draws = length_rng.random((count, 2))
    u_in, u_out = draws[:, 0], draws[:, 1]
    inputs = np.empty(count)
    outputs = np.empty(count)
    hits = np.zeros(count)
    seg_arr = np.asarray(seg_of, dtype=np.int64)
    time_arr = np.asarray(times)
    for index, seg in enumerate(segments):
        mask = seg_arr == index
        if not mask.any():
            continue
        share = np.array([seg.share(x) for x in time_arr[mask]])
        inputs[mask] = _lengths(seg.input_from, seg.input_to, share, u_in[mask])
        outputs[mask] = _lengths(seg.output_from, seg.output_to, share, u_out[mask])
        hits[mask] = seg.hit_from + (seg.hit_to - seg.hit_from) * share
    input_tokens = np.maximum(1, np.rint(inputs)).astype(np.int64)
    output_tokens = np.maximum(1, np.rint(outputs)).astype(np.int64)
    cached = (np.floor(hits * input_tokens / block) * block).astype(np.int64)
    out = tuple(
        RequestSpec(at, int(i), int(o), origins[k], None, int(c))
        for at, i, o, k, c in zip(
            times,
            input_tokens.tolist(),
            output_tokens.tolist(),
            origin_of,
            cached.tolist(),
            strict=True,
        )
    )
    return Workload(out, (), base)


def _lengths(
    dist_from: LengthDistribution, dist_to: LengthDistribution, share: np.ndarray, u: np.ndarray
) -> np.ndarray:
    values = np.asarray(dist_from.quantile(u), dtype=float)
    if dist_to is not dist_from:
        values = values + (np.asarray(dist_to.quantile(u), dtype=float) - values) * share
    return values


def _solve_linear(t0: float, rate0: float, slope: float, mass: float) -> float:
    """The time t where the integral of rate0 + slope*(s - t0) over [t0, t] equals mass."""
    if abs(slope) < 1e-15:
        return t0 + mass / rate0 if rate0 > 0 else math.inf
    # slope/2 x^2 + rate0 x - mass = 0, positive root, written to avoid cancellation.
    disc = rate0 * rate0 + 2.0 * slope * mass
    return t0 + 2.0 * mass / (rate0 + math.sqrt(max(disc, 0.0)))


def workload_trace(
    scenario: Scenario,
    *,
    rate_per_s: float | None = None,
    requests: int | None = None,
    duration_s: float | None = None,
    skip_bad: bool = False,
    seed: int = 0,
) -> Workload:
    """The scenario's trace as requests: de-quantised, time-scaled by ``rate_scale`` (or to
    ``rate_per_s`` mean arrivals per second), cut at ``requests`` or ``duration_s``.

    Several origins get rows assigned by the seeded generator in proportion to their shares.
    """
    workload = scenario.workload
    if workload is None or workload.trace is None:
        raise WorkloadError("the scenario has no workload.trace")
    spec = workload.trace
    read = trace_read(
        spec.path, spec.format, skip_bad=skip_bad, block_tokens=scenario.model.block_tokens
    )
    arrivals = trace_dequantize([row.arrival_s for row in read.rows], spec.dequantize)
    span = arrivals[-1] - arrivals[0]
    natural = (len(arrivals) - 1) / span * spec.rate_scale if span > 0 else 0.0
    factor = spec.rate_scale
    if rate_per_s is not None:
        if not natural > 0:
            raise WorkloadError("the trace spans no time, so it has no rate to rescale")
        factor = spec.rate_scale * rate_per_s / natural
    origins = list(workload.origins) or [c.name for c in scenario.pd_clusters]
    shares = np.array([workload.origins.get(o, 1.0 / len(origins)) for o in origins])
    picks = np.random.default_rng(seed).choice(
        len(origins), size=len(arrivals), p=shares / shares.sum()
    )
    limit = requests if requests is not None else len(arrivals)
    out: list[RequestSpec] = []
    for index, (row, at) in enumerate(zip(read.rows, arrivals, strict=True)):
        t = at / factor
        if len(out) >= limit or (duration_s is not None and t > duration_s):
            break
        out.append(
            RequestSpec(t, row.input_tokens, row.output_tokens, origins[picks[index]], row.hash_ids)
        )
    return Workload(tuple(out), read.skipped_lines, natural * factor / spec.rate_scale)


def workload_build(
    scenario: Scenario,
    *,
    rate_per_s: float | None,
    seed: int,
    requests: int | None = None,
    duration_s: float | None = None,
    skip_bad: bool = False,
) -> Workload:
    """The scenario's requests: its trace when it has one, otherwise Poisson arrivals."""
    if scenario.workload is None:
        raise WorkloadError("the scenario has no workload section")
    try:
        if scenario.workload.trace is not None:
            return workload_trace(
                scenario,
                rate_per_s=rate_per_s,
                requests=requests,
                duration_s=duration_s,
                skip_bad=skip_bad,
                seed=seed,
            )
        return workload_poisson(
            scenario, rate_per_s=rate_per_s, seed=seed, requests=requests, duration_s=duration_s
        )
    except ScenarioError as exc:
        raise WorkloadError(str(exc)) from None
