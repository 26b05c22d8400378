"""The fleet emulator's parts that need no server: faults, the request stream, the journaling
prefix cache and its KV events; and the commands refusing bad input with a clear message.
(The whole emulator against a live control plane is tests/test_demo.py.)"""

from __future__ import annotations

import json
import time
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import redis
from django.core.management import call_command
from django.core.management.base import CommandError

from clusters.live.kv_events import index_events
from clusters.live.prefix_index import RemovedBlocks, StoredBlocks
from fleet.agent.kv import KvStream
from fleet.agent.metrics import AgentMetrics
from fleet.emulator import (
    FAULTS_KEY,
    STATUS_KEY,
    EmulatedEngineEvents,
    FaultError,
    ReportingPrefixCache,
    RequestStream,
    emulator_fault_push,
    emulator_faults_pop,
    fault_validate,
    kv_batch_events,
    scenario_faults,
)
from scheduling.core import kv_vllm
from scheduling.core.kv_events import BlocksRemoved
from scheduling.core.scenario import LinkEvent, RateEvent, StateEvent
from scheduling.core.simulator.workload import RequestSpec, Workload
from tests.factories import InstanceFactory, LinkFactory


def workload(*specs: tuple[float, int, tuple[int, ...] | None]) -> Workload:
    return Workload(
        tuple(RequestSpec(t, tokens, 100, "pd-a", hashes) for t, tokens, hashes in specs)
    )


# -- faults ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ({"kind": "flood"}, "kind: must be one of"),
        ({}, "kind: must be one of"),
        ({"kind": "link", "link": "a->b"}, "gbps: a number is required"),
        ({"kind": "link", "link": "a->b", "gbps": -1}, "gbps: must be at least 0"),
        ({"kind": "link", "link": "a->b", "gbps": float("nan")}, "gbps: a number is required"),
        ({"kind": "link", "link": "a->b", "gbps": True}, "gbps: a number is required"),
        ({"kind": "link", "link": "ab", "gbps": 1}, "link: write it as source->target"),
        ({"kind": "link", "gbps": 1}, "link: a name is required"),
        ({"kind": "instance", "instance": "x", "state": "draining"}, "state: must be down or"),
        ({"kind": "instance", "state": "down"}, "instance: a name is required"),
        ({"kind": "surge", "rate_scale": 0}, "rate_scale: must be positive"),
        ({"kind": "surge", "rate_scale": 2, "cluster": ""}, "cluster: a name is required"),
        ({"kind": "prompts", "scale": "big"}, "scale: a number is required"),
    ],
)
def test_a_malformed_fault_is_refused_naming_the_key(fault: dict[str, Any], message: str) -> None:
    with pytest.raises(FaultError, match=message):
        fault_validate(fault)


def test_faults_travel_through_the_redis_channel_in_order(redis_client: redis.Redis) -> None:
    emulator_fault_push(redis_client, {"kind": "link", "link": "a->b", "gbps": 2})
    emulator_fault_push(redis_client, {"kind": "surge", "rate_scale": 3, "cluster": "pd-a"})
    redis_client.rpush(FAULTS_KEY, "not json")
    assert emulator_faults_pop(redis_client) == [
        {"kind": "link", "link": "a->b", "gbps": 2.0},
        {"kind": "surge", "rate_scale": 3.0, "cluster": "pd-a"},
    ]
    assert redis_client.llen(FAULTS_KEY) == 0


def test_scenario_events_become_faults_in_time_order() -> None:
    faults = scenario_faults(
        [
            RateEvent(at_s=30.0, cluster="pd-a", rate_scale=2.0),
            LinkEvent(at_s=10.0, source="p", target="pd-a", gbps=5.0),
            StateEvent(at_s=20.0, state="down", cluster="pd-a"),
            StateEvent(at_s=25.0, state="active", instance="pd-a-1"),
        ],
        {"pd-a": ["pd-a-0", "pd-a-1"]},
    )
    assert faults == [
        (10.0, {"kind": "link", "link": "p->pd-a", "gbps": 5.0}),
        (20.0, {"kind": "instance", "instance": "pd-a-0", "state": "down"}),
        (20.0, {"kind": "instance", "instance": "pd-a-1", "state": "down"}),
        (25.0, {"kind": "instance", "instance": "pd-a-1", "state": "active"}),
        (30.0, {"kind": "surge", "rate_scale": 2.0, "cluster": "pd-a"}),
    ]
    for _, fault in faults:
        assert fault_validate(fault) == fault


# -- the request stream ------------------------------------------------------------------------


