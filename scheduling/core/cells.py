"""One PD cluster's cells (threshold x prefill/decode split) at an arrival rate, as the
queueing model predicts them all at once: each cell's waits, its mean TTFT and the share of its
requests whose TTFT is within a target.

Pure Python and numpy: no Django. The model is :mod:`scheduling.core.operating`'s (M/G/c
waits at the cluster's PD-P, at the PrfaaS pool it shares with other clusters, and at its
decode slots; a transfer's excess over its prefill at the link's utilisation; one RTT), with
two simplifications that make it vectorise over cells: the link guard's refusals (refused
offloads prefill locally) are settled per threshold on the largest-budget link alone, and
several PrfaaS pools are costed as one.
The search (:mod:`scheduling.core.search`) ranks cells by mean TTFT; the goodput planner
(:mod:`scheduling.core.goodput`) by the share within the TTFT target. Both confirm their
answer with the full operating point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from scheduling.core.fleet import FleetSpec, PdPool, PrfaasPool
from scheduling.core.link import (
    Link,
    OffloadMix,
    link_never_fits,
    link_refusal,
    transfer_excess_s,
)
from scheduling.core.offload import coarse_nodes, linked_pools
from scheduling.core.performance import FloatArray, LengthDistribution, kv_bytes, prefill_seconds
from scheduling.core.queueing import mgc_waits, wait_sum_cdf

#: Rounds of the refusal fixed point per cell model (damped by half each round).
GUARD_ROUNDS = 4


@dataclass(frozen=True)
class PoolLoad:
    """What other PD clusters' offloads ask of a PrfaaS pool: req/s, and the sums over them
    of service seconds and of their squares (per second)."""

    rate: float = 0.0
    s1: float = 0.0
    s2: float = 0.0


@dataclass(frozen=True)
class CellModel:
    """A cluster's cells at ``rate`` arrivals/s: per-node times, per-cell waits (waiting
    probability ``p_*`` and mean ``m_*``) and its own demand on the pool per threshold."""

    weights: FloatArray  # N: length nodes' weights
    offloaded: FloatArray  # K x N: weight of node n offloaded at threshold k
    local_s: FloatArray  # N: local prefill seconds
    remote_s: FloatArray  # K x N: remote prefill + transfer excess + RTT
    p_local: FloatArray  # K x M
    m_local: FloatArray  # K x M
    p_prfaas: FloatArray  # K
    m_prfaas: FloatArray  # K
    p_decode: FloatArray  # M
    m_decode: FloatArray  # M
    demand: tuple[FloatArray, FloatArray, FloatArray]  # K: rate, s1, s2 on the pool

    def mean_ttft(self) -> FloatArray:
        """Mean TTFT per cell (K x M); infinite where a station with traffic is unstable."""
        off = self.offloaded
        loc = self.weights[None, :] - off
        s0_loc = loc.sum(axis=1)
        s0_off = off.sum(axis=1)
        fixed = loc @ self.local_s + (off * self.remote_s).sum(axis=1)
        with np.errstate(invalid="ignore"):
            cost = (
                fixed[:, None]
                + s0_loc[:, None] * self.m_local
                + np.where(s0_off > 0, s0_off * self.m_prfaas, 0.0)[:, None]
                + self.m_decode[None, :]
            )
        return np.asarray(np.where(np.isnan(cost), math.inf, cost))

    def within(self, target_s: float) -> FloatArray:
        """Share of the cluster's requests with TTFT <= ``target_s``, per cell (K x M)."""
        off = self.offloaded
        loc = self.weights[None, :] - off
        local = wait_sum_cdf(
            target_s - self.local_s[None, None, :],
            self.p_local[:, :, None],
            self.m_local[:, :, None],
            self.p_decode[None, :, None],
            self.m_decode[None, :, None],
        )
        remote = wait_sum_cdf(
            target_s - self.remote_s[:, None, :],
            self.p_prfaas[:, None, None],
            self.m_prfaas[:, None, None],
            self.p_decode[None, :, None],
            self.m_decode[None, :, None],
        )
        return np.asarray(
            (local * loc[:, None, :]).sum(axis=2) + (remote * off[:, None, :]).sum(axis=2)
        )


def pool_costed(fleet: FleetSpec) -> PrfaasPool | None:
    """The PrfaaS pools as one (their instances together, the fastest one's prefill times)."""
    live = [p for p in fleet.prfaas if p.instances > 0]
    if not live:
        return None
    fastest = min(live, key=lambda p: float(prefill_seconds(p.prefill, 32768.0)))
    return PrfaasPool(
        fastest.name, sum(p.instances for p in live), fastest.prefill, fastest.gpus_per_instance
    )


