"""Occupancy laws of a loss system of reservations (the link guard's budget, :mod:`scheduling.
core.link`): requests of several sizes, in whole units of a budget of ``G`` units, arrive as
Poisson streams (or negative-binomial crowds) and are refused when they find no room.

Pure numpy: no Django. :func:`occupancy_law` is Panjer's recursion (Kaufman-Roberts with
Poisson counts) over the units taken; :func:`joint_law` carries along a second quantity each
class adds while present (the link's stream rate), capped at a top unit; :func:`class_block`
and :func:`rooms` read refusals off a law; :func:`size_spread` and :func:`class_loads` cut a mix
of fractional sizes into whole-unit classes.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike, NDArray

FloatArray = NDArray[np.float64]


def occupancy_law(loads: FloatArray, dispersion: ArrayLike = 1.0) -> tuple[FloatArray, FloatArray]:
    """The law of the units taken by a random crowd of requests, ``loads[k, b]`` being the
    mean number of requests of ``b`` units present in row ``k``, their count negative binomial
    with variance ``dispersion`` x its mean (1: Poisson). Panjer's recursion; with Poisson
    counts it is Kaufman-Roberts.

    Returns the law truncated to ``0..G`` units (the loss system: requests that find no room
    are refused) and, untruncated, the probability that ``G`` units or more are taken.
    """
    loads = np.atleast_2d(loads)
    if loads.shape[0] == 1:
        return _occupancy_one(loads[0], float(np.max(np.asarray(dispersion, dtype=float))))
    g = loads.shape[-1] - 1
    mean = loads.sum(axis=-1)
    disp = np.maximum(np.broadcast_to(np.asarray(dispersion, dtype=float), mean.shape), 1.0)
    safe = np.where(mean > 0, mean, 1.0)
    f = loads / safe[:, None]
    a = (disp - 1.0) / disp
    b = (mean - disp + 1.0) / disp
    fa = np.ascontiguousarray(f * a[:, None])
    fb = np.ascontiguousarray(f * b[:, None] * np.arange(g + 1, dtype=float))
    # q[n] is stored at rev[g - n], so that q[n-1], ..., q[0] is one contiguous slice.
    rev = np.zeros(loads.shape)
    rev[:, g] = 1.0
    log_scale = np.zeros(loads.shape[0])
    for n in range(1, g + 1):
        tail = rev[:, g - n + 1 :]
        value = np.einsum("ij,ij->i", fa[:, 1 : n + 1], tail)
        value += np.einsum("ij,ij->i", fb[:, 1 : n + 1], tail) / n
        rev[:, g - n] = value
        # Rescale rows that grow large (heavy loads), keeping track of the factor.
        big = value > 1e200
        if big.any():
            rev[big] /= 1e200
            log_scale[big] += math.log(1e200)
    q = np.maximum(rev[:, ::-1], 0.0)
    total = q.sum(axis=-1)
    law = q / total[..., None]
    # log P(nobody there): Poisson -m; negative binomial -(m / (D - 1)) log D.
    excess = disp - 1.0
    with np.errstate(divide="ignore", invalid="ignore"):
        log_empty = np.where(
            excess > 1e-9, -mean / np.where(excess > 1e-9, excess, 1.0) * np.log1p(excess), -mean
        )
        below = np.log(np.maximum(q[..., :g].sum(axis=-1), 1e-300)) + log_scale + log_empty
    tail_p = np.clip(1.0 - np.exp(np.minimum(below, 0.0)), 0.0, 1.0)
    return law, tail_p


def _occupancy_one(loads: FloatArray, dispersion: float) -> tuple[FloatArray, FloatArray]:
    """:func:`occupancy_law` for one row, in plain floats (a loop of numpy calls on one row costs
    more than the arithmetic)."""
    g = len(loads) - 1
    mean = float(loads.sum())
    disp = max(dispersion, 1.0)
    f = [float(v) / mean for v in loads] if mean > 0 else [0.0] * (g + 1)
    a = (disp - 1.0) / disp
    b = (mean - disp + 1.0) / disp
    fa = [a * v for v in f]
    fb = [b * j * v for j, v in enumerate(f)]
    q = [1.0] + [0.0] * g
    scale = 0.0
    for n in range(1, g + 1):
        value = 0.0
        for j in range(1, n + 1):
            value += (fa[j] + fb[j] / n) * q[n - j]
        q[n] = value
        if value > 1e200:
            q = [x / 1e200 for x in q]
            scale += math.log(1e200)
    arr = np.maximum(np.asarray(q), 0.0)
    law = (arr / arr.sum())[None, :]
    excess = disp - 1.0
    log_empty = -mean / excess * math.log1p(excess) if excess > 1e-9 else -mean
    below = math.log(max(float(arr[:g].sum()), 1e-300)) + scale + log_empty
    tail = min(1.0, max(0.0, 1.0 - math.exp(min(below, 0.0))))
    return law, np.array([tail])


def size_spread(units_of: FloatArray, width: int) -> FloatArray:
    """Kinds of fractional size (in units) as a mix of the two whole sizes around them, the
    mean kept: row ``i`` sends kind ``i``'s weight to classes ``0..width-1``."""
    s = np.clip(units_of, 0.0, width - 1)
    lo = np.floor(s).astype(int)
    frac = s - lo
    hi = np.minimum(lo + 1, width - 1)
    out = np.zeros((len(s), width))
    rows = np.arange(len(s))
    out[rows, lo] += 1.0 - frac
    out[rows, hi] += frac
    return out


