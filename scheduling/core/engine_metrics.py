"""An engine's Prometheus ``/metrics`` page read into load numbers (vLLM V1/V0 and SGLang).

Contract: :func:`engine_load` parses one exposition text into an :class:`EngineLoad`, or raises
:class:`EngineMetricsError` (not Prometheus text, or no known request gauge). Used by the agent
beside each engine and by the control plane's own scraper (``clusters.live.scrape``): one
reading of engines for both.

| load                  | vLLM                                                 | SGLang                  |
| --------------------- | ---------------------------------------------------- | ----------------------- |
| running               | ``vllm:num_requests_running``                        | ``sglang:num_running_reqs`` |
| waiting, queue depth  | ``vllm:num_requests_waiting``                        | ``sglang:num_queue_reqs``   |
| KV usage (0..1)       | ``vllm:kv_cache_usage_perc`` / ``gpu_cache_usage_perc`` | ``sglang:token_usage``   |
| queued prefill tokens | waiting x mean prompt (``request_prompt_tokens`` sum/count) | waiting x ``prompt_tokens_total`` / requests |
| KV transfer bytes     | ``vllm:nixl_bytes_transferred`` (histogram sum), ``vllm:kv_offload_*_bytes`` not counted | - |
| failed transfers      | ``vllm:nixl_num_failed_transfers``                   | -                       |

Engines expose no queued-token count, so queued prefill tokens are an estimate: waiting
requests times the engine's mean prompt length so far. Several label sets (data-parallel
engines ``engine="0"``, ``"1"``..., models) are summed; KV usage takes the fullest.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
TRANSFER_BYTES = ("vllm:nixl_bytes_transferred_sum",)
FAILED_TRANSFERS = ("vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_failed_transfers")


class EngineMetricsError(ValueError):
    """A page that is not Prometheus text or carries no known engine metric."""


@dataclass(frozen=True)
class EngineLoad:
    """What an engine's page says about its load (counters are cumulative)."""

    running: int
    waiting: int
    kv_usage: float
    queued_prefill_tokens: int
    transfer_bytes_total: float | None  # KV connector bytes moved, since engine start
    failed_transfers_total: float | None
    # The serving process's start (unix seconds, ``process_start_time_seconds``): a new value
    # is a new engine process (None: the page does not say).
    process_start_s: float | None = None


def engine_load(text: str, source: str = "engine") -> EngineLoad:
    """The load in one exposition text (``source`` names the engine in errors)."""
    values: dict[str, float] = {}
    kv = 0.0
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in KV_USAGE:
                    kv = max(kv, float(s.value))
                else:
                    values[s.name] = values.get(s.name, 0.0) + float(s.value)
    except ValueError as exc:
        raise EngineMetricsError(f"{source}: not Prometheus text ({exc})") from None
    if not any(name in values for name in RUNNING + WAITING):
        raise EngineMetricsError(f"{source}: no vLLM or SGLang request gauges in the page")
    running = sum(values.get(n, 0.0) for n in RUNNING)
    waiting = sum(values.get(n, 0.0) for n in WAITING)
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

    def total(names: tuple[str, ...]) -> float | None:
        found = [values[n] for n in names if n in values]
        return sum(found) if found else None

    return EngineLoad(
        running=round(running),
        waiting=round(waiting),
        kv_usage=min(1.0, max(0.0, kv)),
        queued_prefill_tokens=round(waiting * mean_prompt),
        transfer_bytes_total=total(TRANSFER_BYTES),
        failed_transfers_total=total(FAILED_TRANSFERS[:1]) or total(FAILED_TRANSFERS[1:]),
        process_start_s=values.get("process_start_time_seconds"),
    )
