"""Instances that leave by themselves: no heartbeat, then unreachable, then retired.

A heartbeat is a telemetry sample or a registration (:mod:`clusters.live.heartbeats`). Every
``INSTANCE_SWEEP_S`` the sweep compares each instance's latest heartbeat with now:

* active or draining, silent for longer than ``INSTANCE_UNREACHABLE_AFTER_S``: marked
  ``unreachable``. The write bumps the routers' snapshot version, so routing stops using the
  instance at once (only active instances are routed to);
* unreachable and heartbeating again (its agent kept posting telemetry): back to the state it
  had before it was marked (a registration does the same, :mod:`clusters.registration`);
* registered (not declared), unreachable or down, and silent for longer than
  ``INSTANCE_RETIRE_AFTER_S``: retired, i.e. deleted from the inventory (its last row stays in
  the change log). Declared instances (topology as code, the API) are never retired, only
  marked; neither is an instance a plan still names (the plan's history and rollback need it).

An instance never heard of (declared, no agent yet) is left alone: there is nothing to miss.
Every change is in the change log with its cause (actor ``reachability``, source ``system``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from django.conf import settings

from clusters import services
from clusters.live.heartbeats import heartbeats_forget, heartbeats_read
from clusters.models import Instance, InstanceOrigin, InstanceState
from controlplane.audit import Actor
from controlplane.errors import Conflict, NotFound
from controlplane.models import ChangeRecord

log = logging.getLogger(__name__)

SWEEP_ACTOR = Actor(label="reachability", source="system")
UNREACHABLE_ACTION = "unreachable"
RETURN_ACTION = "reachable"
RETIRE_ACTION = "retire"
_COMES_BACK_AS = (InstanceState.ACTIVE, InstanceState.DRAINING, InstanceState.DOWN)


@dataclass
class SweepResult:
    """Names, per outcome, of one sweep."""

    marked: list[str] = field(default_factory=list)
    returned: list[str] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


def state_before_unreachable(instance: Instance) -> str:
    """The state an unreachable instance had when it was marked (active if unknown)."""
    before = (
        ChangeRecord.objects.filter(
            object_type="clusters.instance",
            object_id=str(instance.pk),
            action=UNREACHABLE_ACTION,
        )
        .order_by("-at", "-id")
        .values_list("before", flat=True)
        .first()
    )
    state = (before or {}).get("state")
    return state if state in _COMES_BACK_AS else InstanceState.ACTIVE


def _state_set(inst: Instance, state: str, action: str, cause: str) -> bool:
    try:
        services.instance_update(
            instance_id=inst.pk,
            version=inst.version,
            changes={"state": state},
            actor=SWEEP_ACTOR,
            action=action,
            cause=cause,
        )
    except (Conflict, NotFound):
        return False  # changed or deleted meanwhile: the next sweep looks again
    return True


def _retire(inst: Instance, cause: str) -> bool:
    try:
        services.instance_delete(
            instance_id=inst.pk,
            version=inst.version,
            actor=SWEEP_ACTOR,
            action=RETIRE_ACTION,
            cause=cause,
        )
    except Conflict as exc:
        if exc.code == "in_use":
            log.info("instance %s not retired: %s", inst.name, exc.detail)
        return False
    except NotFound:
        return False
    heartbeats_forget(inst.name)
    return True


def instances_reachability_sweep(*, now: float | None = None) -> SweepResult:
    """Mark, bring back and retire instances by their heartbeats (see the module docstring)."""
    now = time.time() if now is None else now
    grace = float(settings.INSTANCE_UNREACHABLE_AFTER_S)
    retire_after = float(settings.INSTANCE_RETIRE_AFTER_S)
    instances = list(Instance.objects.order_by("name"))
    seen = heartbeats_read([i.name for i in instances])
    result = SweepResult()
    for inst in instances:
        last = seen.get(inst.name)
        if last is None:
            continue
        silent = now - last
        if inst.state in (InstanceState.ACTIVE, InstanceState.DRAINING) and silent > grace:
            cause = f"no heartbeat for {silent:.0f} s (grace {grace:g} s)"
            if _state_set(inst, InstanceState.UNREACHABLE, UNREACHABLE_ACTION, cause):
                result.marked.append(inst.name)
        elif inst.state == InstanceState.UNREACHABLE and silent <= grace:
            back = state_before_unreachable(inst)
            cause = f"heartbeat again {silent:.0f} s ago: {back}"
            if _state_set(inst, back, RETURN_ACTION, cause):
                result.returned.append(inst.name)
        elif (
            inst.origin == InstanceOrigin.REGISTERED
            and inst.state in (InstanceState.UNREACHABLE, InstanceState.DOWN)
            and silent > retire_after
        ):
            cause = f"no heartbeat for {silent:.0f} s (retired after {retire_after:g} s)"
            if _retire(inst, cause):
                result.retired.append(inst.name)
            else:
                result.kept.append(inst.name)
    return result
