"""``manage.py kv``: Phi_kv at a length and the egress K instances need, against the links."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.management import call_command
from django.core.management.base import CommandError


def run_kv(*args: str) -> str:
    out = io.StringIO()
    call_command("kv", *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def kv_json(*args: str) -> dict[str, Any]:
    return json.loads(run_kv(*args, "--json"))


def test_phi_kv_at_32k_matches_table_5_and_four_instances_fit_the_link(scenarios_dir: Path) -> None:
    out = kv_json(str(scenarios_dir / "paper-case-study.yaml"), "--tokens", "32768")
    (prfaas,) = out["clusters"]
    assert out["kv_cache_mib"] == pytest.approx(701.3)
    assert prfaas["phi_kv_gbps"] == pytest.approx(3.19, abs=0.01)
    assert prfaas["instances"] == 4
    assert prfaas["egress_gbps"] == pytest.approx(4 * prfaas["phi_kv_gbps"])
    (link,) = prfaas["links"]
    assert link["fits"] is True and link["utilisation"] == pytest.approx(0.128, abs=0.001)


def test_a_ten_gbps_link_cannot_carry_six_busy_instances(scenarios_dir: Path) -> None:
    out = kv_json(str(scenarios_dir / "two-pd-clusters.yaml"), "--tokens", "32768")
    links = {link["link"]: link for link in out["clusters"][0]["links"]}
    assert links["prfaas-h200->pd-east"]["fits"] is True
    assert links["prfaas-h200->pd-south"]["fits"] is False


def test_instances_override_the_clusters_own_count(scenarios_dir: Path) -> None:
    out = kv_json(
        str(scenarios_dir / "two-pd-clusters.yaml"), "--tokens", "131072", "--instances", "1"
    )
    (prfaas,) = out["clusters"]
    assert prfaas["instances"] == 1
    assert prfaas["egress_gbps"] == pytest.approx(2.62, abs=0.01)
    assert all(link["fits"] for link in prfaas["links"])


def test_the_human_output_gives_a_verdict_per_link(scenarios_dir: Path) -> None:
    text = run_kv(str(scenarios_dir / "two-pd-clusters.yaml"), "--tokens", "32768")
    assert "Phi_kv 3.20 Gbps per instance" in text
    assert "prfaas-h200->pd-south: 10 Gbps" in text and "EXCEEDS the link" in text


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--tokens", "0"], "--tokens: must be within"),
        (["--tokens", "-5"], "--tokens: must be within"),
        (["--tokens", "1000", "--instances", "0"], "--instances: must be at least 1"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    scenarios_dir: Path, args: list[str], fragment: str
) -> None:
    with pytest.raises(CommandError) as info:
        run_kv(str(scenarios_dir / "paper-case-study.yaml"), *args)
    assert info.value.returncode == 2
    assert fragment in str(info.value)


def test_an_invalid_scenario_exits_2_naming_the_key_path(
    scenarios_dir: Path, tmp_path: Path
) -> None:
    raw = yaml.safe_load((scenarios_dir / "paper-case-study.yaml").read_text())
    raw["model"]["kv_cache_mib"][2] = [100, 5.0]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(CommandError) as info:
        run_kv(str(bad), "--tokens", "1000")
    assert info.value.returncode == 2
    assert str(info.value).startswith("model.kv_cache_mib[2]: table not sorted")


def test_a_missing_file_exits_2(tmp_path: Path) -> None:
    with pytest.raises(CommandError) as info:
        run_kv(str(tmp_path / "absent.yaml"), "--tokens", "1000")
    assert info.value.returncode == 2
    assert "file not found" in str(info.value)
