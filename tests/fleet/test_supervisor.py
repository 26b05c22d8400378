"""The fleet supervisor with fake engines (``fleet.fake_engine``, which honour vLLM's
``kv_role``: a ``kv_consumer`` never writes KV to the shared storage, a ``kv_producer`` does):
a signed flip restarts the engine in the new role's ``kv_role``, once per idempotency key; a
step that is not signed, stale or malformed changes nothing; the role outlives the
supervisor; a bad config file is refused naming its key."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from fleet.agent.config import config_parse as agent_config_parse
from fleet.supervisor.config import ConfigError, config_parse
from fleet.supervisor.processes import AgentProcess, engine_argv
from tests.support.servers import ROOT, free_port
from tests.support.supervisor import SupervisorProcess, engines_of, step_post
from tests.support.waiting import wait_for

SECRET = "test-step-secret"
NAME = "pd-x-0"


def fake_engine(name: str, port: int, storage: Path, role: str = "decode") -> dict[str, Any]:
    return {
        "instance": name,
        "cluster": "pd-x",
        "role": role,
        "accelerator": "H20",
        "kv_connector": "shared_storage",
        "engine": "fake",
        "port": port,
        "command": [
            sys.executable,
            "-m",
            "fleet.fake_engine",
            "--instance",
            "{instance}:{port}:{kv_role}",
            "--connector",
            "shared_storage",
            "--storage",
            str(storage),
        ],
        "startup_timeout_s": 30,
    }


def supervisor_yaml(
    tmp_path: Path, engines: list[dict[str, Any]], control_plane: str, port: int
) -> Path:
    path = tmp_path / "supervisor.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "listen": {"host": "127.0.0.1", "port": port},
                "control_plane": {"url": control_plane},
                "work_dir": str(tmp_path / "work"),
                "agent": {"interval_s": 0.2, "register_every_s": 1},
                "engines": engines,
            }
        )
    )
    return path


@pytest.fixture
def host(tmp_path: Path) -> Iterator[tuple[str, SupervisorProcess, Path, int]]:
    """A supervisor running one fake decode engine (its agent finds no control plane)."""
    storage = tmp_path / "kv"
    storage.mkdir()
    port, engine_port = free_port(), free_port()
    path = supervisor_yaml(
        tmp_path, [fake_engine(NAME, engine_port, storage)], "http://127.0.0.1:9", port
    )
    supervisor = SupervisorProcess(path, "no-token", SECRET)
    supervisor.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for("the engine up", lambda: engines_of(url).get(NAME, {}).get("agent_running"), 60)
        yield url, supervisor, storage, engine_port
    finally:
        supervisor.stop()


def complete(port: int, prompt: str) -> None:
    answer = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 2},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text


def flip(role: str) -> dict[str, Any]:
    return {"action": "flip", "instance": NAME, "to_role": role, "plan_id": 1, "step": 2}


def test_a_signed_flip_restarts_the_engine_with_the_roles_kv_role_once(
    host: tuple[str, SupervisorProcess, Path, int],
) -> None:
    url, _, storage, port = host
    prompt = "a prompt long enough to fill a few blocks " * 8
    complete(port, prompt)
    assert not list(storage.iterdir())  # a kv_consumer writes no KV
    pid = engines_of(url)[NAME]["pid"]

    answer = step_post(url, SECRET, flip("prefill"), key="plan-1-apply-step-2")

    assert answer.status_code == 200, answer.text
    done = answer.json()
    assert (done["done"], done["role"], done["restarted"]) == (True, "prefill", True)
    engine = engines_of(url)[NAME]
    assert (engine["role"], engine["kv_role"], engine["running"]) == (
        "prefill",
        "kv_producer",
        True,
    )
    assert engine["pid"] != pid
    complete(port, prompt)
    assert list(storage.iterdir())  # the kv_producer wrote its KV for a decoder
    # The same step again (a retry): answered as before, the engine left alone.
    again = step_post(url, SECRET, flip("prefill"), key="plan-1-apply-step-2")
    assert again.status_code == 200 and again.json() == done
    assert engines_of(url)[NAME]["pid"] == engine["pid"]


@pytest.mark.parametrize(
    ("secret", "age_s"), [("wrong-secret", 0), (SECRET, 3600)], ids=["wrong secret", "stale"]
)
def test_a_step_signed_wrongly_or_long_ago_is_refused_and_changes_nothing(
    host: tuple[str, SupervisorProcess, Path, int], secret: str, age_s: float
) -> None:
    url, *_ = host
    pid = engines_of(url)[NAME]["pid"]
    answer = step_post(url, secret, flip("prefill"), at=time.time() - age_s)
    assert answer.status_code == 401 and answer.json()["code"] == "bad_signature"
    unsigned = httpx.post(f"{url}/v1/steps", json=flip("prefill"), timeout=10)
    assert unsigned.status_code == 401
    assert (engines_of(url)[NAME]["pid"], engines_of(url)[NAME]["role"]) == (pid, "decode")


def test_unknown_instances_and_bad_steps_are_refused_and_other_steps_do_nothing(
    host: tuple[str, SupervisorProcess, Path, int],
) -> None:
    url, *_ = host
    pid = engines_of(url)[NAME]["pid"]
    unknown = step_post(url, SECRET, {**flip("prefill"), "instance": "elsewhere-0"})
    assert unknown.status_code == 404 and unknown.json()["code"] == "unknown_instance"
    no_role = step_post(url, SECRET, {"action": "flip", "instance": NAME})
    assert no_role.status_code == 422
    drain = step_post(url, SECRET, {"action": "drain", "instance": NAME})
    assert drain.status_code == 200 and drain.json()["done"] is False
    assert engines_of(url)[NAME]["pid"] == pid


def test_the_last_flip_outlives_a_restart_of_the_supervisor(
    host: tuple[str, SupervisorProcess, Path, int],
) -> None:
    url, supervisor, _, _ = host
    assert step_post(url, SECRET, flip("prefill")).status_code == 200
    supervisor.stop()
    supervisor.start()
    back = wait_for("the engine back", lambda: engines_of(url).get(NAME, {}).get("agent_running"))
    assert back and engines_of(url)[NAME]["kv_role"] == "kv_producer"


def test_an_engine_command_gets_its_placeholders_and_the_roles_kv_transfer_config() -> None:
    config = config_parse(
        {
            "control_plane": {"url": "http://cp:8000", "token": "t"},
            "secret": "s",
            "work_dir": "/tmp/w",
            "engines": [
                {
                    **fake_engine(NAME, 8100, Path("/tmp")),
                    "command": ["vllm", "--port", "{port}", "--json", '{"a": 1}'],
                    "kv_transfer_config": {"kv_connector": "ExampleConnector"},
                    "kv_roles": {"prefill": "kv_both"},
                }
            ],
        }
    )
    (engine,) = config.engines
    assert engine_argv(engine, "prefill") == [
        "vllm",
        "--port",
        "8100",
        "--json",
        '{"a": 1}',
        "--kv-transfer-config",
        '{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}',
    ]
    assert engine_argv(engine, "decode")[-1].endswith('"kv_role": "kv_consumer"}')


def test_the_agent_config_written_for_an_engine_is_one_the_agent_reads(tmp_path: Path) -> None:
    config = config_parse(
        {
            "control_plane": {"url": "http://cp:8000", "token": "t"},
            "secret": "s",
            "work_dir": str(tmp_path),
            "agent": {"interval_s": 0.5},
            "engines": [
                {**fake_engine(NAME, 8100, tmp_path), "kv_events": {"endpoint": "tcp://e:1"}}
            ],
        }
    )
    (engine,) = config.engines
    written = AgentProcess(config, engine, tmp_path).agent_config("prefill")
    agent = agent_config_parse(written, env={"PRFAAS_AGENT_TOKEN": "t"})
    assert agent.interval_s == 0.5 and agent.engines[0].kv_events == engine.kv_events
    assert agent.engines[0].register is not None and agent.engines[0].register.role == "prefill"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"role": "both"}, "engines[0].role: must be decode or prefill, got 'both'"),
        ({"command": []}, "engines[0].command: expected list of length >= 1"),
        (
            {"kv_roles": {"prefill": "kv_sideways"}},
            "engines[0].kv_roles[...]: must be kv_both or kv_consumer or kv_producer, got",
        ),
        ({"port": 70000}, "engines[0].port: expected int <= 65535"),
        ({"kv_connector": "rdma"}, "engines[0].kv_connector: must be nixl or shared_storage"),
        ({"env": {"A": 1}}, "engines[0].env[...]: expected str or null, got int"),
        ({"port": "8100"}, "engines[0].port: expected int, got str"),
        ({"kv_roles": {"both": "kv_both"}}, "engines[0].kv_roles key: must be decode or prefill"),
    ],
)
def test_a_bad_config_is_refused_naming_the_key(change: dict[str, Any], message: str) -> None:
    raw = {
        "control_plane": {"url": "http://cp:8000", "token": "t"},
        "secret": "s",
        "work_dir": "/tmp/w",
        "engines": [{**fake_engine(NAME, 8100, Path("/tmp")), **change}],
    }
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_parse(raw)


def test_the_documented_configuration_loads() -> None:
    (block,) = (
        b
        for b in re.findall(r"```yaml\n(.*?)```", (ROOT / "docs/actuators.md").read_text(), re.S)
        if "secret_env" in b
    )
    env = {"PRFAAS_AGENT_TOKEN": "t", "PRFAAS_SUPERVISOR_SECRET": "s"}
    config = config_parse(yaml.safe_load(block), env=env)
    (engine,) = config.engines
    assert config.secret == "s" and config.control_plane.token == "t"
    assert engine.kv_role("prefill") == "kv_producer" and engine.kv_events is not None


def test_a_missing_secret_is_refused_naming_its_variable() -> None:
    raw = {
        "control_plane": {"url": "http://cp:8000", "token": "t"},
        "work_dir": "/tmp/w",
        "engines": [fake_engine(NAME, 8100, Path("/tmp"))],
    }
    with pytest.raises(ConfigError, match="secret_env: environment variable PRFAAS_SUPERVISOR"):
        config_parse(raw, env={})
