"""The agent's KV path: sequence gaps recovered from the engine's replay buffer, what is gone
left as a visible gap, engine restarts, malformed frames, and the uplink's bounds while the
control plane is away. Against the real control plane (uvicorn, PostgreSQL, Redis) and real
ZMQ sockets speaking vLLM's publisher protocol."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import zmq

from clusters.live import prefix_index
from fleet.agent.kv import END_SEQ, KvStream, ZmqKvFeed
from fleet.agent.metrics import AgentMetrics
from fleet.agent.uplink import Uplink, UplinkLimits
from scheduling.core import kv_vllm
from scheduling.core.kv_events import BlocksStored
from tests.factories import ClusterFactory, InstanceFactory, api_token
from tests.fleet.captured import CapturedFrame
from tests.support.servers import control_plane_serve, free_port

INSTANCE = "pd-k-p0"


class Engine:
    """An engine's publisher side in memory: seq from 0, vLLM payloads, a bounded replay
    buffer. ``lose`` publishes without delivering (what a full ZMQ HWM or a dead agent does)."""

    def __init__(self, stream: KvStream, buffer: int = 10_000) -> None:
        self.stream = stream
        self.seq = -1
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        stream.replay = lambda start: [f for f in self.buffer if f[0] >= start]

    def _publish(self, block: int) -> tuple[int, bytes]:
        self.seq += 1
        event = BlocksStored([block], 32, medium="GPU")
        payload = kv_vllm.batch_encode([event], time.time())
        self.buffer.append((self.seq, payload))
        return self.seq, payload

    def send(self, block: int) -> None:
        self.stream.batch_receive(*self._publish(block))

    def lose(self, block: int) -> None:
        self._publish(block)


def value(metric: Any, **labels: str) -> float:
    return float(metric.labels(**labels)._value.get())


@pytest.fixture
def plane(transactional_db: None, redis_client: redis.Redis, settings: Any) -> Iterator[str]:
    from django.db import connection

    pd = ClusterFactory(name="pd-k", model__block_tokens=32)
    InstanceFactory(cluster=pd, name=INSTANCE)
    with control_plane_serve(connection.settings_dict, settings.REDIS_URL) as (base, _proc):
        yield base


def keys(*blocks: int) -> list[str]:
    return [prefix_index.block_hash_key(b) for b in blocks]


def held(*blocks: int) -> int:
    return prefix_index.prefix_match(keys(*blocks), 32).tokens_by_instance.get(INSTANCE, 0) // 32


def test_gaps_are_replayed_restarts_reset_and_lost_batches_show_as_degraded(plane: str) -> None:
    metrics = AgentMetrics()
    # The agent's token is bound to the one instance it runs beside (issue 13).
    uplink = Uplink(plane, api_token("agent", instances=(INSTANCE,))[1], metrics)
    stream = KvStream(INSTANCE, uplink.kv_batch_put, metrics, last_seq=uplink.kv_last_seq(INSTANCE))
    assert stream.state.last_seq is None  # the index knows nothing of this instance yet
    engine = Engine(stream, buffer=4)
    engine.send(1)
    engine.send(2)
    engine.lose(3)
    engine.lose(4)
    engine.send(5)  # seq 4 after 1: the agent asks the replay socket for 2 and 3
    assert uplink.flush()
    state = prefix_index.prefix_index_states([INSTANCE])[0]
    assert (state.state, state.last_seq, state.gaps) == ("exact", 4, 0)
    assert held(1, 2, 3, 4, 5) == 5
    assert value(metrics.kv_replayed, instance=INSTANCE) == 2

    for block in range(6, 12):
        engine.lose(block)  # seq 5..10: more than the engine's buffer of 4 keeps
    engine.send(12)  # seq 11; the buffer holds 8..11
    assert uplink.flush()
    state = prefix_index.prefix_index_states([INSTANCE])[0]
    assert (state.state, state.missed_batches) == ("degraded", 3)
    assert value(metrics.kv_unrecovered, instance=INSTANCE) == 3

    # A new engine process (seq from 0); the agent saw only its second frame.
    engine.seq = -1
    engine.buffer.clear()
    engine.lose(100)
    engine.send(101)
    assert uplink.flush()
    state = prefix_index.prefix_index_states([INSTANCE])[0]
    assert (state.state, state.last_seq) == ("exact", 1)
    assert held(1) == 0 and held(100, 101) == 2
    assert value(metrics.kv_engine_restarts, instance=INSTANCE) == 1

    # A restarted agent resumes from the index's last sequence and catches up at once.
    engine.lose(102)
    engine.lose(103)
    metrics2 = AgentMetrics()
    again = KvStream(INSTANCE, uplink.kv_batch_put, metrics2, last_seq=uplink.kv_last_seq(INSTANCE))
    engine.stream = again
    again.replay = lambda start: [f for f in engine.buffer if f[0] >= start]
    again.catch_up()
    assert uplink.flush()
    assert held(100, 101, 102, 103) == 4
    assert prefix_index.prefix_index_states([INSTANCE])[0].state == "exact"
    uplink.close()


def test_a_malformed_frame_is_counted_and_not_forwarded(plane: str) -> None:
    metrics = AgentMetrics()
    uplink = Uplink(plane, api_token("agent")[1], metrics)
    stream = KvStream(INSTANCE, uplink.kv_batch_put, metrics)
    stream.frame_receive(b"kv-events", (0).to_bytes(8, "big"), b"\xc1 not msgpack")
    stream.frame_receive(b"kv-events", b"\x01", b"")
    assert uplink.buffered() == 0
    assert value(metrics.kv_malformed, instance=INSTANCE) == 2
    uplink.close()


def test_while_the_control_plane_is_away_buffers_stay_bounded_and_drops_are_counted() -> None:
    metrics = AgentMetrics()
    limits = UplinkLimits(max_kv_batches=5, max_telemetry=2, backoff_min_s=30)
    uplink = Uplink(f"http://127.0.0.1:{free_port()}", "t", metrics, limits)
    for seq in range(8):
        uplink.kv_batch_put(INSTANCE, seq, b"x")
    for _ in range(3):
        uplink.telemetry_put([{"instance": INSTANCE, "ts": 1.0}], [])
    assert uplink.buffered() == 5 + 2
    assert value(metrics.dropped, kind="kv_batch", reason="buffer_full") == 3
    assert value(metrics.dropped, kind="telemetry", reason="buffer_full") == 1
    assert uplink.flush() is False
    unreachable = value(metrics.posts, endpoint="/api/v1/kv-events/msgpack", outcome="unreachable")
    assert unreachable == 1
    assert uplink.flush() is False  # backing off: no second attempt yet
    assert value(metrics.posts, endpoint="/api/v1/kv-events/msgpack", outcome="unreachable") == 1
    assert uplink.buffered() == 7  # nothing lost beyond the bounds
    uplink.close()


class VllmPublisher:
    """vLLM's publisher sockets (PUB + ROUTER replay), speaking its protocol: replies
    ``[client, b"", topic, seq, payload]`` per buffered batch, then the end marker."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], pub_port: int, replay_port: int):
        self.pub = context.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{pub_port}")
        self.router = context.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        self.buffer: list[tuple[int, bytes]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve)
        self.thread.start()

    def publish(self, seq: int, payload: bytes, *, deliver: bool = True) -> None:
        self.buffer.append((seq, payload))
        if deliver:
            self.pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), payload])

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.router.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            for seq, payload in list(self.buffer):
                if seq >= int.from_bytes(start, "big"):
                    self.router.send_multipart(
                        [client, b"", b"kv-events", seq.to_bytes(8, "big"), payload]
                    )
            self.router.send_multipart([client, b"", b"", END_SEQ.to_bytes(8, "big"), b""])

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.pub.close()
        self.router.close()


