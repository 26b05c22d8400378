"""Control plane pages: login, overview, audit log, API tokens, and who may do what."""

from __future__ import annotations

from typing import cast

import pytest
from django.contrib.auth.models import User
from django.urls import reverse

from clusters.models import Instance, Link
from controlplane.models import ApiToken, ChangeRecord
from tests.factories import (
    ApiTokenFactory,
    ChangeRecordFactory,
    InstanceFactory,
    LinkFactory,
    UserFactory,
)

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("redis_client")]


def test_an_anonymous_visitor_is_sent_to_the_login_page(client) -> None:
    response = client.get(reverse("overview"))
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("login"))


def test_logging_in_with_a_wrong_password_says_so_and_stays_on_the_form(client) -> None:
    UserFactory(username="ops")
    response = client.post(reverse("login"), {"username": "ops", "password": "wrong"})
    assert response.status_code == 200
    assert "Please enter a correct username and password" in response.content.decode()
    assert "_auth_user_id" not in client.session


def test_logging_in_lands_on_the_overview(client) -> None:
    user = cast(User, UserFactory(username="ops", groups=["viewer"]))
    user.set_password("correct horse battery")
    user.save()
    response = client.post(
        reverse("login"), {"username": "ops", "password": "correct horse battery"}, follow=True
    )
    assert response.redirect_chain[-1][0] == reverse("overview")
    assert "Overview" in response.content.decode()


def test_a_user_without_a_role_cannot_see_the_overview(client_as) -> None:
    assert client_as().get(reverse("overview")).status_code == 403


def test_the_overview_shows_the_topology_in_its_snapshot(client_as) -> None:
    link = cast(Link, LinkFactory(gbps=100.0))
    InstanceFactory(cluster=link.target, name="pd-a-0")
    response = client_as("viewer").get(reverse("overview"))
    assert response.status_code == 200
    snapshot = response.context["snapshot"]
    assert [entry["capacity_gbps"] for entry in snapshot["links"]] == [100.0]
    assert {c["name"] for c in snapshot["clusters"]} == {link.source.name, link.target.name}
    assert 'id="overview-snapshot"' in response.content.decode()


def test_the_overview_raises_a_stale_telemetry_alert_for_a_silent_cluster(client_as) -> None:
    inst = cast(Instance, InstanceFactory(name="quiet-0"))
    snapshot = client_as("viewer").get(reverse("overview")).context["snapshot"]
    stale = [a for a in snapshot["alerts"] if a["code"] == "telemetry_stale"]
    assert [a["subject"] for a in stale] == [inst.cluster.name]


def test_the_audit_log_lists_changes_and_filters_by_action(client_as) -> None:
    ChangeRecordFactory(action=ChangeRecord.Action.CREATE, object_repr="site-created")
    ChangeRecordFactory(action=ChangeRecord.Action.DRAIN, object_repr="instance-drained")
    page = client_as("viewer").get(reverse("audit-list"), {"action": "drain"}).content.decode()
    assert "instance-drained" in page
    assert "site-created" not in page


def test_the_audit_log_says_why_a_system_change_was_made(client_as) -> None:
    ChangeRecordFactory(
        action="unreachable",
        actor="reachability",
        object_repr="pd-a-3",
        cause="no heartbeat for 42 s (grace 30 s)",
    )
    page = client_as("viewer").get(reverse("audit-list"), {"action": "unreachable"}).content
    assert b"no heartbeat for 42 s (grace 30 s)" in page and b"pd-a-3" in page


@pytest.mark.parametrize("group", ["viewer", "operator"])
def test_only_admins_see_the_tokens_page_or_its_link(client_as, group: str) -> None:
    ApiTokenFactory(name="router-1")
    user = client_as(group)
    response = user.get(reverse("token-list"))
    assert response.status_code == 403
    assert "router-1" not in response.content.decode()
    assert reverse("token-list") not in user.get(reverse("audit-list")).content.decode()


def test_an_admin_sees_the_tokens_page(client_as) -> None:
    ApiTokenFactory(name="router-1")
    page = client_as("admin").get(reverse("token-list")).content.decode()
    assert "router-1" in page and "Create token" in page and "Revoke" in page


def test_the_password_reset_pages_do_not_exist(client) -> None:
    # They were public and sent mail through an SMTP server on localhost.
    assert client.get("/accounts/password_reset/").status_code == 404
    assert client.post("/accounts/password_reset/", {"email": "a@b.c"}).status_code == 404
    assert client.get("/accounts/reset/x/y/").status_code == 404


def test_a_viewer_posting_a_token_gets_403_and_nothing_is_created(client_as) -> None:
    response = client_as("viewer").post(
        reverse("token-create"), {"name": "sneaky", "scopes": ["admin"]}
    )
    assert response.status_code == 403
    assert not ApiToken.objects.filter(name="sneaky").exists()


def test_an_operator_cannot_revoke_a_token(client_as) -> None:
    ApiTokenFactory(name="router-1")
    response = client_as("operator").post(reverse("token-revoke", args=["router-1"]))
    assert response.status_code == 403
    assert ApiToken.objects.get(name="router-1").revoked_at is None


def test_creating_a_token_shows_the_secret_once(client_as) -> None:
    client = client_as("admin")
    response = client.post(
        reverse("token-create"),
        {"name": "agent-1", "scopes": ["agent"], "expires_in_days": "", "fleet_wide": "on"},
    )
    assert response.status_code == 201
    secret = response.context["issued"].secret
    assert secret in response.content.decode()
    assert ApiToken.objects.get(name="agent-1").scopes == ["agent"]
    assert secret not in client.get(reverse("token-list")).content.decode()


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        ({"name": "", "scopes": ["read"]}, "name", "This field is required."),
        ({"name": "   ", "scopes": ["read"]}, "name", "This field is required."),
        ({"name": "x"}, "scopes", "This field is required."),
        ({"name": "x", "scopes": ["root"]}, "scopes", "Select a valid choice."),
        (
            {"name": "x", "scopes": ["read"], "expires_in_days": "-1"},
            "expires_in_days",
            "greater than or equal to 0.01",
        ),
        (
            {"name": "x", "scopes": ["read"], "expires_in_days": "soon"},
            "expires_in_days",
            "Enter a number.",
        ),
        ({"name": "dup", "scopes": ["read"]}, "name", "already exists"),
    ],
)
def test_a_bad_token_form_shows_the_error_next_to_the_field_and_saves_nothing(
    client_as, data, field, message
) -> None:
    ApiTokenFactory(name="dup")
    before = ApiToken.objects.count()
    response = client_as("admin").post(reverse("token-create"), data)
    assert response.status_code == 422
    assert any(message in e for e in response.context["form"].errors[field])
    assert f'id="id_{field}_error"' in response.content.decode()
    assert ApiToken.objects.count() == before


def test_revoking_a_token_marks_it_revoked_and_audits_it(client_as) -> None:
    ApiTokenFactory(name="router-1")
    response = client_as("admin").post(reverse("token-revoke", args=["router-1"]), follow=True)
    assert "Token router-1 revoked." in response.content.decode()
    assert ApiToken.objects.get(name="router-1").revoked_at is not None
    assert ChangeRecord.objects.filter(action="revoke", object_repr__contains="router-1").exists()


def test_revoking_an_unknown_token_says_so(client_as) -> None:
    response = client_as("admin").post(reverse("token-revoke", args=["ghost"]), follow=True)
    assert [str(m) for m in response.context["messages"]] == ["no token named 'ghost'"]
