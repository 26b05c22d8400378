"""The emulator as the engines' agents: every ``telemetry_s`` wall seconds the instances'
queues and KV usage, the links' bytes and the PD clusters' service counters, then the KV events
since the last report, all through the agent's own code (:class:`fleet.agent.uplink.Uplink`,
:class:`fleet.agent.kv.KvStream`), the same path as a real engine's. Only the socket is skipped:
frames are handed to the stream in process instead of over ZMQ.

Time: the fleet lives on the simulated clock, the control plane on the wall clock. A link's
bytes are reported over the wall interval divided by ``speed``, so that rates read in fleet time
and the control plane compares them with the capacities it knows.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from typing import Any

from fleet.agent.kv import KvStream
from fleet.agent.metrics import AgentMetrics
from fleet.agent.uplink import KV_PATH, TELEMETRY_PATH, Uplink
from fleet.emulator.config import EmulatorStats
from fleet.emulator.engines import caches, instance_sample
from fleet.emulator.faults import SERVICE_KEPT, SERVICE_KEY
from fleet.emulator.journal import MAX_HASHES_PER_BATCH, EmulatedEngineEvents, kv_batch_events
from scheduling.core.service_levels import TTFT_BUCKETS_S, ttft_bucket
from scheduling.core.simulator.engine import Simulation
from scheduling.core.simulator.fleet import SimRequest

log = logging.getLogger(__name__)


class Reporter:
    """The agents of the emulated engines: one uplink, one KV stream per engine."""

    def __init__(
        self,
        uplink: Uplink,
        metrics: AgentMetrics,
        *,
        speed: float,
        block_tokens: int,
        faults: Any = None,
        clock: Callable[[], float],
    ) -> None:
        self.uplink = uplink
        self.metrics = metrics
        self.speed = speed
        self.block_tokens = block_tokens
        self.faults = faults  # redis-py client (None: the service counters are not kept)
        self._clock = clock
        self._engines: dict[str, EmulatedEngineEvents] = {}
        self._link_sent: dict[str, float] = {}
        # Per PD cluster, the cumulative counters an engine's histograms would give: arrivals,
        # first tokens, first tokens per TTFT bucket (fleet seconds); and the requests still
        # waiting for their first token.
        self._service: dict[str, dict[str, Any]] = {}
        self._awaiting: list[SimRequest] = []
        self._last_telemetry_wall = 0.0

    def arrival(self, request: SimRequest) -> None:
        self._service_of(request.origin)["arrivals"] += 1
        self._awaiting.append(request)

    def _service_of(self, cluster: str) -> dict[str, Any]:
        got = self._service.get(cluster)
        if got is None:
            got = self._service[cluster] = {
                "arrivals": 0,
                "first_tokens": 0,
                "ttft_buckets": [0] * (len(TTFT_BUCKETS_S) + 1),
                "ttft_sum_s": 0.0,
            }
        return got

    def _service_report(self, wall: float) -> list[dict[str, Any]]:
        """Count the first tokens since the last report; the counters of every PD cluster."""
        waiting = []
        for r in self._awaiting:
            if not math.isnan(r.first_token_s):
                counters = self._service_of(r.origin)
                counters["first_tokens"] += 1
                ttft = r.first_token_s - r.arrival_s
                counters["ttft_buckets"][ttft_bucket(ttft)] += 1
                counters["ttft_sum_s"] += ttft
            elif not r.dropped:
                waiting.append(r)
        self._awaiting = waiting
        return [
            {
                "cluster": name,
                "ts": wall,
                "arrivals": c["arrivals"],
                "first_tokens": c["first_tokens"],
                "ttft_buckets": list(c["ttft_buckets"]),
                "ttft_sum_s": c["ttft_sum_s"],
            }
            for name, c in sorted(self._service.items())
        ]

    def report(self, sim: Simulation, wall: float) -> None:
        """One telemetry batch (instances and links) and the KV events since the last one."""
        interval = wall - self._last_telemetry_wall if self._last_telemetry_wall else 0.0
        self._last_telemetry_wall = wall
        instances = []
        for name in sorted(set(sim.prefill_by_name) | set(sim.decode_by_name)):
            sample = instance_sample(sim, name, wall)
            if sample is not None:
                instances.append(sample)
        links = []
        for key, link in sim.links.items():
            link.advance(sim.now)
            sent = link.sent_bytes - self._link_sent.get(key, 0.0)
            self._link_sent[key] = link.sent_bytes
            if interval > 0:
                # Fleet time runs `speed` times faster: report its rate, not the wall rate.
                links.append(
                    {
                        "source": link.source,
                        "target": link.target,
                        "ts": wall,
                        "bytes_sent": max(0, round(sent / self.speed)),
                        "interval_s": interval,
                    }
                )
        clusters = self._service_report(wall)
        self.uplink.telemetry_put(instances, links, clusters)
        if self.faults is not None and clusters:
            # What the emulator reported, for whoever checks the control plane's figures.
            try:
                pipe = self.faults.pipeline(transaction=False)
                pipe.lpush(SERVICE_KEY, json.dumps({"ts": wall, "clusters": clusters}))
                pipe.ltrim(SERVICE_KEY, 0, SERVICE_KEPT - 1)
                pipe.execute()
            except Exception as exc:
                log.warning("emulator: service counters not written: %s", exc)
        self._kv_report(sim, wall)
        self.uplink.flush(force=True)

    def _engine(self, name: str) -> EmulatedEngineEvents:
        engine = self._engines.get(name)
        if engine is None:
            # a new engine process: its stream resumes after what the index last applied, and
            # the engine's seq 0 tells the control plane to start the instance afresh
            stream = KvStream(
                name,
                self.uplink.kv_batch_put,
                self.metrics,
                last_seq=self.uplink.kv_last_seq(name),
            )
            engine = self._engines[name] = EmulatedEngineEvents(stream)
        return engine

    def kv_reset_all(self, sim: Simulation) -> None:
        """Fresh engines: each publishes an empty batch at seq 0, as a vLLM that just started
        does with its first step, so the index forgets the previous run's entries."""
        for name in sorted(caches(sim)):
            self._engine(name).publish([], self._clock())
        self.uplink.flush(force=True)

    def _kv_report(self, sim: Simulation, wall: float) -> None:
        for name, cache in sorted(caches(sim).items()):
            events = cache.take_events()
            for start in range(0, len(events), MAX_HASHES_PER_BATCH):
                part = events[start : start + MAX_HASHES_PER_BATCH]
                self._engine(name).publish(kv_batch_events(part, self.block_tokens), wall)

    def post_stats(self, stats: EmulatorStats) -> None:
        """The emulator's post counters, read from the agent's own metrics."""
        ok = errors = 0
        kv = telemetry = 0
        for metric in self.metrics.posts.collect():
            for sample in metric.samples:
                if not sample.name.endswith("_total"):
                    continue
                path, outcome = sample.labels["endpoint"], sample.labels["outcome"]
                if outcome == "ok":
                    ok += int(sample.value)
                    kv += int(sample.value) if path == KV_PATH else 0
                    telemetry += int(sample.value) if path == TELEMETRY_PATH else 0
                else:
                    errors += int(sample.value)
        stats.kv_posts, stats.telemetry_posts = kv, telemetry
        stats.post_errors = errors
