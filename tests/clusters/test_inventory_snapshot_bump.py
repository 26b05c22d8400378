"""Inventory updates through the services tell the routers' snapshots at once (the services
write with a queryset update, which sends no post_save by itself)."""

from __future__ import annotations

import pytest
import redis

from clusters.services import instance_drain, link_update
from controlplane.audit import CLI_ACTOR
from scheduling.snapshot import SNAPSHOT_VERSION_KEY
from tests.factories import InstanceFactory, LinkFactory

pytestmark = pytest.mark.django_db(transaction=True)


def version(client: redis.Redis) -> int:
    return int(client.get(SNAPSHOT_VERSION_KEY) or 0)


def test_a_link_capacity_change_bumps_the_snapshot_version(redis_client: redis.Redis) -> None:
    link = LinkFactory()
    before = version(redis_client)
    link_update(link_id=link.pk, version=link.version, changes={"gbps": 2.0}, actor=CLI_ACTOR)
    assert version(redis_client) > before


def test_a_drain_bumps_the_snapshot_version(redis_client: redis.Redis) -> None:
    instance = InstanceFactory()
    before = version(redis_client)
    instance_drain(instance_id=instance.pk, actor=CLI_ACTOR, version=instance.version)
    assert version(redis_client) > before


def test_an_update_that_changes_nothing_does_not_bump(redis_client: redis.Redis) -> None:
    link = LinkFactory()
    before = version(redis_client)
    link_update(link_id=link.pk, version=link.version, changes={"gbps": link.gbps}, actor=CLI_ACTOR)
    assert version(redis_client) == before
