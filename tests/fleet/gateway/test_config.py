"""The gateway's configuration file: the example is valid, wrong values name their key."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleet.gateway.config import ConfigError, config_from_dict, config_load
from tests.support.servers import ROOT

ENV = {"PRFAAS_GATEWAY_TOKEN": "secret"}


def base(**extra: Any) -> dict[str, Any]:
    return {"origin": "pd", "control_plane": {"url": "http://cp:8000"}, **extra}


def test_the_example_configuration_is_valid() -> None:
    cfg = config_load(ROOT / "gateway.example.yaml", ENV)
    assert cfg.origin == "pd-h20" and cfg.token == "secret" and cfg.listen.port == 8080
    assert cfg.endpoint_of("pd-h20-3", "") == "http://pd-h20-3:8000"
    assert cfg.endpoint_of("pd-h20-3", "http://10.1.2.3:9000/") == "http://10.1.2.3:9000"


def test_the_kubernetes_configuration_is_valid() -> None:
    manifest = next(yaml.safe_load_all((ROOT / "deploy/kubernetes/base/gateway.yaml").read_text()))
    cfg = config_from_dict(yaml.safe_load(manifest["data"]["gateway.yaml"]), ENV)
    assert cfg.listen.host == "0.0.0.0" and cfg.control_plane.url == "http://web:8000"


def test_an_endpoint_override_wins_over_the_inventory() -> None:
    cfg = config_from_dict(base(endpoints={"p0": "http://127.0.0.1:9"}), ENV)
    assert cfg.endpoint_of("p0", "http://elsewhere:8000") == "http://127.0.0.1:9"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"control_plane": {"url": "http://cp"}}, "origin:"),
        (base(decide="sometimes"), "decide: must be local or remote"),
        (base(max_inflight=0), "max_inflight: expected int >= 1"),
        (base(max_inflight="8"), "max_inflight: expected int, got str"),
        (base(workers=True), "workers: expected int, got bool"),
        (base(live_refresh_s="fast"), "live_refresh_s: expected float, got str"),
        (base(live_refresh_s=5, live_max_age_s=1), "live_max_age_s: must not be below"),
        (base(endpoints={"p0": "ftp://x"}), "endpoints[...]: must start with http://"),
        (base(endpoint_template="http://x:8000"), "endpoint_template: must contain {instance}"),
        (base(colour="blue"), "colour: unknown key"),
        ({"origin": "pd", "control_plane": {"url": "cp:8000"}}, "control_plane.url: must start"),
        ({"origin": "pd", "control_plane": {"url": "http://cp", "x": 1}}, "control_plane.x:"),
        (base(listen={"port": 70000}), "listen.port: expected int <= 65535"),
        (base(max_body_bytes=1 << 20, body_buffer_bytes=1 << 19), "body_buffer_bytes: must not"),
        (base(max_prompt_tokens=20_000_000), "max_prompt_tokens: expected int <= 10000000"),
        (base(header_timeout_s=0), "header_timeout_s: expected float >= 0.1"),
        (base(eject_base_s=60, eject_max_s=30), "eject_max_s: must not be below"),
        (base(first_byte_factor=0.5), "first_byte_factor: expected float >= 1.0"),
        (
            {"origin": "pd", "control_plane": {"url": "http://cp", "cooldown_s": -1}},
            "control_plane.cooldown_s: expected float >= 0.0",
        ),
    ],
)
def test_a_wrong_value_is_refused_naming_its_key(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_dict(data, ENV)


def test_a_missing_token_variable_is_refused() -> None:
    with pytest.raises(ConfigError, match="PRFAAS_GATEWAY_TOKEN is not set"):
        config_from_dict(base(), {})


def test_the_command_exits_2_with_the_key_of_a_bad_configuration(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(base(decide="maybe")))
    done = subprocess.run(
        [sys.executable, "-m", "fleet.gateway", "--config", str(path)],
        cwd=ROOT,
        env={"PRFAAS_GATEWAY_TOKEN": "x", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "decide: must be local or remote" in done.stderr
