"""Queueing approximations for the planner's predictions: waits at M/G/c stations and the
distribution of a sum of service time and waits, for TTFT means and quantiles.

Pure Python and numpy: no Django. Seconds throughout.

**Waits at a station of c identical servers** (:func:`mgc_wait`): Poisson arrivals at rate
lambda, service S with mean E[S] and squared coefficient of variation c_s^2 = Var S / E[S]^2,
utilisation rho = lambda E[S] / c < 1. The Allen-Cunneen approximation:

    P(wait)  = ErlangC(c, lambda E[S])                (exact for exponential service)
    E[W]     = P(wait) * E[S] / (c (1 - rho)) * (c_a^2 + c_s^2) / 2

with c_a^2 the arrivals' squared coefficient of variation (1 for Poisson). The distribution
assumed for the wait: an atom at 0 of mass 1 - P(wait), and otherwise exponential with mean
E[W] / P(wait) (exact for M/M/c; for M/G/c the usual heavy-traffic shape). It is exact for
M/M/c, close for M/G/1 (Pollaczek-Khinchine mean), and degrades when c_s^2 is very large with
few servers, or near saturation (rho -> 1), where every approximation does.

Why M/G/c fits the fleet: the router sends each request to the instance of a cluster that
would start it soonest (least queued work: ``backlog + T(prompt - cached)``, with no cache the
least backlog); with FCFS at each instance that is exactly a central FCFS queue feeding c
servers.

**TTFT** (:func:`ttft_quantile`, :func:`ttft_mean`): a request's TTFT is its deterministic part
(prefill time, transfer excess, RTT) plus independent waits (its prefill station's, then its
decode admission's); a mixture over kinds of request (lengths, routes). Two atom-plus-
exponential waits add up to a closed-form law (hypoexponential), so the mixture's CDF is exact
for the assumed wait laws and a quantile is found by bisection on it.

**A stretch of finite length** (:func:`wait_transient`): the waits above are steady states. A
queue near saturation takes long to build one: in heavy traffic the workload is a reflected
Brownian motion whose relaxation time is ``tau = 2 rho E[W | wait] / (1 - rho)`` (its
variance over its drift squared), and started empty its mean reaches ``E[W] (1 - H1(t /
tau))`` at time t, H1 the first-moment function of Abate and Whitt (1987, "Transient behavior
of regulated Brownian motion I"): ``H1(u) = 2 ((1 + u) Phi^c(sqrt u) - sqrt(u) phi(sqrt u))``.
A workload replayed window after window (a trace) meets each window's queue in this
transient, carried over from the window before; a backlog above the new steady state drains
as a fluid, at ``1 - rho`` seconds of wait per second.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.special import erfc

FloatArray = NDArray[np.float64]


def erlang_b(servers: int, offered: float) -> float:
    """Erlang's loss formula B(c, a), by the stable recursion B(k) = a B(k-1) / (k + a B(k-1))."""
    if offered <= 0:
        return 0.0
    b = 1.0
    for k in range(1, int(servers) + 1):
        b = offered * b / (k + offered * b)
    return b


def erlang_c(servers: int, offered: float) -> float:
    """Probability of waiting in M/M/c with ``offered`` = lambda E[S] erlangs (1 when rho >= 1)."""
    c = int(servers)
    if c <= 0:
        return 1.0
    rho = offered / c
    if rho >= 1:
        return 1.0
    if offered <= 0:
        return 0.0
    b = erlang_b(c, offered)
    return b / (1.0 - rho * (1.0 - b))


def mgc_mean_wait(
    rate: ArrayLike,
    mean_service_s: ArrayLike,
    scv_service: ArrayLike,
    servers: int,
    *,
    scv_arrival: float = 1.0,
) -> FloatArray:
    """:func:`mgc_wait`'s mean, elementwise over arrays of stations with ``servers`` each
    (infinite where utilisation >= 1; 0 without traffic)."""
    return mgc_waits(rate, mean_service_s, scv_service, servers, scv_arrival=scv_arrival)[1]


