"""The agent's uplink against the real control plane: refusals are per instance (a misspelt
instance or one outside the token's binding does not hold back the others), and its buffered
items gauge says what it holds."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from clusters.live import prefix_index, telemetry
from fleet.agent.metrics import AgentMetrics
from fleet.agent.uplink import Uplink, UplinkLimits
from scheduling.core import kv_vllm
from scheduling.core.kv_events import BlocksStored
from tests.factories import ClusterFactory, InstanceFactory, api_token
from tests.support.servers import control_plane_serve, free_port

pytestmark = pytest.mark.timeout(120)

BOUND, OTHER, MISSPELT = "pd-u-p0", "pd-u-p1", "pd-u-pO"
TELEMETRY = "/api/v1/telemetry"


@pytest.fixture
def plane(transactional_db: None, redis_client: redis.Redis, settings: Any) -> Iterator[str]:
    from django.db import connection

    pd = ClusterFactory(name="pd-u", model__block_tokens=32)
    InstanceFactory(cluster=pd, name=BOUND)
    InstanceFactory(cluster=pd, name=OTHER)
    with control_plane_serve(connection.settings_dict, settings.REDIS_URL) as (base, _proc):
        yield base


def value(metric: Any, **labels: str) -> float:
    return float(metric.labels(**labels)._value.get())


def sample(instance: str, running: int) -> dict[str, Any]:
    return {"instance": instance, "ts": time.time(), "running": running}


def stored(block: int) -> bytes:
    return kv_vllm.batch_encode([BlocksStored([block], 32, medium="GPU")], 1.0)


def test_a_refused_instance_is_dropped_alone_and_the_others_go_on(
    plane: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Issue 30, finding 6: a misspelt instance beside a healthy one had every sample refused
    # (404); a token bound to one of two instances had its posts refused (403) and retried for
    # ever, nothing through for either.
    metrics = AgentMetrics()
    uplink = Uplink(plane, api_token("agent", instances=(BOUND,))[1], metrics)
    with caplog.at_level(logging.ERROR, logger="fleet.agent.uplink"):
        uplink.telemetry_put([sample(BOUND, 3), sample(OTHER, 4), sample(MISSPELT, 5)], [])
        uplink.kv_batch_put(OTHER, 0, stored(7))
        uplink.kv_batch_put(BOUND, 0, stored(8))
        assert uplink.flush()
    assert telemetry.instance_states_read([BOUND])[BOUND].running == 3
    assert prefix_index.prefix_index_states([BOUND])[0].last_seq == 0
    # (a name outside the binding is refused as such, known or not)
    assert uplink.refused() == {OTHER: "outside_binding", MISSPELT: "outside_binding"}
    assert value(metrics.refused, name=OTHER, code="outside_binding") == 1
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert OTHER in logged and MISSPELT in logged and "outside_binding" in logged
    assert uplink.buffered() == 0

    # Refused names are not sent again (until their retry time); the healthy one flows.
    posts = [value(metrics.posts, endpoint=TELEMETRY, outcome=s) for s in ("200", "403", "404")]
    for running in (6, 7):
        uplink.telemetry_put([sample(BOUND, running), sample(OTHER, 1), sample(MISSPELT, 1)], [])
        uplink.kv_batch_put(OTHER, 1, stored(9))
        assert uplink.flush()
    assert telemetry.instance_states_read([BOUND])[BOUND].running == 7
    assert value(metrics.posts, endpoint=TELEMETRY, outcome="403") == posts[1]
    assert value(metrics.posts, endpoint=TELEMETRY, outcome="404") == posts[2]
    assert value(metrics.dropped, kind="telemetry_sample", reason="refused_name") == 4
    assert value(metrics.dropped, kind="kv_batch", reason="refused_name") == 3
    uplink.close()


def test_a_misspelt_instance_is_refused_alone_and_accepted_once_it_is_known(
    plane: str,
) -> None:
    metrics = AgentMetrics()
    uplink = Uplink(plane, api_token("agent")[1], metrics, UplinkLimits(refused_retry_s=0.5))
    uplink.telemetry_put([sample(BOUND, 1), sample("pd-u-p2", 2)], [])
    assert uplink.flush()
    assert telemetry.instance_states_read([BOUND])[BOUND].running == 1
    assert uplink.refused() == {"pd-u-p2": "unknown_instance"}
    assert value(metrics.refused, name="pd-u-p2", code="unknown_instance") == 1
    InstanceFactory(cluster__name="pd-u-2", name="pd-u-p2")
    time.sleep(0.6)
    uplink.telemetry_put([sample(BOUND, 1), sample("pd-u-p2", 2)], [])
    assert uplink.flush()
    assert uplink.refused() == {}
    assert value(metrics.refused, name="pd-u-p2", code="unknown_instance") == 0
    assert telemetry.instance_states_read(["pd-u-p2"])["pd-u-p2"].running == 2
    uplink.close()


def test_the_buffered_items_gauge_is_what_the_buffers_hold() -> None:
    # Finding 7: prfaas_agent_buffered_items read 563 with the buffer empty (drops were not
    # subtracted).
    metrics = AgentMetrics()
    limits = UplinkLimits(max_kv_batches=5, max_telemetry=2, backoff_min_s=30)
    uplink = Uplink(f"http://127.0.0.1:{free_port()}", "t", metrics, limits)
    for seq in range(8):
        uplink.kv_batch_put(BOUND, seq, b"x")
    for _ in range(3):
        uplink.telemetry_put([sample(BOUND, 1)], [])
    assert value(metrics.buffered, kind="kv_batch") == 5
    assert value(metrics.buffered, kind="telemetry") == 2
    assert uplink.buffered() == 7
    uplink.close()