def test_the_stream_replays_the_workload_then_loops_with_fresh_block_hashes() -> None:
    stream = RequestStream(
        workload((0.0, 1024, (1, 2)), (1.0, 1536, (1, 3, 4)), (3.0, 600, (5, 6))),
        lambda origin: origin,
        512,
    )
    first = [stream[i] for i in range(6)]
    assert [r.arrival_s for r in first[:3]] == [0.0, 1.0, 3.0]
    assert [r.index for r in first] == list(range(6))
    # The second loop continues the clock with the workload's mean gap and new conversations.
    assert first[3].arrival_s == pytest.approx(4.5)
    assert first[4].arrival_s == pytest.approx(5.5)
    assert first[3].hash_ids is not None and first[0].hash_ids is not None
    assert not set(first[3].hash_ids) & set(first[0].hash_ids)
    assert first[3].input_tokens == first[0].input_tokens


def test_a_finite_stream_ends_where_the_workload_ends() -> None:
    stream = RequestStream(workload((0.0, 100, None), (2.0, 100, None)), str, 512, loop=False)
    assert list(stream) == [stream[0], stream[1]]
    with pytest.raises(IndexError):
        stream[2]


def test_a_surge_shortens_the_gaps_from_the_next_request_on() -> None:
    stream = RequestStream(
        workload(*[(float(i), 100, None) for i in range(10)]), str, 512, loop=False
    )
    assert stream[1].arrival_s == 1.0
    stream.rate_scale(4.0)
    assert stream[3].arrival_s - stream[2].arrival_s == pytest.approx(0.25)
    stream.rate_scale(1.0, origin="elsewhere")  # another origin: this one keeps its surge
    assert stream[5].arrival_s - stream[4].arrival_s == pytest.approx(0.25)


def test_longer_prompts_get_more_blocks_and_shorter_ones_fewer() -> None:
    stream = RequestStream(
        workload(*[(float(i), 1024, (10 + i, 20 + i)) for i in range(4)]), str, 512, loop=False
    )
    assert stream[0].hash_ids == (10, 20)
    stream.prompt_scale = 2.0
    longer = stream[2]
    assert longer.input_tokens == 2048 and longer.hash_ids is not None
    assert longer.hash_ids[:2] == (12, 22) and len(longer.hash_ids) == 4
    stream.prompt_scale = 0.4
    shorter = stream[3]
    assert shorter.input_tokens == 410 and shorter.hash_ids == (13,)


def test_the_stream_maps_unknown_origins_to_a_known_cluster() -> None:
    spec = RequestSpec(0.0, 100, 10, "", None)
    stream = RequestStream(Workload((spec,)), lambda o: o or "pd-main", 512, loop=False)
    assert stream[0].origin == "pd-main"


# -- prefix caches and KV events -------------------------------------------------------------


def test_the_cache_journals_stores_and_evictions_as_vllm_events() -> None:
    # Room for three entries: two blocks and a checkpoint per prefill, the oldest evicted.
    cache = ReportingPrefixCache(30.0, [10.0], 10.0)
    cache.store((1, 2), 2)
    assert cache.match_blocks((1, 2), 2) == 2
    cache.store((7,), 1)  # evicts block 1 and block 2 (the least recently used)
    events = cache.take_events()
    assert events[:3] == [(True, 1), (True, 2), (True, ~2)]
    assert (False, 1) in events and (True, 7) in events
    assert cache.take_events() == []

    # On the wire as vLLM 0.32 sends it, and back through the control plane's decoding.
    payload = kv_vllm.batch_encode(kv_batch_events(events, 512), 1.0)
    decoded = index_events(kv_vllm.batch_decode(payload), 512, "m")

    def keys(*blocks: int) -> bytes:  # the index's packed 8-byte keys
        return b"".join(b.to_bytes(8, "big") for b in blocks)

    assert decoded[0] == StoredBlocks(keys(1, 2), linear=False, medium="GPU", group=0)
    assert decoded[1] == StoredBlocks(keys(2), linear=True, medium="GPU", group=1)
    removed = [e for e in decoded if isinstance(e, RemovedBlocks)]
    # vLLM sends one BlockRemoved per evicted block; the index takes a run of them at once
    assert removed and RemovedBlocks(keys(1, 2), "GPU", 0) in removed


def test_emulated_engines_publish_vllm_frames_into_the_agents_stream() -> None:
    """The emulator's engines go through the agent's KvStream (the real engines' path): seq
    from 0, vLLM payloads, and a replay buffer that fills what the stream did not see."""
    forwarded: list[tuple[int | None, bytes]] = []
    stream = KvStream("pd-a-p0", lambda i, seq, p, n: forwarded.append((seq, p)), AgentMetrics())
    engine = EmulatedEngineEvents(stream)
    engine.publish(kv_batch_events([(True, 1), (True, 2)], 512), 1.0)
    engine.seq += 1  # a batch the stream never received (as if ZMQ had dropped it)
    engine.buffer.append((engine.seq, kv_vllm.batch_encode(kv_batch_events([(True, 3)], 512), 2.0)))
    engine.publish(kv_batch_events([(False, 1)], 512), 3.0)
    assert [seq for seq, _ in forwarded] == [0, 1, 2]
    decoded = [kv_vllm.batch_decode(p).events for _, p in forwarded]
    assert [list(e.hashes) for e in decoded[0]] == [[1, 2]]  # type: ignore[union-attr]
    assert isinstance(decoded[2][0], BlocksRemoved) and decoded[2][0].group == 0


