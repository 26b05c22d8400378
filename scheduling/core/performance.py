"""The performance model of PrfaaS (paper sections 2 and 3.4): tables, KV size and throughput,
decode capacity, and exact statistics of request-length distributions.

Pure Python and numpy: no Django. Units: tokens, seconds, bytes (1 MiB = 2^20 B) and Gbps
(1 Gbps = 10^9 bit/s), as in ``scenarios/SCHEMA.md``.

Length statistics are computed exactly (closed forms for the truncated log-normal, sums for
discrete distributions), never by sampling: the planner compares thresholds 100 tokens apart and
sampling noise would move its answer from run to run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.special import ndtr, ndtri

from scheduling.core.bounds import MIB as MIB
from scheduling.core.scenario import Distribution, EmpiricalDist, FixedDist, LognormalDist

GBPS = 1e9  # bit/s

FloatArray = NDArray[np.float64]


# --------------------------------------------------------------------------------------------
# Piecewise-linear tables


@dataclass(frozen=True)
class Table:
    """A ``[tokens, value]`` table read by piecewise-linear interpolation, with the nearest
    segment extrapolated beyond either end (a one-point table is constant)."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.xs) != len(self.ys) or not self.xs:
            raise ValueError("a table needs as many values as lengths, and at least one point")
        if any(b <= a for a, b in zip(self.xs, self.xs[1:], strict=False)):
            raise ValueError("table lengths must be strictly increasing")

    @classmethod
    def from_points(
        cls, points: Sequence[tuple[float, float]] | Sequence[Sequence[float]]
    ) -> Table:
        return cls(tuple(float(p[0]) for p in points), tuple(float(p[1]) for p in points))

    def __call__(self, x: ArrayLike) -> FloatArray:
        xa = np.asarray(x, dtype=float)
        xs = np.asarray(self.xs)
        ys = np.asarray(self.ys)
        y = np.interp(xa, xs, ys)
        if len(xs) > 1:
            lo_slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
            hi_slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            y = np.where(xa < xs[0], ys[0] + (xa - xs[0]) * lo_slope, y)
            y = np.where(xa > xs[-1], ys[-1] + (xa - xs[-1]) * hi_slope, y)
        return np.asarray(y, dtype=float)

    def scaled(self, factor: float) -> Table:
        return Table(self.xs, tuple(y * factor for y in self.ys))


def kv_bytes(kv_mib: Table, tokens: ArrayLike) -> FloatArray:
    """S_kv(l): KVCache bytes one prefill of ``tokens`` produces (never below zero, even where
    the table is extrapolated)."""
    return np.maximum(kv_mib(tokens), 0.0) * MIB


def prefill_seconds(table: Table, tokens: ArrayLike) -> FloatArray:
    """T_prefill(l) of one instance; a tiny floor keeps extrapolation from reaching zero."""
    return np.maximum(table(tokens), 1e-9)


def phi_kv_gbps(kv_mib: Table, prefill: Table, tokens: ArrayLike) -> FloatArray:
    """Eq. (1): KV throughput of one instance, Phi_kv(l) = S_kv(l) / T_prefill(l), in Gbps."""
    return kv_bytes(kv_mib, tokens) * 8.0 / prefill_seconds(prefill, tokens) / GBPS


def cluster_egress_gbps(
    instances: float, kv_mib: Table, prefill: Table, tokens: ArrayLike
) -> FloatArray:
    """Eq. (2): egress a prefill cluster of ``instances`` needs when all are busy with
    requests of ``tokens`` (the paper's N/P * Phi_kv(L_avg))."""
    return instances * phi_kv_gbps(kv_mib, prefill, tokens)


def transfer_seconds(kv_mib: Table, tokens: ArrayLike, gbps: float) -> FloatArray:
    """Time to ship one request's KVCache over a link of ``gbps`` alone (inf when down)."""
    bits = kv_bytes(kv_mib, tokens) * 8.0
    if gbps <= 0:
        return np.full_like(bits, math.inf)
    return bits / (gbps * GBPS)


def decode_rate_per_instance(max_batch: int, step_seconds: float, output_tokens: float) -> float:
    """Eq. (5) for one instance: requests/s one decode instance finishes at full batch."""
    if output_tokens <= 0:
        return math.inf
    return max_batch / (step_seconds * output_tokens)


# --------------------------------------------------------------------------------------------
# Length distributions


