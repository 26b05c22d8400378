"""Login throttling (django-axes, counts in Redis): per account and per client address, the
right password refused while locked out, and the lock lifted by nothing but time or an admin."""

from __future__ import annotations

from typing import Any, cast

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from tests.factories import UserFactory
from tests.support.processes import RedisServer

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("redis_client")]

RIGHT = "correct horse battery"


@pytest.fixture
def ops() -> User:
    user = cast(User, UserFactory(username="ops", groups=["viewer"]))
    user.set_password(RIGHT)
    user.save()
    return user


def login(client: Client, username: str, password: str, address: str = "10.0.0.1") -> Any:
    return client.post(
        reverse("login"), {"username": username, "password": password}, REMOTE_ADDR=address
    )


def test_200_wrong_passwords_are_refused_after_the_limit_and_then_the_right_one_too(
    client: Client, ops: User
) -> None:
    limit = settings.AXES_FAILURE_LIMIT
    statuses = [login(client, "ops", f"guess-{i}").status_code for i in range(200)]
    # The form answers (200, "wrong password") until the limit, then every try is refused.
    assert statuses[: limit - 1] == [200] * (limit - 1)
    assert set(statuses[limit:]) == {429}
    locked = login(client, "ops", RIGHT)
    assert locked.status_code == 429
    assert "_auth_user_id" not in client.session


def test_an_account_is_locked_however_many_addresses_the_guesses_come_from(
    client: Client, ops: User
) -> None:
    for i in range(settings.AXES_FAILURE_LIMIT):
        login(client, "ops", "wrong", address=f"10.1.0.{i + 1}")
    assert login(client, "ops", RIGHT, address="10.2.0.1").status_code == 429


def test_an_address_is_locked_however_many_accounts_it_guesses_at(
    client: Client, ops: User
) -> None:
    for i in range(settings.AXES_FAILURE_LIMIT):
        login(client, f"nobody-{i}", "wrong", address="10.3.0.1")
    assert login(client, "ops", RIGHT, address="10.3.0.1").status_code == 429
    # Another address may still log in to the same account.
    assert login(client, "ops", RIGHT, address="10.4.0.1").status_code == 302


def test_a_success_before_the_limit_resets_the_count(client: Client, ops: User) -> None:
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        login(client, "ops", "wrong")
    assert login(client, "ops", RIGHT).status_code == 302
    client.logout()
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        login(client, "ops", "wrong")
    assert login(client, "ops", RIGHT).status_code == 302


# --- a Redis outage (issue 33, item 8) ------------------------------------------------------


@pytest.fixture
def redis_stopped(own_redis: RedisServer, settings: Any) -> None:
    """The cache (and so the login throttle) on a private redis-server that is then stopped."""
    settings.CACHES = {"default": {**settings.CACHES["default"], "LOCATION": own_redis.url}}
    own_redis.stop()


@pytest.mark.usefixtures("redis_stopped")
def test_an_operator_logs_in_while_redis_is_down(client: Client, ops: User) -> None:
    response = login(client, "ops", RIGHT)
    assert response.status_code == 302
    assert client.session["_auth_user_id"] == str(ops.pk)


@pytest.mark.usefixtures("redis_stopped")
def test_guessing_is_still_throttled_while_redis_is_down(client: Client, ops: User) -> None:
    # The counts fall back to the process's own memory: lost with the process, never skipped.
    statuses = [login(client, "ops", f"guess-{i}").status_code for i in range(30)]
    assert set(statuses[settings.AXES_FAILURE_LIMIT :]) == {429}
    assert login(client, "ops", RIGHT).status_code == 429