# -- commands: bad input ---------------------------------------------------------------------


def test_emulate_refuses_a_missing_scenario_file(tmp_path: Path) -> None:
    with pytest.raises(CommandError, match="scenario file not found"):
        call_command("emulate", str(tmp_path / "nope.yaml"))


def test_emulate_refuses_a_scenario_without_a_workload(tmp_path: Path, scenarios_dir: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        f"version: 1\nname: bad\nextends: {scenarios_dir / 'paper-case-study.yaml'}\n"
        "workload: {arrival: {process: poisson, rate_per_s: -1}}\n"
    )
    with pytest.raises(CommandError, match=r"bad\.yaml"):
        call_command("emulate", str(bad))


def test_emulate_refuses_a_non_positive_speed(scenarios_dir: Path) -> None:
    with pytest.raises(CommandError, match="speed must be a positive number"):
        call_command(
            "emulate",
            str(scenarios_dir / "paper-case-study.yaml"),
            "--rate",
            "1",
            "--speed",
            "0",
            "--token",
            "t",
        )


@pytest.mark.django_db
def test_emulate_fault_refuses_names_the_inventory_does_not_have(redis_client: redis.Redis) -> None:
    with pytest.raises(CommandError, match="no link nowhere->pd in the inventory"):
        call_command("emulate_fault", "link", "nowhere->pd", "--gbps", "1")
    with pytest.raises(CommandError, match="no instance 'ghost'"):
        call_command("emulate_fault", "instance", "ghost", "down")
    with pytest.raises(CommandError, match="no pd cluster 'ghost'"):
        call_command("emulate_fault", "surge", "--rate-scale", "2", "--cluster", "ghost")
    with pytest.raises(CommandError, match="scale: must be positive"):
        call_command("emulate_fault", "prompts", "--scale", "0")
    assert redis_client.llen(FAULTS_KEY) == 0


def _emulator_status(redis_client: redis.Redis, age_s: float, stopped: bool = False) -> None:
    """The status a running emulator keeps in Redis (tests/test_demo.py injects a fault into a
    real one)."""
    status = {"ts": time.time() - age_s, "stopped": stopped, "routed": 1}
    redis_client.set(STATUS_KEY, json.dumps(status))


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("status", "words"),
    [
        (None, "none has reported a status"),
        ({"age_s": 120.0}, "the last status is 120 s old"),
        ({"age_s": 1.0, "stopped": True}, "the last one stopped"),
    ],
)
def test_emulate_fault_without_a_running_emulator_exits_non_zero_and_queues_nothing(
    redis_client: redis.Redis, status: dict[str, Any] | None, words: str
) -> None:
    link = LinkFactory()
    if status is not None:
        _emulator_status(redis_client, **status)
    with pytest.raises(CommandError) as exc:
        call_command("emulate_fault", "link", link.key, "--gbps", "3")
    assert exc.value.returncode == 2
    assert "no fleet emulator is running" in str(exc.value) and words in str(exc.value)
    assert redis_client.llen(FAULTS_KEY) == 0


@pytest.mark.django_db
def test_emulate_fault_queues_a_known_link_and_instance(redis_client: redis.Redis) -> None:
    _emulator_status(redis_client, age_s=1.0)
    link = LinkFactory()
    instance = InstanceFactory()
    out = StringIO()
    call_command(
        "emulate_fault",
        "link",
        link.key,
        "--gbps",
        "3",
        stdout=out,
    )
    call_command("emulate_fault", "instance", instance.name, "down", stdout=out)
    queued = [json.loads(raw) for raw in redis_client.lrange(FAULTS_KEY, 0, -1)]
    assert queued == [
        {"kind": "link", "link": link.key, "gbps": 3.0},
        {"kind": "instance", "instance": instance.name, "state": "down"},
    ]
    assert "queued for the emulator" in out.getvalue()


def test_emulate_fault_status_without_an_emulator_says_so(redis_client: redis.Redis) -> None:
    with pytest.raises(CommandError, match="no emulator has reported a status"):
        call_command("emulate_fault", "status")


def test_emulate_fault_status_as_a_health_check_fails_when_old(redis_client: redis.Redis) -> None:
    redis_client.set("emulator:status", json.dumps({"ts": 0, "stopped": False, "routed": 1}))
    with pytest.raises(CommandError, match=r"last status is \d+ s old"):
        call_command("emulate_fault", "status", "--max-age", "60")
    out = StringIO()
    call_command("emulate_fault", "status", stdout=out)
    assert json.loads(out.getvalue())["routed"] == 1
