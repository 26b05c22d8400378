"""Engine scraping: read instances' Prometheus ``/metrics`` into the telemetry store, so that
agents are optional. The page is read by :func:`scheduling.core.engine_metrics.engine_load` (vLLM V0/V1
and SGLang names, label sets summed), the same reading the fleet agent does beside an engine.
The scrape URL is the instance's ``endpoint`` + ``/metrics``, or its ``metrics_url`` label.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from clusters.live import telemetry
from clusters.live.telemetry import InstanceSample
from clusters.models import Instance, InstanceState
from scheduling.core.engine_metrics import EngineMetricsError, engine_load

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0
SCRAPE_CONCURRENCY = 16


class ScrapeFormatError(ValueError):
    """A metrics page that is not Prometheus text or carries no known engine metric."""


def engine_sample(instance: str, text: str, ts: float) -> InstanceSample:
    """One instance's load from its Prometheus exposition text."""
    try:
        load = engine_load(text, instance)
    except EngineMetricsError as exc:
        raise ScrapeFormatError(str(exc)) from None
    return InstanceSample(
        instance=instance,
        ts=ts,
        queue_depth=load.waiting,
        running=load.running,
        waiting=load.waiting,
        kv_usage=load.kv_usage,
        queued_prefill_tokens=load.queued_prefill_tokens,
    )


@dataclass(frozen=True)
class ScrapeTarget:
    instance: str
    url: str


@dataclass(frozen=True)
class ScrapeResult:
    stored: int
    failed: dict[str, str]


def scrape_targets() -> list[ScrapeTarget]:
    """Active instances with an endpoint (or a ``metrics_url`` label)."""
    out = []
    for inst in Instance.objects.exclude(state=InstanceState.DOWN).order_by("name"):
        url = (inst.labels or {}).get("metrics_url") or (
            inst.endpoint.rstrip("/") + "/metrics" if inst.endpoint else ""
        )
        if url:
            out.append(ScrapeTarget(inst.name, url))
    return out


def _fetch(client: httpx.Client, target: ScrapeTarget) -> InstanceSample | str:
    try:
        response = client.get(target.url)
        response.raise_for_status()
        return engine_sample(target.instance, response.text, time.time())
    except (httpx.HTTPError, ScrapeFormatError) as exc:
        return f"{type(exc).__name__}: {exc}"


def instances_scrape(targets: Sequence[ScrapeTarget] | None = None) -> ScrapeResult:
    """Scrape ``targets`` (default: every active instance) concurrently and store the samples.

    An instance that cannot be scraped keeps its last sample (which ages into staleness); the
    failures are returned, not raised, so one dead engine does not hide the others.
    """
    if targets is None:
        targets = scrape_targets()
    samples: list[InstanceSample] = []
    failed: dict[str, str] = {}
    if targets:
        with (
            httpx.Client(timeout=SCRAPE_TIMEOUT_S) as client,
            ThreadPoolExecutor(max_workers=min(SCRAPE_CONCURRENCY, len(targets))) as pool,
        ):
            results: Iterable[InstanceSample | str] = pool.map(lambda t: _fetch(client, t), targets)
            for target, result in zip(targets, results, strict=True):
                if isinstance(result, str):
                    failed[target.instance] = result
                else:
                    samples.append(result)
    if samples:
        telemetry.telemetry_batch_store(samples, [])
    for name, why in failed.items():
        log.warning("scrape of %s failed: %s", name, why)
    return ScrapeResult(stored=len(samples), failed=failed)
