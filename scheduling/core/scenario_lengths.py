"""Traces as length distributions: the input and output lengths of a trace file, and
empirical distributions built from observed lengths (the rebalancer's traffic windows).
Pure Python: no Django import here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from scheduling.core.scenario_types import (
    Distribution,
    EmpiricalDist,
    ScenarioError,
    TraceSpec,
    WorkloadSpec,
)

# --------------------------------------------------------------------------------------------
# Traces as length distributions


def trace_lengths(trace: TraceSpec) -> tuple[np.ndarray, np.ndarray]:
    """Input and output lengths (tokens) of every request in a trace file, in file order."""
    inputs: list[int] = []
    outputs: list[int] = []
    where = str(trace.path)
    with trace.path.open(encoding="utf-8") as fh:
        if trace.format == "mooncake":
            for n, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    inputs.append(int(row["input_length"]))
                    outputs.append(int(row["output_length"]))
                except (ValueError, KeyError, TypeError) as exc:
                    raise ScenarioError(
                        "workload.trace.path", f"{where} line {n}: bad row ({exc})"
                    ) from None
        else:
            header = fh.readline().strip().split(",")
            try:
                ci, co = header.index("ContextTokens"), header.index("GeneratedTokens")
            except ValueError:
                raise ScenarioError(
                    "workload.trace.path",
                    f"{where}: expected ContextTokens and GeneratedTokens columns",
                ) from None
            for n, line in enumerate(fh, start=2):
                if not line.strip():
                    continue
                cells = line.rstrip("\n").split(",")
                try:
                    inputs.append(int(cells[ci]))
                    outputs.append(int(cells[co]))
                except (ValueError, IndexError) as exc:
                    raise ScenarioError(
                        "workload.trace.path", f"{where} line {n}: bad row ({exc})"
                    ) from None
    if not inputs:
        raise ScenarioError("workload.trace.path", f"{where}: the trace has no requests")
    return np.asarray(inputs, dtype=float), np.asarray(outputs, dtype=float)


def empirical_from_lengths(
    lengths: Sequence[float] | np.ndarray, *, bin_tokens: float = 0
) -> EmpiricalDist:
    """An empirical distribution from observed lengths: every distinct length is a point
    weighted by its count, or, with ``bin_tokens`` > 0, bins of that width represented by
    their mean length (a histogram, for long windows of traffic)."""
    arr = np.asarray(lengths, dtype=float)
    if arr.size == 0:
        raise ValueError("no lengths to build a distribution from")
    if np.any(arr < 0) or not np.all(np.isfinite(arr)):
        raise ValueError("lengths must be finite and non-negative")
    if bin_tokens > 0:
        bins = np.floor(arr / bin_tokens).astype(np.int64)
        _, inverse, counts = np.unique(bins, return_inverse=True, return_counts=True)
        sums = np.bincount(inverse, weights=arr)
        tokens = sums / counts
    else:
        tokens, counts = np.unique(arr, return_counts=True)
    return EmpiricalDist(
        points=tuple(zip(tokens.tolist(), counts.astype(float).tolist(), strict=True))
    )


def workload_length_distributions(
    workload: WorkloadSpec, *, bin_tokens: float = 0
) -> tuple[Distribution, Distribution]:
    """Input and output length distributions of a workload's steady state (the first phase's
    settings; a trace becomes its empirical distribution)."""
    inp, out = workload.input_tokens, workload.output_tokens
    if workload.phases:
        inp = workload.phases[0].input_tokens or inp
        out = workload.phases[0].output_tokens or out
    if workload.trace is not None:
        ins, outs = trace_lengths(workload.trace)
        inp = inp or empirical_from_lengths(ins, bin_tokens=bin_tokens)
        out = out or empirical_from_lengths(outs, bin_tokens=bin_tokens)
    if inp is None or out is None:
        raise ScenarioError("workload", "no input/output length distribution")
    return inp, out
