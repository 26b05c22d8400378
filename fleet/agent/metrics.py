"""The agent's own Prometheus metrics (``prfaas_agent_*``), on a registry of its own.

Contract: one :class:`AgentMetrics` per agent (tests and the emulator make several in one
process, so nothing goes to the global registry); :meth:`AgentMetrics.serve` exposes them on
``/metrics`` at the configured address.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class AgentMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        inst = ["instance"]
        self.kv_batches_received = Counter(
            "prfaas_agent_kv_batches_received",
            "KV-event batches received from engines",
            inst,
            registry=r,
        )
        self.kv_blocks_received = Counter(
            "prfaas_agent_kv_blocks_received",
            "Block hashes in the received batches",
            inst,
            registry=r,
        )
        self.kv_malformed = Counter(
            "prfaas_agent_kv_malformed",
            "Messages that are not vLLM KV-event batches",
            inst,
            registry=r,
        )
        self.kv_gaps = Counter(
            "prfaas_agent_kv_gaps", "Sequence gaps seen on an engine's stream", inst, registry=r
        )
        self.kv_replayed = Counter(
            "prfaas_agent_kv_replayed_batches",
            "Batches recovered from the replay socket",
            inst,
            registry=r,
        )
        self.kv_unrecovered = Counter(
            "prfaas_agent_kv_unrecovered_batches",
            "Batches missing from the replay buffer too (the instance goes degraded)",
            inst,
            registry=r,
        )
        self.kv_seq_rejected = Counter(
            "prfaas_agent_kv_seq_rejected",
            "Frames far ahead of the stream that the next frame did not follow (corrupt or "
            "forged sequence numbers): dropped",
            inst,
            registry=r,
        )
        self.kv_engine_restarts = Counter(
            "prfaas_agent_kv_engine_restarts",
            "Engine restarts seen (sequence going back, or a new process start time): the "
            "instance's index is cleared and resynced",
            inst,
            registry=r,
        )
        self.buffered = Gauge(
            "prfaas_agent_buffered_items", "Items waiting to be posted", ["kind"], registry=r
        )
        self.posts = Counter(
            "prfaas_agent_posts",
            "Posts to the control plane by outcome",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.posted_batches = Counter(
            "prfaas_agent_kv_batches_posted",
            "KV-event batches the control plane applied",
            inst,
            registry=r,
        )
        self.dropped = Counter(
            "prfaas_agent_dropped",
            "Items dropped: buffer full while the control plane was away, or refused by it",
            ["kind", "reason"],
            registry=r,
        )
        self.refused = Gauge(
            "prfaas_agent_refused",
            "1 while the control plane refuses an instance or link (403 outside_binding, 404 "
            "unknown_instance or unknown_link): its samples and batches are dropped, the "
            "others go on",
            ["name", "code"],
            registry=r,
        )
        self.scrape_errors = Counter(
            "prfaas_agent_scrape_errors", "Failed engine /metrics scrapes", inst, registry=r
        )
        self.engine_running = Gauge(
            "prfaas_agent_engine_requests_running",
            "Running requests the engine reports",
            inst,
            registry=r,
        )
        self.engine_waiting = Gauge(
            "prfaas_agent_engine_requests_waiting",
            "Waiting requests the engine reports",
            inst,
            registry=r,
        )
        self.link_bytes = Counter(
            "prfaas_agent_link_sent_bytes", "KV bytes measured on a link", ["link"], registry=r
        )
        self.link_retransmits = Counter(
            "prfaas_agent_link_retransmits",
            "Retransmitted segments measured on a link",
            ["link"],
            registry=r,
        )

    def serve(self, host: str, port: int) -> object:
        """Serve ``/metrics``; returns the server (``shutdown()`` stops it)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server