def _guarded(
    fleet: FleetSpec,
    link: Link,
    pool: PrfaasPool,
    x: FloatArray,
    w: FloatArray,
    t: FloatArray,
    rate: float,
    others: PoolLoad,
) -> tuple[FloatArray, FloatArray]:
    """Per threshold (K x N): the weight of each length node the link carries (offered, less
    what its guard refuses, :func:`scheduling.core.link.link_refusal`; refused ones prefill
    locally) and its remote time (prefill, transfer excess at the link's utilisation, RTT).
    The refusals, utilisation and PrfaaS wait are settled by a short damped fixed point, as in
    :func:`scheduling.core.operating.operating_point`."""
    kv = kv_bytes(fleet.kv_mib, x)
    fits = ~link_never_fits(kv, link.budget)
    offered = np.where((x[None, :] > t[:, None]) & fits[None, :], w[None, :], 0.0)
    line = link.gbps * 1e9 / 8
    service = prefill_seconds(pool.prefill, x)
    share = offered.sum(axis=1)
    mix = offered / np.where(share > 0, share, 1.0)[:, None]
    refusal = np.zeros_like(offered)
    remote = np.zeros_like(offered)
    for _ in range(GUARD_ROUNDS):
        carried = offered * (1.0 - refusal)
        utilisation = np.clip(rate * (carried @ kv) / line, 0.0, 1.0) if line > 0 else 1.0
        excess = np.stack(
            [
                transfer_excess_s(kv, service, link.gbps, float(u), link.budget)
                for u in np.broadcast_to(utilisation, (len(t),))
            ]
        )
        remote = service[None, :] + np.minimum(excess, 1e6)
        if rate <= 0 or not np.any(share > 0):
            break
        p_rate = others.rate + rate * carried.sum(axis=1)
        p_s1 = others.s1 + rate * (carried @ service)
        p_s2 = others.s2 + rate * (carried @ (service * service))
        with np.errstate(divide="ignore", invalid="ignore"):
            mean = np.where(p_rate > 0, p_s1 / np.where(p_rate > 0, p_rate, 1.0), 0.0)
            scv = np.where(mean > 0, p_s2 / np.where(p_rate > 0, p_rate, 1.0) / mean**2 - 1.0, 0.0)
        _, wait = mgc_waits(p_rate, mean, np.maximum(scv, 0.0), pool.instances)
        # One knapsack per threshold at once: the transfer's excess (it varies with the
        # row's utilisation) joins the PrfaaS wait as time the row's reservations are held.
        extra = (mix * np.minimum(excess, 1e6)).sum(axis=1)
        live = share > 0
        new = np.zeros_like(offered)
        if np.any(live):
            new[live] = link_refusal(
                rate * share[live],
                OffloadMix(mix[live], kv, service, service + link.rtt_ms / 1000.0),
                np.minimum(wait[live], 1e9) + extra[live],
                link.gbps,
                link.budget,
                admitted=1.0 - (mix[live] * refusal[live]).sum(axis=1),
            )
        refusal = 0.5 * refusal + 0.5 * np.where(fits[None, :], new, 1.0)
    return offered * (1.0 - refusal), remote + link.rtt_ms / 1000.0


def cell_model(
    fleet: FleetSpec,
    c: PdPool,
    pool: PrfaasPool | None,
    lengths: LengthDistribution,
    thresholds: FloatArray,
    n_p: FloatArray,
    rate: float,
    *,
    output_tokens: float,
    output_scv: float,
    others: PoolLoad = PoolLoad(),
    scv_arrival: float = 1.0,
) -> CellModel:
    """The cells of ``c`` (``thresholds`` x ``n_p`` prefill instances) at ``rate`` req/s."""
    x, w = coarse_nodes(lengths)
    t = np.asarray(thresholds, dtype=float)
    local_s = prefill_seconds(c.prefill, x)
    links = sorted((lk for lk, _ in linked_pools(fleet, c.name)), key=lambda lk: -lk.budget)
    if pool is None or not links:
        offloaded = np.zeros((len(t), len(x)))
        remote = np.zeros((len(t), len(x)))
    else:
        offloaded, remote = _guarded(fleet, links[0], pool, x, w, t, rate, others)
    service = prefill_seconds(pool.prefill, x) if pool is not None else np.zeros_like(x)
    s0_off = offloaded.sum(axis=1)
    s1_off = offloaded @ service
    s2_off = offloaded @ (service * service)
    loc = w[None, :] - offloaded
    s0_loc = loc.sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        mean_loc = np.where(s0_loc > 0, (loc @ local_s) / np.where(s0_loc > 0, s0_loc, 1.0), 0.0)
        second = np.where(s0_loc > 0, (loc @ (local_s**2)) / np.where(s0_loc > 0, s0_loc, 1.0), 0.0)
        scv_loc = np.maximum(np.where(mean_loc > 0, second / mean_loc**2 - 1.0, 0.0), 0.0)
    # The pool: the other clusters' offloads and this cluster's at each threshold.
    p_rate = others.rate + rate * s0_off
    p_s1 = others.s1 + rate * s1_off
    p_s2 = others.s2 + rate * s2_off
    with np.errstate(divide="ignore", invalid="ignore"):
        p_mean = np.where(p_rate > 0, p_s1 / np.where(p_rate > 0, p_rate, 1.0), 0.0)
        p_scv = np.where(
            p_mean > 0, p_s2 / np.where(p_rate > 0, p_rate, 1.0) / p_mean**2 - 1.0, 0.0
        )
    instances = pool.instances if pool is not None else 0
    p_prf, m_prf = mgc_waits(
        p_rate, p_mean, np.maximum(p_scv, 0.0), instances, scv_arrival=scv_arrival
    )
    splits = np.asarray(n_p, dtype=int)
    p_loc = np.zeros((len(t), len(splits)))
    m_loc = np.zeros((len(t), len(splits)))
    p_dec = np.zeros(len(splits))
    m_dec = np.zeros(len(splits))
    decode_s = output_tokens * c.step_seconds
    for m, n in enumerate(splits):
        p_loc[:, m], m_loc[:, m] = mgc_waits(
            rate * s0_loc, mean_loc, scv_loc, int(n), scv_arrival=scv_arrival
        )
        pd, md = mgc_waits(rate, decode_s, output_scv, (c.instances - int(n)) * c.max_batch)
        p_dec[m], m_dec[m] = float(pd), float(md)
    return CellModel(
        weights=w,
        offloaded=offloaded,
        local_s=local_s,
        remote_s=remote,
        p_local=p_loc,
        m_local=m_loc,
        p_prfaas=p_prf,
        m_prfaas=m_prf,
        p_decode=p_dec,
        m_decode=m_dec,
        demand=(rate * s0_off, rate * s1_off, rate * s2_off),
    )
