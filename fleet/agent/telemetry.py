"""Engine load and link egress, sampled every interval into telemetry batches.

Contract: :class:`TelemetrySampler` is called once per interval (:meth:`TelemetrySampler.sample`)
and returns the ``instances`` and ``links`` rows of one ``POST /api/v1/telemetry`` body:

- per engine, its ``/metrics`` page read by :func:`scheduling.core.engine_metrics.engine_load` (running,
  waiting, KV usage, estimated queued prefill tokens); an engine that cannot be scraped is left
  out (its last sample ages into staleness at the control plane) and counted;
- per link, the bytes sent since the last sample, from where they can be seen:
  ``interface``: the transmit byte counter of a network interface on the PrfaaS side
  (``/proc/net/dev``), with TCP retransmitted segments (``/proc/net/snmp``, host-wide: on a
  host whose only bulk traffic is KV transfer they are the link's);
  ``connector``: the KV connector's transfer counters on the listed engines' pages
  (``vllm:nixl_bytes_transferred`` sum, failed transfers as retransmits).
  The first sample of a counter only sets its baseline; a counter that went back (interface
  reset, engine restart) restarts the baseline instead of reporting a negative rate.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from fleet.agent.config import EngineConfig, LinkConfig
from fleet.agent.metrics import AgentMetrics
from scheduling.core.engine_metrics import EngineLoad, EngineMetricsError, engine_load
from scheduling.core.link import link_key

log = logging.getLogger(__name__)

PROC_NET_DEV = Path("/proc/net/dev")
PROC_NET_SNMP = Path("/proc/net/snmp")


class InterfaceError(LookupError):
    """An interface that is not in /proc/net/dev."""


def interface_tx_bytes(interface: str, text: str | None = None) -> int:
    """Transmitted bytes of ``interface`` since boot (``/proc/net/dev``, 9th counter)."""
    text = PROC_NET_DEV.read_text() if text is None else text
    for line in text.splitlines()[2:]:
        name, _, counters = line.partition(":")
        if name.strip() == interface:
            return int(counters.split()[8])
    raise InterfaceError(f"interface {interface!r} not in /proc/net/dev")


def tcp_retransmits(text: str | None = None) -> int:
    """TCP segments retransmitted since boot (``/proc/net/snmp``, ``Tcp: RetransSegs``)."""
    text = PROC_NET_SNMP.read_text() if text is None else text
    rows = [line.split() for line in text.splitlines() if line.startswith("Tcp:")]
    header, values = rows[0], rows[1]
    return int(values[header.index("RetransSegs")])


@dataclass
class _Counter:
    """Deltas of a cumulative counter; None for the first reading or after a reset."""

    last: float | None = None

    def delta(self, value: float | None) -> float | None:
        if value is None:
            return None
        last, self.last = self.last, value
        if last is None or value < last:
            return None
        return value - last


class TelemetrySampler:
    def __init__(
        self,
        engines: Sequence[EngineConfig],
        links: Sequence[LinkConfig],
        metrics: AgentMetrics,
        *,
        http: httpx.Client | None = None,
        clock: Callable[[], float] = time.time,
        read_tx: Callable[[str], int] = interface_tx_bytes,
        read_retransmits: Callable[[], int] = tcp_retransmits,
    ) -> None:
        self.engines = engines
        self.links = links
        self.metrics = metrics
        self.http = http or httpx.Client(timeout=2.0)
        self.clock = clock
        self.read_tx = read_tx
        self.read_retransmits = read_retransmits
        self._bytes: dict[str, _Counter] = {}
        self._retx: dict[str, _Counter] = {}
        self._last_ts: float | None = None
        # Each engine's load in the last sample (engines that could not be scraped left out).
        self.loads: dict[str, EngineLoad] = {}

    def _scrape(self, engine: EngineConfig) -> EngineLoad | None:
        if not engine.metrics_url:
            return None
        try:
            response = self.http.get(engine.metrics_url)
            response.raise_for_status()
            return engine_load(response.text, engine.instance)
        except (httpx.HTTPError, EngineMetricsError) as exc:
            self.metrics.scrape_errors.labels(engine.instance).inc()
            log.warning("%s: scrape failed: %s", engine.instance, exc)
            return None

    def sample(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        now = self.clock()
        interval = now - self._last_ts if self._last_ts is not None else None
        self._last_ts = now
        loads: dict[str, EngineLoad] = {}
        instances = []
        for engine in self.engines:
            load = self._scrape(engine)
            if load is None:
                continue
            loads[engine.instance] = load
            self.metrics.engine_running.labels(engine.instance).set(load.running)
            self.metrics.engine_waiting.labels(engine.instance).set(load.waiting)
            instances.append(
                {
                    "instance": engine.instance,
                    "ts": now,
                    "queue_depth": load.waiting,
                    "running": load.running,
                    "waiting": load.waiting,
                    "kv_usage": load.kv_usage,
                    "queued_prefill_tokens": load.queued_prefill_tokens,
                }
            )
        links = []
        for link in self.links:
            row = self._link(link, loads, now, interval)
            if row is not None:
                links.append(row)
        self.loads = loads
        return instances, links

    def _link(
        self,
        link: LinkConfig,
        loads: Mapping[str, EngineLoad],
        now: float,
        interval: float | None,
    ) -> dict[str, Any] | None:
        key = link_key(link.source, link.target)
        sent: float | None
        retx: float | None
        if link.measure == "interface":
            try:
                sent = float(self.read_tx(link.interface or ""))
                retx = float(self.read_retransmits())
            except (OSError, InterfaceError, ValueError, IndexError) as exc:
                log.warning("link %s: counters not read: %s", key, exc)
                return None
        else:
            seen = [loads[e] for e in link.engines if e in loads]
            if len(seen) != len(link.engines):
                return None  # a missing engine would read as a drop in the sum
            totals = [s.transfer_bytes_total for s in seen]
            sent = sum(t for t in totals if t is not None) if any(totals) else None
            fails = [s.failed_transfers_total for s in seen if s.failed_transfers_total is not None]
            retx = float(sum(fails)) if fails else 0.0
        d_sent = self._bytes.setdefault(key, _Counter()).delta(sent)
        d_retx = self._retx.setdefault(key, _Counter()).delta(retx)
        if d_sent is None or interval is None or interval <= 0:
            return None
        self.metrics.link_bytes.labels(key).inc(d_sent)
        self.metrics.link_retransmits.labels(key).inc(d_retx or 0)
        return {
            "source": link.source,
            "target": link.target,
            "ts": now,
            "bytes_sent": round(d_sent),
            "interval_s": interval,
            "retransmits": round(d_retx or 0),
        }