def mgc_waits(
    rate: ArrayLike,
    mean_service_s: ArrayLike,
    scv_service: ArrayLike,
    servers: int,
    *,
    scv_arrival: float = 1.0,
) -> tuple[FloatArray, FloatArray]:
    """:func:`mgc_wait` elementwise: the waiting probabilities and the mean waits (1 and
    infinite where utilisation >= 1; 0 and 0 without traffic)."""
    lam = np.asarray(rate, dtype=float)
    es = np.asarray(mean_service_s, dtype=float)
    scv = np.asarray(scv_service, dtype=float)
    lam, es, scv = np.broadcast_arrays(lam, es, scv)
    c = int(servers)
    offered = lam * es
    live = (lam > 0) & (es > 0)
    if c <= 0:
        return np.where(live, 1.0, 0.0), np.where(live, math.inf, 0.0)
    rho = offered / c
    b = np.ones(offered.shape)
    for k in range(1, c + 1):
        b = offered * b / (k + offered * b)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = b / (1.0 - rho * (1.0 - b))
        mean = p * es / (c * (1.0 - rho)) * (scv_arrival + scv) / 2.0
    stable = rho < 1.0
    out = np.where(live, np.where(stable, mean, math.inf), 0.0)
    p_out = np.where(live, np.where(stable, p, 1.0), 0.0)
    return np.asarray(p_out), np.asarray(out)


def wait_sum_cdf(
    y: ArrayLike, p_a: ArrayLike, mean_a: ArrayLike, p_b: ArrayLike, mean_b: ArrayLike
) -> FloatArray:
    """P(W_a + W_b <= y), elementwise (broadcast), for two independent waits of the assumed
    law given by their waiting probabilities and mean waits (0 where either is infinite)."""
    y, pa, ma, pb, mb = np.broadcast_arrays(
        *(np.asarray(v, dtype=float) for v in (y, p_a, mean_a, p_b, mean_b))
    )
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ta = np.where(pa > 0, ma / np.where(pa > 0, pa, 1.0), 0.0)
        tb = np.where(pb > 0, mb / np.where(pb > 0, pb, 1.0), 0.0)
        yy = np.maximum(y, 0.0)
        ea = np.where(ta > 0, np.exp(-yy / np.where(ta > 0, ta, 1.0)), 0.0)
        eb = np.where(tb > 0, np.exp(-yy / np.where(tb > 0, tb, 1.0)), 0.0)
        close = np.abs(ta - tb) <= 1e-9 * np.maximum(ta, tb)
        both = np.where(
            close,
            1.0 - ea * (1.0 + yy / np.where(ta > 0, ta, 1.0)),
            1.0 - (ta * ea - tb * eb) / np.where(close, 1.0, ta - tb),
        )
        # A wait that never happens (p = 0 or zero mean) leaves the other one alone.
        a_on = (pa > 0) & (ta > 0)
        b_on = (pb > 0) & (tb > 0)
        pa_ = np.where(a_on, pa, 0.0)
        pb_ = np.where(b_on, pb, 0.0)
        out = (
            (1 - pa_) * (1 - pb_)
            + pa_ * (1 - pb_) * (1 - ea)
            + (1 - pa_) * pb_ * (1 - eb)
            + pa_ * pb_ * np.where(a_on & b_on, both, 0.0)
        )
    finite = np.isfinite(ma) & np.isfinite(mb)
    return np.asarray(np.where((y >= 0) & finite, np.clip(out, 0.0, 1.0), 0.0))


@dataclass(frozen=True)
class Wait:
    """The law assumed for a queueing wait: 0 with probability ``1 - p_wait``, else exponential
    with mean ``mean_s / p_wait``. ``rho`` is the station's utilisation (>= 1: unstable, and
    the wait infinite)."""

    p_wait: float
    mean_s: float
    rho: float

    @property
    def stable(self) -> bool:
        return self.rho < 1.0

    @property
    def conditional_mean_s(self) -> float:
        return self.mean_s / self.p_wait if self.p_wait > 0 else 0.0

    def cdf(self, x: ArrayLike) -> FloatArray:
        xa = np.asarray(x, dtype=float)
        if not self.stable:
            return np.zeros_like(xa)
        theta = self.conditional_mean_s
        if self.p_wait <= 0 or theta <= 0:
            return np.where(xa >= 0, 1.0, 0.0)
        return np.where(xa >= 0, 1.0 - self.p_wait * np.exp(-np.maximum(xa, 0) / theta), 0.0)