@runtime_checkable
class LengthDistribution(Protocol):
    """What the planner needs from a distribution of (uncached) request lengths L."""

    @property
    def mean(self) -> float: ...

    @property
    def support(self) -> tuple[float, float]:
        """Smallest and largest possible length."""
        ...

    def tail(self, t: ArrayLike) -> FloatArray:
        """p(t) = P(L > t)."""
        ...

    def partial_mean_above(self, t: ArrayLike) -> FloatArray:
        """E[L 1{L > t}]."""
        ...

    def quantile(self, q: ArrayLike) -> FloatArray: ...

    def nodes(self) -> tuple[FloatArray, FloatArray]:
        """Quadrature nodes and weights (summing to 1) for E[f(L)] and quantiles of f(L)."""
        ...


@dataclass(frozen=True)
class TruncatedLognormal:
    """ln L ~ Normal(mu, sigma), conditioned on min <= L <= max. Closed forms throughout."""

    mu: float
    sigma: float
    lo: float
    hi: float
    quadrature_nodes: int = 4096

    def __post_init__(self) -> None:
        if not (self.sigma > 0 and 0 < self.lo < self.hi):
            raise ValueError("need sigma > 0 and 0 < min < max")

    def _z(self, x: ArrayLike) -> FloatArray:
        xa = np.clip(np.asarray(x, dtype=float), self.lo, self.hi)
        return np.asarray((np.log(xa) - self.mu) / self.sigma)

    @property
    def _mass(self) -> float:
        return float(ndtr(self._z(self.hi)) - ndtr(self._z(self.lo)))

    @property
    def support(self) -> tuple[float, float]:
        return (self.lo, self.hi)

    @property
    def mean(self) -> float:
        return float(self.partial_mean_above(self.lo - 1.0))

    def tail(self, t: ArrayLike) -> FloatArray:
        cdf_hi = ndtr(self._z(self.hi))
        return np.asarray(np.clip((cdf_hi - ndtr(self._z(t))) / self._mass, 0.0, 1.0))

    def partial_mean_above(self, t: ArrayLike) -> FloatArray:
        # E[L 1{L <= x}] for a log-normal is exp(mu + s^2/2) * Phi((ln x - mu - s^2) / s).
        s = self.sigma
        scale = math.exp(self.mu + s * s / 2.0)
        upper = ndtr(self._z(self.hi) - s)
        return np.asarray(np.maximum(scale * (upper - ndtr(self._z(t) - s)) / self._mass, 0.0))

    def quantile(self, q: ArrayLike) -> FloatArray:
        qa = np.clip(np.asarray(q, dtype=float), 0.0, 1.0)
        a, b = ndtr(self._z(self.lo)), ndtr(self._z(self.hi))
        x = np.exp(self.mu + self.sigma * ndtri(a + qa * (b - a)))
        return np.asarray(np.clip(x, self.lo, self.hi))

    def nodes(self) -> tuple[FloatArray, FloatArray]:
        n = self.quadrature_nodes
        u = (np.arange(n) + 0.5) / n
        return self.quantile(u), np.full(n, 1.0 / n)


