"""Policy versions: the next version is current, every bad threshold or guard is refused
with a message naming it, and a stale base version conflicts."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.audit import CLI_ACTOR
from controlplane.errors import Conflict, Invalid
from controlplane.models import ChangeRecord
from scheduling.policies import guards_from_json, policy_create, policy_current
from tests.factories import ClusterFactory, PrfaasClusterFactory


@pytest.fixture
def clusters(db: None) -> None:
    pd = ClusterFactory(name="pd-a")
    PrfaasClusterFactory(name="prfaas-x", model=pd.model)


def test_each_new_policy_is_the_next_version_and_current(clusters: None) -> None:
    assert policy_current() is None
    first = policy_create(actor=CLI_ACTOR, thresholds={"pd-a": 8000}, note="first")
    second = policy_create(
        actor=CLI_ACTOR, thresholds={"pd-a": 12000}, guards={"stale_after_s": 10.0}
    )
    assert (first.version, second.version) == (1, 2)
    current = policy_current()
    assert current is not None and current.version == 2
    assert current.guards == {"stale_after_s": 10.0} and current.created_by == "cli"
    assert ChangeRecord.objects.filter(object_type="scheduling.policy").count() == 2


def test_a_change_based_on_an_old_version_conflicts(clusters: None) -> None:
    policy_create(actor=CLI_ACTOR, thresholds={"pd-a": 8000})
    with pytest.raises(Conflict, match="v1, not v0"):
        policy_create(actor=CLI_ACTOR, thresholds={"pd-a": 9000}, expected_version=0)
    assert policy_current().version == 1  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("thresholds", "guards", "message"),
    [
        ({"nowhere": 1000}, {}, "thresholds.nowhere: no such cluster"),
        ({"prfaas-x": 1000}, {}, "thresholds.prfaas-x: only pd clusters"),
        ({"pd-a": -1}, {}, "thresholds.pd-a: must be between"),
        ({"pd-a": 10**12}, {}, "thresholds.pd-a: must be between"),
        ({"pd-a": 1.5}, {}, "thresholds.pd-a: must be an integer"),
        ({"pd-a": True}, {}, "thresholds.pd-a: must be an integer"),
        ([1, 2], {}, "thresholds: must be an object"),
        ({"pd-a": 1000}, {"bogus": 1}, "guards.bogus: unknown guard"),
        ({"pd-a": 1000}, {"stale_mode": 3}, "guards.stale_mode: must be a str"),
        ({"pd-a": 1000}, {"allow_cache_transfer": "yes"}, "guards.allow_cache_transfer"),
        ({"pd-a": 1000}, {"stale_after_s": float("nan")}, "guards.stale_after_s"),
        (
            {"pd-a": 1000},
            {"abundant_utilisation": 0.9, "scarce_utilisation": 0.5},
            "abundant_utilisation must not exceed",
        ),
    ],
)
def test_bad_policies_are_refused_and_nothing_is_written(
    clusters: None, thresholds: Any, guards: Any, message: str
) -> None:
    with pytest.raises(Invalid, match=message.replace(".", r"\.")):
        policy_create(actor=CLI_ACTOR, thresholds=thresholds, guards=guards)
    assert policy_current() is None


def test_guards_default_to_the_routers() -> None:
    assert guards_from_json({}).stale_after_s > 0
    assert guards_from_json({"stale_mode": "local"}).stale_mode == "local"
