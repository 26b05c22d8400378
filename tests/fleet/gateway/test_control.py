"""The gateway's side of the control plane (``fleet.gateway.control``) against the real control
plane under uvicorn: outcomes delivered once while the control plane stalls, refusals per
item, a dead control plane costing one timeout and then none."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from clusters.live import telemetry
from controlplane.audit import CLI_ACTOR
from fleet.gateway import metrics
from fleet.gateway.config import ControlPlaneConfig, GatewayConfig
from fleet.gateway.control import ControlPlane
from scheduling.core import routing
from scheduling.core.link import link_key
from scheduling.policies import policy_create
from tests.factories import api_token
from tests.support.fleets import pd_prfaas_fleet
from tests.support.servers import control_plane_serve

pytestmark = pytest.mark.timeout(120)

PD, PRFAAS = "pd-c", "prfaas-c"


@pytest.fixture
def plane(transactional_db: None, redis_client: redis.Redis, settings: Any) -> Iterator[Any]:
    from django.db import connection

    pd_prfaas_fleet(PD, PRFAAS, h20_prefill_seconds=[[1024, 0.6], [32768, 5.0]])
    policy_create(actor=CLI_ACTOR, thresholds={PD: 4096})
    with control_plane_serve(connection.settings_dict, settings.REDIS_URL) as (base, proc):
        yield base, proc


def config(base: str, timeout_s: float = 0.5, **extra: Any) -> GatewayConfig:
    """(Made outside the event loop: it writes a token to the database.)"""
    return GatewayConfig(
        origin=PD,
        control_plane=ControlPlaneConfig(url=base, timeout_s=timeout_s),
        token=api_token("router")[1],
        outcome_interval_s=0.1,
        **extra,
    )


def an_outcome(request_id: str, key: str, reservation: dict[str, Any] | None = None) -> dict:
    d = routing.RouteDecision(
        route="local",
        prefill=routing.Placement(PD, f"{PD}-p0", ""),
        decode=routing.Placement(PD, f"{PD}-d0", ""),
        incremental_tokens=1000,
        cached_tokens=0,
        threshold=4096,
        policy_version=1,
        reason="below_threshold",
        ttft_estimate_s=routing.TtftEstimate(local=0.5, prfaas=None),
        request_id=request_id,
    )
    decision = routing.decision_to_dict(d)
    decision["reservation"] = reservation
    return {
        "decision": decision,
        "decided_by": "gateway",
        "origin": PD,
        "prompt_tokens": 1000,
        "route": "local",
        "reason": "below_threshold",
        "prefill": {"cluster": PD, "instance": f"{PD}-p0"},
        "decode": {"cluster": PD, "instance": f"{PD}-d0"},
        "incremental_tokens": 1000,
        "cached_tokens": 0,
        "output_tokens": 4,
        "observed_ttft_s": 0.4,
        "transfer": "none",
        "transfer_bytes": 0,
        "status": "ok",
        "error": None,
        "ts": time.time(),
        "request_id": request_id,
        "block_hashes": 0,
        "idempotency_key": key,
    }


def recent(base: str) -> list[dict[str, Any]]:
    got = httpx.get(
        f"{base}/api/v1/outcomes/recent?limit=500",
        headers={"Authorization": f"Bearer {api_token('read')[1]}"},
        timeout=10,
    )
    assert got.status_code == 200, got.text
    return list(got.json())


def test_outcomes_retried_past_a_stalled_control_plane_are_applied_once(plane: Any) -> None:
    # Issue 30, finding 2: stalled 4 s, the control plane later applied each of the gateway's
    # timed-out copies (30 outcomes for 10 requests).
    base, proc = plane
    cfg = config(base, timeout_s=0.5)

    async def run() -> None:
        control = ControlPlane(cfg)
        await control.start()
        try:
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                for i in range(10):
                    control.outcome_add(an_outcome(f"st-{i}", f"st-{i}/a"), notable=True)
                await asyncio.sleep(4.0)  # timed-out posts pile up in the stopped server
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            deadline = time.monotonic() + 30
            while control.outcomes_pending and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert control.outcomes_pending == 0
            await asyncio.sleep(1.0)  # the last copies the server still held
        finally:
            await control.close()

    asyncio.run(run())
    ids = sorted(r["request_id"] for r in recent(base))
    assert ids == sorted(f"st-{i}" for i in range(10))


def test_two_flushes_at_once_send_each_outcome_once(plane: Any) -> None:
    # The flush loop and a caller (shutdown) may flush together: each outcome goes once.
    base, _ = plane
    cfg = config(base, outcome_batch=3)

    async def run() -> list[int]:
        control = ControlPlane(cfg)
        try:
            for i in range(10):
                control.outcome_add(an_outcome(f"tw-{i}", f"tw-{i}/a"), notable=True)
            sent = await asyncio.gather(control.flush(), control.flush(), control.flush())
            assert control.outcomes_pending == 0
            return list(sent)
        finally:
            await control.close()

    sent = asyncio.run(run())
    assert sum(sent) == 10
    ids = sorted(r["request_id"] for r in recent(base))
    assert ids == sorted(f"tw-{i}" for i in range(10))


def test_a_refused_outcome_is_counted_and_the_others_release_their_reservations(
    plane: Any,
) -> None:
    # Finding 1 through the gateway: one outcome the control plane cannot take beside three
    # offloads: theirs are applied and every reservation is released.
    base, _ = plane
    cfg = config(base)

    async def run() -> None:
        control = ControlPlane(cfg)
        await control.start()
        try:
            # Read before queueing: the gateway's own flush loop may send them meanwhile.
            before = metrics.OUTCOMES_REJECTED.labels("invalid")._value.get()
            link = routing.LinkReservation(PRFAAS, PD, 300_000_000, None)
            for i in range(4):
                taken = await asyncio.to_thread(control.client.link_reserve, link, 60.0)
                assert taken is not None
                rv = {"source": PRFAAS, "target": PD, "bytes": taken.bytes, "id": taken.id}
                item = an_outcome(f"rf-{i}", f"rf-{i}/a", rv)
                if i == 1:
                    item["prompt_tokens"] = 15_000_000
                control.outcome_add(item, notable=True)
            await control.flush()
            assert metrics.OUTCOMES_REJECTED.labels("invalid")._value.get() == before + 1
        finally:
            await control.close()

    asyncio.run(run())
    assert telemetry.link_reserved_bytes(link_key(PRFAAS, PD)) == 0
    assert sorted(r["request_id"] for r in recent(base)) == ["rf-0", "rf-2", "rf-3"]
