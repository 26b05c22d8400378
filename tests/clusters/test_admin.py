"""The admin edits the inventory through the services: same rules, versions and audit."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.db.models import Model
from django.test import Client
from django.urls import reverse

from clusters.models import (
    Accelerator,
    Cluster,
    Instance,
    Link,
    ModelProfile,
    PerformanceProfile,
    Site,
)
from controlplane.models import ApiToken, ChangeRecord
from tests.factories import (
    ChangeRecordFactory,
    InstanceFactory,
    LinkFactory,
    PerformanceProfileFactory,
    SiteFactory,
    UserFactory,
    api_token,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_user() -> User:
    user: User = UserFactory()
    user.is_staff = user.is_superuser = True
    user.save()
    return user


@pytest.fixture
def browser(admin_user: User) -> Client:
    client = Client()
    client.force_login(admin_user)
    return client


@pytest.mark.parametrize(
    "model",
    [
        Site,
        Accelerator,
        ModelProfile,
        PerformanceProfile,
        Cluster,
        Instance,
        Link,
        ApiToken,
        ChangeRecord,
    ],
)
def test_every_model_has_a_working_changelist(browser: Client, model: type[Model]) -> None:
    LinkFactory()
    InstanceFactory()
    PerformanceProfileFactory()
    ChangeRecordFactory()
    api_token("read")
    url = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
    assert browser.get(url).status_code == 200


def test_an_admin_edit_bumps_the_version_and_is_recorded(browser: Client, admin_user: User) -> None:
    site = SiteFactory(name="dc-a")
    url = reverse("admin:clusters_site_change", args=[site.pk])
    form = browser.get(url)
    assert 'name="expected_version"' in form.content.decode()
    response = browser.post(url, {"name": "dc-a", "description": "edited", "expected_version": 1})
    assert response.status_code == 302
    site.refresh_from_db()
    assert (site.description, site.version) == ("edited", 2)
    record = ChangeRecord.objects.get(object_type="clusters.site", action="update")
    assert record.source == "admin"
    assert record.actor == f"user:{admin_user.username}"
    assert (record.after or {})["description"] == "edited"


def test_an_admin_edit_over_a_newer_version_is_refused(browser: Client) -> None:
    site = SiteFactory(name="dc-a")
    Site.objects.filter(pk=site.pk).update(version=2, description="someone else")
    url = reverse("admin:clusters_site_change", args=[site.pk])
    response = browser.post(
        url, {"name": "dc-a", "description": "mine", "expected_version": 1}, follow=True
    )
    assert "is at version 2" in response.content.decode()
    site.refresh_from_db()
    assert site.description == "someone else"
    assert not ChangeRecord.objects.filter(object_type="clusters.site").exists()


def test_an_admin_add_and_delete_are_recorded(browser: Client) -> None:
    add = reverse("admin:clusters_site_add")
    assert browser.post(add, {"name": "dc-new", "description": ""}).status_code == 302
    site = Site.objects.get(name="dc-new")
    delete = reverse("admin:clusters_site_delete", args=[site.pk])
    assert browser.post(delete, {"post": "yes"}).status_code == 302
    assert not Site.objects.filter(pk=site.pk).exists()
    actions = ChangeRecord.objects.filter(
        object_type="clusters.site", object_id=str(site.pk)
    ).values_list("action", flat=True)
    assert sorted(actions) == ["create", "delete"]


def test_the_admin_refuses_a_decode_instance_in_a_prfaas_cluster(browser: Client) -> None:
    instance = InstanceFactory(cluster__kind="prfaas", role="prefill")
    url = reverse("admin:clusters_instance_change", args=[instance.pk])
    response = browser.post(
        url,
        {
            "cluster": instance.cluster_id,
            "name": instance.name,
            "role": "decode",
            "state": "active",
            "endpoint": "",
            "labels": "{}",
            "expected_version": 1,
        },
    )
    assert response.status_code == 200
    assert "cannot hold a decode instance" in response.content.decode()
    assert Instance.objects.get(pk=instance.pk).role == "prefill"


def test_change_records_are_read_only_in_the_admin(browser: Client) -> None:
    record = ChangeRecordFactory()
    assert browser.get(reverse("admin:controlplane_changerecord_add")).status_code == 403
    delete = reverse("admin:controlplane_changerecord_delete", args=[record.pk])
    assert browser.post(delete, {"post": "yes"}).status_code == 403
    assert ChangeRecord.objects.filter(pk=record.pk).exists()


def test_tokens_can_be_revoked_from_the_admin(browser: Client) -> None:
    token, _ = api_token("read")
    url = reverse("admin:controlplane_apitoken_changelist")
    response = browser.post(url, {"action": "revoke", "_selected_action": [token.pk]})
    assert response.status_code == 302
    token.refresh_from_db()
    assert token.revoked_at is not None
