"""The one scenario reader: YAML files in the format of ``shared/scenarios/SCHEMA.md``.

A scenario describes a PrfaaS deployment (model, hardware profiles, clusters, links) and its
traffic. The planner CLI, the simulator and the inventory import all read scenarios through
:func:`scenario_load`, so there is exactly one idea of what a valid file is.

The reader is strict on purpose: a typo in a scenario silently falling back to a default would
make every number derived from it quietly wrong. Every problem is a :class:`ScenarioError`
whose ``path`` names the key (``profiles[1].prefill_seconds[3]``).

Pure Python: no Django import here (the pure core must run in routers and workers alike).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml

from scheduling.core import bounds
from scheduling.core.bounds import Bound
from scheduling.core.routing import KV_CONNECTORS

ROOT = "<scenario>"

ClusterKind = Literal["prfaas", "pd"]
TableT = tuple[tuple[float, float], ...]


class ScenarioError(ValueError):
    """A scenario that cannot be used, with the key path of the first problem found."""

    def __init__(self, path: str, message: str):
        self.path = path or ROOT
        self.message = message
        super().__init__(f"{self.path}: {self.message}")


def location_path(loc: Sequence[str | int]) -> str:
    """Render a location as a key path: ``("profiles", 1, "prefill_seconds")`` ->
    ``profiles[1].prefill_seconds``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


# --------------------------------------------------------------------------------------------
# Domain dataclasses (frozen: the pure core passes them around without defensive copies)


@dataclass(frozen=True)
class ScenarioModel:
    """The served model: how much KVCache one prefill produces at each input length."""

    name: str
    attention: Mapping[str, Any]
    block_tokens: int
    kv_cache_mib: TableT
    linear_state_mib: float | None = None


@dataclass(frozen=True)
class AcceleratorSpec:
    """A kind of accelerator and its relative price per GPU-hour."""

    name: str
    gpu_hour_cost: float


@dataclass(frozen=True)
class DecodeSpec:
    """Decode capacity of one instance: concurrent requests and the time of one step."""

    max_batch: int
    step_seconds: float


@dataclass(frozen=True)
class ProfileSpec:
    """Performance of one model instance on one accelerator."""

    accelerator: str
    gpus_per_instance: int
    prefill_seconds: TableT
    decode: DecodeSpec | None = None


@dataclass(frozen=True)
class ScenarioCluster:
    """One kind of hardware at one site; ``prfaas`` clusters only prefill."""

    name: str
    kind: ClusterKind
    site: str
    accelerator: str
    prefill_instances: int
    decode_instances: int = 0
    # The engines' disaggregated KV protocol, as a gateway drives it (clusters.models.KvConnector).
    kv_connector: str = "nixl"

    @property
    def instances(self) -> int:
        return self.prefill_instances + self.decode_instances


@dataclass(frozen=True)
class ScenarioLink:
    """The Ethernet path from a PrfaaS cluster to a PD cluster (0 Gbps = link down).

    ``kv_budget_mib``: the most KVCache in flight on it (reserved from the routing decision to
    the transfer's end); ``target_utilisation``: the mean egress share the planner may plan
    onto it. ``None``: the router's defaults (:mod:`scheduling.core.link`).
    """

    source: str
    target: str
    gbps: float
    rtt_ms: float = 0.0
    kv_budget_mib: float | None = None
    target_utilisation: float | None = None

    @property
    def key(self) -> str:
        return f"{self.source}->{self.target}"


@dataclass(frozen=True)
class LognormalDist:
    """Log-normal lengths truncated to [min, max]."""

    mu: float
    sigma: float
    min: float
    max: float


@dataclass(frozen=True)
class FixedDist:
    """Every request has the same length."""

    value: float


@dataclass(frozen=True)
class EmpiricalDist:
    """Discrete lengths with weights (points sorted by tokens, weights need not sum to 1)."""

    points: TableT


Distribution = LognormalDist | FixedDist | EmpiricalDist


@dataclass(frozen=True)
class ArrivalSpec:
    """How requests arrive; ``rate_per_s`` None means a tool searches for it."""

    process: Literal["poisson"] = "poisson"
    rate_per_s: float | None = None


@dataclass(frozen=True)
class TraceSpec:
    """A request trace replayed instead of length distributions (``path`` is absolute)."""

    path: Path
    format: Literal["mooncake", "azure"]
    dequantize: str = "none"
    rate_scale: float = 1.0


@dataclass(frozen=True)
class PhaseSpec:
    """One consecutive stretch of a workload overriding some of its settings."""

    duration_s: float
    ramp: bool = False
    arrival: ArrivalSpec | None = None
    input_tokens: Distribution | None = None
    output_tokens: Distribution | None = None
    prefix_hit_fraction: float | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    """The traffic: arrivals, lengths (distributions or a trace) and where it arrives."""

    arrival: ArrivalSpec
    input_tokens: Distribution | None
    output_tokens: Distribution | None
    trace: TraceSpec | None
    phases: tuple[PhaseSpec, ...]
    origins: Mapping[str, float]
    prefix_hit_fraction: float | None


