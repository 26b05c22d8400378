"""The live-view websocket: authentication, snapshots, sequence numbers, gaps and resync."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from typing import Any, cast

import pytest
import redis
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.test import AsyncClient, Client

from clusters.models import Instance, Link
from controlplane import live
from controlplane.asgi import application
from scheduling.consumers import (
    CLOSE_FORBIDDEN,
    CLOSE_UNAUTHENTICATED,
    CLOSE_UNKNOWN_GROUP,
    HEARTBEAT_S,
    REORDER_WINDOW_S,
)
from scheduling.overview import overview_tick_publish
from tests.factories import (
    ClusterFactory,
    InstanceFactory,
    LinkFactory,
    UserFactory,
    api_token,
)
from tests.support.processes import RedisServer

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("redis_client")]

TIMEOUT = 3


def _session_cookie(username: str = "ops", groups: tuple[str, ...] = ("viewer",)) -> bytes:
    user = cast(Any, UserFactory(username=username, groups=list(groups)))
    client = Client()
    client.force_login(user)
    return f"sessionid={client.cookies['sessionid'].value}".encode()


async def _communicator(group: str, cookie: bytes | None) -> WebsocketCommunicator:
    headers = [(b"origin", b"http://testserver"), (b"host", b"testserver")]
    if cookie is not None:
        headers.append((b"cookie", cookie))
    return WebsocketCommunicator(application, f"/ws/live/{group}/", headers=headers)


async def _connected(group: str = live.PLANS) -> tuple[WebsocketCommunicator, dict[str, Any]]:
    cookie = await sync_to_async(_session_cookie)()
    comm = await _communicator(group, cookie)
    connected, _ = await comm.connect(timeout=TIMEOUT)
    assert connected
    snapshot = await comm.receive_json_from(timeout=TIMEOUT)
    return comm, snapshot


def _event(n: int) -> live.PlanEvent:
    return live.PlanEvent(plan_id=n, state="proposed", ts=1000.0 + n, actor="test")


async def test_an_anonymous_connection_is_closed_with_4401() -> None:
    comm = await _communicator(live.OVERVIEW, cookie=None)
    await comm.connect(timeout=TIMEOUT)
    closed = await comm.receive_output(timeout=TIMEOUT)
    assert closed == {"type": "websocket.close", "code": CLOSE_UNAUTHENTICATED}
    await comm.disconnect()


async def test_a_user_in_no_access_group_is_closed_with_4403() -> None:
    cookie = await sync_to_async(_session_cookie)("nobody", ())
    comm = await _communicator(live.OVERVIEW, cookie)
    await comm.connect(timeout=TIMEOUT)
    closed = await comm.receive_output(timeout=TIMEOUT)
    assert closed == {"type": "websocket.close", "code": CLOSE_FORBIDDEN}
    await comm.disconnect()


async def test_a_message_that_is_not_json_gets_an_error_and_the_socket_stays_open() -> None:
    comm, _ = await _connected()
    await comm.send_to(text_data="{not json")
    reply = await comm.receive_json_from(timeout=TIMEOUT)
    assert reply["type"] == "error"
    await comm.send_json_to({"type": "resync"})
    assert (await comm.receive_json_from(timeout=TIMEOUT))["type"] == "snapshot"
    await comm.disconnect()


@pytest.mark.parametrize(
    "message",
    ["[" * 200_000 + "]" * 200_000, '{"type": "resync", "pad": "' + "x" * 10_000 + '"}'],
    ids=["nested 200k deep", "10 KB"],
)
async def test_a_deeply_nested_or_huge_message_is_not_parsed_and_the_socket_stays_open(
    message: str,
) -> None:
    comm, _ = await _connected()
    await comm.send_to(text_data=message)
    assert (await comm.receive_json_from(timeout=TIMEOUT))["type"] == "error"
    await comm.send_json_to({"type": "resync"})
    assert (await comm.receive_json_from(timeout=TIMEOUT))["type"] == "snapshot"
    await comm.disconnect()


async def test_an_unknown_group_is_closed_with_4404() -> None:
    cookie = await sync_to_async(_session_cookie)()
    comm = await _communicator("secrets", cookie)
    await comm.connect(timeout=TIMEOUT)
    closed = await comm.receive_output(timeout=TIMEOUT)
    assert closed == {"type": "websocket.close", "code": CLOSE_UNKNOWN_GROUP}
    await comm.disconnect()


async def test_connecting_sends_a_snapshot_with_the_groups_current_sequence_number() -> None:
    for n in range(3):
        await live.live_apublish(live.PLANS, _event(n))
    comm, snapshot = await _connected(live.PLANS)
    assert snapshot["type"] == "snapshot"
    assert snapshot["group"] == live.PLANS
    assert snapshot["seq"] == 3
    assert snapshot["reason"] == "connect"
    assert isinstance(snapshot["data"], dict)
    await comm.disconnect()


async def test_the_overview_snapshot_carries_links_clusters_and_alerts() -> None:
    comm, snapshot = await _connected(live.OVERVIEW)
    assert snapshot["seq"] == 0
    assert {"links", "clusters", "alerts", "window_s"} <= set(snapshot["data"])
    await comm.disconnect()


async def test_frames_follow_the_snapshot_with_consecutive_sequence_numbers() -> None:
    await live.live_apublish(live.PLANS, _event(0))
    comm, snapshot = await _connected()
    for n in range(1, 4):
        await live.live_apublish(live.PLANS, _event(n))
    frames = [await comm.receive_json_from(timeout=TIMEOUT) for _ in range(3)]
    assert [f["seq"] for f in frames] == [
        snapshot["seq"] + 1,
        snapshot["seq"] + 2,
        snapshot["seq"] + 3,
    ]
    assert [f["data"]["plan_id"] for f in frames] == [1, 2, 3]
    assert all(f["type"] == "plan_event" and f["epoch"] == snapshot["epoch"] for f in frames)
    await comm.disconnect()


async def test_a_frame_published_from_sync_code_reaches_the_socket() -> None:
    comm, snapshot = await _connected()
    await sync_to_async(live.live_publish)(live.PLANS, _event(7))
    frame = await comm.receive_json_from(timeout=TIMEOUT)
    assert (frame["seq"], frame["data"]["plan_id"]) == (snapshot["seq"] + 1, 7)
    await comm.disconnect()


async def test_two_publishers_never_hand_out_the_same_sequence_number() -> None:
    results = await asyncio.gather(*(live.asequence_next(live.PLANS) for _ in range(50)))
    seqs = sorted(seq for _, seq in results)
    assert seqs == list(range(1, 51))
    assert len({epoch for epoch, _ in results}) == 1


async def test_frames_arriving_out_of_order_are_sent_in_order() -> None:
    comm, snapshot = await _connected()
    epoch, base = snapshot["epoch"], snapshot["seq"]
    layer = get_channel_layer()
    for seq in (base + 2, base + 1):  # the later number reaches the layer first
        frame = live.frame_make(live.PLANS, _event(seq), epoch, seq)
        await layer.group_send(live.PLANS, {"type": live.FRAME_EVENT, "frame": frame})
    frames = [await comm.receive_json_from(timeout=TIMEOUT) for _ in range(2)]
    assert [f["seq"] for f in frames] == [base + 1, base + 2]
    await comm.disconnect()


async def test_a_duplicate_frame_is_dropped() -> None:
    comm, snapshot = await _connected()
    frame = await live.live_apublish(live.PLANS, _event(1))
    layer = get_channel_layer()
    await layer.group_send(live.PLANS, {"type": live.FRAME_EVENT, "frame": frame})
    await live.live_apublish(live.PLANS, _event(2))
    got = [await comm.receive_json_from(timeout=TIMEOUT) for _ in range(2)]
    assert [f["seq"] for f in got] == [snapshot["seq"] + 1, snapshot["seq"] + 2]
    assert await comm.receive_nothing(timeout=0.2)
    await comm.disconnect()


async def test_a_lost_frame_is_answered_with_a_fresh_snapshot() -> None:
    comm, snapshot = await _connected()
    await live.asequence_next(live.PLANS)  # a number given out whose frame never arrives
    await live.live_apublish(live.PLANS, _event(2))
    resync = await comm.receive_json_from(timeout=TIMEOUT + REORDER_WINDOW_S)
    assert resync["type"] == "snapshot"
    assert resync["reason"] == "gap"
    assert resync["seq"] == snapshot["seq"] + 2
    await live.live_apublish(live.PLANS, _event(3))
    after = await comm.receive_json_from(timeout=TIMEOUT)
    assert after["seq"] == resync["seq"] + 1
    await comm.disconnect()


async def test_a_client_that_asks_for_a_resync_gets_a_snapshot() -> None:
    comm, _ = await _connected()
    for n in range(2):
        await live.live_apublish(live.PLANS, _event(n))
    for _ in range(2):
        await comm.receive_json_from(timeout=TIMEOUT)
    await comm.send_json_to({"type": "resync"})
    snapshot = await comm.receive_json_from(timeout=TIMEOUT)
    assert (snapshot["type"], snapshot["reason"], snapshot["seq"]) == ("snapshot", "requested", 2)
    await comm.disconnect()


async def test_an_unknown_client_message_gets_an_error_naming_the_accepted_one() -> None:
    comm, _ = await _connected()
    await comm.send_json_to({"type": "subscribe", "group": "secrets"})
    reply = await comm.receive_json_from(timeout=TIMEOUT)
    assert reply["type"] == "error"
    assert "resync" in reply["detail"]
    await comm.disconnect()


async def test_a_new_epoch_after_a_redis_reset_is_answered_with_a_snapshot() -> None:
    comm, snapshot = await _connected()
    frame = live.frame_make(live.PLANS, _event(1), "another-epoch", 1)
    await get_channel_layer().group_send(live.PLANS, {"type": live.FRAME_EVENT, "frame": frame})
    resync = await comm.receive_json_from(timeout=TIMEOUT)
    assert (resync["type"], resync["reason"]) == ("snapshot", "epoch")
    assert resync["epoch"] == snapshot["epoch"]  # the store's epoch, not the stray frame's
    await comm.disconnect()


async def test_a_lost_last_frame_is_noticed_by_the_heartbeat() -> None:
    comm, snapshot = await _connected()
    await live.asequence_next(live.PLANS)  # lost, and nothing follows it to reveal the gap
    resync = await comm.receive_json_from(timeout=3 * HEARTBEAT_S + TIMEOUT)
    assert (resync["type"], resync["reason"]) == ("snapshot", "gap")
    assert resync["seq"] == snapshot["seq"] + 1
    await comm.disconnect()


@pytest.fixture
def layer_on_own_redis(own_redis: RedisServer, settings: Any) -> RedisServer:
    """The channel layer and live state on the test's own redis-server, which it restarts."""
    settings.REDIS_URL = own_redis.url
    settings.CHANNEL_LAYERS = {
        "default": {**settings.CHANNEL_LAYERS["default"], "CONFIG": {"hosts": [own_redis.url]}}
    }
    return own_redis


