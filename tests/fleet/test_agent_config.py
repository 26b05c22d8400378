"""The agent's configuration: a good file loads, every bad value is refused naming its key,
and the command exits 2 with that message."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleet.agent.config import ConfigError, config_load, config_parse
from tests.support.servers import ROOT

GOOD: dict[str, Any] = {
    "control_plane": {"url": "http://cp:8000", "token_env": "TOKEN"},
    "engines": [
        {
            "instance": "pd-a-p0",
            "metrics_url": "http://127.0.0.1:8000/metrics",
            "kv_events": {
                "endpoint": "tcp://127.0.0.1:5557",
                "replay_endpoint": "tcp://127.0.0.1:5558",
            },
        }
    ],
    "links": [
        {"source": "prfaas-x", "target": "pd-a", "measure": "connector", "engines": ["pd-a-p0"]}
    ],
}


def with_(**changes: Any) -> dict[str, Any]:
    return {**GOOD, **changes}


def test_a_good_file_loads_with_defaults(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    config = config_load(path, env={"TOKEN": "secret"})
    assert (
        config.control_plane.token == "secret"
        and config.listen.port == 9464
        and config.flush_s == 0.05
    )
    assert config.engines[0].kv_events is not None
    assert config.engines[0].kv_events.replay_endpoint == "tcp://127.0.0.1:5558"
    assert config.links[0].engines == ("pd-a-p0",)
    assert config.engines[0].kv_events.max_seq_jump == 100_000
    left_empty = config_parse(with_(interval_s=None, links=None), env={"TOKEN": "t"})
    assert left_empty.interval_s == 1.0 and left_empty.links == ()


def test_the_documented_configurations_load() -> None:
    env = {"PRFAAS_AGENT_TOKEN": "t"}
    full, register = re.findall(r"```yaml\n(.*?)```", (ROOT / "docs/agent.md").read_text(), re.S)
    assert config_parse(yaml.safe_load(full), env).links[1].engines == ("pd-a-p0",)
    block = {"control_plane": {"url": "http://cp"}, **yaml.safe_load(register)}
    assert config_parse(block, env).engines[0].register is not None
    manifest = ROOT / "deploy/kubernetes/overlays/demo/engines-with-agent.yaml"
    sidecar = next(yaml.safe_load_all(manifest.read_text()))["data"]["agent.yaml"]
    assert config_parse(yaml.safe_load(sidecar), env).engines[0].kv_events is not None


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (with_(control_plane={"url": "cp:8000", "token": "t"}), "control_plane.url: must start"),
        (with_(control_plane={"url": "http://cp", "token_env": "NOPE"}), "NOPE is not set"),
        (with_(engines=[]), "engines: expected list of length >= 1"),
        (with_(engines=[{"instance": "a"}]), "engines[0]: give metrics_url, kv_events or both"),
        (
            with_(engines=[{"instance": "a", "kv_events": {"endpoint": "localhost:5557"}}]),
            "engines[0].kv_events.endpoint: a ZMQ endpoint",
        ),
        (
            with_(engines=[GOOD["engines"][0], GOOD["engines"][0]]),
            "engines[1].instance: 'pd-a-p0' listed twice",
        ),
        (with_(interval_s=0), "interval_s: expected float > 0.0"),
        (with_(interval_s=3601), "interval_s: expected float <= 3600"),
        (with_(interval_s="1"), "interval_s: expected float, got str"),
        (with_(interval_s=True), "interval_s: expected float, got bool"),
        (with_(listen={"port": 70000}), "listen.port: expected int <= 65535"),
        (with_(links=[{"source": "a", "target": "b", "measure": "ping"}]), "links[0].measure"),
        (
            with_(links=[{"source": "a", "target": "b", "measure": "interface"}]),
            "links[0].interface: required",
        ),
        (
            with_(links=[{"source": "a", "target": "b", "measure": "connector", "engines": ["x"]}]),
            "links[0].engines: not among the engines: x",
        ),
        ([1, 2], "config: expected mapping, got list"),
        (
            with_(
                engines=[
                    {
                        "instance": "a",
                        "kv_events": {"endpoint": "tcp://127.0.0.1:5557", "max_seq_jump": 0},
                    }
                ]
            ),
            "engines[0].kv_events.max_seq_jump: expected int >= 1",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_key(raw: Any, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        config_parse(raw, env={"TOKEN": "t"})
    assert message in str(exc.value)


def test_the_command_exits_2_with_the_message(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(with_(interval_s=-1)))
    done = subprocess.run(
        [sys.executable, "-m", "fleet.agent", "--config", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"TOKEN": "t", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 2
    assert "interval_s: expected float > 0.0" in done.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "fleet.agent", "--config", str(tmp_path / "none.yaml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "none.yaml" in missing.stderr
