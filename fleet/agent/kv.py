"""One engine's KV-event stream: sequence tracking, gap recovery by replay, forwarding.

Contract: :class:`KvStream` takes each published message (``topic, seq, payload``) as the
engine's ZMQ PUB socket delivers it (:meth:`KvStream.frame_receive`), checks and decodes it with
:mod:`scheduling.core.kv_vllm` (into the engine-neutral events of :mod:`scheduling.core.kv_events`),
and hands the batches to the uplink in sequence order, with gaps filled
from the engine's replay buffer where it still holds them:

- ``seq == last + 1``: forwarded;
- ``seq > last + 1`` (ZMQ dropped messages past its high-water mark, or the agent restarted and
  learnt ``last`` from the control plane): the missing ``last+1 .. seq-1`` are asked for on the
  replay socket; what comes back is forwarded first. What the engine no longer holds stays a
  gap, which the control plane sees and marks the instance ``degraded`` (counted here too);
- ``seq <= last`` outside a replay just done: the engine restarted (its sequence starts at 0 per
  process). The new process's frames from 0 are replayed; if frame 0 cannot be had, an
  ``AllBlocksCleared`` batch at seq 0 is forwarded in its place (a restarted engine's cache is
  empty), so the control plane resets the instance instead of skipping its frames as repeats.

Forwarded payloads are the neutral events re-encoded in vLLM's format, the control plane's
uplink format (:func:`compact`): without ``token_ids`` (checked here, not needed by the index:
~10x less to send). :class:`ZmqKvFeed` is the
socket side for a real engine: a SUB socket and a DEALER for replay (vLLM's ROUTER answers
``[b"", topic, seq, payload]`` per buffered batch, then ``[b"", b"", 0xff..ff, b""]``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq

from fleet.agent.metrics import AgentMetrics
from scheduling.core import kv_events, kv_vllm

log = logging.getLogger(__name__)

END_SEQ = (1 << 64) - 1
# A jump of more than this many sequence numbers is not taken as the stream's new position
# until the next frame confirms it (the jumped-to seq + 1): one corrupt or forged frame (seq
# 2^40) would otherwise make every later frame look like a repeat. vLLM's replay buffer holds
# 10,000 batches, so a longer gap cannot be recovered anyway; past it the stream resyncs.
MAX_SEQ_JUMP = 100_000
# An engine process that started this long after the index last heard of its instance is a
# new one (allows for clock skew between the engine's host and the control plane).
START_SKEW_S = 2.0
Frame = tuple[int, bytes]  # (seq, payload)
Replay = Callable[[int], Sequence[Frame]]
Forward = Callable[[str, int | None, bytes, int], None]  # instance, seq, payload, blocks


@dataclass
class StreamState:
    last_seq: int | None = None
    replayed_from: int | None = None  # a replay just returned frames from here on
    held: Frame | None = None  # a frame past MAX_SEQ_JUMP, until the next one confirms it
    engine_start: float | None = None  # the engine process's start time, when its page says
    index_at: float | None = None  # when the control plane's index last applied a batch
    resync_wanted: bool = False  # a new engine process was seen: resync on the feed thread


class KvStream:
    """Sequence-tracking and gap recovery for one engine instance (no sockets)."""

    def __init__(
        self,
        instance: str,
        forward: Forward,
        metrics: AgentMetrics,
        *,
        topic: str = "",
        replay: Replay | None = None,
        last_seq: int | None = None,
        index_at: float | None = None,
        max_seq_jump: int = MAX_SEQ_JUMP,
    ) -> None:
        self.instance = instance
        self.forward = forward
        self.metrics = metrics
        self.topic = topic.encode()
        self.replay = replay
        self.max_seq_jump = max_seq_jump
        self.state = StreamState(last_seq=last_seq, index_at=index_at)
        self._lock = threading.Lock()

    # -- entry point ----------------------------------------------------------------------

    def frame_receive(self, topic: bytes, seq_bytes: bytes, payload: bytes) -> None:
        """One message as the PUB socket delivered it (three frames)."""
        if self.topic and not topic.startswith(self.topic):
            return
        if len(seq_bytes) != 8:
            self.metrics.kv_malformed.labels(self.instance).inc()
            log.warning("%s: sequence frame of %d bytes, not 8", self.instance, len(seq_bytes))
            return
        self.batch_receive(int.from_bytes(seq_bytes, "big"), payload)

    def batch_receive(self, seq: int, payload: bytes) -> None:
        with self._lock:
            self.metrics.kv_batches_received.labels(self.instance).inc()
            if seq > kv_events.MAX_SEQ:
                # The control plane refuses it (and the post it travels in): never forwarded,
                # never the stream's position.
                self.metrics.kv_malformed.labels(self.instance).inc()
                log.warning("%s: sequence %d out of range, dropped", self.instance, seq)
                return
            if self._held_resolve(seq, payload):
                return
            last = self.state.last_seq
            if last is not None and seq > last + self.max_seq_jump:
                self.state.held = (seq, payload)
                return
            if last is not None and seq <= last:
                replayed_from = self.state.replayed_from
                if replayed_from is not None and replayed_from <= seq:
                    return  # already forwarded from the replay
                self._resync(upto=(seq, payload), why=f"seq {seq} after {last}")
                return
            # A frame past the last ends the window in which repeats of a replay are expected.
            self.state.replayed_from = None
            if last is not None and seq > last + 1:
                self._recover(last + 1, seq)
            self._deliver(seq, payload)

    def _held_resolve(self, seq: int, payload: bytes) -> bool:
        """A frame arrived while one far ahead is held: if this one follows it, the stream did
        jump (forward what replay still has, then both: a gap the control plane marks
        ``degraded``; True); otherwise the held one was corrupt or forged and is dropped."""
        held = self.state.held
        if held is None:
            return False
        self.state.held = None
        if seq == held[0] + 1:
            last = self.state.last_seq
            log.warning("%s: the stream jumped from %s to %d", self.instance, last, held[0])
            if last is not None:
                self._recover(last + 1, held[0])
            self._deliver(*held)
            self._deliver(seq, payload)
            return True
        self.metrics.kv_seq_rejected.labels(self.instance).inc()
        log.warning(
            "%s: dropped a frame with seq %d (after %s, not followed by %d): not the stream's",
            self.instance,
            held[0],
            self.state.last_seq,
            held[0] + 1,
        )
        return False

    def engine_started(self, start_s: float | None) -> None:
        """The engine process's start time as its page says (sampled every interval). A new
        value, or a process that started after the index last heard of this instance, is a
        new engine process whatever its sequence numbers say: the stream resyncs (on the
        feed's thread, :meth:`resync_if_wanted`)."""
        if start_s is None:
            return
        with self._lock:
            before, self.state.engine_start = self.state.engine_start, start_s
            index_at = self.state.index_at
            if before is None:
                new = index_at is not None and start_s > index_at + START_SKEW_S
            else:
                new = abs(start_s - before) > 1e-3
            if new:
                log.warning(
                    "%s: a new engine process (started %.3f; before: %s, index updated %s)",
                    self.instance,
                    start_s,
                    before,
                    index_at,
                )
                self.state.resync_wanted = True

    def resync_if_wanted(self) -> None:
        with self._lock:
            if self.state.resync_wanted:
                self.state.resync_wanted = False
                self._resync(why="new engine process")

    def catch_up(self) -> None:
        """Forward what the engine published since the index's last sequence (an agent that
        restarts calls this once connected, so it does not wait for the next live frame)."""
        with self._lock:
            last = self.state.last_seq
            if last is None or self.replay is None:
                return
            frames = [f for f in self._fetch(last + 1) if f[0] > last]
            if frames and frames[0][0] != last + 1:
                self.metrics.kv_gaps.labels(self.instance).inc()
                self.metrics.kv_unrecovered.labels(self.instance).inc(frames[0][0] - last - 1)
            for seq, payload in frames:
                self._deliver(seq, payload)
            self.metrics.kv_replayed.labels(self.instance).inc(len(frames))
            if frames:
                log.info(
                    "%s: caught up %d batch(es) after seq %d", self.instance, len(frames), last
                )

    # -- internals --------------------------------------------------------------------------

    def _deliver(self, seq: int, payload: bytes) -> None:
        last = self.state.last_seq
        if last is not None and seq <= last:
            return
        try:
            batch = kv_vllm.batch_decode(payload, f"{self.instance} seq {seq}")
        except kv_events.KvEventFormatError as exc:
            # Not forwarded: the control plane will see the hole and mark the instance degraded.
            self.metrics.kv_malformed.labels(self.instance).inc()
            log.warning("%s: dropped a malformed batch: %s", self.instance, exc)
            self.state.last_seq = seq
            return
        blocks = kv_events.blocks_in(batch)
        self.metrics.kv_blocks_received.labels(self.instance).inc(blocks)
        self.forward(self.instance, seq, compact(batch), blocks)
        self.state.last_seq = seq

    def _fetch(self, start: int) -> list[Frame]:
        if self.replay is None:
            return []
        try:
            frames = sorted(self.replay(start))
        except (zmq.ZMQError, OSError, TimeoutError) as exc:
            log.warning("%s: replay from %d failed: %s", self.instance, start, exc)
            return []
        self.state.replayed_from = start
        return frames

    def _recover(self, first: int, upto: int) -> None:
        """Fill ``first .. upto-1`` from the replay buffer; count what stays missing."""
        self.metrics.kv_gaps.labels(self.instance).inc()
        recovered = 0
        for seq, payload in self._fetch(first):
            if first <= seq < upto:
                self._deliver(seq, payload)
                recovered += 1
        self.metrics.kv_replayed.labels(self.instance).inc(recovered)
        missing = (upto - first) - recovered
        if missing > 0:
            self.metrics.kv_unrecovered.labels(self.instance).inc(missing)
            log.warning(
                "%s: %d batch(es) before seq %d are gone from the engine's replay buffer; the "
                "control plane will mark the instance degraded",
                self.instance,
                missing,
                upto,
            )

    def _resync(self, *, upto: Frame | None = None, why: str) -> None:
        """A new engine process (its sequence went back, or its start time changed): the
        instance's index is cleared and refilled with the new process's stream from seq 0,
        as far as the replay buffer still holds it (``upto``: the frame that showed it, last).

        The control plane clears an instance on a batch at seq 0 after a higher one. If the
        new process's frame 0 is gone, an ``AllBlocksCleared`` at seq 0 stands for it (a new
        process's cache starts empty) and what follows is a gap: ``degraded`` until the next
        clear. If the new process has published nothing yet, the clear goes without a
        sequence (its own frame 0 then resets the sequence)."""
        self.metrics.kv_engine_restarts.labels(self.instance).inc()
        log.warning("%s: engine restarted (%s): resyncing its index", self.instance, why)
        self.state.last_seq = None
        self.state.held = None
        end = upto[0] if upto is not None else None
        self.state.replayed_from = None
        frames = [] if end == 0 else [f for f in self._fetch(0) if end is None or f[0] < end]
        replayed = self.state.replayed_from == 0
        if end != 0 and (not frames or frames[0][0] != 0):
            cleared = kv_vllm.batch_encode([kv_events.CacheCleared()], time.time())
            if upto is None and replayed and not frames:
                # Nothing published yet: its own frame 0, when it comes, resets the sequence.
                self.forward(self.instance, None, cleared, 0)
            else:
                self.forward(self.instance, 0, cleared, 0)
                self.state.last_seq = 0
        for s, p in frames:
            self._deliver(s, p)
        if upto is not None:
            if self.state.last_seq is not None and upto[0] > self.state.last_seq + 1:
                self._recover(self.state.last_seq + 1, upto[0])
            self._deliver(*upto)


def compact(batch: kv_events.EventBatch) -> bytes:
    """The batch's neutral events in the uplink's format (vLLM's), without what the index does
    not need: ``token_ids`` (checked against the hashes by the decoder), LoRA, extra keys."""
    return kv_vllm.batch_encode(batch.events, batch.ts, batch.rank)


class ZmqKvFeed:
    """The sockets of one real engine: SUB for the stream, DEALER for replay."""

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        stream: KvStream,
        endpoint: str,
        replay_endpoint: str | None,
        *,
        replay_timeout_s: float = 5.0,
    ) -> None:
        self.context = context
        self.stream = stream
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_s = replay_timeout_s
        if replay_endpoint is not None:
            stream.replay = self.replay
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def replay(self, start: int) -> list[Frame]:
        """Every batch the engine still buffers from ``start`` on (a fresh DEALER per call, so
        a lost answer never lingers into the next one)."""
        assert self.replay_endpoint is not None
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            out: list[Frame] = []
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000)):
                    raise TimeoutError(f"no end marker within {self.replay_timeout_s:g} s")
                parts = sock.recv_multipart()
                if parts and parts[0] == b"":
                    parts = parts[1:]
                if len(parts) != 3:
                    continue
                _, seq_bytes, payload = parts
                seq = int.from_bytes(seq_bytes, "big")
                if seq == END_SEQ:
                    return out
                out.append((seq, payload))
        finally:
            sock.close()

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self.run, name=f"kv-{self.stream.instance}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def run(self) -> None:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.stream.topic)
        sub.connect(self.endpoint)
        try:
            # Live frames queue in the SUB socket meanwhile; the stream skips the repeats.
            self.stream.catch_up()
            while not self._stop.is_set():
                self.stream.resync_if_wanted()
                if not sub.poll(100):
                    continue
                parts = sub.recv_multipart()
                if len(parts) != 3:
                    self.stream.metrics.kv_malformed.labels(self.stream.instance).inc()
                    continue
                try:
                    self.stream.frame_receive(*parts)
                except Exception:  # one bad message must not stop the feed
                    log.exception("%s: frame handling failed", self.stream.instance)
        finally:
            sub.close()