async def test_the_socket_keeps_streaming_after_redis_restarts(
    layer_on_own_redis: RedisServer,
) -> None:
    comm, snapshot = await _connected()
    await live.live_apublish(live.PLANS, _event(1))
    assert (await comm.receive_json_from(timeout=TIMEOUT))["seq"] == snapshot["seq"] + 1

    await sync_to_async(
        layer_on_own_redis.restart
    )()  # all data gone: counters, epoch, group membership

    # Frames published while the consumer is still reconnecting may be lost; the snapshot that
    # follows covers them. Once it has resynced, frames flow again in sequence.
    last_snapshot: dict[str, Any] | None = None
    deadline = time.monotonic() + 10 * HEARTBEAT_S  # generous: a loaded machine reconnects slowly
    received: dict[str, Any] = {}
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.ConnectionError):
            await live.live_apublish(live.PLANS, _event(2))
        # receive_nothing polls; a receive that times out would cancel the application.
        while not await comm.receive_nothing(timeout=0.5):
            received = await comm.receive_json_from(timeout=TIMEOUT)
            if received["type"] == "snapshot":
                last_snapshot = received
            elif last_snapshot is not None:
                break
        if received.get("type") == "plan_event" and last_snapshot is not None:
            break
    assert last_snapshot is not None, "no snapshot after the restart"
    assert last_snapshot["epoch"] != snapshot["epoch"]
    assert received["type"] == "plan_event"
    assert received["epoch"] == last_snapshot["epoch"]
    assert received["seq"] == last_snapshot["seq"] + 1
    await comm.disconnect()