NO_WAIT = Wait(0.0, 0.0, 0.0)


def mgc_wait(
    rate: float,
    mean_service_s: float,
    scv_service: float,
    servers: int,
    *,
    scv_arrival: float = 1.0,
) -> Wait:
    """The Allen-Cunneen wait at a station of ``servers`` fed at ``rate`` (see the module)."""
    if rate <= 0 or mean_service_s <= 0:
        return NO_WAIT
    if servers <= 0:
        return Wait(1.0, math.inf, math.inf)
    offered = rate * mean_service_s
    rho = offered / servers
    if rho >= 1:
        return Wait(1.0, math.inf, rho)
    p = erlang_c(servers, offered)
    mean = p * mean_service_s / (servers * (1.0 - rho)) * (scv_arrival + scv_service) / 2.0
    return Wait(p, mean, rho)


@dataclass(frozen=True)
class Crowd:
    """Mean and variance of how many requests are at a station (queued or in service), of
    how many are in service and of how many wait, under the law assumed in
    :func:`mgc_crowd`."""

    in_system_mean: float
    in_system_var: float
    busy_mean: float
    busy_var: float
    queue_mean: float = 0.0
    queue_var: float = 0.0


def mgc_crowd(
    rate: float,
    mean_service_s: float,
    scv_service: float,
    servers: int,
    *,
    scv_arrival: float = 1.0,
) -> Crowd:
    """How many requests an M/G/c station holds: below c, the M/M/c shape (Poisson-like,
    P(n) ~ a^n / n!); from c on, a geometric tail whose mass is the Erlang-C waiting
    probability and whose mean queue is Allen-Cunneen's (lambda E[W], Little)."""
    wait = mgc_wait(rate, mean_service_s, scv_service, servers, scv_arrival=scv_arrival)
    c = int(servers)
    if rate <= 0 or mean_service_s <= 0 or c <= 0 or not wait.stable:
        if rate <= 0:
            return Crowd(0.0, 0.0, 0.0, 0.0)
        return Crowd(math.inf, math.inf, c, 0.0, math.inf, math.inf)
    offered = rate * mean_service_s
    p_wait = wait.p_wait
    # Below c: a^n / n!, scaled to the mass 1 - P(wait).
    n = np.arange(c)
    log_terms = n * math.log(offered) - np.array([math.lgamma(k + 1) for k in n])
    head = np.exp(log_terms - log_terms.max())
    head *= (1.0 - p_wait) / head.sum()
    head_mean = float(np.dot(n, head))
    head_sq = float(np.dot(n * n, head))
    # From c on: c + K with K geometric (P(K = k) = (1 - r) r^k), E[K | waiting] from Little.
    queue = rate * wait.mean_s
    if p_wait > 0 and queue > 0:
        r = queue / (p_wait + queue)
        k_mean = r / (1.0 - r)
        k_sq = r * (1.0 + r) / (1.0 - r) ** 2
    else:
        k_mean = k_sq = 0.0
    mean = head_mean + p_wait * (c + k_mean)
    second = head_sq + p_wait * (c * c + 2 * c * k_mean + k_sq)
    busy_mean = head_mean + p_wait * c
    busy_second = head_sq + p_wait * c * c
    queue_mean = p_wait * k_mean
    return Crowd(
        mean,
        max(0.0, second - mean * mean),
        busy_mean,
        max(0.0, busy_second - busy_mean**2),
        queue_mean,
        max(0.0, p_wait * k_sq - queue_mean**2),
    )


