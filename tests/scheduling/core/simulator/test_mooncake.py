"""The Mooncake conversation trace: prefix caches, link traffic, and why routing by incremental
length matters (acceptance 4)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduling.core.planner import plan_scenario
from scheduling.core.scenario import Scenario, scenario_load
from scheduling.core.simulator.report import report_write
from scheduling.core.simulator.run import SimulationConfig, SimulationResult, simulate

# The first 4,000 requests (about 20 minutes of the trace): enough for conversations to come
# back to their cached prefixes.
REQUESTS = 4000


@pytest.fixture(scope="module")
def mooncake(scenarios_dir: Path) -> Scenario:
    return scenario_load(scenarios_dir / "mooncake-conversation.yaml")


@pytest.fixture(scope="module")
def runs(mooncake: Scenario) -> dict[str, SimulationResult]:
    plan = plan_scenario(mooncake)
    return {
        length: simulate(
            mooncake,
            SimulationConfig(policy="prfaas", requests=REQUESTS, routing_length=length, seed=1),
            plan=plan,
            keep_requests=length == "incremental",
        )
        for length in ("incremental", "prompt")
    }


@pytest.mark.slow
def test_routing_by_incremental_length_offloads_fewer_requests_and_moves_fewer_bytes(
    runs: dict[str, SimulationResult],
) -> None:
    incremental, prompt = runs["incremental"], runs["prompt"]
    assert incremental.thresholds == prompt.thresholds
    assert incremental.offload_fraction < prompt.offload_fraction
    assert incremental.kv_bytes_offloaded < prompt.kv_bytes_offloaded
    sent = {r: sum(link.sent_bytes for link in runs[r].links) for r in runs}
    assert sent["incremental"] < sent["prompt"]


@pytest.mark.slow
def test_the_prefix_caches_serve_a_real_share_of_the_prompt_tokens(
    runs: dict[str, SimulationResult],
) -> None:
    # The trace's infinite-cache bound is 37.4% of prompt tokens (SOURCE.md); a hit needs the
    # blocks and a linear-state checkpoint at exactly that length, so it is lower than that.
    hit = runs["incremental"].cache_hit_fraction
    assert 0.05 < hit < 0.374
    cached = [r for r in runs["incremental"].per_request if r.cached_tokens]
    assert all(r.cached_tokens % 512 == 0 for r in cached)


@pytest.mark.slow
def test_the_report_gives_the_cache_hit_fraction_and_the_link_traffic(
    runs: dict[str, SimulationResult], tmp_path: Path
) -> None:
    result = runs["incremental"]
    page = report_write(result, tmp_path / "report").read_text(encoding="utf-8")
    assert "cache-hit fraction" in page
    assert f"{result.cache_hit_fraction:.3f}" in page
    assert "link traffic: KV offloaded" in page
    assert f"{result.kv_bytes_offloaded / 1e9:.2f}" in page
    assert "data:image/png;base64," in page
    assert (tmp_path / "report" / "link_gbps.png").stat().st_size > 0


def test_the_synthetic_trace_replays_from_its_own_scenario_with_its_prefixes_reused(
    scenarios_dir: Path,
) -> None:
    # Its own scenario names only the trace and extends the conversation's fleet: the path is
    # read relative to the scenario, as a user's own trace would be.
    synthetic = scenario_load(scenarios_dir / "mooncake-synthetic.yaml")
    assert synthetic.workload is not None and synthetic.workload.trace is not None
    assert synthetic.workload.trace.path.name == "synthetic_trace.jsonl"
    result = simulate(synthetic, SimulationConfig(policy="prfaas", requests=800, seed=1))
    assert result.finished == 800 and result.dropped == 0
    # 64% of its block references were seen before (traces/mooncake/SOURCE.md): caches hit.
    assert result.cache_hit_fraction > 0.05
