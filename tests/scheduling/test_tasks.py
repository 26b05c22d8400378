"""Celery tasks through a real worker (a subprocess on the session's Redis): the brute force's
cells, sent as a group, come back exactly as this process computes them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import group

from scheduling.core.brute_force import SEED, slo_cell_goodput
from scheduling.core.scenario import scenario_load
from scheduling.core.scenario_writer import scenario_to_dict
from scheduling.tasks import slo_cell_goodput as slo_cell_goodput_task
from tests.support.servers import celery_worker_start, celery_worker_stop

pytestmark = pytest.mark.slow

REQUESTS = 1000  # fewer, and the run's edges alone keep it from sustaining 97%
NEVER = 131_100.0


@pytest.fixture
def worker(redis_client: Any) -> Iterator[None]:
    proc = celery_worker_start()
    yield
    celery_worker_stop(proc)


def test_brute_force_cells_sent_as_a_group_come_back_as_computed_in_process(
    worker: None, scenarios_dir: Path
) -> None:
    scenario = scenario_load(scenarios_dir / "thin-link.yaml")
    # A tiny grid over the thin link (8 instances): an offloading threshold and never, two
    # splits, every cell from zero; then one cell again, floored at another's goodput (as
    # the brute force floors a wave at the best rate before it).
    cells = [({"pd-h20": (t, n, 8 - n)}, 0.0) for t in (12_000.0, NEVER) for n in (5, 6)]
    here = [
        slo_cell_goodput(scenario, cell, floor, slo_s=15.0, requests=REQUESTS)
        for cell, floor in cells
    ]
    cells.append(({"pd-h20": (12_000.0, 6, 2)}, here[0].rate_rps))
    here.append(slo_cell_goodput(scenario, *cells[-1], slo_s=15.0, requests=REQUESTS))
    data = scenario_to_dict(scenario)
    sent = group(
        slo_cell_goodput_task.s(
            data, {k: list(v) for k, v in cell.items()}, floor, 15.0, REQUESTS, SEED
        )
        for cell, floor in cells
    )
    there = sent.apply_async().get(timeout=240)

    # Same seed, same cell: the same goodput to the last bit, and the same simulations.
    assert [r["rate_rps"] for r in there] == [h.rate_rps for h in here]
    assert [r["simulations"] for r in there] == [h.simulations for h in here]
    assert all(h.rate_rps > 0 for h in here[:4]) and here[4].simulations >= 1
