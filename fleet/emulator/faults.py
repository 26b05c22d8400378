"""The emulator's faults: their shapes, the Redis channel that carries them to a running
emulator (``manage.py emulate_fault`` pushes, the emulator pops every tick), the status line it
writes back, and a scenario's timed ``events`` turned into the same faults.

No Django: callers pass a redis-py client.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from scheduling.core.link import link_key
from scheduling.core.scenario import LinkEvent, RateEvent, StateEvent
from scheduling.core.simulator.fleet import ACTIVE, DOWN

log = logging.getLogger(__name__)

# Redis key of the fault channel: a list of JSON faults, pushed on the right, popped on the left.
FAULTS_KEY = "emulator:faults"
# Redis key of the emulator's status line (a JSON string, refreshed every few seconds).
STATUS_KEY = "emulator:status"
# A status older than this says no emulator is running (one writes it every ``status_s``).
STATUS_FRESH_S = 30.0
# The per-cluster service counters of every telemetry report, newest first (15 min at 1 s).
SERVICE_KEY = "emulator:service"
SERVICE_KEPT = 900
FAULT_KINDS = ("link", "instance", "surge", "prompts")


class FaultError(ValueError):
    """A fault that is not one of the known shapes (message says why)."""


def fault_validate(fault: Mapping[str, Any]) -> dict[str, Any]:
    """A fault as the channel carries it, checked; raises :class:`FaultError` naming the key.

    Shapes: ``{"kind": "link", "link": "source->target", "gbps": >= 0}``;
    ``{"kind": "instance", "instance": name, "state": "down" | "active"}``;
    ``{"kind": "surge", "rate_scale": > 0, "cluster": optional pd cluster}``;
    ``{"kind": "prompts", "scale": > 0}`` (prompt lengths multiplied by ``scale``).
    """
    kind = fault.get("kind")
    if kind not in FAULT_KINDS:
        raise FaultError(f"kind: must be one of {', '.join(FAULT_KINDS)}, not {kind!r}")

    def number(key: str, *, positive: bool) -> float:
        value = fault.get(key)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise FaultError(f"{key}: a number is required")
        if value < 0 or (positive and value == 0):
            raise FaultError(f"{key}: must be {'positive' if positive else 'at least 0'}")
        return float(value)

    def name(key: str, *, optional: bool = False) -> str | None:
        value = fault.get(key)
        if value is None and optional:
            return None
        if not isinstance(value, str) or not value:
            raise FaultError(f"{key}: a name is required")
        return value

    if kind == "link":
        link = name("link")
        assert link is not None
        if "->" not in link:
            raise FaultError("link: write it as source->target")
        return {"kind": kind, "link": link, "gbps": number("gbps", positive=False)}
    if kind == "instance":
        state = fault.get("state")
        if state not in (DOWN, ACTIVE):
            raise FaultError("state: must be down or active")
        return {"kind": kind, "instance": name("instance"), "state": state}
    if kind == "surge":
        out: dict[str, Any] = {"kind": kind, "rate_scale": number("rate_scale", positive=True)}
        cluster = name("cluster", optional=True)
        if cluster is not None:
            out["cluster"] = cluster
        return out
    return {"kind": kind, "scale": number("scale", positive=True)}


def emulator_fault_push(client: Any, fault: Mapping[str, Any]) -> dict[str, Any]:
    """Queue a fault for the running emulator (``client``: a redis-py client)."""
    checked = fault_validate(fault)
    client.rpush(FAULTS_KEY, json.dumps(checked))
    return checked


def emulator_faults_pop(client: Any, limit: int = 100) -> list[dict[str, Any]]:
    """Take the queued faults; a malformed one is logged and dropped."""
    out: list[dict[str, Any]] = []
    for _ in range(limit):
        raw = client.lpop(FAULTS_KEY)
        if raw is None:
            break
        try:
            out.append(fault_validate(json.loads(raw)))
        except (ValueError, TypeError) as exc:
            log.warning("emulator: ignored fault %r: %s", raw, exc)
    return out


def emulator_status_read(client: Any) -> dict[str, Any] | None:
    """The running emulator's last status (None when none was written)."""
    raw = client.get(STATUS_KEY)
    return json.loads(raw) if raw else None


def scenario_faults(
    events: Sequence[LinkEvent | StateEvent | RateEvent], members: Mapping[str, Sequence[str]]
) -> list[tuple[float, dict[str, Any]]]:
    """A scenario's timed ``events`` as faults, by time (``members``: instances per cluster,
    for an event that takes a whole cluster down or up)."""
    out: list[tuple[float, dict[str, Any]]] = []
    for event in events:
        if isinstance(event, LinkEvent):
            link = link_key(event.source, event.target)
            out.append((event.at_s, {"kind": "link", "link": link, "gbps": event.gbps}))
        elif isinstance(event, StateEvent):
            names = (
                [event.instance]
                if event.instance is not None
                else list(members.get(event.cluster or "", ()))
            )
            for name in names:
                out.append(
                    (event.at_s, {"kind": "instance", "instance": name, "state": event.state})
                )
        else:
            out.append(
                (
                    event.at_s,
                    {"kind": "surge", "rate_scale": event.rate_scale, "cluster": event.cluster},
                )
            )
    return sorted(out, key=lambda e: e[0])
