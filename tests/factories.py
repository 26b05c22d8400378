"""factory-boy factories for every model, shared by the whole suite.

Inventory factories save rows directly (version 1); tests of the services call the services.
``api_token(...)`` returns a real token and its one-time secret, for the Authorization header.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import factory
from django.contrib.auth.models import Group, User
from django.utils import timezone

from clusters.models import (
    Accelerator,
    Cluster,
    ClusterKind,
    Instance,
    InstanceRole,
    Link,
    ModelProfile,
    PerformanceProfile,
    Site,
)
from controlplane.audit import CLI_ACTOR
from controlplane.models import ApiToken, ChangeRecord
from controlplane.services import token_create
from scheduling.models import Plan, PlanStatus, RebalanceMode, RebalanceTick

T = TypeVar("T")


class ModelFactory(factory.django.DjangoModelFactory[T]):
    """Base of the factories below: ``XFactory(...)`` is typed as the model it creates."""

    class Meta:
        abstract = True

    if TYPE_CHECKING:
        # factory-boy builds through its metaclass; this only tells mypy what comes out.
        def __new__(cls, *args: Any, **kwargs: Any) -> T:  # type: ignore[misc]
            ...


KV_CACHE_MIB = [[1024, 190.8], [8192, 308.9], [32768, 701.3], [131072, 2316.3]]
PREFILL_SECONDS = [[1024, 0.44], [8192, 0.72], [32768, 1.84], [131072, 7.40]]


class SiteFactory(ModelFactory[Site]):
    class Meta:
        model = Site

    name = factory.Sequence(lambda n: f"dc-{n}")


class AcceleratorFactory(ModelFactory[Accelerator]):
    class Meta:
        model = Accelerator

    name = factory.Sequence(lambda n: f"gpu-{n}")
    gpu_hour_cost = 1.0


class ModelProfileFactory(ModelFactory[ModelProfile]):
    class Meta:
        model = ModelProfile

    name = factory.Sequence(lambda n: f"model-{n}")
    attention = factory.LazyFunction(lambda: {"linear": "KDA", "full": "MLA"})
    block_tokens = 512
    kv_cache_mib = factory.LazyFunction(lambda: [list(p) for p in KV_CACHE_MIB])
    linear_state_mib = None


class PerformanceProfileFactory(ModelFactory[PerformanceProfile]):
    class Meta:
        model = PerformanceProfile

    accelerator = factory.SubFactory(AcceleratorFactory)
    model = factory.SubFactory(ModelProfileFactory)
    gpus_per_instance = 8
    prefill_seconds = factory.LazyFunction(lambda: [list(p) for p in PREFILL_SECONDS])
    decode_max_batch = 20
    decode_step_seconds = 0.025


class ClusterFactory(ModelFactory[Cluster]):
    """A pd cluster; use ``PrfaasClusterFactory`` for a prefill-only one."""

    class Meta:
        model = Cluster

    name = factory.Sequence(lambda n: f"pd-{n}")
    kind = ClusterKind.PD
    site = factory.SubFactory(SiteFactory)
    accelerator = factory.SubFactory(AcceleratorFactory)
    model = factory.SubFactory(ModelProfileFactory)


class PrfaasClusterFactory(ClusterFactory):
    name = factory.Sequence(lambda n: f"prfaas-{n}")
    kind = ClusterKind.PRFAAS


class InstanceFactory(ModelFactory[Instance]):
    class Meta:
        model = Instance

    cluster = factory.SubFactory(ClusterFactory)
    name = factory.Sequence(lambda n: f"instance-{n}")
    role = InstanceRole.PREFILL
    endpoint = factory.Sequence(lambda n: f"http://10.0.0.{n % 250 + 1}:8000")
    labels = factory.LazyFunction(dict)


class LinkFactory(ModelFactory[Link]):
    class Meta:
        model = Link

    source = factory.SubFactory(PrfaasClusterFactory)
    target = factory.SubFactory(ClusterFactory)
    gbps = 100.0
    rtt_ms = 10.0


class UserFactory(ModelFactory[User]):
    """A user; ``UserFactory(groups=["operator"])`` puts it in those access groups.

    No usable password by default (hashing one costs most of a second): log in with
    ``client.force_login(user)``, or call ``user.set_password(...)`` where a test needs one.
    """

    class Meta:
        model = User
        skip_postgeneration_save = True

    username = factory.Sequence(lambda n: f"user{n}")
    password = factory.PostGenerationMethodCall("set_unusable_password")

    @factory.post_generation
    def groups(self, create: bool, extracted: Any, **kwargs: Any) -> None:
        if create and extracted:
            for name in extracted:
                group, _ = Group.objects.get_or_create(name=name)
                self.groups.add(group)
        if create:
            self.save()  # type: ignore[attr-defined]


class ApiTokenFactory(ModelFactory[ApiToken]):
    """A token row whose secret nobody knows; use :func:`api_token` to call the API with one."""

    class Meta:
        model = ApiToken

    name = factory.Sequence(lambda n: f"token-{n}")
    prefix = factory.Sequence(lambda n: f"prfaas_{n:05d}")
    secret_sha256 = factory.Sequence(lambda n: f"{n:064x}")
    scopes = factory.LazyFunction(lambda: ["read"])


class ChangeRecordFactory(ModelFactory[ChangeRecord]):
    class Meta:
        model = ChangeRecord

    actor = "cli"
    source = "cli"
    object_type = "clusters.site"
    object_id = factory.Sequence(str)
    object_repr = factory.Sequence(lambda n: f"dc-{n}")
    action = ChangeRecord.Action.CREATE
    before = None
    after = factory.LazyFunction(dict)


class RebalanceTickFactory(ModelFactory[RebalanceTick]):
    class Meta:
        model = RebalanceTick

    cluster = factory.SubFactory(ClusterFactory)
    period_start = factory.Sequence(lambda n: timezone.now() - timedelta(minutes=10 * (n + 1)))
    action = "propose"
    reason = "gain"


class PlanFactory(ModelFactory[Plan]):
    """A plan row as the rebalancer stores it (its figures given by the test); the plan pages'
    tests of a plan the rebalancer really proposes use tests/scheduling/plan_pages_support."""

    class Meta:
        model = Plan

    tick = factory.SubFactory(RebalanceTickFactory)
    cluster = factory.SelfAttribute("tick.cluster")
    status = PlanStatus.PROPOSED
    mode = RebalanceMode.MANUAL
    threshold_before = 19600.0
    threshold_after = 12000.0
    n_p_before, n_d_before, n_p_after, n_d_after = 4, 4, 5, 3
    gain = 0.2
    predictions = factory.LazyFunction(dict)
    simulated = factory.LazyFunction(dict)
    inputs = factory.LazyFunction(dict)


_token_names = iter(range(10**9))


def api_token(
    *scopes: str,
    name: str | None = None,
    expired: bool = False,
    revoked: bool = False,
    instances: tuple[str, ...] = (),
    links: tuple[str, ...] = (),
    clusters: tuple[str, ...] = (),
) -> tuple[ApiToken, str]:
    """A real token with ``scopes`` (created through the service) and its secret. An agent or
    register token is bound to ``instances``, ``links`` and ``clusters`` when given, else
    fleet-wide."""
    issued = token_create(
        name=name or f"test-token-{next(_token_names)}",
        scopes=list(scopes),
        actor=CLI_ACTOR,
        instances=instances,
        links=links,
        clusters=clusters,
        fleet_wide=not instances and not links and not clusters,
    )
    token = issued.token
    if expired:
        ApiToken.objects.filter(pk=token.pk).update(
            expires_at=timezone.now() - timedelta(seconds=1)
        )
    if revoked:
        ApiToken.objects.filter(pk=token.pk).update(revoked_at=timezone.now())
    token.refresh_from_db()
    return token, issued.secret


def bearer(secret: str) -> dict[str, str]:
    """Headers for the Django test client: ``client.get(url, headers=bearer(secret))``."""
    return {"Authorization": f"Bearer {secret}"}
