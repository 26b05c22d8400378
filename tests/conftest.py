"""Fixtures shared by the whole suite: real Redis, the repository's scenarios and test
fixtures, factories."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from django.conf import settings

from tests.support.paths import SCENARIOS
from tests.support.processes import RedisServer


@pytest.fixture(scope="session")
def scenarios_dir() -> Path:
    """The repository's own scenarios (not ``settings.SCENARIOS_DIR``, which a deployment may
    point elsewhere): the files the tests' expectations are about."""
    return SCENARIOS


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    """The real Redis the app's live state is on, emptied before and after each test that asks
    for it: the session's Redis, or its Redis Cluster (``make test-cluster``), whose client
    speaks the same commands (the plain Redis, holding the cache, is emptied too)."""
    from controlplane.redis_connection import redis_cluster_sync

    plain = redis.Redis.from_url(settings.REDIS_URL)
    client = redis_cluster_sync(settings.REDIS_CLUSTER_URL) if settings.REDIS_CLUSTER_URL else plain
    for c in {id(plain): plain, id(client): client}.values():
        c.flushdb()
    yield client
    for c in {id(plain): plain, id(client): client}.values():
        c.flushdb()
        c.close()


@pytest.fixture
def route_state_clean(redis_client: redis.Redis) -> Iterator[None]:
    """The route path's per-process state (policy snapshot, token cache, Redis back-off) reset
    before and after the test, on the emptied real Redis: no test sees another's."""
    from controlplane.auth import token_cache_clear
    from scheduling import decisions
    from scheduling.livestate import live_state_reset
    from scheduling.snapshot import snapshot_reset

    def reset() -> None:
        snapshot_reset()
        live_state_reset()
        token_cache_clear()
        decisions.route_records_reset()
        decisions._redis_skip_until = 0.0

    reset()
    yield
    reset()


@pytest.fixture
def client_as(client: Any) -> Callable[..., Any]:
    """The Django test client, logged in as a new user in the given access groups."""
    from tests.factories import UserFactory

    def login(*groups: str) -> Any:
        client.force_login(UserFactory(groups=list(groups)))
        return client

    return login


@pytest.fixture(scope="session")
def captured_frames() -> list[Any]:
    """The KV-event frames a real vLLM 0.32 published (``tests/fleet/captured.py``)."""
    from tests.fleet.captured import captured_frames as parse

    return parse()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Schemathesis gives every operation's item the test function's node id (the operation is
    only in its name). pytest-xdist's file scheduling keys work by node id, so under
    ``make test`` it ran one operation of 65; each item gets its operation in its id."""
    for item in items:
        if type(item).__name__ != "SchemathesisFunction" or item.nodeid.endswith("]"):
            continue
        own = f"{item.nodeid.rpartition('::')[0]}::{item.name}"
        item._id = type(item._id).parse(own)  # pytest 9's structured node id


@pytest.fixture
def own_redis(tmp_path: Path, settings: Any) -> Iterator[RedisServer]:
    """A redis-server of the test's own (never the session's), started; the test may stop it,
    start it again on the same port, restart it empty or flush its script cache. Live state
    follows REDIS_URL to it even when the session's is on a Redis Cluster."""
    settings.REDIS_CLUSTER_URL = ""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()
