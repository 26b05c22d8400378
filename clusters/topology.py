"""Topology as code: make the inventory match a scenario file, and write the inventory back out.

The file is read by the one scenario reader (:mod:`scheduling.core.scenario`); this module only maps
the validated :class:`Scenario` onto rows through the inventory services, so every change is
validated, versioned and audited like any other write.

Apply rules:
- Sites, accelerators, the model profile, its performance profiles, clusters and links are
  matched by name (profiles by accelerator and model, links by source and target) and created
  or updated. Fields the file does not describe (site descriptions, instance state, endpoints,
  labels, a link's KV budget or target utilisation when its entry gives none, and a cluster's
  Kubernetes scale targets when it gives no ``scale_targets``) are left alone; a link entry's
  ``kv_budget_mib`` and ``target_utilisation`` and a cluster's ``scale_targets`` are applied.
- A cluster's declared instances are described by counts: when the existing declared instances
  already have the file's number of prefill and decode instances, nothing changes (whatever
  their names); else the cluster gets the instances ``<cluster>-0 .. <cluster>-(P+D-1)``, the
  first P prefill and the rest decode, reusing (and re-roling) rows with those names and
  deleting the other declared ones. Instances their agents registered are not the file's: they
  are neither counted nor deleted (a file of clusters with no instances leaves the fleet to its
  agents). ``instances=False`` leaves every instance alone.
- ``prune`` also deletes every inventory object the file does not mention.
- Everything happens in one transaction; ``dry_run`` rolls it back after counting.
- Any problem is a :class:`~scheduling.core.scenario.ScenarioError` naming the key path, and leaves
  the database as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.db import connection, transaction

from clusters import services
from clusters.models import (
    Accelerator,
    Cluster,
    ClusterKind,
    Instance,
    InstanceOrigin,
    InstanceRole,
    Link,
    ModelProfile,
    PerformanceProfile,
    Site,
    Versioned,
)
from controlplane.audit import Actor
from controlplane.errors import ApiError, Conflict
from scheduling.core.link import Link as CoreLink
from scheduling.core.scale_targets import scale_targets_json, scale_targets_of
from scheduling.core.scenario import (
    AcceleratorSpec,
    DecodeSpec,
    ProfileSpec,
    Scenario,
    ScenarioCluster,
    ScenarioError,
    ScenarioModel,
    scenario_parse,
    scenario_to_dict,
)

EXPORT_NAME = "inventory"


@dataclass
class ApplyResult:
    """What an apply did (or, dry run, would do): four counts and one line per change."""

    created: int = 0
    updated: int = 0
    deleted: int = 0
    unchanged: int = 0
    changes: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return {
            "created": self.created,
            "updated": self.updated,
            "deleted": self.deleted,
            "unchanged": self.unchanged,
        }

    def summary(self) -> str:
        return ", ".join(f"{key} {value}" for key, value in self.counts().items())


def table_stored(table: Any) -> list[list[float]]:
    """A table as the inventory stores it: integral token counts as ints."""
    return [[int(t) if float(t).is_integer() else t, float(v)] for t, v in table]


@contextmanager
def _at(path: str) -> Iterator[None]:
    """Report a service refusal as a scenario error at ``path``."""
    try:
        yield
    except Conflict:
        raise  # a concurrent write won (409), not a problem of the scenario
    except ApiError as exc:
        raise ScenarioError(path, exc.detail) from None


class _Applier:
    def __init__(
        self, scenario: Scenario, *, actor: Actor, prune: bool, instances: bool = True
    ) -> None:
        self.s = scenario
        self.actor = actor
        self.prune = prune
        self.declare_instances = instances
        self.result = ApplyResult()
        # Rows already changed once in this apply: never counted again as unchanged.
        self.touched: set[tuple[str, int]] = set()

    # bookkeeping -----------------------------------------------------------------------------

    def _created(self, obj: Versioned) -> None:
        self.result.created += 1
        self.result.changes.append(f"create {obj._meta.model_name} {obj}")

    def _deleted(self, obj: Versioned) -> None:
        self.result.deleted += 1
        self.result.changes.append(f"delete {obj._meta.model_name} {obj}")

    def _sync(
        self,
        obj: Versioned,
        wanted: dict[str, Any],
        update: Callable[..., Versioned],
        id_arg: str,
    ) -> Versioned:
        """Update ``obj`` to ``wanted`` when any field differs; count it either way."""
        diff = {k: v for k, v in wanted.items() if getattr(obj, k) != v}
        key = (type(obj).__name__, obj.pk)
        if not diff:
            if key not in self.touched:
                self.result.unchanged += 1
            return obj
        updated = update(**{id_arg: obj.pk}, version=obj.version, changes=diff, actor=self.actor)
        self.touched.add(key)
        self.result.updated += 1
        self.result.changes.append(
            f"update {obj._meta.model_name} {obj}: {', '.join(sorted(diff))}"
        )
        return updated

    def _delete(self, obj: Versioned, delete: Callable[..., None], id_arg: str, path: str) -> None:
        with _at(path):
            delete(**{id_arg: obj.pk}, version=obj.version, actor=self.actor)
        self._deleted(obj)

    # sections --------------------------------------------------------------------------------

    def sites(self) -> dict[str, Site]:
        out: dict[str, Site] = {}
        for i, spec in enumerate(self.s.clusters):
            if spec.site in out:
                continue
            site = Site.objects.filter(name=spec.site).first()
            if site is None:
                with _at(f"clusters[{i}].site"):
                    site = services.site_create(actor=self.actor, name=spec.site)
                self._created(site)
            else:
                self.result.unchanged += 1
            out[spec.site] = site
        return out

    def accelerators(self) -> dict[str, Accelerator]:
        out: dict[str, Accelerator] = {}
        for i, spec in enumerate(self.s.accelerators):
            acc = Accelerator.objects.filter(name=spec.name).first()
            with _at(f"accelerators[{i}]"):
                if acc is None:
                    acc = services.accelerator_create(
                        actor=self.actor, name=spec.name, gpu_hour_cost=spec.gpu_hour_cost
                    )
                    self._created(acc)
                else:
                    acc = self._sync(  # type: ignore[assignment]
                        acc,
                        {"gpu_hour_cost": spec.gpu_hour_cost},
                        services.accelerator_update,
                        "accelerator_id",
                    )
            out[spec.name] = acc
        return out

    def model(self) -> ModelProfile:
        spec = self.s.model
        wanted: dict[str, Any] = {
            "attention": dict(spec.attention),
            "block_tokens": spec.block_tokens,
            "kv_cache_mib": table_stored(spec.kv_cache_mib),
            "linear_state_mib": spec.linear_state_mib,
        }
        model = ModelProfile.objects.filter(name=spec.name).first()
        with _at("model"):
            if model is None:
                model = services.model_profile_create(actor=self.actor, name=spec.name, **wanted)
                self._created(model)
                return model
            return self._sync(  # type: ignore[return-value]
                model, wanted, services.model_profile_update, "model_profile_id"
            )

    def profiles(self, model: ModelProfile, accelerators: dict[str, Accelerator]) -> None:
        for i, spec in enumerate(self.s.profiles):
            acc = accelerators[spec.accelerator]
            wanted: dict[str, Any] = {
                "gpus_per_instance": spec.gpus_per_instance,
                "prefill_seconds": table_stored(spec.prefill_seconds),
                "decode_max_batch": spec.decode.max_batch if spec.decode else None,
                "decode_step_seconds": spec.decode.step_seconds if spec.decode else None,
            }
            profile = PerformanceProfile.objects.filter(accelerator=acc, model=model).first()
            with _at(f"profiles[{i}]"):
                if profile is None:
                    profile = services.performance_profile_create(
                        actor=self.actor, accelerator_id=acc.pk, model_id=model.pk, **wanted
                    )
                    self._created(profile)
                else:
                    self._sync(
                        profile,
                        wanted,
                        services.performance_profile_update,
                        "performance_profile_id",
                    )

    def clusters(
        self, sites: dict[str, Site], accelerators: dict[str, Accelerator], model: ModelProfile
    ) -> dict[str, Cluster]:
        out: dict[str, Cluster] = {}
        for i, spec in enumerate(self.s.clusters):
            path = f"clusters[{i}]"
            wanted: dict[str, Any] = {
                "kind": spec.kind,
                "site_id": sites[spec.site].pk,
                "accelerator_id": accelerators[spec.accelerator].pk,
                "model_id": model.pk,
                "kv_connector": spec.kv_connector,
            }
            if spec.scale_targets is not None:
                wanted["scale_targets"] = scale_targets_json(spec.scale_targets)
            cluster = Cluster.objects.filter(name=spec.name).first()
            with _at(path):
                if cluster is None:
                    cluster = services.cluster_create(actor=self.actor, name=spec.name, **wanted)
                    self._created(cluster)
                    self.instances(cluster, spec, path, before_kind_change=False)
                else:
                    self.instances(cluster, spec, path, before_kind_change=True)
                    cluster = self._sync(  # type: ignore[assignment]
                        cluster, wanted, services.cluster_update, "cluster_id"
                    )
                    self.instances(cluster, spec, path, before_kind_change=False)
            out[spec.name] = cluster
        return out

    def instances(
        self, cluster: Cluster, spec: ScenarioCluster, path: str, *, before_kind_change: bool
    ) -> None:
        """Reconcile a cluster's instances with the file's counts (see the module docstring).

        Called twice for an existing cluster: before its own update, to delete surplus rows and
        turn decode rows into prefill ones (so a pd -> prfaas change is allowed), and after it,
        for the rest. Only the second call counts unchanged rows.
        """
        if not self.declare_instances:
            return
        existing = list(
            Instance.objects.filter(cluster=cluster, origin=InstanceOrigin.DECLARED).order_by(
                "name", "id"
            )
        )
        roles = [r.role for r in existing]
        if (
            roles.count(InstanceRole.PREFILL) == spec.prefill_instances
            and roles.count(InstanceRole.DECODE) == spec.decode_instances
        ):
            if not before_kind_change:
                self.result.unchanged += sum(
                    ("Instance", inst.pk) not in self.touched for inst in existing
                )
            return
        wanted = {name: InstanceRole(role) for name, role in spec.instance_roles().items()}
        by_name = {inst.name: inst for inst in existing}
        # A wanted name an agent registered becomes declared (the file now owns it).
        for taken in Instance.objects.filter(cluster=cluster, name__in=wanted).exclude(
            origin=InstanceOrigin.DECLARED
        ):
            by_name[taken.name] = taken
        for row in existing:
            if row.name not in wanted:
                self._delete(row, services.instance_delete, "instance_id", path)
        for name, role in wanted.items():
            inst = by_name.get(name)
            if before_kind_change:
                if inst is not None and inst.role != role == InstanceRole.PREFILL:
                    self._sync(inst, {"role": role}, services.instance_update, "instance_id")
                continue
            if inst is None:
                created = services.instance_create(
                    actor=self.actor, cluster_id=cluster.pk, name=name, role=role
                )
                self._created(created)
            else:
                inst.refresh_from_db()
                self._sync(
                    inst,
                    {"role": role, "origin": InstanceOrigin.DECLARED},
                    services.instance_update,
                    "instance_id",
                )

    def links(self, clusters: dict[str, Cluster]) -> set[tuple[int, int]]:
        keep: set[tuple[int, int]] = set()
        for i, spec in enumerate(self.s.links):
            source, target = clusters[spec.source], clusters[spec.target]
            keep.add((source.pk, target.pk))
            wanted: dict[str, Any] = {"gbps": spec.gbps, "rtt_ms": spec.rtt_ms}
            if spec.kv_budget_bytes is not None:
                wanted["kv_budget_bytes"] = spec.kv_budget_bytes
            if spec.target_utilisation is not None:
                wanted["target_utilisation"] = spec.target_utilisation
            link = Link.objects.filter(source=source, target=target).first()
            with _at(f"links[{i}]"):
                if link is None:
                    link = services.link_create(
                        actor=self.actor, source_id=source.pk, target_id=target.pk, **wanted
                    )
                    self._created(link)
                else:
                    self._sync(link, wanted, services.link_update, "link_id")
        return keep

    def prune_links(self) -> None:
        wanted = {(spec.source, spec.target) for spec in self.s.links}
        for link in Link.objects.select_related("source", "target"):
            if (link.source.name, link.target.name) not in wanted:
                self._delete(link, services.link_delete, "link_id", "links")

    def prune_rest(self, model: ModelProfile) -> None:
        cluster_names = {spec.name for spec in self.s.clusters}
        for cluster in Cluster.objects.exclude(name__in=cluster_names):
            for inst in Instance.objects.filter(cluster=cluster):
                self._delete(inst, services.instance_delete, "instance_id", "clusters")
            self._delete(cluster, services.cluster_delete, "cluster_id", "clusters")
        profile_accs = {spec.accelerator for spec in self.s.profiles}
        for profile in PerformanceProfile.objects.select_related("accelerator", "model"):
            if profile.model_id != model.pk or profile.accelerator.name not in profile_accs:
                self._delete(
                    profile,
                    services.performance_profile_delete,
                    "performance_profile_id",
                    "profiles",
                )
        for other in ModelProfile.objects.exclude(pk=model.pk):
            self._delete(other, services.model_profile_delete, "model_profile_id", "model")
        acc_names = {spec.name for spec in self.s.accelerators}
        for acc in Accelerator.objects.exclude(name__in=acc_names):
            self._delete(acc, services.accelerator_delete, "accelerator_id", "accelerators")
        site_names = {spec.site for spec in self.s.clusters}
        for site in Site.objects.exclude(name__in=site_names):
            self._delete(site, services.site_delete, "site_id", "clusters")

    def run(self) -> ApplyResult:
        sites = self.sites()
        accelerators = self.accelerators()
        model = self.model()
        self.profiles(model, accelerators)
        if self.prune:
            self.prune_links()
        clusters = self.clusters(sites, accelerators, model)
        self.links(clusters)
        if self.prune:
            self.prune_rest(model)
        return self.result


# pg_advisory_xact_lock key of topology applies ("topo" in ASCII).
TOPOLOGY_LOCK_KEY = 0x746F706F


def _applies_serialise() -> None:
    """One apply at a time: a second waits for the first to commit and then applies against
    its result (the same file twice: the second changes nothing) instead of losing a race on
    a unique name."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [TOPOLOGY_LOCK_KEY])


