"""The decision log: the recent-decisions list copied into rows kept for hours, searchable."""

from __future__ import annotations

import json

import pytest
from django.test import override_settings

from controlplane.redis_connection import redis_sync
from scheduling.decision_log import decision_log_archive, decision_log_page
from scheduling.models import DecisionRecord
from scheduling.traffic import RECENT_CAP, recent_queue

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("redis_client")]

T0 = 1.8e9


def _push(n: int, start: float = T0, origin: str = "pd-a") -> None:
    pipe = redis_sync().pipeline()
    for i in range(n):
        entry = {
            "ts": start + i,
            "inputs": {
                "origin": origin,
                "prompt_tokens": 1000 + i,
                "request_id": f"req-{int(start - T0) + i}",
            },
            "decision": {"route": "local", "reason": "below_threshold"},
        }
        recent_queue(pipe, json.dumps(entry))
    pipe.execute()


def test_copying_the_same_entries_twice_keeps_each_decision_once() -> None:
    _push(30)
    assert decision_log_archive(now=T0 + 30).added == 30
    assert decision_log_archive(now=T0 + 31).added == 0
    assert DecisionRecord.objects.count() == 30


def test_the_log_holds_decisions_long_after_the_recent_list_dropped_them() -> None:
    step = RECENT_CAP - 100  # copied before the list turns over, as the 2 s beat does
    for batch in range(5):
        assert decision_log_archive(now=T0 + batch * step).overflowed is False
        _push(step, start=T0 + batch * step)
    decision_log_archive(now=T0 + 5 * step)
    assert len(redis_sync().lrange("traffic:recent", 0, -1)) == RECENT_CAP
    assert DecisionRecord.objects.count() == 5 * step
    (row,) = decision_log_page(request_id="req-0").rows
    assert row["ts"] == T0  # the very first one, long gone from the list


@override_settings(DECISION_LOG_RETENTION_S=100, DECISION_LOG_MAX_ROWS=1000)
def test_the_log_drops_decisions_older_than_its_retention() -> None:
    _push(50)
    decision_log_archive(now=T0 + 120)
    assert sorted(DecisionRecord.objects.values_list("ts", flat=True)) == [
        T0 + i for i in range(20, 50)
    ]


def test_pages_walk_back_through_the_log_without_repeats() -> None:
    _push(120)
    decision_log_archive(now=T0 + 120)
    seen: list[str] = []
    page = decision_log_page(limit=50)
    assert page.total == 120
    while True:
        seen += [r["inputs"]["request_id"] for r in page.rows]
        if page.older is None:
            break
        page = decision_log_page(before=page.older, limit=50)
    assert seen == [f"req-{i}" for i in reversed(range(120))]


def test_a_cursor_that_is_not_one_shows_the_newest_page() -> None:
    _push(3)
    decision_log_archive(now=T0 + 3)
    assert len(decision_log_page(before="nan:x").rows) == 3
    assert len(decision_log_page(before="inf:3").rows) == 3
