"""The one scenario reader: YAML files in the format of ``scenarios/SCHEMA.md``.

A scenario describes a PrfaaS deployment (model, hardware profiles, clusters, links) and its
traffic. The planner CLI, the simulator and the inventory import all read scenarios through
:func:`scenario_load`, so there is exactly one idea of what a valid file is.

The reader is strict on purpose: a typo in a scenario silently falling back to a default would
make every number derived from it quietly wrong. Every problem is a :class:`ScenarioError`
whose ``path`` names the key (``profiles[1].prefill_seconds[3]``).

The types live in :mod:`scheduling.core.scenario_types`, the field checks in
:mod:`~scheduling.core.scenario_fields`, the writer in :mod:`~scheduling.core.scenario_writer`
and trace lengths in :mod:`~scheduling.core.scenario_lengths`; this module re-exports them, so
``scheduling.core.scenario`` stays the one place callers import a scenario from.

Pure Python: no Django import here (the pure core must run in routers and workers alike).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from scheduling.core import bounds
from scheduling.core.bounds import MIB
from scheduling.core.kinds import ClusterKind
from scheduling.core.link import Link, link_parse
from scheduling.core.routing import KV_CONNECTORS
from scheduling.core.scale_targets import ScaleTarget, ScaleTargetError, scale_targets_read
from scheduling.core.scenario_fields import (
    Loc,
    bool_read,
    distribution_read,
    error_at,
    int_read,
    int_within,
    kind_name,
    list_read,
    mapping_read,
    number_read,
    number_within,
    str_read,
    table_within,
)
from scheduling.core.scenario_lengths import (
    empirical_from_lengths,
    trace_lengths,
    workload_length_distributions,
)
from scheduling.core.scenario_types import (
    ROOT,
    AcceleratorSpec,
    ArrivalSpec,
    CacheSpec,
    DecodeSpec,
    Distribution,
    EmpiricalDist,
    Event,
    FixedDist,
    LinkEvent,
    LognormalDist,
    PhaseSpec,
    ProfileSpec,
    RateEvent,
    Scenario,
    ScenarioCluster,
    ScenarioError,
    ScenarioModel,
    SloSpec,
    StateEvent,
    TableT,
    TraceSpec,
    WorkloadSpec,
    location_path,
)
from scheduling.core.scenario_writer import (
    distribution_to_dict,
    scenario_to_dict,
)

# The scenario's public face: the types, the reader, the writer and the length helpers.
__all__ = [
    "ROOT",
    "SCENARIO_OPTIONAL_KEYS",
    "SCENARIO_REQUIRED_KEYS",
    "AcceleratorSpec",
    "ArrivalSpec",
    "CacheSpec",
    "DecodeSpec",
    "Distribution",
    "EmpiricalDist",
    "Event",
    "FixedDist",
    "LinkEvent",
    "Loc",
    "LognormalDist",
    "PhaseSpec",
    "ProfileSpec",
    "RateEvent",
    "Scenario",
    "ScenarioCluster",
    "ScenarioError",
    "ScenarioModel",
    "SloSpec",
    "StateEvent",
    "TableT",
    "TraceSpec",
    "WorkloadSpec",
    "distribution_to_dict",
    "empirical_from_lengths",
    "location_path",
    "scenario_load",
    "scenario_merge",
    "scenario_parse",
    "scenario_to_dict",
    "trace_lengths",
    "workload_length_distributions",
]


def _read_yaml(path: Path, where: str) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScenarioError(where, f"file not found: {path}") from None
    except OSError as exc:
        raise ScenarioError(where, f"cannot read {path}: {exc.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ScenarioError(where, f"invalid YAML in {path}{at}: {problem}") from None


def scenario_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Merge ``over`` onto ``base``: mappings key by key, lists and scalars replace, and a
    ``None`` value removes the key."""
    out: dict[str, Any] = dict(base)
    for key, value in over.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = scenario_merge(out[key], value)
        else:
            out[key] = _strip_nulls(value)
    return out


def _strip_nulls(data: Any) -> Any:
    """A file without a base may still say ``key: null``; it means the key is absent."""
    if isinstance(data, Mapping):
        return {k: _strip_nulls(v) for k, v in data.items() if v is not None}
    return data