def topology_apply(
    scenario: Scenario,
    *,
    actor: Actor,
    dry_run: bool = False,
    prune: bool = False,
    instances: bool = True,
) -> ApplyResult:
    """Make the inventory match ``scenario`` in one transaction (rolled back when dry);
    ``instances=False`` leaves the instances to their agents."""
    with transaction.atomic():
        _applies_serialise()
        result = _Applier(scenario, actor=actor, prune=prune, instances=instances).run()
        if dry_run:
            transaction.set_rollback(True)
    return result


def topology_apply_mapping(
    data: Any, *, base_dir: Path, actor: Actor, dry_run: bool = False, prune: bool = False
) -> ApplyResult:
    """Validate a scenario given as a mapping (e.g. a JSON body) and apply it."""
    scenario = scenario_parse(data, base_dir=base_dir)
    return topology_apply(scenario, actor=actor, dry_run=dry_run, prune=prune)


def topology_scenario(*, declared_only: bool = False) -> Scenario:
    """The inventory as a scenario (deployment only: no workload); ``declared_only`` counts
    only the declared instances (what topology as code owns: an export applies back to
    nothing changed), otherwise every instance (the fleet as the planner sees it).

    Raises ScenarioError when the inventory cannot be written as one scenario (empty, or
    clusters serving several models).
    """
    models = list(ModelProfile.objects.filter(clusters__isnull=False).distinct())
    if not models:
        models = list(ModelProfile.objects.all())
    if len(models) != 1:
        names = ", ".join(m.name for m in models) or "none"
        raise ScenarioError(
            "model", f"a scenario describes exactly one model; the inventory has: {names}"
        )
    model = models[0]
    profiles = {
        p.accelerator_id: p
        for p in PerformanceProfile.objects.filter(model=model).select_related("accelerator")
    }
    accelerators = list(Accelerator.objects.order_by("name"))
    clusters = []
    for cluster in Cluster.objects.filter(model=model).select_related("site", "accelerator"):
        members = cluster.instances.all()
        if declared_only:
            members = members.filter(origin=InstanceOrigin.DECLARED)
        roles = list(members.values_list("role", flat=True))
        clusters.append(
            ScenarioCluster(
                name=cluster.name,
                kind=ClusterKind(cluster.kind),
                site=cluster.site.name,
                accelerator=cluster.accelerator.name,
                prefill_instances=roles.count(InstanceRole.PREFILL),
                decode_instances=(
                    roles.count(InstanceRole.DECODE) if cluster.kind == ClusterKind.PD else 0
                ),
                kv_connector=cluster.kv_connector,
                scale_targets=(
                    tuple(scale_targets_of(cluster.scale_targets, cluster.kind).values()) or None
                ),
            )
        )
    return Scenario(
        version=1,
        name=EXPORT_NAME,
        description="",
        model=ScenarioModel(
            name=model.name,
            attention=model.attention or {},
            block_tokens=model.block_tokens,
            kv_cache_mib=tuple((t, v) for t, v in model.kv_cache_mib),
            linear_state_mib=model.linear_state_mib,
        ),
        accelerators=tuple(
            AcceleratorSpec(name=a.name, gpu_hour_cost=a.gpu_hour_cost) for a in accelerators
        ),
        profiles=tuple(
            ProfileSpec(
                accelerator=p.accelerator.name,
                gpus_per_instance=p.gpus_per_instance,
                prefill_seconds=tuple((t, v) for t, v in p.prefill_seconds),
                decode=(
                    DecodeSpec(max_batch=p.decode_max_batch, step_seconds=p.decode_step_seconds)
                    if p.decode_max_batch is not None and p.decode_step_seconds is not None
                    else None
                ),
            )
            for p in sorted(profiles.values(), key=lambda p: p.accelerator.name)
        ),
        clusters=tuple(clusters),
        links=tuple(
            CoreLink(
                source=link.source.name,
                target=link.target.name,
                gbps=link.gbps,
                rtt_ms=link.rtt_ms,
                kv_budget_bytes=link.kv_budget_bytes,
                target_utilisation=link.target_utilisation,
            )
            for link in Link.objects.select_related("source", "target").order_by(
                "source__name", "target__name"
            )
        ),
        workload=None,
    )


def topology_export() -> dict[str, Any]:
    """The inventory in the scenario file format; checked by the reader before it is returned,
    so what this writes always applies back (with zero changes)."""
    data = scenario_to_dict(topology_scenario(declared_only=True))
    scenario_parse(data, base_dir=Path.cwd())
    return data
