"""The change log: written by every change, readable, and never rewritten."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from controlplane.models import ChangeRecord
from tests.factories import ChangeRecordFactory, SiteFactory, UserFactory, api_token, bearer

pytestmark = pytest.mark.django_db


def test_a_change_record_cannot_be_updated() -> None:
    record = ChangeRecordFactory()
    record.object_repr = "rewritten"
    with pytest.raises(PermissionError):
        record.save()
    with pytest.raises(PermissionError):
        ChangeRecord.objects.filter(pk=record.pk).update(object_repr="rewritten")
    assert ChangeRecord.objects.get(pk=record.pk).object_repr != "rewritten"


def test_a_change_record_cannot_be_deleted() -> None:
    record = ChangeRecordFactory()
    with pytest.raises(PermissionError):
        record.delete()
    with pytest.raises(PermissionError):
        ChangeRecord.objects.filter(pk=record.pk).delete()
    assert ChangeRecord.objects.filter(pk=record.pk).exists()


def test_the_audit_endpoint_lists_newest_first_and_filters_by_object() -> None:
    client = Client(headers=bearer(api_token("admin")[1]))
    site = SiteFactory()
    client.patch(
        f"/api/v1/sites/{site.pk}",
        data=json.dumps({"version": 1, "description": "first"}),
        content_type="application/json",
    )
    client.patch(
        f"/api/v1/sites/{site.pk}",
        data=json.dumps({"version": 2, "description": "second"}),
        content_type="application/json",
    )
    ChangeRecordFactory(object_type="clusters.cluster")
    reader = Client(headers=bearer(api_token("read")[1]))
    response = reader.get(f"/api/v1/audit?object_type=clusters.site&object_id={site.pk}")
    assert response.status_code == 200
    body = response.json()
    assert body["count"] == 2
    assert [i["after"]["description"] for i in body["items"]] == ["second", "first"]
    assert body["items"][1]["before"]["description"] == ""
    assert {i["action"] for i in body["items"]} == {"update"}


def test_the_audit_endpoint_paginates() -> None:
    for _ in range(5):
        ChangeRecordFactory()
    reader = Client(headers=bearer(api_token("read")[1]))
    page = reader.get("/api/v1/audit?limit=2&offset=2").json()
    assert len(page["items"]) == 2
    assert page["count"] >= 5


@pytest.mark.parametrize("method", ["post", "put", "patch", "delete"])
def test_the_audit_log_is_not_writable_through_the_api(method: str) -> None:
    client = Client(headers=bearer(api_token("admin")[1]))
    response = getattr(client, method)("/api/v1/audit", data="{}", content_type="application/json")
    assert response.status_code == 405


@pytest.mark.parametrize("query", ["limit=x", "offset=-1"])
def test_the_audit_endpoint_refuses_bad_paging(query: str) -> None:
    reader = Client(headers=bearer(api_token("read")[1]))
    response = reader.get(f"/api/v1/audit?{query}")
    assert response.status_code == 422
    assert set(response.json()) == {"detail", "code"}


def test_a_session_users_api_write_is_recorded_under_the_users_name() -> None:
    user = UserFactory(groups=["admin"])
    client = Client()
    client.force_login(user)
    response = client.post(
        "/api/v1/sites", data=json.dumps({"name": "dc-s"}), content_type="application/json"
    )
    assert response.status_code == 201
    record = ChangeRecord.objects.get(object_type="clusters.site", action="create")
    assert (record.actor, record.actor_user_id) == (f"user:{user.username}", user.pk)
    assert record.actor_token_id is None