def thinned_dispersion(
    crowd_mean: float, crowd_var: float, share: float, extra: float = 0.0
) -> float:
    """Variance-to-mean ratio of the requests of one kind (each of a crowd independently of
    that kind with probability ``share``) plus an independent Poisson number ``extra``."""
    q = min(1.0, max(0.0, share))
    mean = q * crowd_mean + extra
    if mean <= 0 or not math.isfinite(mean):
        return 1.0
    var = q * q * crowd_var + q * (1.0 - q) * crowd_mean + extra
    return max(1.0, var / mean)


#: Gauss-Legendre nodes for a transient's mean over a stretch (in sqrt(time): the mean rises
#: like sqrt(t) from an empty start, smooth in that variable).
_GL_NODES, _GL_WEIGHTS = np.polynomial.legendre.leggauss(24)


def _rise(u: FloatArray) -> FloatArray:
    """``1 - H1(u)``: the mean of a reflected Brownian motion started empty, at ``u``
    relaxation times, as a share of its steady mean (0 at 0, -> 1)."""
    r = np.sqrt(np.maximum(u, 0.0))
    tail = 0.5 * erfc(r / math.sqrt(2.0))
    density = np.exp(-0.5 * r * r) / math.sqrt(2.0 * math.pi)
    return np.asarray(np.clip(1.0 - 2.0 * ((1.0 + u) * tail - r * density), 0.0, 1.0))


def _rise_age(share: float) -> float:
    """The age (in relaxation times) at which an empty start's mean is ``share`` of the
    steady one: a backlog carried in counts as that much time already spent."""
    if share <= 0.0:
        return 0.0
    lo, hi = 0.0, 1.0
    while float(_rise(np.array([hi]))[0]) < share and hi < 1e6:
        lo, hi = hi, hi * 4.0
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if float(_rise(np.array([mid]))[0]) < share:
            lo = mid
        else:
            hi = mid
    return hi


def wait_transient(wait: Wait, duration_s: float, backlog_s: float = 0.0) -> tuple[Wait, float]:
    """A station's wait averaged over a stretch of ``duration_s`` seconds that starts with a
    mean wait of ``backlog_s`` (0: empty), rather than its steady state (see the module); and
    the mean wait it leaves at its end, for the next stretch. ``duration_s`` <= 0 or not
    finite: the stretch lasts, and the steady state holds. An unstable station keeps its
    infinite wait and leaves its backlog grown by ``(rho - 1) x duration_s``."""
    if not (duration_s > 0 and math.isfinite(duration_s)):
        return wait, wait.mean_s
    if not wait.stable:
        return wait, max(backlog_s, 0.0) + (wait.rho - 1.0) * duration_s
    steady = wait.mean_s
    if steady <= 0.0 or wait.rho <= 0.0:
        return wait, max(steady, 0.0)
    if backlog_s >= steady:
        # Above its steady state: the excess drains as a fluid.
        drain = 1.0 - wait.rho
        excess = backlog_s - steady
        gone_s = excess / drain if drain > 0 else math.inf
        if gone_s >= duration_s:
            mean = backlog_s - drain * duration_s / 2.0
        else:
            mean = steady + excess * gone_s / (2.0 * duration_s)
        end = max(steady, backlog_s - drain * duration_s)
    else:
        tau = 2.0 * wait.rho * wait.conditional_mean_s / (1.0 - wait.rho)
        u0 = _rise_age(backlog_s / steady)
        u1 = u0 + duration_s / tau
        # The mean over [u0, u1], integrated in v = sqrt(u) (du = 2 v dv).
        v0, v1 = math.sqrt(u0), math.sqrt(u1)
        v = 0.5 * (v1 - v0) * _GL_NODES + 0.5 * (v1 + v0)
        area = 0.5 * (v1 - v0) * float(np.dot(_GL_WEIGHTS, _rise(v * v) * 2.0 * v))
        mean = steady * area / (u1 - u0)
        end = steady * float(_rise(np.array([u1]))[0])
    return Wait(wait.p_wait, mean, wait.rho), end