@dataclass(frozen=True)
class LinkEvent:
    """At ``at_s`` the link's capacity becomes ``gbps``."""

    at_s: float
    source: str
    target: str
    gbps: float


@dataclass(frozen=True)
class StateEvent:
    """At ``at_s`` an instance (or a whole cluster) goes ``down`` or comes back ``active``."""

    at_s: float
    state: Literal["down", "active"]
    instance: str | None = None
    cluster: str | None = None


@dataclass(frozen=True)
class RateEvent:
    """At ``at_s`` the traffic arriving at a cluster is scaled by ``rate_scale``."""

    at_s: float
    cluster: str
    rate_scale: float


Event = LinkEvent | StateEvent | RateEvent


@dataclass(frozen=True)
class CacheSpec:
    """Prefix-cache capacity of each instance of a cluster."""

    gib_per_instance: float


@dataclass(frozen=True)
class SloSpec:
    """Service objectives: per-request decode speed."""

    decode_tokens_per_s: float


@dataclass(frozen=True)
class Scenario:
    """A validated scenario: deployment plus workload (see ``shared/scenarios/SCHEMA.md``)."""

    version: int
    name: str
    description: str
    model: ScenarioModel
    accelerators: tuple[AcceleratorSpec, ...]
    profiles: tuple[ProfileSpec, ...]
    clusters: tuple[ScenarioCluster, ...]
    links: tuple[ScenarioLink, ...]
    workload: WorkloadSpec | None
    events: tuple[Event, ...] = ()
    caches: Mapping[str, CacheSpec] = field(default_factory=dict)
    slo: SloSpec | None = None
    expected: Mapping[str, Any] | None = None
    source: Path | None = None

    def accelerator(self, name: str) -> AcceleratorSpec:
        for acc in self.accelerators:
            if acc.name == name:
                return acc
        raise KeyError(name)

    def profile_for(self, accelerator: str) -> ProfileSpec:
        for prof in self.profiles:
            if prof.accelerator == accelerator:
                return prof
        raise KeyError(accelerator)

    def cluster(self, name: str) -> ScenarioCluster:
        for c in self.clusters:
            if c.name == name:
                return c
        raise KeyError(name)

    @property
    def prfaas_clusters(self) -> tuple[ScenarioCluster, ...]:
        return tuple(c for c in self.clusters if c.kind == "prfaas")

    @property
    def pd_clusters(self) -> tuple[ScenarioCluster, ...]:
        return tuple(c for c in self.clusters if c.kind == "pd")


# --------------------------------------------------------------------------------------------
# Loading and merging


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
        raise ScenarioError(ROOT, f"expected a mapping at the top level, got {_kind(data)}")
    data = dict(data)
    _anchor_paths(data, base_dir)
    target = data.pop("extends", None)
    if target is None:
        return _strip_nulls(data)
    if not isinstance(target, str) or not target:
        raise ScenarioError("extends", f"expected a file name, got {_kind(target)}")
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
# Validation helpers: each takes the raw value and its location


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__


Loc = tuple[str | int, ...]


def _err(loc: Loc, message: str) -> ScenarioError:
    return ScenarioError(location_path(loc), message)


def _mapping(
    value: Any, loc: Loc, *, required: Sequence[str] = (), optional: Sequence[str] = ()
) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _err(loc, f"expected a mapping, got {_kind(value)}")
    allowed = (*required, *optional)
    for key in value:
        if key not in allowed:
            raise _err((*loc, str(key)), f"unknown key (allowed: {', '.join(allowed)})")
    for key in required:
        if key not in value:
            raise _err((*loc, key), "required key is missing")
    return value


def _list(value: Any, loc: Loc, *, nonempty: bool = False) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise _err(loc, f"expected a list, got {_kind(value)}")
    if nonempty and not value:
        raise _err(loc, "must not be empty")
    return list(value)


def _str(value: Any, loc: Loc, *, choices: Sequence[str] | None = None) -> str:
    if not isinstance(value, str) or not value:
        raise _err(loc, f"expected a non-empty string, got {_kind(value)}")
    if choices is not None and value not in choices:
        raise _err(loc, f"expected one of {', '.join(choices)}, got {value!r}")
    return value


def _number(
    value: Any,
    loc: Loc,
    *,
    minimum: float | None = 0.0,
    positive: bool = False,
    maximum: float | None = None,
) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _err(loc, f"expected a number, got {_kind(value)}")
    number = float(value)
    if not np.isfinite(number):
        raise _err(loc, "must be a finite number")
    if positive and number <= 0:
        raise _err(loc, f"must be positive, got {value}")
    if minimum is not None and number < minimum:
        word = "negative" if minimum == 0 else f"below {minimum}"
        raise _err(loc, f"must not be {word}, got {value}")
    if maximum is not None and number > maximum:
        raise _err(loc, f"must be at most {maximum}, got {value}")
    return number