@dataclass(frozen=True)
class DiscreteLengths:
    """Lengths taking finitely many values with weights: a fixed length, or an empirical
    histogram built from a trace or from observed traffic."""

    values: tuple[float, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.values or len(self.values) != len(self.weights):
            raise ValueError("need at least one length, with one weight each")
        if any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
            raise ValueError("weights must be non-negative and not all zero")
        if any(b <= a for a, b in zip(self.values, self.values[1:], strict=False)):
            raise ValueError("lengths must be strictly increasing")

    @classmethod
    def from_points(cls, points: Sequence[tuple[float, float]]) -> DiscreteLengths:
        merged: dict[float, float] = {}
        for tokens, weight in points:
            merged[float(tokens)] = merged.get(float(tokens), 0.0) + float(weight)
        keys = sorted(merged)
        return cls(tuple(keys), tuple(merged[k] for k in keys))

    @property
    def _x(self) -> FloatArray:
        return np.asarray(self.values, dtype=float)

    @property
    def _w(self) -> FloatArray:
        w = np.asarray(self.weights, dtype=float)
        return w / w.sum()

    @property
    def support(self) -> tuple[float, float]:
        return (self.values[0], self.values[-1])

    @property
    def mean(self) -> float:
        return float(self.partial_mean_above(-math.inf))

    def _above(self, t: ArrayLike, f: FloatArray) -> FloatArray:
        # Suffix sums of the raw weights, so that P(L > t) is exactly 1 below the shortest
        # length and exactly 0 at or above the longest.
        total = np.cumsum(np.asarray(self.weights, dtype=float)[::-1])[-1]
        suffix = np.concatenate((np.cumsum(f[::-1])[::-1], [0.0]))
        idx = np.searchsorted(self._x, np.asarray(t, dtype=float), side="right")
        return np.asarray(suffix[idx] / total)

    def tail(self, t: ArrayLike) -> FloatArray:
        return self._above(t, np.asarray(self.weights, dtype=float))

    def partial_mean_above(self, t: ArrayLike) -> FloatArray:
        return self._above(t, np.asarray(self.weights, dtype=float) * self._x)

    def quantile(self, q: ArrayLike) -> FloatArray:
        cum = np.cumsum(self._w)
        idx = np.searchsorted(cum, np.asarray(q, dtype=float) - 1e-12, side="left")
        return np.asarray(self._x[np.clip(idx, 0, len(self.values) - 1)])

    def nodes(self) -> tuple[FloatArray, FloatArray]:
        return self._x, self._w


def length_distribution(spec: Distribution, *, scale: float = 1.0) -> LengthDistribution:
    """The distribution a scenario describes, with lengths multiplied by ``scale`` (e.g.
    ``1 - prefix_hit_fraction`` for uncached lengths)."""
    if scale <= 0:
        raise ValueError("scale must be positive")
    if isinstance(spec, LognormalDist):
        return TruncatedLognormal(
            spec.mu + math.log(scale), spec.sigma, spec.min * scale, spec.max * scale
        )
    if isinstance(spec, FixedDist):
        return DiscreteLengths((spec.value * scale,), (1.0,))
    if isinstance(spec, EmpiricalDist):
        return DiscreteLengths.from_points([(x * scale, w) for x, w in spec.points])
    raise TypeError(f"not a distribution: {spec!r}")


@dataclass(frozen=True)
class LengthSplit:
    """p, l_long and l_short of a distribution at each threshold of a grid (arrays)."""

    thresholds: FloatArray
    p: FloatArray
    l_long: FloatArray
    l_short: FloatArray


def length_split(lengths: LengthDistribution, thresholds: ArrayLike) -> LengthSplit:
    """p = P(L > t), l_long = E[L | L > t], l_short = E[L | L <= t] for every t (nan where the
    conditioning event has probability zero)."""
    t = np.atleast_1d(np.asarray(thresholds, dtype=float))
    p = lengths.tail(t)
    # Snap rounding dust so that "everything" and "nothing" offloaded are exact.
    p = np.where(p <= 1e-12, 0.0, np.where(p >= 1 - 1e-12, 1.0, p))
    above = lengths.partial_mean_above(t)
    mean = lengths.mean
    lo, hi = lengths.support
    eps = 1e-12
    with np.errstate(divide="ignore", invalid="ignore"):
        l_long = np.where(p > eps, above / np.where(p > eps, p, 1.0), np.nan)
        q = 1.0 - p
        l_short = np.where(q > eps, (mean - above) / np.where(q > eps, q, 1.0), np.nan)
    # Rounding near p = 0 or 1 must not put a conditional mean outside its side of t.
    l_long = np.clip(l_long, np.maximum(t, lo), hi)
    l_short = np.clip(l_short, lo, np.minimum(np.maximum(t, lo), hi))
    return LengthSplit(t, np.asarray(p), np.asarray(l_long), np.asarray(l_short))


def expectation(lengths: LengthDistribution, f: Callable[[FloatArray], FloatArray]) -> float:
    """E[f(L)] by quadrature over the distribution's nodes."""
    x, w = lengths.nodes()
    return float(np.dot(f(x), w))


def weighted_quantile(values: FloatArray, weights: FloatArray, q: float) -> float:
    """The q-quantile of a discrete distribution of values (the smallest v with F(v) >= q)."""
    order = np.argsort(values, kind="stable")
    v = values[order]
    cum = np.cumsum(weights[order])
    cum /= cum[-1]
    idx = int(np.searchsorted(cum, q - 1e-12, side="left"))
    return float(v[min(idx, len(v) - 1)])