def moments(values: ArrayLike, weights: ArrayLike) -> tuple[float, float]:
    """Mean and squared coefficient of variation of a discrete law (weights need not sum
    to 1; (0, 0) when they sum to 0)."""
    v = np.asarray(values, dtype=float)
    w = np.asarray(weights, dtype=float)
    total = float(w.sum())
    if total <= 0:
        return 0.0, 0.0
    mean = float(np.dot(v, w) / total)
    if mean <= 0:
        return mean, 0.0
    second = float(np.dot(v * v, w) / total)
    return mean, max(0.0, second / (mean * mean) - 1.0)


def _sum_cdf(y: FloatArray, a: Wait, b: Wait) -> FloatArray:
    """P(W_a + W_b <= y) for two independent waits of the assumed law."""
    pa, pb = a.p_wait, b.p_wait
    ta, tb = a.conditional_mean_s, b.conditional_mean_s
    yy = np.maximum(y, 0.0)
    if pa <= 0 or ta <= 0:
        return b.cdf(y)
    if pb <= 0 or tb <= 0:
        return a.cdf(y)
    ea = np.exp(-yy / ta)
    eb = np.exp(-yy / tb)
    if abs(ta - tb) <= 1e-9 * max(ta, tb):
        both = 1.0 - ea * (1.0 + yy / ta)
    else:
        both = 1.0 - (ta * ea - tb * eb) / (ta - tb)
    out = (1 - pa) * (1 - pb) + pa * (1 - pb) * (1 - ea) + (1 - pa) * pb * (1 - eb) + pa * pb * both
    return np.where(y >= 0, out, 0.0)


@dataclass(frozen=True)
class TtftPart:
    """One kind of request in the TTFT mixture: its share, its deterministic seconds (an array:
    one value per length node, with ``weights`` of the same shape summing to ``share``), and
    the two waits it meets (prefill station, decode admission)."""

    weights: FloatArray
    fixed_s: FloatArray
    prefill_wait: Wait
    decode_wait: Wait

    @property
    def stable(self) -> bool:
        return self.prefill_wait.stable and self.decode_wait.stable


def ttft_mean(parts: Sequence[TtftPart]) -> float:
    """Mean TTFT of the mixture (infinite when a station with traffic is unstable)."""
    total = 0.0
    mass = 0.0
    for part in parts:
        w = float(part.weights.sum())
        if w <= 0:
            continue
        if not part.stable:
            return math.inf
        total += float(np.dot(part.weights, part.fixed_s))
        total += w * (part.prefill_wait.mean_s + part.decode_wait.mean_s)
        mass += w
    return total / mass if mass > 0 else 0.0


def ttft_cdf(parts: Sequence[TtftPart], x: float) -> float:
    """P(TTFT <= x) over the mixture."""
    mass = 0.0
    below = 0.0
    for part in parts:
        w = float(part.weights.sum())
        if w <= 0:
            continue
        mass += w
        if not part.stable:
            continue
        below += float(
            np.dot(part.weights, _sum_cdf(x - part.fixed_s, part.prefill_wait, part.decode_wait))
        )
    return below / mass if mass > 0 else 1.0


def ttft_quantile(parts: Sequence[TtftPart], q: float) -> float:
    """The q-quantile of TTFT over the mixture (infinite when unstable stations hold more than
    1 - q of the traffic)."""
    live = [p for p in parts if float(p.weights.sum()) > 0]
    if not live:
        return 0.0
    lo = 0.0
    hi = max(float(np.max(p.fixed_s)) for p in live)
    hi += (
        sum(
            max(p.prefill_wait.conditional_mean_s, 0.0) + max(p.decode_wait.conditional_mean_s, 0.0)
            for p in live
            if p.stable
        )
        * 10.0
        + 1.0
    )
    if ttft_cdf(live, hi) < q:
        hi *= 100.0
        if ttft_cdf(live, hi) < q:
            return math.inf
    for _ in range(60):
        mid = (lo + hi) / 2
        if ttft_cdf(live, mid) >= q:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-4 * max(hi, 1e-3):
            break
    return hi
