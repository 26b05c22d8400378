"""The route path's in-process live state: used while younger than its bound, never older.

Another process's telemetry is written straight to the real Redis (as that process's ingest
would), so this process only learns of it by reading Redis again.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from django.test import AsyncClient

from clusters.live import telemetry as live_telemetry
from scheduling import livestate
from tests.scheduling.api.test_route import Fleet, _fleet, route, telemetry


@pytest.fixture
def fleet(transactional_db: None, route_state_clean: None) -> Fleet:
    return _fleet(budget_bytes=50 * 2**30)


async def backlog_elsewhere(queued_tokens: int) -> None:
    """Another web process ingests telemetry: PrfaaS prefill queues far over the hard limit."""
    now = time.time()
    samples = [
        live_telemetry.InstanceSample(
            f"prfaas-x-p{i}", now, queue_depth=40, queued_prefill_tokens=queued_tokens
        )
        for i in range(2)
    ]
    await live_telemetry.telemetry_batch_store_async(samples, [])


async def test_live_state_younger_than_its_bound_is_used(fleet: Fleet, settings: Any) -> None:
    settings.LIVE_STATE_MAX_AGE_S = 30.0
    settings.LIVE_STATE_REFRESH_S = 30.0
    client = AsyncClient()
    await telemetry(client, fleet)
    before = await route(client, fleet, prompt_tokens=60_000)
    await backlog_elsewhere(5_000_000)
    during = await route(client, fleet, prompt_tokens=60_000)
    assert before["route"] == during["route"] == "prfaas"
    assert 0 <= during["live_age_s"] <= 30.0


async def test_live_state_older_than_its_bound_is_not_used(fleet: Fleet, settings: Any) -> None:
    settings.LIVE_STATE_MAX_AGE_S = 0.3
    settings.LIVE_STATE_REFRESH_S = 30.0  # no background read: only the bound can renew it
    client = AsyncClient()
    await telemetry(client, fleet)
    before = await route(client, fleet, prompt_tokens=60_000)
    await backlog_elsewhere(5_000_000)
    await asyncio.sleep(0.4)
    after = await route(client, fleet, prompt_tokens=60_000)
    assert (before["route"], after["route"]) == ("prfaas", "local")
    assert after["reason"] == "prfaas_backlog"
    assert after["live_age_s"] < 0.3


async def test_a_read_past_the_refresh_period_is_renewed_in_the_background(
    fleet: Fleet, settings: Any
) -> None:
    settings.LIVE_STATE_MAX_AGE_S = 30.0
    settings.LIVE_STATE_REFRESH_S = 0.05
    client = AsyncClient()
    await telemetry(client, fleet)
    await route(client, fleet, prompt_tokens=60_000)
    first = livestate.live_state_cached()
    await backlog_elsewhere(5_000_000)
    await asyncio.sleep(0.1)
    # This call still decides with the read it has (younger than the bound) ...
    assert (await route(client, fleet, prompt_tokens=60_000))["route"] == "prfaas"
    # ... and has started the next read, which the following calls decide with.
    for _ in range(50):
        if livestate.live_state_cached() is not first:
            break
        await asyncio.sleep(0.02)
    assert (await route(client, fleet, prompt_tokens=60_000))["reason"] == "prfaas_backlog"


async def test_telemetry_ingested_here_replaces_the_read_at_once(
    fleet: Fleet, settings: Any
) -> None:
    settings.LIVE_STATE_MAX_AGE_S = 30.0
    settings.LIVE_STATE_REFRESH_S = 30.0
    client = AsyncClient()
    await telemetry(client, fleet)
    assert (await route(client, fleet, prompt_tokens=60_000))["route"] == "prfaas"
    await telemetry(client, fleet, prfaas_queued_tokens=5_000_000)
    assert (await route(client, fleet, prompt_tokens=60_000))["reason"] == "prfaas_backlog"