async def test_telemetry_posted_through_the_api_reaches_the_overview_socket() -> None:
    link = await sync_to_async(_link_with_agent_token)()
    comm, snapshot = await _connected(live.OVERVIEW)
    assert [entry["key"] for entry in snapshot["data"]["links"]] == [link["key"]]
    body = {
        "idempotency_key": "batch-1",
        "links": [
            {
                "source": link["source"],
                "target": link["target"],
                "ts": time.time(),
                "bytes_sent": 5 * 10**9 // 8,
                "interval_s": 1.0,
            }
        ],
    }
    response = await AsyncClient().post(
        "/api/v1/telemetry",
        body,
        content_type="application/json",
        headers={"Authorization": f"Bearer {link['secret']}"},
    )
    assert response.status_code == 200
    frame = await comm.receive_json_from(timeout=TIMEOUT)
    assert frame["type"] == "link_samples"
    assert frame["seq"] == snapshot["seq"] + 1
    [sample] = frame["data"]["samples"]
    assert sample["link"] == link["key"]
    assert sample["gbps"] == pytest.approx(5.0)
    await comm.disconnect()


def _link_with_agent_token() -> dict[str, str]:
    link = cast(Link, LinkFactory())
    _, secret = api_token("agent")
    key = link.key
    return {"key": key, "source": link.source.name, "target": link.target.name, "secret": secret}