def test_the_zmq_feed_fills_a_gap_through_the_replay_socket(
    captured_frames: list[CapturedFrame],
) -> None:
    frames = [f for f in captured_frames if f.section in "ABC"]  # seq 0, 1, 2 of one engine
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub_port, replay_port = free_port(), free_port()
    publisher = VllmPublisher(context, pub_port, replay_port)
    metrics = AgentMetrics()
    forwarded: list[tuple[int | None, int]] = []
    stream = KvStream(
        INSTANCE,
        lambda i, seq, p, blocks: forwarded.append((seq, blocks)),
        metrics,
        topic="kv-events",
    )
    feed = ZmqKvFeed(
        context, stream, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"
    )
    feed.start()
    try:
        time.sleep(0.5)  # the subscription reaches the publisher
        publisher.publish(0, frames[0].payload)
        publisher.publish(1, frames[1].payload, deliver=False)
        publisher.publish(2, frames[2].payload)
        deadline = time.monotonic() + 10
        while len(forwarded) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert forwarded == [(0, 11), (1, 1), (2, 1)]
        assert value(metrics.kv_gaps, instance=INSTANCE) == 1
        assert value(metrics.kv_replayed, instance=INSTANCE) == 1
    finally:
        feed.stop()
        publisher.close()
        context.term()


