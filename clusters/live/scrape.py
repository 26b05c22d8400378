"""Engine scraping: read instances' Prometheus ``/metrics`` into the telemetry store, so that
agents are optional. vLLM (V0 and V1 names) and SGLang are understood
(``../shared/samples/``):

| telemetry             | vLLM                                                 | SGLang                  |
| --------------------- | ---------------------------------------------------- | ----------------------- |
| running               | ``vllm:num_requests_running``                        | ``sglang:num_running_reqs`` |
| waiting, queue depth  | ``vllm:num_requests_waiting``                        | ``sglang:num_queue_reqs``   |
| KV usage (0..1)       | ``vllm:kv_cache_usage_perc`` / ``gpu_cache_usage_perc`` | ``sglang:token_usage``   |
| queued prefill tokens | waiting x mean prompt (``request_prompt_tokens`` sum/count) | waiting x ``prompt_tokens_total`` / requests |

Engines expose no queued-token count, so queued prefill tokens are an estimate: waiting
requests times the engine's mean prompt length so far. Several label sets (data-parallel
engines, models) are summed; KV usage takes the fullest. The scrape URL is the instance's
``endpoint`` + ``/metrics``, or its ``metrics_url`` label when set.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from clusters.live import telemetry
from clusters.live.telemetry import InstanceSample
from clusters.models import Instance, InstanceState

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0
SCRAPE_CONCURRENCY = 16

_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")


class ScrapeFormatError(ValueError):
    """A metrics page that is not Prometheus text or carries no known engine metric."""


def engine_sample(instance: str, text: str, ts: float) -> InstanceSample:
    """One instance's load from its Prometheus exposition text."""
    values: dict[str, float] = {}
    kv = 0.0
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in _KV:
                    kv = max(kv, float(s.value))
                else:
                    values[s.name] = values.get(s.name, 0.0) + float(s.value)
    except ValueError as exc:
        raise ScrapeFormatError(f"{instance}: not Prometheus text ({exc})") from None
    if not any(name in values for name in _RUNNING + _WAITING):
        raise ScrapeFormatError(f"{instance}: no vLLM or SGLang request gauges in the page")
    running = sum(values.get(n, 0.0) for n in _RUNNING)
    waiting = sum(values.get(n, 0.0) for n in _WAITING)
    mean_prompt = 0.0
    if values.get("vllm:request_prompt_tokens_count"):
        mean_prompt = (
            values["vllm:request_prompt_tokens_sum"] / values["vllm:request_prompt_tokens_count"]
        )
    elif values.get("sglang:e2e_request_latency_seconds_count"):
        mean_prompt = (
            values.get("sglang:prompt_tokens_total", 0.0)
            / values["sglang:e2e_request_latency_seconds_count"]
        )
    return InstanceSample(
        instance=instance,
        ts=ts,
        queue_depth=round(waiting),
        running=round(running),
        waiting=round(waiting),
        kv_usage=min(1.0, max(0.0, kv)),
        queued_prefill_tokens=round(waiting * mean_prompt),
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
