"""The building blocks: the fluid link (the prefix cache: tests/scheduling/core/
test_prefix_cache.py)."""

from __future__ import annotations

import math

import pytest

from scheduling.core.simulator.link import Flow, FluidLink


def _run_link(link: FluidLink, until: float) -> list[tuple[float, Flow]]:
    """Advance a link event by event until ``until``; returns (time, flow) completions."""
    done: list[tuple[float, Flow]] = []
    now = link.last_s
    while True:
        link.reshare()
        wait = link.next_completion()
        if now + wait > until or math.isinf(wait):
            link.advance(until)
            done.extend((until, f) for f in link.finished())
            return done
        now += wait
        link.advance(now)
        done.extend((now, f) for f in link.finished())


def test_concurrent_transfers_share_the_link_fairly() -> None:
    link = FluidLink("a", "b", capacity_bps=100.0, rtt_s=0.0)
    big = Flow("big", 300.0, 300.0, math.inf, False)
    small = Flow("small", 100.0, 100.0, math.inf, False)
    link.flows = [big, small]
    done = _run_link(link, 10.0)
    # Both at 50 B/s until the small one ends at t=2, then the big one alone at 100 B/s.
    assert [(t, f.owner) for t, f in done] == [
        (pytest.approx(2.0), "small"),
        (pytest.approx(4.0), "big"),
    ]
    assert link.sent_bytes == pytest.approx(400.0)
    assert link.delivered_bytes == pytest.approx(400.0)


def test_a_transfer_cannot_outrun_its_prefill_and_leaves_the_rest_to_others() -> None:
    link = FluidLink("a", "b", capacity_bps=100.0, rtt_s=0.0)
    streaming = Flow("streaming", 100.0, 100.0, cap_bps=20.0, producing=True)  # 5 s prefill
    bulk = Flow("bulk", 240.0, 240.0, math.inf, False)
    link.flows = [streaming, bulk]
    link.reshare()
    assert streaming.rate == pytest.approx(20.0)
    assert bulk.rate == pytest.approx(80.0)
    done = _run_link(link, 5.0)
    assert [f.owner for _, f in done] == ["bulk"]
    assert done[0][0] == pytest.approx(3.0)
    # The prefill ends at t=5: everything it produced has been sent by then.
    assert streaming.remaining_bytes == pytest.approx(0.0, abs=1e-6)
    streaming.producing = False
    streaming.cap_bps = math.inf
    assert [f.owner for f in link.finished()] == ["streaming"]


def test_utilisation_series_is_bucketed_per_second() -> None:
    link = FluidLink("a", "b", capacity_bps=100.0, rtt_s=0.0)
    link.flows = [Flow("x", 250.0, 250.0, math.inf, False)]
    _run_link(link, 10.0)
    assert link.buckets[:3] == pytest.approx([100.0, 100.0, 50.0])
