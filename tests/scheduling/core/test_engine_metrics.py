"""Engine /metrics pages read into load: real vLLM 0.32 and SGLang pages, several engines'
label sets summed, connector transfer counters, and pages that are not engines'."""

from __future__ import annotations

import pytest

from scheduling.core.engine_metrics import EngineMetricsError, engine_load
from tests.support.paths import FIXTURES


def test_a_real_vllm_page() -> None:
    load = engine_load((FIXTURES / "vllm-0.32-cpu" / "vllm-metrics.txt").read_text())
    assert (load.running, load.waiting) == (0, 0)
    assert 0.0 <= load.kv_usage <= 1.0
    assert load.transfer_bytes_total is None  # no KV connector on that server


def test_an_sglang_page() -> None:
    text = (FIXTURES / "sglang-metrics.txt").read_text()
    load = engine_load(text)
    assert load.running >= 0 and load.waiting >= 0 and 0.0 <= load.kv_usage <= 1.0


PAGE = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
# TYPE vllm:request_prompt_tokens histogram
vllm:request_prompt_tokens_sum{engine="0",model_name="m"} 3000.0
vllm:request_prompt_tokens_count{engine="0",model_name="m"} 3.0
# TYPE vllm:nixl_bytes_transferred histogram
vllm:nixl_bytes_transferred_sum{engine="0",model_name="m"} 1.5e9
vllm:nixl_bytes_transferred_sum{engine="1",model_name="m"} 0.5e9
vllm:nixl_bytes_transferred_count{engine="0",model_name="m"} 7.0
# TYPE vllm:nixl_num_failed_transfers counter
vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 2.0
"""


def test_data_parallel_engines_are_summed_and_the_fullest_kv_taken() -> None:
    load = engine_load(PAGE)
    assert (load.running, load.waiting, load.kv_usage) == (5, 5, 0.75)
    assert load.queued_prefill_tokens == 5 * 1000
    assert load.transfer_bytes_total == 2.0e9 and load.failed_transfers_total == 2.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not a metric page {", "not Prometheus text"),
        ("# TYPE x gauge\nx 1\n", "no vLLM or SGLang"),
    ],
)
def test_pages_that_are_not_an_engines_are_refused(text: str, message: str) -> None:
    with pytest.raises(EngineMetricsError, match=message):
        engine_load(text, "e")
