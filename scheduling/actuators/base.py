"""What every actuator shares: the step notice it is told, the report it answers with, its
error, and the ``record`` actuator (nothing beyond the control plane's own state)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


class ActuatorError(Exception):
    """The actuator could not carry a step out.

    ``retry`` False: trying again cannot help (a permission the control plane lacks, a role
    that never got ready within its deadline, a controller that removed another pod): the
    step fails at once, naming why, instead of being retried.
    """

    def __init__(self, message: str, *, retry: bool = True) -> None:
        super().__init__(message)
        self.retry = retry


@dataclass(frozen=True)
class StepNotice:
    """One step of a plan being applied or rolled back, as an actuator is told about it.

    ``memo`` is what the actuator reported for this step before (empty the first time), kept
    in the database across polls and worker crashes; ``started_at`` (epoch seconds) is when the
    step was first claimed."""

    plan_id: int
    step: int
    action: str  # drain, flip, activate, policy
    cluster: str
    instance: str = ""
    from_role: str = ""
    to_role: str = ""
    threshold: float | None = None
    policy_version: int | None = None
    rollback: bool = False
    memo: Mapping[str, Any] = field(default_factory=dict)
    started_at: float | None = None

    @property
    def idempotency_key(self) -> str:
        kind = "rollback" if self.rollback else "apply"
        return f"plan-{self.plan_id}-{kind}-step-{self.step}"

    def payload(self) -> dict[str, Any]:
        return {
            "plan_id": self.plan_id,
            "step": self.step,
            "action": self.action,
            "cluster": self.cluster,
            "instance": self.instance or None,
            "from_role": self.from_role or None,
            "to_role": self.to_role or None,
            "threshold": self.threshold,
            "policy_version": self.policy_version,
            "rollback": self.rollback,
            "idempotency_key": self.idempotency_key,
        }


@dataclass(frozen=True)
class StepReport:
    """An actuator's answer: ``done``, or not yet (ask again in ``wait_s`` seconds). ``memo``
    is stored with the step before anything else happens and comes back in the next notice:
    an actuator records there what it decided before it acts on it. ``detail`` is shown with
    the step."""

    done: bool = True
    detail: str = ""
    memo: Mapping[str, Any] = field(default_factory=dict)
    wait_s: float = 0.0


class Actuator(Protocol):
    name: str
    #: True when a role change replaces the instance (its pod goes, another pod comes) rather
    #: than turning the same engine into the other role.
    replaces_instances: bool

    def notify(self, notice: StepNotice) -> StepReport | None:
        """Carry the step out on the fleet (None or a done report), say how far it got (a
        report not done), or raise :class:`ActuatorError`."""
        ...


class RecordActuator:
    """Only the control plane's own state changes; nothing leaves the process."""

    name = "record"
    replaces_instances = False

    def notify(self, notice: StepNotice) -> StepReport | None:
        return None
