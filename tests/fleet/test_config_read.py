"""The fleet programs' one typed reader: strict types, and every refusal starts with the key
path of the value refused, whatever msgspec's own wording."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import pytest

from fleet.config_read import (
    ConfigError,
    HttpUrl,
    Port,
    ZmqEndpoint,
    config_convert,
    config_file_read,
    env_secret,
)


class Feed(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    endpoint: ZmqEndpoint
    role: Literal["prefill", "decode"] | None = None

    def __post_init__(self) -> None:
        if self.endpoint.endswith(":0"):
            raise ValueError(".endpoint: port 0 is not a publisher")


class Doc(msgspec.Struct, frozen=True, kw_only=True):
    url: HttpUrl
    port: Port = 9000
    period_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 1.0
    feeds: tuple[Feed, ...] = ()
    roles: dict[Literal["prefill", "decode"], str] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.port == 9001:
            raise ValueError("9001 is taken")


def refused(raw: Any) -> str:
    with pytest.raises(ConfigError) as exc:
        config_convert(raw, Doc)
    return str(exc.value)


def test_a_good_document_converts_with_its_defaults() -> None:
    doc = config_convert(
        {"url": "http://cp", "period_s": 2, "feeds": [{"endpoint": "tcp://e:1"}]}, Doc
    )
    assert doc == Doc(url="http://cp", period_s=2.0, feeds=(Feed(endpoint="tcp://e:1"),))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"url": "http://cp", "port": "80"}, "port: expected int, got str"),
        ({"url": "http://cp", "port": True}, "port: expected int, got bool"),
        ({"url": "http://cp", "port": 70000}, "port: expected int <= 65535"),
        ({"url": "http://cp", "period_s": 0}, "period_s: expected float > 0.0"),
        ({"url": "http://cp", "period_s": float("nan")}, "period_s: expected float > 0.0"),
        ({}, "url: required"),
        ({"url": "cp:8000"}, "url: must start with http:// or https://"),
        ([1], "config: expected mapping, got list"),
        ({"url": "http://cp", "feeds": {}}, "feeds: expected list, got mapping"),
        ({"url": "http://cp", "feeds": [{}]}, "feeds[0].endpoint: required"),
        ({"url": "http://cp", "feeds": [{"endpoint": "e:1"}]}, "feeds[0].endpoint: a ZMQ endpoint"),
        (
            {"url": "http://cp", "feeds": [{"endpoint": "tcp://e:1", "x": 1}]},
            "feeds[0].x: unknown key",
        ),
        (
            {"url": "http://cp", "feeds": [{"endpoint": "tcp://e:1", "role": "both"}]},
            "feeds[0].role: must be decode or prefill, got 'both'",
        ),
        ({"url": "http://cp", "roles": {"both": "x"}}, "roles key: must be decode or prefill, got"),
        ({"url": "http://cp", "roles": {"decode": 1}}, "roles[...]: expected str, got int"),
        (
            {"url": "http://cp", "feeds": [{"endpoint": "tcp://e:0"}]},
            "feeds[0].endpoint: port 0 is",
        ),
        ({"url": "http://cp", "port": 9001}, "config: 9001 is taken"),
    ],
)
def test_a_refusal_starts_with_the_key_path(raw: Any, message: str) -> None:
    assert refused(raw).startswith(message)


def test_a_null_counts_as_left_out_only_when_asked() -> None:
    raw = {"url": "http://cp", "port": None, "feeds": [{"endpoint": "tcp://e:1", "role": None}]}
    assert refused(raw) == "port: expected int, got null"
    doc = config_convert(raw, Doc, null_is_default=True)
    assert doc.port == 9000 and doc.feeds[0].role is None


def test_a_file_that_cannot_be_read_or_is_not_yaml_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read: No such file"):
        config_file_read(tmp_path / "none.yaml")
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    with pytest.raises(ConfigError, match="not YAML"):
        config_file_read(tmp_path / "bad.yaml")
    (tmp_path / "good.yaml").write_text("url: http://cp\n")
    assert config_file_read(tmp_path / "good.yaml") == {"url": "http://cp"}


def test_a_secret_is_the_files_or_else_the_named_variables() -> None:
    assert env_secret("given", "TOKEN", "token_env", {"TOKEN": "env"}) == "given"
    assert env_secret("", "TOKEN", "token_env", {"TOKEN": "env"}) == "env"
    with pytest.raises(ConfigError, match=r"^token_env: environment variable TOKEN is not set$"):
        env_secret("", "TOKEN", "token_env", {})
