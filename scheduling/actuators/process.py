"""The ``process`` actuator: a plan's role flips carried out on local engines.

For fleets without Kubernetes: a supervisor (``python -m fleet.supervisor``, one per host) runs
the engines of its host from a config file. On a plan's ``flip`` step (apply or rollback) this
actuator sends the step, signed as a webhook's (:mod:`scheduling.core.signing`), to
``{url}/v1/steps`` of the cluster's supervisor (the rebalance settings' ``webhook_url`` and
``webhook_secret``) and waits, up to ``PROCESS_ACTUATOR_DEADLINE_S``, while the supervisor
restarts the drained engine in its new role (vLLM's ``kv_role``), sees it healthy and restarts
its agent, which registers it in the new role. Other steps (drain, wait, activate, policy) are
the control plane's own. A refusal or a time-out fails the attempt; the plan's step machinery
retries it (the idempotency key is the same, and the supervisor acts once per key).

``PLAN_STALLED_S`` must exceed an engine's restart, or the stalled-plan sweep re-drives the
plan meanwhile (harmless: the supervisor joins the second call to the flip in progress).
"""

from __future__ import annotations

from django.conf import settings

from scheduling.actuators.base import StepNotice
from scheduling.actuators.webhook import WebhookActuator

STEPS_PATH = "/v1/steps"


class ProcessActuator(WebhookActuator):
    """Flip steps to a fleet supervisor; every other step stays in the control plane."""

    name = "process"

    def __init__(self, url: str, secret: str, *, deadline_s: float | None = None) -> None:
        deadline = float(settings.PROCESS_ACTUATOR_DEADLINE_S if deadline_s is None else deadline_s)
        # One attempt per step attempt: an engine restart is not retried within seconds.
        super().__init__(
            url.rstrip("/") + STEPS_PATH,
            secret,
            attempts=1,
            timeout_s=deadline,
            deadline_s=deadline,
        )

    def notify(self, notice: StepNotice) -> None:
        if notice.action == "flip":
            super().notify(notice)
