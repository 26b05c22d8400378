"""Engine scraping against a real local HTTP server serving real vLLM and SGLang pages."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import redis

from clusters.live import telemetry
from clusters.live.scrape import ScrapeFormatError, engine_sample, instances_scrape
from clusters.models import InstanceRole, InstanceState
from scheduling.snapshot import snapshot_reset
from scheduling.tasks import engines_scrape
from tests.factories import ClusterFactory, InstanceFactory
from tests.support.paths import FIXTURES

# vLLM before V1 named its KV gauge ``gpu_cache_usage_perc`` (the captured V1 page has
# ``kv_cache_usage_perc``): the three gauges of such a page, as vLLM 0.8 wrote them.
VLLM_V0_PAGE = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.0
"""


@pytest.fixture
def pages() -> dict[str, str]:
    return {
        "/vllm/metrics": VLLM_V0_PAGE,
        "/vllm1/metrics": (FIXTURES / "vllm-0.32-cpu" / "vllm-metrics.txt").read_text(),
        "/sglang/metrics": (FIXTURES / "sglang-metrics.txt").read_text(),
        "/garbage/metrics": "this is { not prometheus",
    }


@pytest.fixture
def engines(pages: dict[str, str]) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write((body or "").encode())

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_sglang_page_maps_to_queue_running_and_kv_usage(pages: dict[str, str]) -> None:
    s = engine_sample("i", pages["/sglang/metrics"], ts=1.0)
    assert (s.running, s.waiting, s.queue_depth) == (162, 2826, 2826)
    assert s.kv_usage == pytest.approx(0.28)
    # waiting x mean prompt (prompt tokens / finished requests) = 2826 x 8128902 / 11228
    assert s.queued_prefill_tokens == round(2826 * 8.128902e6 / 11228)


def test_vllm_v0_and_v1_pages_are_understood(pages: dict[str, str]) -> None:
    v0 = engine_sample("a", pages["/vllm/metrics"], ts=1.0)
    v1 = engine_sample("b", pages["/vllm1/metrics"], ts=1.0)
    assert (v0.running, v0.waiting, v0.kv_usage) == (0, 0, 0.0)
    assert (v1.running, v1.waiting, v1.kv_usage) == (0, 0, 0.0)


def test_a_page_without_engine_gauges_is_refused() -> None:
    with pytest.raises(ScrapeFormatError, match="no vLLM or SGLang"):
        engine_sample("x", "# HELP up up\n# TYPE up gauge\nup 1\n", ts=1.0)


@pytest.mark.django_db(transaction=True)
def test_scrape_stores_every_reachable_engine_and_reports_the_rest(
    engines: str, redis_client: redis.Redis
) -> None:
    snapshot_reset()
    pd = ClusterFactory(name="pd-a")
    InstanceFactory(cluster=pd, name="sg", role=InstanceRole.DECODE, endpoint=f"{engines}/sglang")
    InstanceFactory(cluster=pd, name="vl", role=InstanceRole.PREFILL, endpoint=f"{engines}/vllm")
    InstanceFactory(
        cluster=pd,
        name="custom",
        role=InstanceRole.PREFILL,
        endpoint="http://127.0.0.1:9",
        labels={"metrics_url": f"{engines}/vllm1/metrics"},
    )
    InstanceFactory(
        cluster=pd, name="bad", role=InstanceRole.PREFILL, endpoint=f"{engines}/garbage"
    )
    InstanceFactory(cluster=pd, name="gone", role=InstanceRole.PREFILL, endpoint=f"{engines}/none")
    InstanceFactory(cluster=pd, name="down", state=InstanceState.DOWN, endpoint=f"{engines}/sglang")
    result = instances_scrape()
    assert result.stored == 3
    assert set(result.failed) == {"bad", "gone"}
    states = telemetry.instance_states_read(["sg", "vl", "custom", "bad", "down"])
    assert set(states) == {"sg", "vl", "custom"}
    assert states["sg"].queue_depth == 2826
    # the beat task is a thin wrapper over the same service
    assert engines_scrape.apply().get() == 3
    snapshot_reset()
