"""Optimistic concurrency under real contention: eight writers, one row, one version each."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, connections

from clusters.models import Accelerator
from clusters.services import accelerator_update
from controlplane.audit import Actor
from controlplane.errors import Conflict
from controlplane.models import ChangeRecord
from tests.factories import AcceleratorFactory

WRITERS = 8


def _require_postgresql() -> None:
    if connection.vendor != "postgresql":
        pytest.skip(
            f"row-lock semantics are PostgreSQL's; this database is {connection.vendor} "
            "(set DATABASE_URL=postgres://...)"
        )


def _race(accelerator_id: int, rounds_per_writer: int) -> tuple[list[int], list[Conflict]]:
    """Each writer reads the version, then all write at once; every attempt writes a value of its
    own, so no attempt is a no-op (a no-op update leaves the version alone)."""
    barrier = threading.Barrier(WRITERS)
    wins: list[int] = []
    conflicts: list[Conflict] = []
    lock = threading.Lock()

    def writer(n: int) -> None:
        try:
            for round_ in range(rounds_per_writer):
                version = Accelerator.objects.get(pk=accelerator_id).version
                barrier.wait(timeout=30)
                try:
                    accelerator_update(
                        accelerator_id=accelerator_id,
                        version=version,
                        changes={"gpu_hour_cost": float(1 + n + WRITERS * round_)},
                        actor=Actor(label=f"writer-{n}", source="test"),
                    )
                except Conflict as exc:
                    with lock:
                        conflicts.append(exc)
                else:
                    with lock:
                        wins.append(n)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(WRITERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return wins, conflicts


@pytest.mark.django_db(transaction=True)
def test_eight_concurrent_writers_with_one_version_lose_no_update() -> None:
    _require_postgresql()
    accelerator = AcceleratorFactory(gpu_hour_cost=0.5)
    rounds = 3
    wins, conflicts = _race(accelerator.pk, rounds)

    final = Accelerator.objects.get(pk=accelerator.pk)
    # Every attempt either won or got a 409: none vanished.
    assert len(wins) + len(conflicts) == WRITERS * rounds
    # The version counts exactly the winning writes: no two writers won with the same version.
    assert final.version == 1 + len(wins)
    assert len(wins) >= rounds
    # In the first round all eight hold version 1, so exactly one of them can win it.
    assert len(conflicts) >= WRITERS - 1
    # The stored value is the last winner's, and every win left its own audit record.
    records = list(
        ChangeRecord.objects.filter(
            object_type="clusters.accelerator", object_id=str(accelerator.pk), action="update"
        ).order_by("id")
    )
    assert len(records) == len(wins)
    afters = [r.after or {} for r in records]
    assert [a["version"] for a in afters] == list(range(2, final.version + 1))
    assert final.gpu_hour_cost == afters[-1]["gpu_hour_cost"]
    for conflict in conflicts:
        assert conflict.status == 409
        assert "is at version" in conflict.detail