def class_loads(spread: FloatArray, per_kind: FloatArray) -> FloatArray:
    """Offered load per class (what takes no whole unit takes none)."""
    out = per_kind @ spread
    out[..., 0] = 0.0
    return out


def class_block(law: FloatArray) -> FloatArray:
    """``out[k, b]``: probability that a request of ``b`` units finds no room (more than
    ``units - b`` units taken)."""
    units = law.shape[-1] - 1
    upper = np.concatenate(
        [np.cumsum(law[:, ::-1], axis=1)[:, ::-1], np.zeros((law.shape[0], 1))], axis=1
    )
    return upper[:, units + 1 - np.arange(units + 1)]


def joint_law(budget_spread: FloatArray, rate_spread: FloatArray, loads: FloatArray) -> FloatArray:
    """The joint law of (budget units taken, stream-rate units) on a link, per row:
    ``out[k, b, r]``, ``b`` in ``0..G`` (the loss system: what finds no room is refused),
    ``r`` in ``0..U``, ``U`` standing for the line rate or more. ``loads[k, c]``: mean number
    present of class ``c``, which takes ``budget_spread[c]`` (a law over ``0..G``) units of
    the budget and streams at ``rate_spread[c]`` (over ``0..U``) units of the line rate.
    Poisson counts: classes taking a whole unit or more form one crowd (Kaufman-Roberts on
    the budget units, the rate carried along and capped at ``U``); smaller ones take no
    budget and add their streams independently."""
    rows = loads.shape[0]
    g = budget_spread.shape[1] - 1
    u = rate_spread.shape[1] - 1
    # Class c split into its (b, r) cells: cell loads rows x (G+1) x (U+1).
    cells = np.matmul((loads[:, :, None] * budget_spread[None]).transpose(0, 2, 1), rate_spread)
    small = cells[:, 0, :].copy()
    cells[:, 0, :] = 0.0
    live_b, live_r = np.nonzero(cells.max(axis=0) > 0)
    q = np.zeros((rows, g + 1, u + 1))
    q[:, 0, 0] = 1.0
    for n in range(1, g + 1):
        pick = live_b <= n
        bs, rs = live_b[pick], live_r[pick]
        if len(bs) == 0:
            continue
        prev = q[:, n - bs, :]  # rows x cells x (U+1)
        # Shift each cell's predecessor by its rate units, what passes U piling up at U.
        tail = np.cumsum(prev[:, :, ::-1], axis=2)[:, :, ::-1]
        idx = np.arange(u + 1)[None, :] - rs[:, None]  # cells x (U+1)
        shifted = np.where(idx >= 0, np.take_along_axis(prev, np.maximum(idx, 0)[None], 2), 0.0)
        shifted[:, :, u] = np.take_along_axis(tail, (u - rs)[None, :, None], 2)[:, :, 0]
        coef = cells[:, bs, rs] * (bs[None, :] / n)
        q[:, n, :] = np.einsum("kc,kcr->kr", coef, shifted)
        # Rescale rows that grow large (heavy loads): only the law's shape matters.
        big = q[:, n, :].max(axis=1) > 1e200
        if big.any():
            q[big] /= 1e200
    q = np.maximum(q, 0.0)
    law = q / np.maximum(q.sum(axis=(1, 2)), 1e-300)[:, None, None]
    if small.sum() > 0:
        # Streams of reservations below one budget unit: independent of the budget.
        spread = np.zeros((rows, u + 1))
        spread[:, 1:] = small[:, 1:]
        lone, over = occupancy_law(spread)
        below = lone[:, :u] * ((1.0 - over) / np.maximum(lone[:, :u].sum(axis=1), 1e-300))[:, None]
        extra = np.concatenate([below, over[:, None]], axis=1)
        out = np.zeros_like(law)
        for r in range(u + 1):
            if not extra[:, r].any():
                continue
            moved = np.zeros_like(law)
            moved[:, :, r:] = law[:, :, : u + 1 - r]
            moved[:, :, u] += law[:, :, u + 1 - r :].sum(axis=2)
            out += extra[:, r, None, None] * moved
        law = out
    return law


def rooms(law: FloatArray, rates: slice) -> FloatArray:
    """``out[k, b]``: probability that a reservation of ``b`` budget units finds room while
    the line's rate (joint ``law``) is in ``rates`` (units)."""
    units = law.shape[1] - 1
    taken = np.cumsum(law[:, :, rates].sum(axis=2), axis=1)  # P(taken <= x, rate in rates)
    return taken[:, units - np.arange(units + 1)]
