"""The plain-dict (JSON) forms of a policy snapshot and of a decision.

``GET /api/v1/policy`` serves :func:`policy_snapshot_to_dict`; router clients read it back
with :func:`policy_snapshot_from_dict`, which checks every key and names the key path of any
problem (:class:`SnapshotFormatError`). Decisions travel as :func:`decision_to_dict`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from scheduling.core.routing.live import ControlState, InstanceLoad, LinkLoad, LiveState
from scheduling.core.routing.types import (
    KV_CONNECTORS,
    SNAPSHOT_FORMAT,
    CacheTransfer,
    ClusterSpec,
    DecodeProfile,
    InstanceSpec,
    Link,
    LinkRefusal,
    LinkReservation,
    ModelSpec,
    Placement,
    PolicySnapshot,
    RouteDecision,
    RouteGuards,
    RoutingPolicy,
    SnapshotFormatError,
    Topology,
    TtftEstimate,
)

# --------------------------------------------------------------------------------------
# Plain-dict (JSON) forms
# --------------------------------------------------------------------------------------


def _num(x: float) -> float | None:
    """JSON has no infinity: an unbounded value is written as null."""
    return None if x is None or not math.isfinite(x) else x


LINK_FIELDS = ("source", "target", "gbps", "rtt_ms", "kv_budget_bytes", "target_utilisation")


def _link_dict(lk: Link) -> dict[str, Any]:
    out: dict[str, Any] = {
        "source": lk.source,
        "target": lk.target,
        "gbps": lk.gbps,
        "rtt_ms": lk.rtt_ms,
        "kv_budget_bytes": lk.budget,
    }
    if lk.target_utilisation is not None:
        out["target_utilisation"] = lk.target_utilisation
    return out


def policy_snapshot_to_dict(snapshot: PolicySnapshot) -> dict[str, Any]:
    """The JSON-able form of a policy and its topology: what ``GET /api/v1/policy`` serves
    and what a router client caches (complete enough to call :func:`route_decide`)."""
    policy, topology = snapshot.policy, snapshot.topology
    g = policy.guards
    model = topology.model
    return {
        "format": SNAPSHOT_FORMAT,
        "policy": {
            "version": policy.version,
            "thresholds": dict(sorted(policy.thresholds.items())),
            "guards": {name: getattr(g, name) for name in RouteGuards.__dataclass_fields__},
        },
        "model": {
            "name": model.name,
            "block_tokens": model.block_tokens,
            "kv_cache_mib": [list(p) for p in model.kv_cache_mib],
            "linear_state_mib": model.linear_state_mib,
        },
        "clusters": [
            {
                "name": c.name,
                "kind": c.kind,
                "accelerator": c.accelerator,
                "site": c.site,
                "prefill_seconds": [list(p) for p in c.prefill_seconds],
                "decode": (
                    None
                    if c.decode is None
                    else {"max_batch": c.decode.max_batch, "step_seconds": c.decode.step_seconds}
                ),
                "kv_connector": c.kv_connector,
            }
            for c in topology.clusters
        ],
        "instances": [
            {
                "name": i.name,
                "cluster": i.cluster,
                "role": i.role,
                "state": i.state,
                "endpoint": i.endpoint,
            }
            for i in topology.instances
        ],
        "links": [_link_dict(lk) for lk in topology.links],
    }


_GUARD_DEFAULTS = RouteGuards()


def route_guards_from_dict(raw: Any, path: str = "guards") -> RouteGuards:
    """The router's guards with ``raw`` overriding the defaults, every value checked: an unknown
    name, a wrong type or a value out of its range raises SnapshotFormatError naming
    ``{path}.{name}``. Policies stored in the database and snapshots read by routers both go
    through here."""
    if not isinstance(raw, Mapping):
        raise SnapshotFormatError(f"{path}: must be an object")
    fields = RouteGuards.__dataclass_fields__
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise SnapshotFormatError(
            f"{path}.{unknown[0]}: unknown guard (known: {', '.join(sorted(fields))})"
        )
    kwargs: dict[str, Any] = {}
    for name, value in raw.items():
        expected = type(getattr(_GUARD_DEFAULTS, name))
        if expected is bool or expected is str:
            ok = isinstance(value, expected)
        else:
            ok = (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value)
            )
        if not ok:
            raise SnapshotFormatError(f"{path}.{name}: must be a {expected.__name__}")
        kwargs[name] = float(value) if expected is float else value
    try:
        return RouteGuards(**kwargs)
    except ValueError as exc:  # a range rule of RouteGuards; its message starts with "guards."
        raise SnapshotFormatError(f"{path}{str(exc).removeprefix('guards')}") from None


class _Reader:
    """Strict reading of a snapshot dict: wrong keys and types name their key path."""

    _MISSING = object()

    @staticmethod
    def mapping(value: Any, path: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise SnapshotFormatError(f"{path}: expected an object")
        return value

    @staticmethod
    def only(obj: Mapping[str, Any], path: str, allowed: Iterable[str]) -> None:
        unknown = sorted(set(obj) - set(allowed))
        if unknown:
            raise SnapshotFormatError(f"{path}.{unknown[0]}: unknown key")

    @classmethod
    def get(
        cls, obj: Mapping[str, Any], key: str, path: str, kind: Any, default: Any = _MISSING
    ) -> Any:
        where = f"{path}.{key}" if path else key
        if key not in obj:
            if default is cls._MISSING:
                raise SnapshotFormatError(f"{where}: missing")
            return default
        value = obj[key]
        if value is None and default is None:
            return None
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise SnapshotFormatError(f"{where}: expected a number")
            if not math.isfinite(value):
                raise SnapshotFormatError(f"{where}: expected a finite number")
            return float(value)
        if kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise SnapshotFormatError(f"{where}: expected an integer")
            return value
        if not isinstance(value, kind):
            raise SnapshotFormatError(f"{where}: expected {getattr(kind, '__name__', kind)}")
        return value

    @classmethod
    def table(cls, value: Any, path: str) -> tuple[tuple[float, float], ...]:
        if not isinstance(value, list) or not value:
            raise SnapshotFormatError(f"{path}: expected a non-empty list of [tokens, value]")
        out: list[tuple[float, float]] = []
        for i, point in enumerate(value):
            if (
                not isinstance(point, list | tuple)
                or len(point) != 2
                or any(isinstance(v, bool) or not isinstance(v, int | float) for v in point)
                or not all(math.isfinite(v) for v in point)
            ):
                raise SnapshotFormatError(f"{path}[{i}]: expected [tokens, value] numbers")
            if i and point[0] <= out[-1][0]:
                raise SnapshotFormatError(f"{path}[{i}]: tokens must increase")
            out.append((float(point[0]), float(point[1])))
        return tuple(out)


def policy_snapshot_from_dict(data: Any) -> PolicySnapshot:
    """Read the dict :func:`policy_snapshot_to_dict` writes. Raises SnapshotFormatError
    naming the key path of the first problem (``instances[3].role: ...``)."""
    r = _Reader
    root = r.mapping(data, "snapshot")
    r.only(root, "snapshot", ("format", "policy", "model", "clusters", "instances", "links"))
    fmt = r.get(root, "format", "", int)
    if fmt != SNAPSHOT_FORMAT:
        raise SnapshotFormatError(f"format: unsupported snapshot format {fmt}")

    pol = r.mapping(r.get(root, "policy", "", dict), "policy")
    r.only(pol, "policy", ("version", "thresholds", "guards"))
    version = r.get(pol, "version", "policy", int)
    raw_thresholds = r.mapping(r.get(pol, "thresholds", "policy", dict), "policy.thresholds")
    thresholds = {}
    for name in raw_thresholds:
        value = r.get(raw_thresholds, name, "policy.thresholds", int)
        if value < 0:
            raise SnapshotFormatError(f"policy.thresholds.{name}: must not be negative")
        thresholds[str(name)] = value
    guards = route_guards_from_dict(r.get(pol, "guards", "policy", dict, {}), "policy.guards")

    m = r.mapping(r.get(root, "model", "", dict), "model")
    r.only(m, "model", ("name", "block_tokens", "kv_cache_mib", "linear_state_mib"))
    model = ModelSpec(
        name=r.get(m, "name", "model", str),
        block_tokens=r.get(m, "block_tokens", "model", int),
        kv_cache_mib=r.table(r.get(m, "kv_cache_mib", "model", list), "model.kv_cache_mib"),
        linear_state_mib=r.get(m, "linear_state_mib", "model", float, None),
    )
    clusters = []
    for i, c in enumerate(r.get(root, "clusters", "", list)):
        path = f"clusters[{i}]"
        c = r.mapping(c, path)
        r.only(
            c,
            path,
            ("name", "kind", "accelerator", "site", "prefill_seconds", "decode", "kv_connector"),
        )
        connector = r.get(c, "kv_connector", path, str, "nixl")
        if connector not in KV_CONNECTORS:
            raise SnapshotFormatError(
                f"{path}.kv_connector: expected one of {', '.join(KV_CONNECTORS)}"
            )
        d = r.get(c, "decode", path, dict, None)
        decode = None
        if d is not None:
            r.only(d, f"{path}.decode", ("max_batch", "step_seconds"))
            decode = DecodeProfile(
                r.get(d, "max_batch", f"{path}.decode", int),
                r.get(d, "step_seconds", f"{path}.decode", float),
            )
        clusters.append(
            ClusterSpec(
                name=r.get(c, "name", path, str),
                kind=r.get(c, "kind", path, str),
                accelerator=r.get(c, "accelerator", path, str, ""),
                site=r.get(c, "site", path, str, ""),
                prefill_seconds=r.table(
                    r.get(c, "prefill_seconds", path, list), f"{path}.prefill_seconds"
                ),
                decode=decode,
                kv_connector=connector,
            )
        )
    instances = []
    for i, inst in enumerate(r.get(root, "instances", "", list)):
        path = f"instances[{i}]"
        inst = r.mapping(inst, path)
        r.only(inst, path, ("name", "cluster", "role", "state", "endpoint"))
        instances.append(
            InstanceSpec(
                name=r.get(inst, "name", path, str),
                cluster=r.get(inst, "cluster", path, str),
                role=r.get(inst, "role", path, str),
                state=r.get(inst, "state", path, str, "active"),
                endpoint=r.get(inst, "endpoint", path, str, ""),
            )
        )
    links = []
    for i, lk in enumerate(r.get(root, "links", "", list)):
        path = f"links[{i}]"
        lk = r.mapping(lk, path)
        r.only(
            lk,
            path,
            # ``inflight_budget_bytes``: the name earlier releases wrote (policies routers cached).
            (*LINK_FIELDS, "inflight_budget_bytes"),
        )
        budget_field = (
            "inflight_budget_bytes" if "inflight_budget_bytes" in lk else "kv_budget_bytes"
        )
        links.append(
            Link(
                source=r.get(lk, "source", path, str),
                target=r.get(lk, "target", path, str),
                gbps=r.get(lk, "gbps", path, float),
                rtt_ms=r.get(lk, "rtt_ms", path, float, 0.0),
                kv_budget_bytes=r.get(lk, budget_field, path, int, None),
                target_utilisation=r.get(lk, "target_utilisation", path, float, None),
            )
        )
    try:
        topology = Topology(model, tuple(clusters), tuple(instances), tuple(links))
    except ValueError as exc:
        raise SnapshotFormatError(f"topology: {exc}") from None
    return PolicySnapshot(RoutingPolicy(version, thresholds, guards), topology)


def _placement_dict(p: Placement) -> dict[str, str]:
    return {"cluster": p.cluster, "instance": p.instance, "endpoint": p.endpoint}


def decision_to_dict(decision: RouteDecision) -> dict[str, Any]:
    """The JSON-able form of a decision (the route API's response body)."""
    ct = decision.cache_transfer
    rv = decision.reservation
    return {
        "request_id": decision.request_id,
        "route": decision.route,
        "prefill": _placement_dict(decision.prefill),
        "decode": _placement_dict(decision.decode),
        "incremental_tokens": decision.incremental_tokens,
        "cached_tokens": decision.cached_tokens,
        "threshold": _num(decision.threshold),
        "policy_version": decision.policy_version,
        "reason": decision.reason,
        "ttft_estimate_s": {
            "local": _num(decision.ttft_estimate_s.local),
            "prfaas": _num(decision.ttft_estimate_s.prfaas)
            if decision.ttft_estimate_s.prfaas is not None
            else None,
        },
        "cache_transfer": None
        if ct is None
        else {
            "source_cluster": ct.source_cluster,
            "source_instance": ct.source_instance,
            "target_cluster": ct.target_cluster,
            "target_instance": ct.target_instance,
            "tokens": ct.tokens,
            "bytes": ct.bytes,
        },
        "reservation": None
        if rv is None
        else {"source": rv.source, "target": rv.target, "bytes": rv.bytes, "id": rv.id},
        "kv_bytes": decision.kv_bytes,
        "stale": decision.stale,
        "link_refusal": None
        if (lr := decision.link_refusal) is None
        else {"source": lr.source, "target": lr.target, "cause": lr.cause},
    }


def decision_from_dict(data: Mapping[str, Any]) -> RouteDecision:
    """Read a decision dict (as :func:`decision_to_dict` writes it; unknown keys ignored so
    that a newer server can add fields). Raises ValueError on a malformed body."""
    try:
        ttft = data["ttft_estimate_s"]
        ct = data.get("cache_transfer")
        rv = data.get("reservation")
        lr = data.get("link_refusal")
        threshold = data.get("threshold")
        return RouteDecision(
            route=str(data["route"]),
            prefill=Placement(
                **{k: str(data["prefill"][k]) for k in ("cluster", "instance", "endpoint")}
            ),
            decode=Placement(
                **{k: str(data["decode"][k]) for k in ("cluster", "instance", "endpoint")}
            ),
            incremental_tokens=int(data["incremental_tokens"]),
            cached_tokens=int(data["cached_tokens"]),
            threshold=math.inf if threshold is None else float(threshold),
            policy_version=int(data["policy_version"]),
            reason=str(data["reason"]),
            ttft_estimate_s=TtftEstimate(
                math.inf if ttft.get("local") is None else float(ttft["local"]),
                None if ttft.get("prfaas") is None else float(ttft["prfaas"]),
            ),
            cache_transfer=None
            if ct is None
            else CacheTransfer(
                str(ct["source_cluster"]),
                None if ct.get("source_instance") is None else str(ct["source_instance"]),
                str(ct["target_cluster"]),
                str(ct["target_instance"]),
                int(ct["tokens"]),
                int(ct["bytes"]),
            ),
            reservation=None
            if rv is None
            else LinkReservation(
                str(rv["source"]),
                str(rv["target"]),
                int(rv["bytes"]),
                None if rv.get("id") is None else str(rv["id"]),
            ),
            kv_bytes=int(data.get("kv_bytes", 0)),
            request_id=data.get("request_id"),
            stale=bool(data.get("stale", False)),
            link_refusal=None
            if lr is None
            else LinkRefusal(str(lr["source"]), str(lr["target"]), str(lr["cause"])),
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"malformed decision: {exc!r}") from None


# --------------------------------------------------------------------------------------
# Live state as JSON (``GET /api/v1/route/live``, read by routers that decide in process)
# --------------------------------------------------------------------------------------


def live_state_to_dict(live: LiveState) -> dict[str, Any]:
    """The JSON-able form of a live snapshot: loads by instance, links as a list (JSON keys
    are strings), control state by PD cluster."""
    return {
        "now": live.now,
        "stale": live.stale,
        "telemetry_at": live.telemetry_at,
        "instances": {
            name: {
                "queue_depth": x.queue_depth,
                "queued_prefill_tokens": x.queued_prefill_tokens,
                "queued_prefill_s": x.queued_prefill_s,
                "running": x.running,
                "waiting": x.waiting,
                "kv_usage": x.kv_usage,
                "updated_at": x.updated_at,
                "state": x.state,
            }
            for name, x in live.instances.items()
        },
        "links": [
            {
                "source": source,
                "target": target,
                "egress_gbps": x.egress_gbps,
                "inflight_bytes": x.inflight_bytes,
                "updated_at": x.updated_at,
            }
            for (source, target), x in live.links.items()
        ],
        "control": {
            name: {
                "threshold_factor": c.threshold_factor,
                "congested_since": c.congested_since,
                "updated_at": c.updated_at,
                "scarce": c.scarce,
                "cause": c.cause,
            }
            for name, c in live.control.items()
        },
    }


def live_state_from_dict(data: Any, *, now: float | None = None) -> LiveState:
    """Read :func:`live_state_to_dict`'s form (``now``: the reader's clock, default the
    writer's). Raises SnapshotFormatError naming the key path of the first problem."""
    r = _Reader
    root = r.mapping(data, "live")
    opt_float = (float, None)
    instances: dict[str, InstanceLoad] = {}
    for name, x in r.mapping(r.get(root, "instances", "live", dict, {}), "instances").items():
        path = f"instances.{name}"
        x = r.mapping(x, path)
        instances[str(name)] = InstanceLoad(
            queue_depth=r.get(x, "queue_depth", path, int, 0),
            queued_prefill_tokens=r.get(x, "queued_prefill_tokens", path, int, 0),
            queued_prefill_s=r.get(x, "queued_prefill_s", path, *opt_float),
            running=r.get(x, "running", path, int, 0),
            waiting=r.get(x, "waiting", path, int, 0),
            kv_usage=r.get(x, "kv_usage", path, float, 0.0),
            updated_at=r.get(x, "updated_at", path, *opt_float),
            state=r.get(x, "state", path, str, None),
        )
    links: dict[tuple[str, str], LinkLoad] = {}
    for i, x in enumerate(r.get(root, "links", "live", list, [])):
        path = f"links[{i}]"
        x = r.mapping(x, path)
        key = (r.get(x, "source", path, str), r.get(x, "target", path, str))
        links[key] = LinkLoad(
            egress_gbps=r.get(x, "egress_gbps", path, float, 0.0),
            inflight_bytes=r.get(x, "inflight_bytes", path, int, 0),
            updated_at=r.get(x, "updated_at", path, *opt_float),
        )
    control: dict[str, ControlState] = {}
    for name, x in r.mapping(r.get(root, "control", "live", dict, {}), "control").items():
        path = f"control.{name}"
        x = r.mapping(x, path)
        control[str(name)] = ControlState(
            threshold_factor=r.get(x, "threshold_factor", path, float, 1.0),
            congested_since=r.get(x, "congested_since", path, *opt_float),
            updated_at=r.get(x, "updated_at", path, *opt_float),
            scarce=r.get(x, "scarce", path, bool, False),
            cause=r.get(x, "cause", path, str, None),
        )
    return LiveState(
        now=r.get(root, "now", "live", float) if now is None else now,
        instances=instances,
        links=links,
        control=control,
        stale=r.get(root, "stale", "live", bool, False),
        telemetry_at=r.get(root, "telemetry_at", "live", *opt_float),
    )
