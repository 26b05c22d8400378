"""``manage.py simulate``: output, reports, and a clear exit status 2 for every bad input."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from collections.abc import Callable
from io import StringIO
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError

from tests.scheduling.core.simulator.conftest import ONE_INSTANCE


def _run(*args: str) -> str:
    out = StringIO()
    call_command("simulate", *args, stdout=out)
    return out.getvalue()


def _fails(*args: str) -> str:
    with pytest.raises(CommandError) as caught:
        _run(*args)
    assert caught.value.returncode == 2
    return str(caught.value)


@pytest.fixture
def case_study_path(scenarios_dir: Path) -> Path:
    return scenarios_dir / "paper-case-study.yaml"


@pytest.fixture
def small(write_scenario: Callable[..., Path]) -> Path:
    return write_scenario(ONE_INSTANCE.format(service=0.5, rate=1.0))


def test_json_output_has_every_documented_field(scenarios_dir: Path) -> None:
    out = json.loads(
        _run(
            str(scenarios_dir / "paper-case-study.yaml"),
            "--policy",
            "prfaas",
            "--rate",
            "2",
            "--requests",
            "800",
            "--json",
        )
    )
    for key in (
        "requests",
        "throughput_rps",
        "offload_fraction",
        "cache_hit_fraction",
        "wall_s",
        "dropped",
        "skipped",
    ):
        assert key in out
    assert set(out["ttft"]) >= {"mean", "p50", "p90", "p99"}
    assert set(out["tpot"]) >= {"mean", "p99"}
    assert set(out["link"]) >= {"mean_gbps", "p99_gbps"}
    assert out["requests"] == 800
    assert out["finished"] == 800
    assert 0.3 < out["offload_fraction"] < 0.7
    assert out["tpot"]["mean"] == pytest.approx(0.025)


@pytest.mark.slow
def test_capacity_prints_the_sustained_rate_and_goodput_under_a_ttft_target(small: Path) -> None:
    out = json.loads(
        _run(str(small), "--capacity", "--requests", "3000", "--ttft-slo", "1.0", "--json")
    )
    # One instance serving 0.5 s prefills saturates at 2 req/s.
    assert out["capacity_rps"] == pytest.approx(2.0, rel=0.10)
    assert 0 < out["goodput_capacity_rps"] < out["capacity_rps"]
    assert any(not p["sustained"] for p in out["probes"])


def test_human_output_csv_and_report(small: Path, tmp_path: Path) -> None:
    table = tmp_path / "requests.csv"
    text = _run(
        str(small),
        "--rate",
        "1",
        "--requests",
        "200",
        "--csv",
        str(table),
        "--report",
        str(tmp_path / "rep"),
    )
    assert "TTFT mean/p50/p90/p99" in text
    rows = list(csv.DictReader(table.open(encoding="utf-8")))
    assert len(rows) == 200
    assert rows[0]["route"] == "local"
    assert float(rows[0]["ttft_s"]) >= 0.5
    assert (tmp_path / "rep" / "report.html").is_file()


def test_a_corrupt_trace_line_stops_with_its_line_number_or_is_skipped_and_counted(
    write_scenario: Callable[..., Path], scenarios_dir: Path, tmp_path: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [
        json.dumps(
            {
                "timestamp": i * 100,
                "input_length": 30000,
                "output_length": 20,
                "hash_ids": list(range(i * 100, i * 100 + 59)),
            }
        )
        for i in range(40)
    ]
    rows[6] = '{"timestamp": 600, "input_length": "lots"'
    trace.write_text("\n".join(rows) + "\n", encoding="utf-8")
    scenario = write_scenario(
        f"version: 1\nname: corrupt\nextends: {scenarios_dir / 'mooncake-conversation.yaml'}\n"
        f"workload:\n  trace: {{path: {trace}, format: mooncake}}\n"
    )
    message = _fails(str(scenario), "--rate", "1")
    assert "trace.jsonl:7:" in message
    out = json.loads(_run(str(scenario), "--rate", "1", "--skip-bad", "--json"))
    assert out["skipped"] == 1
    assert out["skipped_lines"] == [7]
    assert out["requests"] == 39


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rate", "-1"], "--rate: must be a positive"),
        (["--rate", "nan"], "--rate: must be a positive"),
        (["--rate", "1", "--requests", "0"], "--requests: must be between"),
        (["--rate", "1", "--duration", "-5"], "--duration: must be a positive"),
        (["--rate", "1", "--ttft-slo", "0"], "--ttft-slo: must be a positive"),
        (["--rate", "1", "--threshold", "-3"], "--threshold: must be a non-negative"),
        (["--rate", "1", "--policy", "homogeneous", "--threshold", "100"], "has no threshold"),
        (["--rate", "1", "--report", "/nonexistent/dir/rep"], "--report: directory"),
        (["--rate", "1", "--csv", "/nonexistent/dir/x.csv"], "--csv: directory"),
        (["--rate", "1", "--replan-interval", "0"], "--replan-interval: must be a positive"),
    ],
)
def test_bad_arguments_name_the_problem_with_exit_status_2(
    small: Path, args: list[str], message: str
) -> None:
    assert message in _fails(str(small), *args)


def test_a_missing_or_invalid_scenario_file_exits_with_status_2(
    write_scenario: Callable[..., Path], tmp_path: Path
) -> None:
    assert "not found" in _fails(str(tmp_path / "absent.yaml"), "--rate", "1")
    broken = write_scenario("version: 1\nname: x\nmodel: 3\n", "broken.yaml")
    assert "accelerators: required key is missing" in _fails(str(broken), "--rate", "1")


def test_a_scenario_without_a_rate_needs_rate_or_capacity(case_study_path: Path) -> None:
    assert "pass --rate R or --capacity" in _fails(str(case_study_path), "--requests", "10")


def _manage(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", "simulate", *args],
        cwd=settings.BASE_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_from_the_command_line_bad_usage_exits_with_status_2(small: Path) -> None:
    both = _manage(str(small), "--rate", "1", "--capacity")
    assert both.returncode == 2
    assert "not allowed with argument" in both.stderr
    bad = _manage(str(small), "--rate", "-2")
    assert bad.returncode == 2
    assert "--rate: must be a positive" in bad.stderr


def test_a_scenario_with_phases_is_simulated_over_its_whole_length_by_default(
    write_scenario: Callable[..., Path],
) -> None:
    """No cut at a fixed request count: 8 then 12 req/s over 1,500 s of phases is ~14,000
    arrivals, more than the count used for scenarios without phases, spanning every phase."""
    text = ONE_INSTANCE.format(service=0.01, rate=8.0) + (
        "  phases:\n"
        "    - {duration_s: 1000}\n"
        "    - {duration_s: 500, arrival: {process: poisson, rate_per_s: 12.0}}\n"
    )
    out = json.loads(_run(str(write_scenario(text)), "--json"))
    assert out["requests"] > 10_000
    assert out["duration_s"] > 1400
    assert pytest.approx(out["requests"], rel=0.05) == 8 * 1000 + 12 * 500
