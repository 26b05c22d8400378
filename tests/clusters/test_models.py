"""What must always hold is refused by the database itself, even behind the services' back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.db import IntegrityError, transaction

from clusters.models import (
    Accelerator,
    Cluster,
    Instance,
    Link,
    ModelProfile,
    PerformanceProfile,
    Site,
    table_errors,
)
from tests.factories import (
    AcceleratorFactory,
    ClusterFactory,
    InstanceFactory,
    LinkFactory,
    ModelProfileFactory,
    PerformanceProfileFactory,
    PrfaasClusterFactory,
    SiteFactory,
)

pytestmark = pytest.mark.django_db


def _refused(write: Callable[[], Any]) -> None:
    with pytest.raises(IntegrityError), transaction.atomic():
        write()


def test_names_are_unique() -> None:
    site = SiteFactory()
    _refused(lambda: Site.objects.create(name=site.name))
    cluster = ClusterFactory()
    _refused(
        lambda: Cluster.objects.create(
            name=cluster.name,
            kind="pd",
            site=cluster.site,
            accelerator=cluster.accelerator,
            model=cluster.model,
        )
    )
    instance = InstanceFactory()
    _refused(lambda: InstanceFactory(name=instance.name))


def test_one_performance_profile_per_accelerator_and_model() -> None:
    profile = PerformanceProfileFactory()
    _refused(
        lambda: PerformanceProfileFactory(accelerator=profile.accelerator, model=profile.model)
    )


def test_capacities_must_be_positive() -> None:
    acc = AcceleratorFactory()
    _refused(lambda: Accelerator.objects.filter(pk=acc.pk).update(gpu_hour_cost=0))
    model = ModelProfileFactory()
    _refused(lambda: ModelProfile.objects.filter(pk=model.pk).update(block_tokens=0))
    profile = PerformanceProfileFactory()
    _refused(lambda: PerformanceProfile.objects.filter(pk=profile.pk).update(gpus_per_instance=0))
    _refused(lambda: PerformanceProfile.objects.filter(pk=profile.pk).update(decode_max_batch=None))
    link = LinkFactory()
    _refused(lambda: Link.objects.filter(pk=link.pk).update(gbps=-1))
    _refused(lambda: Link.objects.filter(pk=link.pk).update(rtt_ms=-0.5))
    _refused(lambda: Link.objects.filter(pk=link.pk).update(kv_budget_bytes=0))


def test_a_link_of_zero_gbps_is_allowed_it_means_down() -> None:
    link = LinkFactory(gbps=0)
    assert Link.objects.get(pk=link.pk).gbps == 0


def test_a_link_must_run_from_a_prfaas_cluster_to_a_pd_cluster() -> None:
    with pytest.raises(IntegrityError), transaction.atomic():
        LinkFactory(source=ClusterFactory())
    with pytest.raises(IntegrityError), transaction.atomic():
        LinkFactory(target=PrfaasClusterFactory())
    link = LinkFactory()
    _refused(lambda: Link.objects.filter(pk=link.pk).update(source_kind="pd"))


def test_a_prfaas_cluster_holds_no_decode_instance() -> None:
    with pytest.raises(IntegrityError), transaction.atomic():
        InstanceFactory(cluster=PrfaasClusterFactory(), role="decode")
    instance = InstanceFactory(cluster=PrfaasClusterFactory(), role="prefill")
    _refused(lambda: Instance.objects.filter(pk=instance.pk).update(role="decode"))


def test_enumerations_and_versions_are_checked() -> None:
    instance = InstanceFactory()
    _refused(lambda: Instance.objects.filter(pk=instance.pk).update(state="asleep"))
    _refused(lambda: Instance.objects.filter(pk=instance.pk).update(role="both"))
    _refused(lambda: Cluster.objects.filter(pk=instance.cluster_id).update(kind="gpu"))
    _refused(lambda: Instance.objects.filter(pk=instance.pk).update(version=0))


def test_saving_copies_the_cluster_kind_onto_instances_and_links() -> None:
    link = LinkFactory()
    instance = InstanceFactory(cluster=link.target, role="decode")
    assert (link.source_kind, link.target_kind) == ("prfaas", "pd")
    assert instance.cluster_kind == "pd"


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        ([], "at least two"),
        ("1024", "at least two"),
        ([[1024, 1.0]], "at least two"),
        ([[1024, 1.0], [512, 2.0]], "[1][0]: tokens must be strictly increasing"),
        ([[1024, 1.0], [1024, 2.0]], "[1][0]"),
        ([[0, 1.0], [8, 2.0]], "[0][0]: tokens must be a positive integer"),
        ([[10.5, 1.0], [20, 2.0]], "[0][0]"),
        ([[1024, -1.0], [2048, 1.0]], "[0][1]: must be positive"),
        ([[1024, 0], [2048, 1.0]], "[0][1]"),
        ([[1024], [2048, 1.0]], "[0]: must be a [tokens, value] pair"),
        ([[1024, "big"], [2048, 1.0]], "[0]"),
        ([[True, 1.0], [2048, 1.0]], "[0]"),
    ],
)
def test_table_errors_name_the_bad_entry(table: Any, problem: str) -> None:
    errors = table_errors(table)
    assert any(problem in e for e in errors), errors


def test_a_sorted_positive_table_has_no_errors() -> None:
    assert table_errors([[1024, 0.44], [8192, 0.72]]) == []


@pytest.mark.parametrize(
    ("field", "value"),
    [("gbps", 1e308), ("gbps", float("inf")), ("gbps", float("nan")), ("rtt_ms", 1e7)],
)
def test_the_database_refuses_a_link_beyond_its_physical_bounds(field: str, value: float) -> None:
    link = LinkFactory()
    with pytest.raises(IntegrityError, match="link_physically_bounded"), transaction.atomic():
        Link.objects.filter(pk=link.pk).update(**{field: value})
