"""Inventory services: validation, versions, the cluster-kind rules, audit records."""

from __future__ import annotations

import pytest

from clusters import services
from clusters.models import Accelerator, Cluster, Instance
from controlplane.audit import CLI_ACTOR
from controlplane.errors import Conflict, Invalid, NotFound
from controlplane.models import ChangeRecord
from tests.factories import (
    ClusterFactory,
    InstanceFactory,
    LinkFactory,
    ModelProfileFactory,
    PerformanceProfileFactory,
    SiteFactory,
)

pytestmark = pytest.mark.django_db


def test_an_update_that_changes_nothing_keeps_the_version_and_writes_no_record() -> None:
    site = SiteFactory(description="same")
    result = services.site_update(
        site_id=site.pk, version=1, changes={"description": "same"}, actor=CLI_ACTOR
    )
    assert result.version == 1
    assert not ChangeRecord.objects.exists()


def test_a_field_that_is_not_editable_is_refused_by_name() -> None:
    site = SiteFactory()
    with pytest.raises(Invalid, match="version"):
        services.site_update(site_id=site.pk, version=1, changes={"version": 9}, actor=CLI_ACTOR)
    with pytest.raises(Invalid, match="source_kind"):
        services.link_update(
            link_id=LinkFactory().pk, version=1, changes={"source_kind": "pd"}, actor=CLI_ACTOR
        )


def test_unknown_ids_are_not_found() -> None:
    with pytest.raises(NotFound):
        services.cluster_update(cluster_id=987654, version=1, changes={}, actor=CLI_ACTOR)
    with pytest.raises(NotFound):
        services.instance_drain(instance_id=987654, actor=CLI_ACTOR)


def test_a_pd_cluster_with_only_prefill_instances_may_become_prfaas_and_its_rows_follow() -> None:
    instance = InstanceFactory(role="prefill")
    cluster = services.cluster_update(
        cluster_id=instance.cluster_id, version=1, changes={"kind": "prfaas"}, actor=CLI_ACTOR
    )
    assert cluster.kind == "prfaas"
    assert Instance.objects.get(pk=instance.pk).cluster_kind == "prfaas"
    # The copy keeps the DB's own rule working: a decode instance is now refused there.
    with pytest.raises(Invalid, match="decode"):
        services.instance_update(
            instance_id=instance.pk, version=1, changes={"role": "decode"}, actor=CLI_ACTOR
        )


@pytest.mark.parametrize(
    ("end", "new_kind"), [("source", "pd"), ("target", "prfaas")], ids=["source", "target"]
)
def test_a_kind_change_that_would_turn_a_link_around_is_refused(end: str, new_kind: str) -> None:
    link = LinkFactory()
    cluster = getattr(link, end)
    with pytest.raises(Invalid, match="links"):
        services.cluster_update(
            cluster_id=cluster.pk, version=1, changes={"kind": new_kind}, actor=CLI_ACTOR
        )
    assert Cluster.objects.get(pk=cluster.pk).kind == cluster.kind


def test_moving_an_instance_to_another_cluster_updates_its_kind_copy() -> None:
    instance = InstanceFactory(role="prefill")
    prfaas = ClusterFactory(kind="prfaas")
    moved = services.instance_update(
        instance_id=instance.pk, version=1, changes={"cluster_id": prfaas.pk}, actor=CLI_ACTOR
    )
    assert (moved.cluster_kind, moved.version) == ("prfaas", 2)


def test_duplicates_are_conflicts_and_bad_values_are_invalid() -> None:
    SiteFactory(name="dc-a")
    with pytest.raises(Conflict):
        services.site_create(actor=CLI_ACTOR, name="dc-a")
    profile = PerformanceProfileFactory()
    with pytest.raises((Conflict, Invalid)):
        services.performance_profile_create(
            actor=CLI_ACTOR,
            accelerator_id=profile.accelerator_id,
            model_id=profile.model_id,
            gpus_per_instance=8,
            prefill_seconds=[[1024, 1.0], [2048, 2.0]],
        )
    with pytest.raises(Invalid, match="decode"):
        services.performance_profile_create(
            actor=CLI_ACTOR,
            accelerator_id=profile.accelerator_id,
            model_id=ModelProfileFactory().pk,
            gpus_per_instance=8,
            prefill_seconds=[[1024, 1.0], [2048, 2.0]],
            decode_max_batch=4,
        )
    with pytest.raises(Invalid, match="gpu_hour_cost"):
        services.accelerator_create(actor=CLI_ACTOR, name="free", gpu_hour_cost=0)
    with pytest.raises(Invalid, match="endpoint"):
        services.instance_create(
            actor=CLI_ACTOR,
            cluster_id=ClusterFactory().pk,
            name="x",
            role="prefill",
            endpoint="nope",
        )
    assert not Accelerator.objects.filter(name="free").exists()
    assert not Instance.objects.filter(name="x").exists()


def test_deleting_a_cluster_with_instances_is_refused_and_keeps_everything() -> None:
    instance = InstanceFactory()
    with pytest.raises(Conflict, match="still used"):
        services.cluster_delete(cluster_id=instance.cluster_id, version=1, actor=CLI_ACTOR)
    assert Instance.objects.filter(pk=instance.pk).exists()
    assert not ChangeRecord.objects.exists()


def test_every_service_write_leaves_a_record_with_the_actor() -> None:
    site = services.site_create(actor=CLI_ACTOR, name="dc-x")
    services.site_update(site_id=site.pk, version=1, changes={"name": "dc-y"}, actor=CLI_ACTOR)
    services.site_delete(site_id=site.pk, version=2, actor=CLI_ACTOR)
    records = ChangeRecord.objects.filter(
        object_type="clusters.site", object_id=str(site.pk)
    ).order_by("id")
    assert [(r.action, r.actor) for r in records] == [
        ("create", "cli"),
        ("update", "cli"),
        ("delete", "cli"),
    ]
    assert (records[1].before or {})["name"] == "dc-x"
    assert (records[1].after or {})["name"] == "dc-y"