def _anchor_paths(data: dict[str, Any], base_dir: Path) -> None:
    """Make file paths absolute against the file that names them, before merging, so that a
    scenario extending another keeps the base's trace pointing where the base meant."""
    workload = data.get("workload")
    if isinstance(workload, Mapping):
        trace = workload.get("trace")
        if isinstance(trace, Mapping) and isinstance(trace.get("path"), str):
            trace = dict(trace)
            trace["path"] = str((base_dir / trace["path"]).resolve())
            workload = dict(workload)
            workload["trace"] = trace
            data["workload"] = workload


def _resolve(data: Any, base_dir: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ScenarioError(ROOT, f"expected a mapping at the top level, got {kind_name(data)}")
    data = dict(data)
    _anchor_paths(data, base_dir)
    target = data.pop("extends", None)
    if target is None:
        return _strip_nulls(data)
    if not isinstance(target, str) or not target:
        raise ScenarioError("extends", f"expected a file name, got {kind_name(target)}")
    base_path = (base_dir / target).resolve()
    if base_path in chain:
        cycle = " -> ".join(p.name for p in (*chain, base_path))
        raise ScenarioError("extends", f"circular extends: {cycle}")
    if not base_path.is_file():
        raise ScenarioError("extends", f"file not found: {target} (looked at {base_path})")
    raw = _read_yaml(base_path, "extends")
    try:
        base = _resolve(raw, base_path.parent, (*chain, base_path))
    except ScenarioError as exc:
        raise ScenarioError(exc.path, f"{exc.message} (in {base_path.name})") from None
    return scenario_merge(base, data)


def scenario_load(path: str | Path) -> Scenario:
    """Read, merge (``extends``) and validate a scenario file."""
    path = Path(path).resolve()
    if not path.is_file():
        raise ScenarioError(ROOT, f"file not found: {path}")
    raw = _read_yaml(path, ROOT)
    merged = _resolve(raw, path.parent, (path,))
    return _build(merged, source=path)


def scenario_parse(
    data: Mapping[str, Any], *, base_dir: Path, source: Path | None = None
) -> Scenario:
    """Validate a scenario given as a mapping; ``extends`` and trace paths resolve against
    ``base_dir``."""
    chain = (source.resolve(),) if source is not None else ()
    merged = _resolve(data, Path(base_dir).resolve(), chain)
    return _build(merged, source=source)


# --------------------------------------------------------------------------------------------
# Sections


def _model(value: Any) -> ScenarioModel:
    loc: Loc = ("model",)
    body = mapping_read(
        value,
        loc,
        required=("name", "block_tokens", "kv_cache_mib"),
        optional=("attention", "linear_state_mib"),
    )
    attention = body.get("attention", {})
    if not isinstance(attention, Mapping):
        raise error_at((*loc, "attention"), f"expected a mapping, got {kind_name(attention)}")
    linear = body.get("linear_state_mib")
    return ScenarioModel(
        name=str_read(body["name"], (*loc, "name")),
        attention=dict(attention),
        block_tokens=int_within(body["block_tokens"], (*loc, "block_tokens"), bounds.BLOCK_TOKENS),
        kv_cache_mib=table_within(
            body["kv_cache_mib"], (*loc, "kv_cache_mib"), bounds.KV_CACHE_MIB
        ),
        linear_state_mib=(
            None
            if linear is None
            else number_within(linear, (*loc, "linear_state_mib"), bounds.LINEAR_STATE_MIB)
        ),
    )


def _unique(names: list[tuple[str, Loc]], what: str) -> None:
    seen: dict[str, Loc] = {}
    for name, loc in names:
        if name in seen:
            raise error_at(loc, f"duplicate {what} {name!r} (first at {location_path(seen[name])})")
        seen[name] = loc


def _accelerators(value: Any) -> tuple[AcceleratorSpec, ...]:
    out = []
    for i, item in enumerate(list_read(value, ("accelerators",), nonempty=True)):
        loc: Loc = ("accelerators", i)
        body = mapping_read(item, loc, required=("name", "gpu_hour_cost"))
        out.append(
            AcceleratorSpec(
                name=str_read(body["name"], (*loc, "name")),
                gpu_hour_cost=number_within(
                    body["gpu_hour_cost"], (*loc, "gpu_hour_cost"), bounds.GPU_HOUR_COST
                ),
            )
        )
    _unique([(a.name, ("accelerators", i, "name")) for i, a in enumerate(out)], "accelerator")
    return tuple(out)


def _profiles(value: Any, accelerators: set[str]) -> tuple[ProfileSpec, ...]:
    out = []
    for i, item in enumerate(list_read(value, ("profiles",), nonempty=True)):
        loc: Loc = ("profiles", i)
        body = mapping_read(
            item,
            loc,
            required=("accelerator", "gpus_per_instance", "prefill_seconds"),
            optional=("decode",),
        )
        acc = str_read(body["accelerator"], (*loc, "accelerator"))
        if acc not in accelerators:
            raise error_at((*loc, "accelerator"), f"unknown accelerator {acc!r}")
        table = table_within(
            body["prefill_seconds"], (*loc, "prefill_seconds"), bounds.PREFILL_SECONDS
        )
        for j, (_, seconds) in enumerate(table):
            if seconds <= 0:
                raise error_at((*loc, "prefill_seconds", j, 1), "prefill time must be positive")
        decode = None
        if "decode" in body:
            dloc: Loc = (*loc, "decode")
            d = mapping_read(body["decode"], dloc, required=("max_batch", "step_seconds"))
            decode = DecodeSpec(
                max_batch=int_within(d["max_batch"], (*dloc, "max_batch"), bounds.DECODE_MAX_BATCH),
                step_seconds=number_within(
                    d["step_seconds"], (*dloc, "step_seconds"), bounds.DECODE_STEP_SECONDS
                ),
            )
        out.append(
            ProfileSpec(
                accelerator=acc,
                gpus_per_instance=int_within(
                    body["gpus_per_instance"], (*loc, "gpus_per_instance"), bounds.GPUS_PER_INSTANCE
                ),
                prefill_seconds=table,
                decode=decode,
            )
        )
    _unique(
        [(p.accelerator, ("profiles", i, "accelerator")) for i, p in enumerate(out)],
        "profile for accelerator",
    )
    return tuple(out)


def _clusters(
    value: Any, profiles: Mapping[str, ProfileSpec], accelerators: set[str]
) -> tuple[ScenarioCluster, ...]:
    out = []
    for i, item in enumerate(list_read(value, ("clusters",), nonempty=True)):
        loc: Loc = ("clusters", i)
        keys = ("name", "kind", "site", "accelerator", "prefill_instances")
        extra = ("kv_connector", "scale_targets")
        body = mapping_read(item, loc, optional=(*keys, "decode_instances", *extra))
        if "kind" not in body:
            raise error_at((*loc, "kind"), "required key is missing")
        kind = str_read(body["kind"], (*loc, "kind"), choices=tuple(k.value for k in ClusterKind))
        if kind == "prfaas" and "decode_instances" in body:
            raise error_at(
                (*loc, "decode_instances"),
                "a prfaas cluster only prefills: it has no decode instances",
            )
        mapping_read(
            item,
            loc,
            required=(*keys, "decode_instances") if kind == "pd" else keys,
            optional=extra,
        )
        acc = str_read(body["accelerator"], (*loc, "accelerator"))
        if acc not in accelerators:
            raise error_at((*loc, "accelerator"), f"unknown accelerator {acc!r}")
        if acc not in profiles:
            raise error_at((*loc, "accelerator"), f"no profile for accelerator {acc!r}")
        if kind == "pd" and profiles[acc].decode is None:
            raise error_at(
                (*loc, "accelerator"), f"a pd cluster needs a decode profile for {acc!r}"
            )
        out.append(
            ScenarioCluster(
                name=str_read(body["name"], (*loc, "name")),
                kind=ClusterKind(kind),
                site=str_read(body["site"], (*loc, "site")),
                accelerator=acc,
                prefill_instances=int_within(
                    body["prefill_instances"], (*loc, "prefill_instances"), bounds.CLUSTER_INSTANCES
                ),
                decode_instances=(
                    int_within(
                        body["decode_instances"],
                        (*loc, "decode_instances"),
                        bounds.CLUSTER_INSTANCES,
                    )
                    if kind == "pd"
                    else 0
                ),
                kv_connector=str_read(
                    body.get("kv_connector", "nixl"),
                    (*loc, "kv_connector"),
                    choices=KV_CONNECTORS,
                ),
                scale_targets=(
                    _scale_targets(body["scale_targets"], (*loc, "scale_targets"), kind)
                    if "scale_targets" in body
                    else None
                ),
            )
        )
    _unique([(c.name, ("clusters", i, "name")) for i, c in enumerate(out)], "cluster")
    return tuple(out)


def _scale_targets(value: Any, loc: Loc, kind: str) -> tuple[ScaleTarget, ...]:
    try:
        return scale_targets_read(value, (), cluster_kind=kind)
    except ScaleTargetError as exc:
        raise error_at((*loc, *exc.loc), exc.message) from None


def _share_or_none(body: Mapping[str, Any], loc: Loc, key: str) -> float | None:
    """An optional share within (0, 1]."""
    if body.get(key) is None:
        return None
    return number_read(body[key], (*loc, key), positive=True, maximum=1.0)


def _links(value: Any, clusters: Mapping[str, ScenarioCluster]) -> tuple[Link, ...]:
    out = []
    for i, item in enumerate(list_read(value, ("links",))):
        loc: Loc = ("links", i)
        body = mapping_read(
            item,
            loc,
            required=("source", "target", "gbps"),
            optional=("rtt_ms", "kv_budget_mib", "target_utilisation", "max_refused_share"),
        )
        ends = {}
        for end, kind in (("source", "prfaas"), ("target", "pd")):
            name = str_read(body[end], (*loc, end))
            if name not in clusters:
                raise error_at((*loc, end), f"unknown cluster {name!r}")
            if clusters[name].kind != kind:
                raise error_at(
                    (*loc, end),
                    f"a link runs from a prfaas cluster to a pd cluster; {name!r} is a "
                    f"{clusters[name].kind} cluster",
                )
            ends[end] = name
        out.append(
            Link(
                source=ends["source"],
                target=ends["target"],
                gbps=number_within(body["gbps"], (*loc, "gbps"), bounds.LINK_GBPS),
                rtt_ms=number_within(body.get("rtt_ms", 0.0), (*loc, "rtt_ms"), bounds.LINK_RTT_MS),
                # Files give the budget in MiB; the one link type holds bytes.
                kv_budget_bytes=(
                    None
                    if body.get("kv_budget_mib") is None
                    else round(
                        number_within(
                            body["kv_budget_mib"],
                            (*loc, "kv_budget_mib"),
                            bounds.LINK_KV_BUDGET_MIB,
                        )
                        * MIB
                    )
                ),
                target_utilisation=_share_or_none(body, loc, "target_utilisation"),
                max_refused_share=_share_or_none(body, loc, "max_refused_share"),
            )
        )
    _unique([(link.key, ("links", i)) for i, link in enumerate(out)], "link")
    return tuple(out)


def _arrival(value: Any, loc: Loc) -> ArrivalSpec:
    body = mapping_read(value, loc, required=("process",), optional=("rate_per_s",))
    rate = body.get("rate_per_s")
    return ArrivalSpec(
        process=str_read(body["process"], (*loc, "process"), choices=("poisson",)),  # type: ignore[arg-type]
        rate_per_s=None if rate is None else number_read(rate, (*loc, "rate_per_s"), positive=True),
    )


def _trace(value: Any, loc: Loc) -> TraceSpec:
    body = mapping_read(
        value, loc, required=("path", "format"), optional=("dequantize", "rate_scale")
    )
    path = Path(str_read(body["path"], (*loc, "path")))
    if not path.is_file():
        raise error_at((*loc, "path"), f"trace file not found: {path}")
    return TraceSpec(
        path=path,
        format=str_read(body["format"], (*loc, "format"), choices=("mooncake", "azure")),  # type: ignore[arg-type]
        dequantize=str_read(
            body.get("dequantize", "none"), (*loc, "dequantize"), choices=("none", "uniform")
        ),
        rate_scale=number_read(body.get("rate_scale", 1.0), (*loc, "rate_scale"), positive=True),
    )


_PHASE_KEYS = ("arrival", "input_tokens", "output_tokens", "prefix_hit_fraction")


def _phase(value: Any, loc: Loc) -> PhaseSpec:
    body = mapping_read(value, loc, required=("duration_s",), optional=("ramp", *_PHASE_KEYS))
    hit = body.get("prefix_hit_fraction")
    return PhaseSpec(
        duration_s=number_read(body["duration_s"], (*loc, "duration_s"), positive=True),
        ramp=bool_read(body.get("ramp", False), (*loc, "ramp")),
        arrival=_arrival(body["arrival"], (*loc, "arrival")) if "arrival" in body else None,
        input_tokens=distribution_read(body["input_tokens"], (*loc, "input_tokens"))
        if "input_tokens" in body
        else None,
        output_tokens=(
            distribution_read(body["output_tokens"], (*loc, "output_tokens"))
            if "output_tokens" in body
            else None
        ),
        prefix_hit_fraction=None
        if hit is None
        else number_read(hit, (*loc, "prefix_hit_fraction"), maximum=1.0),
    )


def _workload(value: Any, clusters: tuple[ScenarioCluster, ...]) -> WorkloadSpec:
    loc: Loc = ("workload",)
    body = mapping_read(
        value,
        loc,
        required=("arrival",),
        optional=(
            "input_tokens",
            "output_tokens",
            "trace",
            "phases",
            "origins",
            "prefix_hit_fraction",
        ),
    )
    trace = _trace(body["trace"], (*loc, "trace")) if "trace" in body else None
    inp = (
        distribution_read(body["input_tokens"], (*loc, "input_tokens"))
        if "input_tokens" in body
        else None
    )
    out = (
        distribution_read(body["output_tokens"], (*loc, "output_tokens"))
        if "output_tokens" in body
        else None
    )
    if trace is not None and inp is not None:
        raise error_at(
            (*loc, "input_tokens"), "give either a trace or length distributions, not both"
        )
    if trace is None and inp is None:
        raise error_at((*loc, "input_tokens"), "required key is missing (or give workload.trace)")
    if trace is None and out is None:
        raise error_at((*loc, "output_tokens"), "required key is missing (or give workload.trace)")
    pd_names = [c.name for c in clusters if c.kind == "pd"]
    if "origins" in body:
        raw = mapping_read(body["origins"], (*loc, "origins"), optional=tuple(pd_names))
        origins: dict[str, float] = {}
        for name, share in raw.items():
            oloc: Loc = (*loc, "origins", str(name))
            if name not in pd_names:
                raise error_at(oloc, f"not a pd cluster (pd clusters: {', '.join(pd_names)})")
            origins[str(name)] = number_read(share, oloc)
        total = sum(origins.values())
        if abs(total - 1.0) > 1e-6:
            raise error_at((*loc, "origins"), f"shares must sum to 1, got {total:g}")
    elif len(pd_names) == 1:
        origins = {pd_names[0]: 1.0}
    elif pd_names:
        raise error_at(
            (*loc, "origins"),
            f"required when there are several pd clusters ({', '.join(pd_names)})",
        )
    else:
        origins = {}
    hit = body.get("prefix_hit_fraction")
    phases = tuple(
        _phase(p, (*loc, "phases", i))
        for i, p in enumerate(list_read(body.get("phases", []), (*loc, "phases")))
    )
    if phases and phases[0].ramp:
        raise error_at(
            (*loc, "phases", 0, "ramp"), "the first phase has no previous phase to ramp from"
        )
    return WorkloadSpec(
        arrival=_arrival(body["arrival"], (*loc, "arrival")),
        input_tokens=inp,
        output_tokens=out,
        trace=trace,
        phases=phases,
        origins=origins,
        prefix_hit_fraction=None
        if hit is None
        else number_read(hit, (*loc, "prefix_hit_fraction"), maximum=1.0),
    )


def _events(
    value: Any, clusters: Mapping[str, ScenarioCluster], links: tuple[Link, ...]
) -> tuple[Event, ...]:
    link_keys = {link.key for link in links}
    out: list[Event] = []
    for i, item in enumerate(list_read(value, ("events",))):
        loc: Loc = ("events", i)
        if not isinstance(item, Mapping):
            raise error_at(loc, f"expected a mapping, got {kind_name(item)}")
        if "link" in item:
            body = mapping_read(item, loc, required=("at_s", "link", "gbps"))
            key = str_read(body["link"], (*loc, "link"))
            if key not in link_keys:
                raise error_at(
                    (*loc, "link"), f"unknown link {key!r} (links: {', '.join(sorted(link_keys))})"
                )
            source, target = link_parse(key) or ("", "")
            out.append(
                LinkEvent(
                    at_s=number_read(body["at_s"], (*loc, "at_s")),
                    source=source,
                    target=target,
                    gbps=number_within(body["gbps"], (*loc, "gbps"), bounds.LINK_GBPS),
                )
            )
        elif "state" in item:
            body = mapping_read(
                item, loc, required=("at_s", "state"), optional=("instance", "cluster")
            )
            if ("instance" in body) == ("cluster" in body):
                raise error_at(loc, "a state event names exactly one of instance or cluster")
            cluster = None
            if "cluster" in body:
                cluster = str_read(body["cluster"], (*loc, "cluster"))
                if cluster not in clusters:
                    raise error_at((*loc, "cluster"), f"unknown cluster {cluster!r}")
            out.append(
                StateEvent(
                    at_s=number_read(body["at_s"], (*loc, "at_s")),
                    state=str_read(body["state"], (*loc, "state"), choices=("down", "active")),  # type: ignore[arg-type]
                    instance=str_read(body["instance"], (*loc, "instance"))
                    if "instance" in body
                    else None,
                    cluster=cluster,
                )
            )
        elif "rate_scale" in item:
            body = mapping_read(item, loc, required=("at_s", "cluster", "rate_scale"))
            cluster = str_read(body["cluster"], (*loc, "cluster"))
            if cluster not in clusters:
                raise error_at((*loc, "cluster"), f"unknown cluster {cluster!r}")
            out.append(
                RateEvent(
                    at_s=number_read(body["at_s"], (*loc, "at_s")),
                    cluster=cluster,
                    rate_scale=number_read(body["rate_scale"], (*loc, "rate_scale")),
                )
            )
        else:
            raise error_at(
                loc, "an event changes a link (link, gbps), a state (state) or a rate (rate_scale)"
            )
    return tuple(out)


def _caches(value: Any, clusters: Mapping[str, ScenarioCluster]) -> dict[str, CacheSpec]:
    body = mapping_read(value, ("caches",), optional=tuple(clusters))
    out = {}
    for name, item in body.items():
        loc: Loc = ("caches", name)
        c = mapping_read(item, loc, required=("gib_per_instance",))
        out[name] = CacheSpec(
            gib_per_instance=number_read(c["gib_per_instance"], (*loc, "gib_per_instance"))
        )
    return out


_TOP_REQUIRED = ("version", "name", "model", "accelerators", "profiles", "clusters")
_TOP_OPTIONAL = ("description", "links", "workload", "events", "caches", "slo", "expected")
# The top level of a scenario, for those describing it elsewhere (the topology API's schema).
SCENARIO_REQUIRED_KEYS = _TOP_REQUIRED
SCENARIO_OPTIONAL_KEYS = (*_TOP_OPTIONAL, "extends")


def _build(data: Mapping[str, Any], *, source: Path | None) -> Scenario:
    body = mapping_read(data, (), required=_TOP_REQUIRED, optional=_TOP_OPTIONAL)
    version = int_read(body["version"], ("version",), minimum=1)
    if version != 1:
        raise error_at(("version",), f"unsupported schema version {version} (this reader knows 1)")
    description = body.get("description", "")
    if not isinstance(description, str):
        raise error_at(("description",), f"expected a string, got {kind_name(description)}")
    model = _model(body["model"])
    accelerators = _accelerators(body["accelerators"])
    profiles = _profiles(body["profiles"], {a.name for a in accelerators})
    clusters = _clusters(
        body["clusters"], {p.accelerator: p for p in profiles}, {a.name for a in accelerators}
    )
    by_name = {c.name: c for c in clusters}
    links = _links(body.get("links", []), by_name)
    workload = _workload(body["workload"], clusters) if "workload" in body else None
    slo = None
    if "slo" in body:
        s = mapping_read(body["slo"], ("slo",), required=("decode_tokens_per_s",))
        slo = SloSpec(
            decode_tokens_per_s=number_read(
                s["decode_tokens_per_s"], ("slo", "decode_tokens_per_s"), positive=True
            )
        )
    expected = body.get("expected")
    if expected is not None and not isinstance(expected, Mapping):
        raise error_at(("expected",), f"expected a mapping, got {kind_name(expected)}")
    return Scenario(
        version=version,
        name=str_read(body["name"], ("name",)),
        description=description.strip(),
        model=model,
        accelerators=accelerators,
        profiles=profiles,
        clusters=clusters,
        links=links,
        workload=workload,
        events=_events(body.get("events", []), by_name, links),
        caches=_caches(body.get("caches", {}), by_name),
        slo=slo,
        expected=None if expected is None else json.loads(json.dumps(expected)),
        source=source,
    )
