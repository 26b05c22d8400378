"""API tokens: issued once, hashed at rest, scoped, expiring, revocable, cheap to check."""

from __future__ import annotations

import hashlib
import importlib
import time
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test import Client, RequestFactory
from django.utils import timezone

from controlplane import auth
from controlplane.auth import AsyncTokenAuth, Principal, TokenAuth, token_cache_clear
from controlplane.errors import Forbidden
from controlplane.models import ApiToken, ChangeRecord
from tests.factories import InstanceFactory, LinkFactory, UserFactory, api_token, bearer

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def fresh_cache() -> Iterator[None]:
    token_cache_clear()
    yield
    token_cache_clear()


def token_command(*args: str) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command("token", *args, stdout=out, stderr=err)
    return out.getvalue().strip(), err.getvalue().strip()


def test_create_prints_the_token_once_and_stores_only_its_hash() -> None:
    secret, note = token_command("create", "--name", "router-a", "--scope", "router")
    token = ApiToken.objects.get(name="router-a")
    assert secret.startswith(token.prefix)
    assert token.secret_sha256 == hashlib.sha256(secret.encode()).hexdigest()
    assert secret not in str(list(ApiToken.objects.values()))
    assert "shown once" in note
    listing, _ = token_command("list")
    assert "router-a" in listing and token.prefix in listing and secret not in listing


def test_create_with_several_scopes_and_an_expiry() -> None:
    token_command(
        "create", "--name", "ops", "--scope", "read", "--scope", "operate", "--expires", "7"
    )
    token = ApiToken.objects.get(name="ops")
    assert token.scopes == ["operate", "read"]
    assert token.expires_at is not None
    assert timedelta(days=6) < token.expires_at - timezone.now() <= timedelta(days=7)


def test_create_records_the_change_without_the_secret() -> None:
    InstanceFactory(name="pd-p0")
    token_command("create", "--name", "agent-1", "--scope", "agent", "--instance", "pd-p0")
    record = ChangeRecord.objects.get(object_type="controlplane.apitoken", action="create")
    after = record.after or {}
    assert after["name"] == "agent-1"
    assert "secret_sha256" not in after


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["create", "--name", "x", "--scope", "superpower"], "invalid choice"),
        (["create", "--name", "x"], "--scope"),
        (["create", "--scope", "read"], "--name"),
        (["create", "--name", "x", "--scope", "read", "--expires", "soon"], "invalid float"),
        (["create", "--name", "x", "--scope", "read", "--expires", "-1"], "positive"),
        (["create", "--name", " ", "--scope", "read"], "name"),
        (["revoke", "nobody"], "no token named"),
        (["create", "--name", "x", "--scope", "agent"], "must be bound"),
        (["create", "--name", "x", "--scope", "agent", "--link", "a-b"], "source->target"),
        (["create", "--name", "x", "--scope", "agent", "--link", "a>b"], "source->target"),
        (["create", "--name", "x", "--scope", "agent", "--instance", "nowhere-0"], "no instance"),
        (["create", "--name", "x", "--scope", "agent", "--link", "a->b"], "no link 'a->b'"),
        (["bind", "nobody", "--fleet-wide"], "no token named"),
    ],
)
def test_bad_token_commands_are_refused_with_a_clear_message(args: list[str], words: str) -> None:
    with pytest.raises(CommandError) as exc:
        token_command(*args)
    assert words in str(exc.value)
    assert ApiToken.objects.count() == 0


def test_bind_takes_an_existing_link_as_source_arrow_target_and_refuses_the_rest() -> None:
    link = LinkFactory()
    written = link.key
    token_command("create", "--name", "agent-l", "--scope", "agent", "--link", written)
    for args, words in (
        (["--link", f"{link.source.name}>{link.target.name}"], "must be source->target"),
        (["--link", f"{link.target.name}->{link.source.name}"], "no link"),
        (["--link", written, "--instance", "nowhere-0"], "no instance named 'nowhere-0'"),
    ):
        with pytest.raises(CommandError) as exc:
            token_command("bind", "agent-l", *args)
        assert words in str(exc.value) and exc.value.returncode == 2
    assert ApiToken.objects.get(name="agent-l").links == [written]


def test_creating_a_token_with_a_taken_name_is_refused() -> None:
    token_command("create", "--name", "dup", "--scope", "read")
    with pytest.raises(CommandError) as exc:
        token_command("create", "--name", "dup", "--scope", "read")
    assert "already exists" in str(exc.value)
    assert ApiToken.objects.count() == 1


def test_revoke_stops_the_token_at_once_in_this_process() -> None:
    token, secret = api_token("read", name="soon-revoked")
    client = Client(headers=bearer(secret))
    assert client.get("/api/v1/sites").status_code == 200
    out, _ = token_command("revoke", "soon-revoked")
    assert "revoked" in out
    assert client.get("/api/v1/sites").status_code == 401
    assert ChangeRecord.objects.filter(action="revoke", object_id=str(token.pk)).exists()


def test_other_processes_see_a_revocation_within_the_cache_ttl(settings: Any) -> None:
    """Simulate another process: the row is revoked behind the cache's back."""
    token, secret = api_token("read")
    client = Client(headers=bearer(secret))
    assert client.get("/api/v1/sites").status_code == 200
    ApiToken.objects.filter(pk=token.pk).update(revoked_at=timezone.now())
    settings.API_TOKEN_CACHE_S = 3600
    assert client.get("/api/v1/sites").status_code == 200  # still cached: the documented TTL
    settings.API_TOKEN_CACHE_S = 0
    assert client.get("/api/v1/sites").status_code == 401