def stored(block: int) -> bytes:
    return kv_vllm.batch_encode([BlocksStored([block], 32, medium="GPU")], 1.0)


def wait_for(check: Any, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_frame_with_an_absurd_sequence_jump_does_not_stop_the_stream(plane: str) -> None:
    # Issue 30, finding 4: one frame with seq 2^40 became the stream's high-water mark and every
    # later frame was dropped as "already replayed", while the index stayed `exact`.
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub_port, replay_port = free_port(), free_port()
    publisher = VllmPublisher(context, pub_port, replay_port)
    metrics = AgentMetrics()
    uplink = Uplink(plane, api_token("agent", instances=(INSTANCE,))[1], metrics)
    stream = KvStream(INSTANCE, uplink.kv_batch_put, metrics, topic="kv-events")
    feed = ZmqKvFeed(
        context, stream, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"
    )
    feed.start()
    try:
        time.sleep(0.5)  # the subscription reaches the publisher
        for seq in range(3):
            publisher.publish(seq, stored(seq + 1))
        publisher.pub.send_multipart([b"kv-events", (1 << 40).to_bytes(8, "big"), stored(999)])
        publisher.publish(3, stored(4))
        publisher.pub.send_multipart([b"kv-events", (1 << 41).to_bytes(8, "big"), b"\xc1junk"])
        publisher.pub.send_multipart([b"kv-events", (1 << 60).to_bytes(8, "big"), stored(998)])
        for seq in range(4, 6):
            publisher.publish(seq, stored(seq + 1))
        wait_for(lambda: stream.state.last_seq == 5)
        assert uplink.flush()
        state = prefix_index.prefix_index_states([INSTANCE])[0]
        assert (state.state, state.last_seq, state.gaps) == ("exact", 5, 0)
        assert held(1, 2, 3, 4, 5, 6) == 6 and held(999) == 0 and held(998) == 0
        assert value(metrics.kv_seq_rejected, instance=INSTANCE) == 2
        assert value(metrics.kv_malformed, instance=INSTANCE) == 1  # beyond 2^53

        # A stream that really moved that far (the next frame follows it) is taken, as a gap.
        publisher.publish(500_000, stored(50))
        publisher.publish(500_001, stored(51))
        wait_for(lambda: stream.state.last_seq == 500_001)
        assert uplink.flush()
        state = prefix_index.prefix_index_states([INSTANCE])[0]
        assert (state.state, state.last_seq) == ("degraded", 500_001)
        assert held(50, 51) == 2
    finally:
        feed.stop()
        publisher.close()
        context.term()
        uplink.close()
