"""The agent process: one KV feed per engine, a sampler, an uplink, its own /metrics.

Contract: :class:`Agent` wires :class:`fleet.agent.kv.KvStream` (one per engine, fed by a ZMQ
feed thread for a real engine, or directly by the emulator), the
:class:`fleet.agent.telemetry.TelemetrySampler`, the :class:`fleet.agent.uplink.Uplink` and,
for engines with a ``register`` block, the :class:`fleet.agent.register.Registrar` (first
thing at start, then every ``register_every_s`` while the engine answers).
:meth:`Agent.run` runs until :meth:`Agent.stop` (SIGTERM/SIGINT in ``__main__``), then posts
what is still buffered (bounded in time) and closes its sockets. On start, each engine's stream
learns from the control plane the last sequence number the index applied for it, so a
restarted agent replays what it missed from the engine instead of leaving a gap.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import zmq

from fleet.agent.config import AgentConfig, EngineConfig
from fleet.agent.kv import MAX_SEQ_JUMP, KvStream, Replay, ZmqKvFeed
from fleet.agent.metrics import AgentMetrics
from fleet.agent.register import Registrar
from fleet.agent.telemetry import TelemetrySampler
from fleet.agent.uplink import Uplink, UplinkLimits

log = logging.getLogger(__name__)

FINAL_FLUSH_S = 5.0


class Agent:
    def __init__(
        self,
        config: AgentConfig,
        *,
        metrics: AgentMetrics | None = None,
        uplink: Uplink | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics or AgentMetrics()
        cp, buffer = config.control_plane, config.buffer
        self.uplink = uplink or Uplink(
            cp.url,
            cp.token,
            self.metrics,
            UplinkLimits(max_kv_batches=buffer.max_kv_batches, max_telemetry=buffer.max_telemetry),
        )
        self.sampler = TelemetrySampler(config.engines, config.links, self.metrics)
        registered = [(e.instance, e.register) for e in config.engines if e.register is not None]
        self.registrar = (
            Registrar(
                cp.url,
                cp.token,
                registered,
                every_s=config.register_every_s,
                registry=self.metrics.registry,
            )
            if registered
            else None
        )
        self.streams: dict[str, KvStream] = {}
        self.feeds: list[ZmqKvFeed] = []
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._stop = threading.Event()
        self._server: object | None = None

    def stream_add(
        self,
        instance: str,
        *,
        topic: str = "",
        replay: Replay | None = None,
        max_seq_jump: int = MAX_SEQ_JUMP,
    ) -> KvStream:
        """A stream for ``instance``, resuming after the index's last applied sequence."""
        index = self.uplink.kv_index_state(instance)
        stream = KvStream(
            instance,
            self.uplink.kv_batch_put,
            self.metrics,
            topic=topic,
            replay=replay,
            last_seq=index.last_seq,
            index_at=index.updated_at,
            max_seq_jump=max_seq_jump,
        )
        self.streams[instance] = stream
        return stream

    def _feeds_start(self, engines: Sequence[EngineConfig]) -> None:
        self._context = zmq.Context()
        for engine in engines:
            kv = engine.kv_events
            if kv is None:
                continue
            stream = self.stream_add(engine.instance, topic=kv.topic, max_seq_jump=kv.max_seq_jump)
            feed = ZmqKvFeed(
                self._context,
                stream,
                kv.endpoint,
                kv.replay_endpoint,
                replay_timeout_s=kv.replay_timeout_s,
            )
            feed.start()
            self.feeds.append(feed)

    def run(self) -> None:
        if self.config.listen.port:
            self._server = self.metrics.serve(self.config.listen.host, self.config.listen.port)
        if self.registrar is not None:
            # Before the feeds: a stream asks where the index stands for its instance.
            self.registrar.tick()
        self._feeds_start(self.config.engines)
        uplink_thread = threading.Thread(target=self._uplink_loop, name="uplink", daemon=True)
        uplink_thread.start()
        log.info(
            "agent: %d engine(s), %d link(s), posting to %s",
            len(self.config.engines),
            len(self.config.links),
            self.config.control_plane.url,
        )
        next_sample = time.monotonic()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_sample:
                    next_sample = now + self.config.interval_s
                    instances, links = self.sampler.sample()
                    self.uplink.telemetry_put(instances, links)
                    self._engines_seen()
                    if self.registrar is not None:
                        self.registrar.tick()
                self._stop.wait(max(0.0, next_sample - time.monotonic()))
        finally:
            for feed in self.feeds:
                feed.stop()
            self.uplink.wake.set()
            uplink_thread.join(10)
            self._final_flush()
            self.close()

    def _engines_seen(self) -> None:
        """Each engine's process start time, as its page said in the last sample, to its
        stream: a new process is resynced even when its sequence numbers look continuous."""
        for instance, load in self.sampler.loads.items():
            stream = self.streams.get(instance)
            if stream is not None:
                stream.engine_started(load.process_start_s)

    def _uplink_loop(self) -> None:
        while not self._stop.is_set():
            # Woken by new items, or when a back-off ends (the first post after an outage
            # goes as soon as it may, not at the next item).
            self.uplink.wake.wait(self.uplink.retry_in() or self.config.flush_s * 20)
            self.uplink.wake.clear()
            self.uplink.flush()
            # batch what arrives within one flush period into the next post
            self._stop.wait(self.config.flush_s)

    def _final_flush(self) -> None:
        deadline = time.monotonic() + FINAL_FLUSH_S
        while self.uplink.buffered() and time.monotonic() < deadline:
            if not self.uplink.flush(force=True):
                time.sleep(0.2)
        if self.uplink.buffered():
            log.warning("agent: %d item(s) not posted at exit", self.uplink.buffered())

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        if self._context is not None:
            self._context.term()
            self._context = None
        server = self._server
        if server is not None:
            server.shutdown()  # type: ignore[attr-defined]
            server.server_close()  # type: ignore[attr-defined]
            self._server = None
        if self.registrar is not None:
            self.registrar.close()
        self.uplink.close()
