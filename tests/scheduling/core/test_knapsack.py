"""The loss system's occupancy laws: exact against Erlang's loss formula and a brute-force
enumeration of the stationary law of two classes."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from scheduling.core.knapsack import class_block, joint_law, occupancy_law, rooms


def erlang_b(servers: int, offered: float) -> float:
    terms = [offered**k / math.factorial(k) for k in range(servers + 1)]
    return terms[-1] / sum(terms)


def test_one_unit_requests_are_refused_as_erlangs_loss_formula_says() -> None:
    loads = np.zeros((1, 9))
    loads[0, 1] = 5.0  # 5 erlangs of one-unit requests on 8 units
    law, _ = occupancy_law(loads)
    assert class_block(law)[0, 1] == pytest.approx(erlang_b(8, 5.0), rel=1e-9)


def test_two_sizes_share_the_budget_as_their_product_form_says() -> None:
    # 2.0 erlangs of 1-unit and 0.7 of 3-unit requests on 6 units: the stationary law is
    # a^n1/n1! * b^n2/n2! over the states that fit, normalised.
    a, b, g = 2.0, 0.7, 6
    weight = {}
    for n1, n2 in itertools.product(range(g + 1), range(g // 3 + 1)):
        if n1 + 3 * n2 <= g:
            weight[(n1, n2)] = a**n1 / math.factorial(n1) * b**n2 / math.factorial(n2)
    total = sum(weight.values())
    taken = np.zeros(g + 1)
    for (n1, n2), w in weight.items():
        taken[n1 + 3 * n2] += w / total
    loads = np.zeros((1, g + 1))
    loads[0, 1], loads[0, 3] = a, b
    law, _ = occupancy_law(loads)
    np.testing.assert_allclose(law[0], taken, rtol=1e-9)
    # A 3-unit request is refused when more than 3 units are taken.
    assert class_block(law)[0, 3] == pytest.approx(taken[4:].sum(), rel=1e-9)
    # The joint law without streams is the same knapsack, all of it at rate 0.
    budget = np.eye(g + 1)[[1, 3]]
    rate = np.eye(3)[[0, 0]]
    joint = joint_law(budget, rate, np.array([[a, b]]))
    np.testing.assert_allclose(joint[0, :, 0], taken, rtol=1e-9)
    np.testing.assert_allclose(rooms(joint, slice(0, 3))[0], 1.0 - class_block(law)[0], rtol=1e-9)