def test_a_cached_token_costs_no_query(django_assert_num_queries: Any, settings: Any) -> None:
    _, secret = api_token("read")
    settings.API_TOKEN_CACHE_S = 3600
    assert auth.token_principal(secret) is not None
    with django_assert_num_queries(0):
        for _ in range(20):
            assert auth.token_principal(secret) is not None


def test_expiry_is_checked_on_every_request_even_when_cached(settings: Any) -> None:
    token, secret = api_token("read")
    settings.API_TOKEN_CACHE_S = 3600
    assert auth.token_principal(secret) is not None
    token_cache_clear()
    ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() + timedelta(seconds=1))
    assert auth.token_principal(secret) is not None
    ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    token_cache_clear()
    assert auth.token_principal(secret) is None


def test_a_cached_token_is_refused_from_the_moment_it_expires(settings: Any) -> None:
    token, secret = api_token("read")
    settings.API_TOKEN_CACHE_S = 3600
    expires = timezone.now() + timedelta(seconds=0.5)
    ApiToken.objects.filter(pk=token.pk).update(expires_at=expires)
    assert auth.token_principal(secret) is not None
    time.sleep(max(0.0, (expires - timezone.now()).total_seconds()) + 0.05)
    # Still cached (an hour), yet past its expiry: refused without asking the database.
    assert auth.token_principal(secret) is None


def test_last_used_is_written_at_most_once_per_interval(settings: Any) -> None:
    token, secret = api_token("read")
    settings.API_TOKEN_LAST_USED_WRITE_S = 3600
    auth.token_principal(secret)
    first = ApiToken.objects.get(pk=token.pk).last_used_at
    assert first is not None
    auth.token_principal(secret)
    assert ApiToken.objects.get(pk=token.pk).last_used_at == first
    settings.API_TOKEN_LAST_USED_WRITE_S = 0
    auth.token_principal(secret)
    latest = ApiToken.objects.get(pk=token.pk).last_used_at
    assert latest is not None and latest > first


def test_an_unknown_scope_in_the_auth_class_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown scope"):
        TokenAuth("superuser")


def test_admin_scope_implies_every_other_scope() -> None:
    principal = Principal(name="t", scopes=frozenset({"admin"}), token_id=1)
    assert all(principal.has_scope(s) for s in ("router", "agent", "read", "operate"))
    assert not Principal(name="t", scopes=frozenset({"read"})).has_scope("operate")


# Sessions: browsers use groups.


@pytest.mark.parametrize(
    ("groups", "read", "operate", "admin"),
    [
        ([], 403, 403, 403),
        (["viewer"], 200, 403, 403),
        (["operator"], 200, 404, 403),
        (["admin"], 200, 404, 422),
    ],
)
def test_session_users_get_scopes_from_their_groups(
    groups: list[str], read: int, operate: int, admin: int
) -> None:
    user = UserFactory(groups=groups)
    client = Client()
    client.force_login(user)
    assert client.get("/api/v1/sites").status_code == read
    assert client.post("/api/v1/instances/987654/drain").status_code == operate
    assert (
        client.post("/api/v1/sites", data="{}", content_type="application/json").status_code
        == admin
    )


def test_a_superuser_session_holds_every_scope() -> None:
    user = UserFactory()
    user.is_superuser = True
    user.save()
    client = Client()
    client.force_login(user)
    assert client.post("/api/v1/instances/987654/drain").status_code == 404


def test_a_session_write_without_the_csrf_token_is_refused() -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(UserFactory(groups=["admin"]))
    response = client.post("/api/v1/sites", data='{"name": "x"}', content_type="application/json")
    assert response.status_code == 403
    assert response.json()["code"] == "csrf_failed"


def test_the_data_migration_is_applied_and_creates_the_three_groups() -> None:
    """Applied by migrate, and what it does: a transactional test's flush (any earlier test in
    this process, in whatever order xdist hands them out) empties the groups table, so the
    migration's function is run again on the schema as it stood, after the rows are gone."""
    from django.contrib.auth.models import Group

    migration = importlib.import_module("controlplane.migrations.0002_access_groups")
    executor = MigrationExecutor(connection)
    assert ("controlplane", "0002_access_groups") in executor.loader.applied_migrations
    Group.objects.filter(name__in=migration.GROUPS).delete()
    state = executor.loader.project_state(("controlplane", "0002_access_groups"))
    migration.groups_create(state.apps, None)

    assert set(Group.objects.values_list("name", flat=True)) >= {"viewer", "operator", "admin"}
    assert Group.objects.get(name="viewer").permissions.filter(codename="view_cluster").exists()
    assert (
        not Group.objects.get(name="viewer").permissions.filter(codename="change_cluster").exists()
    )
    assert (
        Group.objects.get(name="operator").permissions.filter(codename="change_instance").exists()
    )


# The async auth class, for async operations such as the route endpoint.


@pytest.mark.django_db(transaction=True)
async def test_async_auth_accepts_a_scoped_token_and_refuses_others() -> None:
    from asgiref.sync import sync_to_async
    from django.db import connections

    _, secret = await sync_to_async(api_token)("router")
    _, read_secret = await sync_to_async(api_token)("read")
    rf = RequestFactory()
    guard = AsyncTokenAuth("router")
    principal = await guard(rf.post("/x", headers=bearer(secret)))
    assert principal is not None and principal.has_scope("router")
    with pytest.raises(Forbidden):
        await guard(rf.post("/x", headers=bearer(read_secret)))
    assert await guard(rf.post("/x", headers=bearer("prfaas_wrong"))) is None
    assert await guard(rf.post("/x", headers={"Authorization": "Basic abc"})) is None
    # The ORM ran in asgiref's worker thread: close its connection so the test DB can be dropped.
    await sync_to_async(connections.close_all)()