async def test_the_overview_tick_publishes_decision_mix_alerts_and_policy() -> None:
    await sync_to_async(_fleet_with_policy)()
    comm, snapshot = await _connected(live.OVERVIEW)
    count = await sync_to_async(overview_tick_publish)()
    frames = [await comm.receive_json_from(timeout=TIMEOUT) for _ in range(count)]
    assert [f["seq"] for f in frames] == list(
        range(snapshot["seq"] + 1, snapshot["seq"] + 1 + count)
    )
    by_type = {f["type"]: f["data"] for f in frames}
    assert by_type["decision_mix"]["cluster"] == "pd-x"
    assert by_type["decision_mix"]["threshold"] == 12000
    assert by_type["policy_event"]["thresholds"] == {"pd-x": 12000}
    assert [a["code"] for a in by_type["alerts"]["alerts"]] == ["telemetry_stale"]
    await comm.disconnect()


def _fleet_with_policy() -> None:
    from controlplane.audit import CLI_ACTOR
    from scheduling.policies import policy_create

    inst = cast(Instance, InstanceFactory(cluster=ClusterFactory(name="pd-x")))
    assert inst.state == "active"
    policy_create(actor=CLI_ACTOR, thresholds={"pd-x": 12000})


_PUBLISHER = """
import django, sys
django.setup()
from controlplane import live
for n in range(int(sys.argv[1]), int(sys.argv[1]) + 20):
    live.live_publish(live.PLANS, live.PlanEvent(plan_id=n, state="proposed", ts=0.0))
"""


async def test_two_publishing_processes_reach_a_socket_once_each_and_in_order() -> None:
    comm, snapshot = await _connected()
    db = settings.DATABASES["default"]  # the test database: on_commit asks it for autocommit
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "DATABASE_URL": f"postgres://{db['USER']}:{db['PASSWORD']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
    }
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", _PUBLISHER, str(start), env=env, cwd=str(settings.BASE_DIR)
        )
        for start in (0, 100)
    ]
    assert [await p.wait() for p in procs] == [0, 0]
    frames = [await comm.receive_json_from(timeout=TIMEOUT) for _ in range(40)]
    assert [f["seq"] for f in frames] == list(range(snapshot["seq"] + 1, snapshot["seq"] + 41))
    ids = sorted(f["data"]["plan_id"] for f in frames)
    assert ids == [*range(20), *range(100, 120)]
    assert await comm.receive_nothing(timeout=0.3)
    await comm.disconnect()