def _within(value: Any, loc: Loc, bound: Bound) -> float:
    """A number within a physical bound (scheduling.core.bounds)."""
    number = _number(value, loc, minimum=None)
    problem = bound.error(number)
    if problem is not None:
        raise _err(loc, f"{problem}, got {value}")
    return number


def _int_within(value: Any, loc: Loc, bound: Bound) -> int:
    number = _int(value, loc, minimum=int(bound.low))
    if number > bound.high:
        raise _err(loc, f"must be at most {bound.high:g} {bound.unit}, got {value}")
    return number


def _bounded_table(value: Any, loc: Loc, values: Bound) -> TableT:
    table = _table(value, loc)
    for i, (tokens, val) in enumerate(table):
        _within(tokens, (*loc, i, 0), bounds.TABLE_TOKENS)
        _within(val, (*loc, i, 1), values)
    return table


def _int(value: Any, loc: Loc, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _err(loc, f"expected an integer, got {_kind(value)}")
    if value < minimum:
        word = "negative" if minimum == 0 else f"below {minimum}"
        raise _err(loc, f"must not be {word}, got {value}")
    return value


def _bool(value: Any, loc: Loc) -> bool:
    if not isinstance(value, bool):
        raise _err(loc, f"expected true or false, got {_kind(value)}")
    return value


def _table(value: Any, loc: Loc, *, min_points: int = 2) -> TableT:
    rows = _list(value, loc)
    if len(rows) < min_points:
        raise _err(loc, f"needs at least {min_points} [tokens, value] points, got {len(rows)}")
    points: list[tuple[float, float]] = []
    for i, row in enumerate(rows):
        if not isinstance(row, list | tuple) or len(row) != 2:
            raise _err((*loc, i), f"expected a [tokens, value] pair, got {_kind(row)}")
        tokens = _number(row[0], (*loc, i, 0))
        val = _number(row[1], (*loc, i, 1))
        if points and tokens <= points[-1][0]:
            raise _err(
                (*loc, i),
                f"table not sorted by tokens: {row[0]} follows {points[-1][0]:g}",
            )
        points.append((tokens, val))
    return tuple(points)


def _distribution(value: Any, loc: Loc) -> Distribution:
    body = _mapping(
        value, loc, optional=("distribution", "mu", "sigma", "min", "max", "value", "points")
    )
    if "distribution" not in body:
        raise _err((*loc, "distribution"), "required key is missing")
    kind = _str(
        body["distribution"], (*loc, "distribution"), choices=("lognormal", "fixed", "empirical")
    )
    if kind == "lognormal":
        body = _mapping(value, loc, required=("distribution", "mu", "sigma", "min", "max"))
        mu = _number(body["mu"], (*loc, "mu"), minimum=None)
        sigma = _number(body["sigma"], (*loc, "sigma"), positive=True)
        lo = _number(body["min"], (*loc, "min"), positive=True)
        hi = _number(body["max"], (*loc, "max"), positive=True)
        if hi <= lo:
            raise _err((*loc, "max"), f"must exceed min ({lo:g}), got {hi:g}")
        return LognormalDist(mu=mu, sigma=sigma, min=lo, max=hi)
    if kind == "fixed":
        body = _mapping(value, loc, required=("distribution", "value"))
        return FixedDist(value=_number(body["value"], (*loc, "value")))
    body = _mapping(value, loc, required=("distribution", "points"))
    points = _table(body["points"], (*loc, "points"), min_points=1)
    if sum(w for _, w in points) <= 0:
        raise _err((*loc, "points"), "weights must not all be zero")
    return EmpiricalDist(points=points)


# --------------------------------------------------------------------------------------------
# Sections


def _model(value: Any) -> ScenarioModel:
    loc: Loc = ("model",)
    body = _mapping(
        value,
        loc,
        required=("name", "block_tokens", "kv_cache_mib"),
        optional=("attention", "linear_state_mib"),
    )
    attention = body.get("attention", {})
    if not isinstance(attention, Mapping):
        raise _err((*loc, "attention"), f"expected a mapping, got {_kind(attention)}")
    linear = body.get("linear_state_mib")
    return ScenarioModel(
        name=_str(body["name"], (*loc, "name")),
        attention=dict(attention),
        block_tokens=_int_within(body["block_tokens"], (*loc, "block_tokens"), bounds.BLOCK_TOKENS),
        kv_cache_mib=_bounded_table(
            body["kv_cache_mib"], (*loc, "kv_cache_mib"), bounds.KV_CACHE_MIB
        ),
        linear_state_mib=(
            None
            if linear is None
            else _within(linear, (*loc, "linear_state_mib"), bounds.LINEAR_STATE_MIB)
        ),
    )


def _unique(names: list[tuple[str, Loc]], what: str) -> None:
    seen: dict[str, Loc] = {}
    for name, loc in names:
        if name in seen:
            raise _err(loc, f"duplicate {what} {name!r} (first at {location_path(seen[name])})")
        seen[name] = loc


def _accelerators(value: Any) -> tuple[AcceleratorSpec, ...]:
    out = []
    for i, item in enumerate(_list(value, ("accelerators",), nonempty=True)):
        loc: Loc = ("accelerators", i)
        body = _mapping(item, loc, required=("name", "gpu_hour_cost"))
        out.append(
            AcceleratorSpec(
                name=_str(body["name"], (*loc, "name")),
                gpu_hour_cost=_within(
                    body["gpu_hour_cost"], (*loc, "gpu_hour_cost"), bounds.GPU_HOUR_COST
                ),
            )
        )
    _unique([(a.name, ("accelerators", i, "name")) for i, a in enumerate(out)], "accelerator")
    return tuple(out)


def _profiles(value: Any, accelerators: set[str]) -> tuple[ProfileSpec, ...]:
    out = []
    for i, item in enumerate(_list(value, ("profiles",), nonempty=True)):
        loc: Loc = ("profiles", i)
        body = _mapping(
            item,
            loc,
            required=("accelerator", "gpus_per_instance", "prefill_seconds"),
            optional=("decode",),
        )
        acc = _str(body["accelerator"], (*loc, "accelerator"))
        if acc not in accelerators:
            raise _err((*loc, "accelerator"), f"unknown accelerator {acc!r}")
        table = _bounded_table(
            body["prefill_seconds"], (*loc, "prefill_seconds"), bounds.PREFILL_SECONDS
        )
        for j, (_, seconds) in enumerate(table):
            if seconds <= 0:
                raise _err((*loc, "prefill_seconds", j, 1), "prefill time must be positive")
        decode = None
        if "decode" in body:
            dloc: Loc = (*loc, "decode")
            d = _mapping(body["decode"], dloc, required=("max_batch", "step_seconds"))
            decode = DecodeSpec(
                max_batch=_int_within(
                    d["max_batch"], (*dloc, "max_batch"), bounds.DECODE_MAX_BATCH
                ),
                step_seconds=_within(
                    d["step_seconds"], (*dloc, "step_seconds"), bounds.DECODE_STEP_SECONDS
                ),
            )
        out.append(
            ProfileSpec(
                accelerator=acc,
                gpus_per_instance=_int_within(
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
    for i, item in enumerate(_list(value, ("clusters",), nonempty=True)):
        loc: Loc = ("clusters", i)
        keys = ("name", "kind", "site", "accelerator", "prefill_instances")
        body = _mapping(item, loc, optional=(*keys, "decode_instances", "kv_connector"))
        if "kind" not in body:
            raise _err((*loc, "kind"), "required key is missing")
        kind = _str(body["kind"], (*loc, "kind"), choices=("prfaas", "pd"))
        if kind == "prfaas" and "decode_instances" in body:
            raise _err(
                (*loc, "decode_instances"),
                "a prfaas cluster only prefills: it has no decode instances",
            )
        _mapping(
            item,
            loc,
            required=(*keys, "decode_instances") if kind == "pd" else keys,
            optional=("kv_connector",),
        )
        acc = _str(body["accelerator"], (*loc, "accelerator"))
        if acc not in accelerators:
            raise _err((*loc, "accelerator"), f"unknown accelerator {acc!r}")
        if acc not in profiles:
            raise _err((*loc, "accelerator"), f"no profile for accelerator {acc!r}")
        if kind == "pd" and profiles[acc].decode is None:
            raise _err((*loc, "accelerator"), f"a pd cluster needs a decode profile for {acc!r}")
        out.append(
            ScenarioCluster(
                name=_str(body["name"], (*loc, "name")),
                kind=kind,  # type: ignore[arg-type]
                site=_str(body["site"], (*loc, "site")),
                accelerator=acc,
                prefill_instances=_int_within(
                    body["prefill_instances"], (*loc, "prefill_instances"), bounds.CLUSTER_INSTANCES
                ),
                decode_instances=(
                    _int_within(
                        body["decode_instances"],
                        (*loc, "decode_instances"),
                        bounds.CLUSTER_INSTANCES,
                    )
                    if kind == "pd"
                    else 0
                ),
                kv_connector=_str(
                    body.get("kv_connector", "nixl"),
                    (*loc, "kv_connector"),
                    choices=KV_CONNECTORS,
                ),
            )
        )
    _unique([(c.name, ("clusters", i, "name")) for i, c in enumerate(out)], "cluster")
    return tuple(out)


def _links(value: Any, clusters: Mapping[str, ScenarioCluster]) -> tuple[ScenarioLink, ...]:
    out = []
    for i, item in enumerate(_list(value, ("links",))):
        loc: Loc = ("links", i)
        body = _mapping(
            item,
            loc,
            required=("source", "target", "gbps"),
            optional=("rtt_ms", "kv_budget_mib", "target_utilisation"),
        )
        ends = {}
        for end, kind in (("source", "prfaas"), ("target", "pd")):
            name = _str(body[end], (*loc, end))
            if name not in clusters:
                raise _err((*loc, end), f"unknown cluster {name!r}")
            if clusters[name].kind != kind:
                raise _err(
                    (*loc, end),
                    f"a link runs from a prfaas cluster to a pd cluster; {name!r} is a "
                    f"{clusters[name].kind} cluster",
                )
            ends[end] = name
        out.append(
            ScenarioLink(
                source=ends["source"],
                target=ends["target"],
                gbps=_within(body["gbps"], (*loc, "gbps"), bounds.LINK_GBPS),
                rtt_ms=_within(body.get("rtt_ms", 0.0), (*loc, "rtt_ms"), bounds.LINK_RTT_MS),
                kv_budget_mib=(
                    None
                    if body.get("kv_budget_mib") is None
                    else _within(
                        body["kv_budget_mib"], (*loc, "kv_budget_mib"), bounds.LINK_KV_BUDGET_MIB
                    )
                ),
                target_utilisation=(
                    None
                    if body.get("target_utilisation") is None
                    else _number(
                        body["target_utilisation"],
                        (*loc, "target_utilisation"),
                        positive=True,
                        maximum=1.0,
                    )
                ),
            )
        )
    _unique([(link.key, ("links", i)) for i, link in enumerate(out)], "link")
    return tuple(out)


def _arrival(value: Any, loc: Loc) -> ArrivalSpec:
    body = _mapping(value, loc, required=("process",), optional=("rate_per_s",))
    rate = body.get("rate_per_s")
    return ArrivalSpec(
        process=_str(body["process"], (*loc, "process"), choices=("poisson",)),  # type: ignore[arg-type]
        rate_per_s=None if rate is None else _number(rate, (*loc, "rate_per_s"), positive=True),
    )


def _trace(value: Any, loc: Loc) -> TraceSpec:
    body = _mapping(value, loc, required=("path", "format"), optional=("dequantize", "rate_scale"))
    path = Path(_str(body["path"], (*loc, "path")))
    if not path.is_file():
        raise _err((*loc, "path"), f"trace file not found: {path}")
    return TraceSpec(
        path=path,
        format=_str(body["format"], (*loc, "format"), choices=("mooncake", "azure")),  # type: ignore[arg-type]
        dequantize=_str(
            body.get("dequantize", "none"), (*loc, "dequantize"), choices=("none", "uniform")
        ),
        rate_scale=_number(body.get("rate_scale", 1.0), (*loc, "rate_scale"), positive=True),
    )


_PHASE_KEYS = ("arrival", "input_tokens", "output_tokens", "prefix_hit_fraction")


def _phase(value: Any, loc: Loc) -> PhaseSpec:
    body = _mapping(value, loc, required=("duration_s",), optional=("ramp", *_PHASE_KEYS))
    hit = body.get("prefix_hit_fraction")
    return PhaseSpec(
        duration_s=_number(body["duration_s"], (*loc, "duration_s"), positive=True),
        ramp=_bool(body.get("ramp", False), (*loc, "ramp")),
        arrival=_arrival(body["arrival"], (*loc, "arrival")) if "arrival" in body else None,
        input_tokens=_distribution(body["input_tokens"], (*loc, "input_tokens"))
        if "input_tokens" in body
        else None,
        output_tokens=(
            _distribution(body["output_tokens"], (*loc, "output_tokens"))
            if "output_tokens" in body
            else None
        ),
        prefix_hit_fraction=None
        if hit is None
        else _number(hit, (*loc, "prefix_hit_fraction"), maximum=1.0),
    )


def _workload(value: Any, clusters: tuple[ScenarioCluster, ...]) -> WorkloadSpec:
    loc: Loc = ("workload",)
    body = _mapping(
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
        _distribution(body["input_tokens"], (*loc, "input_tokens"))
        if "input_tokens" in body
        else None
    )
    out = (
        _distribution(body["output_tokens"], (*loc, "output_tokens"))
        if "output_tokens" in body
        else None
    )
    if trace is not None and inp is not None:
        raise _err((*loc, "input_tokens"), "give either a trace or length distributions, not both")
    if trace is None and inp is None:
        raise _err((*loc, "input_tokens"), "required key is missing (or give workload.trace)")
    if trace is None and out is None:
        raise _err((*loc, "output_tokens"), "required key is missing (or give workload.trace)")
    pd_names = [c.name for c in clusters if c.kind == "pd"]
    if "origins" in body:
        raw = _mapping(body["origins"], (*loc, "origins"), optional=tuple(pd_names))
        origins: dict[str, float] = {}
        for name, share in raw.items():
            oloc: Loc = (*loc, "origins", str(name))
            if name not in pd_names:
                raise _err(oloc, f"not a pd cluster (pd clusters: {', '.join(pd_names)})")
            origins[str(name)] = _number(share, oloc)
        total = sum(origins.values())
        if abs(total - 1.0) > 1e-6:
            raise _err((*loc, "origins"), f"shares must sum to 1, got {total:g}")
    elif len(pd_names) == 1:
        origins = {pd_names[0]: 1.0}
    elif pd_names:
        raise _err(
            (*loc, "origins"),
            f"required when there are several pd clusters ({', '.join(pd_names)})",
        )
    else:
        origins = {}
    hit = body.get("prefix_hit_fraction")
    phases = tuple(
        _phase(p, (*loc, "phases", i))
        for i, p in enumerate(_list(body.get("phases", []), (*loc, "phases")))
    )
    if phases and phases[0].ramp:
        raise _err(
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
        else _number(hit, (*loc, "prefix_hit_fraction"), maximum=1.0),
    )


def _events(
    value: Any, clusters: Mapping[str, ScenarioCluster], links: tuple[ScenarioLink, ...]
) -> tuple[Event, ...]:
    link_keys = {link.key for link in links}
    out: list[Event] = []
    for i, item in enumerate(_list(value, ("events",))):
        loc: Loc = ("events", i)
        if not isinstance(item, Mapping):
            raise _err(loc, f"expected a mapping, got {_kind(item)}")
        if "link" in item:
            body = _mapping(item, loc, required=("at_s", "link", "gbps"))
            key = _str(body["link"], (*loc, "link"))
            if key not in link_keys:
                raise _err(
                    (*loc, "link"), f"unknown link {key!r} (links: {', '.join(sorted(link_keys))})"
                )
            source, target = key.split("->")
            out.append(
                LinkEvent(
                    at_s=_number(body["at_s"], (*loc, "at_s")),
                    source=source,
                    target=target,
                    gbps=_within(body["gbps"], (*loc, "gbps"), bounds.LINK_GBPS),
                )
            )
        elif "state" in item:
            body = _mapping(item, loc, required=("at_s", "state"), optional=("instance", "cluster"))
            if ("instance" in body) == ("cluster" in body):
                raise _err(loc, "a state event names exactly one of instance or cluster")
            cluster = None
            if "cluster" in body:
                cluster = _str(body["cluster"], (*loc, "cluster"))
                if cluster not in clusters:
                    raise _err((*loc, "cluster"), f"unknown cluster {cluster!r}")
            out.append(
                StateEvent(
                    at_s=_number(body["at_s"], (*loc, "at_s")),
                    state=_str(body["state"], (*loc, "state"), choices=("down", "active")),  # type: ignore[arg-type]
                    instance=_str(body["instance"], (*loc, "instance"))
                    if "instance" in body
                    else None,
                    cluster=cluster,
                )
            )
        elif "rate_scale" in item:
            body = _mapping(item, loc, required=("at_s", "cluster", "rate_scale"))
            cluster = _str(body["cluster"], (*loc, "cluster"))
            if cluster not in clusters:
                raise _err((*loc, "cluster"), f"unknown cluster {cluster!r}")
            out.append(
                RateEvent(
                    at_s=_number(body["at_s"], (*loc, "at_s")),
                    cluster=cluster,
                    rate_scale=_number(body["rate_scale"], (*loc, "rate_scale")),
                )
            )
        else:
            raise _err(
                loc, "an event changes a link (link, gbps), a state (state) or a rate (rate_scale)"
            )
    return tuple(out)


def _caches(value: Any, clusters: Mapping[str, ScenarioCluster]) -> dict[str, CacheSpec]:
    body = _mapping(value, ("caches",), optional=tuple(clusters))
    out = {}
    for name, item in body.items():
        loc: Loc = ("caches", name)
        c = _mapping(item, loc, required=("gib_per_instance",))
        out[name] = CacheSpec(
            gib_per_instance=_number(c["gib_per_instance"], (*loc, "gib_per_instance"))
        )
    return out


_TOP_REQUIRED = ("version", "name", "model", "accelerators", "profiles", "clusters")
_TOP_OPTIONAL = ("description", "links", "workload", "events", "caches", "slo", "expected")
# The top level of a scenario, for those describing it elsewhere (the topology API's schema).
SCENARIO_REQUIRED_KEYS = _TOP_REQUIRED
SCENARIO_OPTIONAL_KEYS = (*_TOP_OPTIONAL, "extends")


def _build(data: Mapping[str, Any], *, source: Path | None) -> Scenario:
    body = _mapping(data, (), required=_TOP_REQUIRED, optional=_TOP_OPTIONAL)
    version = _int(body["version"], ("version",), minimum=1)
    if version != 1:
        raise _err(("version",), f"unsupported schema version {version} (this reader knows 1)")
    description = body.get("description", "")
    if not isinstance(description, str):
        raise _err(("description",), f"expected a string, got {_kind(description)}")
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
        s = _mapping(body["slo"], ("slo",), required=("decode_tokens_per_s",))
        slo = SloSpec(
            decode_tokens_per_s=_number(
                s["decode_tokens_per_s"], ("slo", "decode_tokens_per_s"), positive=True
            )
        )
    expected = body.get("expected")
    if expected is not None and not isinstance(expected, Mapping):
        raise _err(("expected",), f"expected a mapping, got {_kind(expected)}")
    return Scenario(
        version=version,
        name=_str(body["name"], ("name",)),
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


# --------------------------------------------------------------------------------------------
# Back to the file format


def _table_out(table: TableT) -> list[list[float]]:
    return [[_num_out(x), _num_out(y)] for x, y in table]


def _num_out(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


def distribution_to_dict(dist: Distribution) -> dict[str, Any]:
    if isinstance(dist, LognormalDist):
        return {
            "distribution": "lognormal",
            "mu": dist.mu,
            "sigma": dist.sigma,
            "min": _num_out(dist.min),
            "max": _num_out(dist.max),
        }
    if isinstance(dist, FixedDist):
        return {"distribution": "fixed", "value": _num_out(dist.value)}
    return {"distribution": "empirical", "points": _table_out(dist.points)}


def _arrival_out(a: ArrivalSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"process": a.process}
    if a.rate_per_s is not None:
        out["rate_per_s"] = a.rate_per_s
    return out


def _event_out(e: Event) -> dict[str, Any]:
    if isinstance(e, LinkEvent):
        return {"at_s": e.at_s, "link": f"{e.source}->{e.target}", "gbps": e.gbps}
    if isinstance(e, StateEvent):
        out: dict[str, Any] = {"at_s": e.at_s, "state": e.state}
        if e.instance is not None:
            out["instance"] = e.instance
        if e.cluster is not None:
            out["cluster"] = e.cluster
        return out
    return {"at_s": e.at_s, "cluster": e.cluster, "rate_scale": e.rate_scale}


def _link_out(link: ScenarioLink) -> dict[str, Any]:
    out: dict[str, Any] = {
        "source": link.source,
        "target": link.target,
        "gbps": link.gbps,
        "rtt_ms": link.rtt_ms,
    }
    if link.kv_budget_mib is not None:
        out["kv_budget_mib"] = link.kv_budget_mib
    if link.target_utilisation is not None:
        out["target_utilisation"] = link.target_utilisation
    return out


def scenario_to_dict(s: Scenario) -> dict[str, Any]:
    """The scenario in the file format (already merged: no ``extends``; absolute trace path)."""
    model: dict[str, Any] = {
        "name": s.model.name,
        "attention": dict(s.model.attention),
        "block_tokens": s.model.block_tokens,
        "kv_cache_mib": _table_out(s.model.kv_cache_mib),
    }
    if s.model.linear_state_mib is not None:
        model["linear_state_mib"] = s.model.linear_state_mib
    profiles = []
    for p in s.profiles:
        prof: dict[str, Any] = {
            "accelerator": p.accelerator,
            "gpus_per_instance": p.gpus_per_instance,
            "prefill_seconds": _table_out(p.prefill_seconds),
        }
        if p.decode is not None:
            prof["decode"] = {
                "max_batch": p.decode.max_batch,
                "step_seconds": p.decode.step_seconds,
            }
        profiles.append(prof)
    clusters = []
    for c in s.clusters:
        cl: dict[str, Any] = {
            "name": c.name,
            "kind": c.kind,
            "site": c.site,
            "accelerator": c.accelerator,
            "prefill_instances": c.prefill_instances,
        }
        if c.kind == "pd":
            cl["decode_instances"] = c.decode_instances
        if c.kv_connector != "nixl":
            cl["kv_connector"] = c.kv_connector
        clusters.append(cl)
    out: dict[str, Any] = {
        "version": s.version,
        "name": s.name,
        "description": s.description,
        "model": model,
        "accelerators": [
            {"name": a.name, "gpu_hour_cost": a.gpu_hour_cost} for a in s.accelerators
        ],
        "profiles": profiles,
        "clusters": clusters,
        "links": [_link_out(link) for link in s.links],
    }
    if s.workload is not None:
        w = s.workload
        wl: dict[str, Any] = {"arrival": _arrival_out(w.arrival)}
        if w.input_tokens is not None:
            wl["input_tokens"] = distribution_to_dict(w.input_tokens)
        if w.output_tokens is not None:
            wl["output_tokens"] = distribution_to_dict(w.output_tokens)
        if w.trace is not None:
            wl["trace"] = {
                "path": str(w.trace.path),
                "format": w.trace.format,
                "dequantize": w.trace.dequantize,
                "rate_scale": w.trace.rate_scale,
            }
        if w.phases:
            phases = []
            for ph in w.phases:
                d: dict[str, Any] = {"duration_s": ph.duration_s}
                if ph.ramp:
                    d["ramp"] = True
                if ph.arrival is not None:
                    d["arrival"] = _arrival_out(ph.arrival)
                if ph.input_tokens is not None:
                    d["input_tokens"] = distribution_to_dict(ph.input_tokens)
                if ph.output_tokens is not None:
                    d["output_tokens"] = distribution_to_dict(ph.output_tokens)
                if ph.prefix_hit_fraction is not None:
                    d["prefix_hit_fraction"] = ph.prefix_hit_fraction
                phases.append(d)
            wl["phases"] = phases
        if w.origins:
            wl["origins"] = dict(w.origins)
        if w.prefix_hit_fraction is not None:
            wl["prefix_hit_fraction"] = w.prefix_hit_fraction
        out["workload"] = wl
    if s.events:
        out["events"] = [_event_out(e) for e in s.events]
    if s.caches:
        out["caches"] = {k: {"gib_per_instance": v.gib_per_instance} for k, v in s.caches.items()}
    if s.slo is not None:
        out["slo"] = {"decode_tokens_per_s": s.slo.decode_tokens_per_s}
    if s.expected is not None:
        out["expected"] = json.loads(json.dumps(s.expected))
    return out


# --------------------------------------------------------------------------------------------
# Traces as length distributions


def trace_lengths(trace: TraceSpec) -> tuple[np.ndarray, np.ndarray]:
    """Input and output lengths (tokens) of every request in a trace file, in file order."""
    inputs: list[int] = []
    outputs: list[int] = []
    where = str(trace.path)
    with trace.path.open(encoding="utf-8") as fh:
        if trace.format == "mooncake":
            for n, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    inputs.append(int(row["input_length"]))
                    outputs.append(int(row["output_length"]))
                except (ValueError, KeyError, TypeError) as exc:
                    raise ScenarioError(
                        "workload.trace.path", f"{where} line {n}: bad row ({exc})"
                    ) from None
        else:
            header = fh.readline().strip().split(",")
            try:
                ci, co = header.index("ContextTokens"), header.index("GeneratedTokens")
            except ValueError:
                raise ScenarioError(
                    "workload.trace.path",
                    f"{where}: expected ContextTokens and GeneratedTokens columns",
                ) from None
            for n, line in enumerate(fh, start=2):
                if not line.strip():
                    continue
                cells = line.rstrip("\n").split(",")
                try:
                    inputs.append(int(cells[ci]))
                    outputs.append(int(cells[co]))
                except (ValueError, IndexError) as exc:
                    raise ScenarioError(
                        "workload.trace.path", f"{where} line {n}: bad row ({exc})"
                    ) from None
    if not inputs:
        raise ScenarioError("workload.trace.path", f"{where}: the trace has no requests")
    return np.asarray(inputs, dtype=float), np.asarray(outputs, dtype=float)


def empirical_from_lengths(
    lengths: Sequence[float] | np.ndarray, *, bin_tokens: float = 0
) -> EmpiricalDist:
    """An empirical distribution from observed lengths: every distinct length is a point
    weighted by its count, or, with ``bin_tokens`` > 0, bins of that width represented by
    their mean length (a histogram, for long windows of traffic)."""
    arr = np.asarray(lengths, dtype=float)
    if arr.size == 0:
        raise ValueError("no lengths to build a distribution from")
    if np.any(arr < 0) or not np.all(np.isfinite(arr)):
        raise ValueError("lengths must be finite and non-negative")
    if bin_tokens > 0:
        bins = np.floor(arr / bin_tokens).astype(np.int64)
        _, inverse, counts = np.unique(bins, return_inverse=True, return_counts=True)
        sums = np.bincount(inverse, weights=arr)
        tokens = sums / counts
    else:
        tokens, counts = np.unique(arr, return_counts=True)
    return EmpiricalDist(
        points=tuple(zip(tokens.tolist(), counts.astype(float).tolist(), strict=True))
    )


def workload_length_distributions(
    workload: WorkloadSpec, *, bin_tokens: float = 0
) -> tuple[Distribution, Distribution]:
    """Input and output length distributions of a workload's steady state (the first phase's
    settings; a trace becomes its empirical distribution)."""
    inp, out = workload.input_tokens, workload.output_tokens
    if workload.phases:
        inp = workload.phases[0].input_tokens or inp
        out = workload.phases[0].output_tokens or out
    if workload.trace is not None:
        ins, outs = trace_lengths(workload.trace)
        inp = inp or empirical_from_lengths(ins, bin_tokens=bin_tokens)
        out = out or empirical_from_lengths(outs, bin_tokens=bin_tokens)
    if inp is None or out is None:
        raise ScenarioError("workload", "no input/output length distribution")
    return inp, out
