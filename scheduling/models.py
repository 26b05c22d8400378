"""Django side of scheduling: the versioned routing policy routers obey."""

from __future__ import annotations

from django.db import models
from django.db.models import Q


class Policy(models.Model):
    """One version of the routing parameters every router obeys.

    ``thresholds`` maps each PD cluster (by name) to its threshold ``t`` in tokens: a request
    whose incremental length is above ``t`` is offloaded to a PrfaaS cluster. A PD cluster
    missing from the map never offloads. ``guards`` overrides the short-term control
    parameters of :class:`scheduling.core.routing.RouteGuards` (congestion, backlog, staleness, cache
    transfers). Versions only grow; the current policy is the highest version. Rows are never
    edited: a change is a new version, so any decision can be traced to the policy it used.
    """

    version = models.PositiveIntegerField(unique=True)
    thresholds = models.JSONField(default=dict, help_text="{pd cluster name: tokens}")
    guards = models.JSONField(default=dict, blank=True, help_text="overrides of router guards")
    created_by = models.CharField(max_length=200, help_text="actor: user, token or cli")
    created_at = models.DateTimeField(auto_now_add=True)
    note = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["-version"]
        verbose_name_plural = "policies"
        constraints = [
            models.CheckConstraint(condition=Q(version__gte=1), name="policy_version_positive"),
        ]

    def __str__(self) -> str:
        return f"policy v{self.version}"


# ---------------------------------------------------------------------------------------------
# Long-term rebalancer: per-cluster settings, ticks (exactly once per period), plans and steps.


class RebalanceMode(models.TextChoices):
    AUTO = "auto", "auto: apply plans that pass the guards"
    MANUAL = "manual", "manual: wait for an operator to approve"


class ActuatorKind(models.TextChoices):
    RECORD = "record", "record: change only the control plane's state"
    WEBHOOK = "webhook", "webhook: also POST each step to the operator's automation"
    KUBERNETES = "kubernetes", "kubernetes: scale each role's object through /scale"
    METRICS = "metrics", "metrics: publish desired replicas on /metrics for HPA or KEDA"
    PROCESS = "process", "process: restart local engines in their new role (fleet.supervisor)"


class RebalanceSettings(models.Model):
    """How the long-term rebalancer treats one PD cluster: whether it applies plans by itself
    or waits for an operator, overrides of the rebalancer's guards (defaults documented in
    ``scheduling.core.rebalancer``), how long a drain may take, and the actuator that carries role
    changes out to the fleet."""

    cluster = models.OneToOneField(
        "clusters.Cluster", on_delete=models.CASCADE, related_name="rebalance_settings"
    )
    enabled = models.BooleanField(default=True)
    mode = models.CharField(
        max_length=10, choices=RebalanceMode.choices, default=RebalanceMode.MANUAL
    )
    guards = models.JSONField(default=dict, blank=True, help_text="overrides of rebalancer Guards")
    drain_timeout_s = models.PositiveIntegerField(default=600)
    drain_poll_s = models.PositiveIntegerField(default=5)
    default_output_tokens = models.PositiveIntegerField(
        default=1024, help_text="mean output length used when routers do not report it"
    )
    actuator = models.CharField(
        max_length=10, choices=ActuatorKind.choices, default=ActuatorKind.RECORD
    )
    webhook_url = models.URLField(max_length=500, blank=True, default="")
    webhook_secret = models.CharField(max_length=200, blank=True, default="")
    # kubernetes: how long a scaled role may take to get its pods removed or ready.
    ready_timeout_s = models.PositiveIntegerField(default=900)
    version = models.PositiveIntegerField(default=1, editable=False)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(mode__in=RebalanceMode.values), name="rebalancesettings_mode_valid"
            ),
            models.CheckConstraint(
                condition=~Q(actuator=ActuatorKind.WEBHOOK) | ~Q(webhook_url=""),
                name="rebalancesettings_webhook_has_url",
            ),
            models.CheckConstraint(
                condition=Q(actuator__in=ActuatorKind.values),
                name="rebalancesettings_actuator_valid",
            ),
            models.CheckConstraint(
                condition=Q(ready_timeout_s__gte=1) & Q(ready_timeout_s__lte=86400),
                name="rebalancesettings_ready_timeout_bounded",
            ),
        ]

    def __str__(self) -> str:
        return f"rebalance settings of cluster {self.cluster_id}"


class RebalanceTick(models.Model):
    """One run of the rebalancer for one PD cluster and period: exactly one row per
    ``(cluster, period_start)`` however many beats or retries fire, with what was decided
    (hold and its reason, or a plan), the inputs it saw and the predictions it made."""

    cluster = models.ForeignKey(
        "clusters.Cluster", on_delete=models.CASCADE, related_name="rebalance_ticks"
    )
    period_start = models.DateTimeField()
    decided_at = models.DateTimeField(auto_now_add=True)
    action = models.CharField(max_length=10)  # hold or propose
    reason = models.CharField(max_length=40)
    detail = models.TextField(blank=True, default="")
    gain = models.FloatField(null=True, blank=True)
    split_direction = models.SmallIntegerField(default=0)
    threshold_direction = models.SmallIntegerField(default=0)
    pending_count = models.PositiveSmallIntegerField(default=0)
    inputs = models.JSONField(default=dict)
    predictions = models.JSONField(default=dict)

    class Meta:
        ordering = ["-period_start", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["cluster", "period_start"], name="rebalancetick_unique_cluster_period"
            ),
        ]

    def __str__(self) -> str:
        return f"tick {self.cluster_id}@{self.period_start:%Y-%m-%d %H:%M}: {self.reason}"


class PlanStatus(models.TextChoices):
    PROPOSED = "proposed"
    APPROVED = "approved"
    APPLYING = "applying"
    APPLIED = "applied"
    REJECTED = "rejected"
    SUPERSEDED = "superseded"
    FAILED = "failed"
    ROLLING_BACK = "rolling_back"
    ROLLED_BACK = "rolled_back"


class Plan(models.Model):
    """A change the rebalancer proposes for one PD cluster: a new threshold and prefill/decode
    split, the instances to flip, the predicted throughput, TTFT and egress of the current and
    proposed settings, what simulating both on the recent traffic showed, and its lifecycle ``proposed -> approved -> applying -> applied`` (or
    ``rejected``, ``superseded``, ``failed``, ``rolling_back -> rolled_back``)."""

    tick = models.OneToOneField(RebalanceTick, on_delete=models.PROTECT, related_name="plan")
    cluster = models.ForeignKey("clusters.Cluster", on_delete=models.PROTECT, related_name="plans")
    status = models.CharField(
        max_length=20, choices=PlanStatus.choices, default=PlanStatus.PROPOSED
    )
    version = models.PositiveIntegerField(default=1, editable=False)
    mode = models.CharField(max_length=10, choices=RebalanceMode.choices)
    threshold_before = models.FloatField()
    threshold_after = models.FloatField()
    n_p_before = models.PositiveIntegerField()
    n_d_before = models.PositiveIntegerField()
    n_p_after = models.PositiveIntegerField()
    n_d_after = models.PositiveIntegerField()
    gain = models.FloatField()
    role_changes = models.JSONField(default=list, help_text="[{instance, from_role, to_role}]")
    predictions = models.JSONField(default=dict, help_text="current, proposed, target")
    simulated = models.JSONField(
        default=dict,
        blank=True,
        help_text="current and proposed simulated on the recent traffic before proposing "
        "(scheduling.core.simulator.verify): at the observed rate and under stress",
    )
    inputs = models.JSONField(default=dict, help_text="window, fleet, policy version, guards")
    policy_version_before = models.PositiveIntegerField(null=True, blank=True)
    policy_version_after = models.PositiveIntegerField(null=True, blank=True)
    policy_version_restored = models.PositiveIntegerField(null=True, blank=True)
    approved_by = models.CharField(max_length=200, blank=True, default="")
    decided_by = models.CharField(max_length=200, blank=True, default="")
    error = models.TextField(blank=True, default="")
    closed_reason = models.TextField(
        blank=True, default="", help_text="why it was rejected (the operator's words) or superseded"
    )
    proposed_at = models.DateTimeField(auto_now_add=True)
    approved_at = models.DateTimeField(null=True, blank=True)
    applying_at = models.DateTimeField(null=True, blank=True)
    applied_at = models.DateTimeField(null=True, blank=True)
    closed_at = models.DateTimeField(null=True, blank=True, help_text="rejected/superseded/failed")
    rollback_at = models.DateTimeField(null=True, blank=True)
    rolled_back_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-proposed_at", "-id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(status__in=PlanStatus.values), name="plan_status_valid"
            ),
            models.CheckConstraint(condition=Q(version__gte=1), name="plan_version_positive"),
            # At most one plan per cluster may be changing the fleet at a time.
            models.UniqueConstraint(
                fields=["cluster"],
                condition=Q(status__in=["approved", "applying", "rolling_back"]),
                name="plan_one_in_flight_per_cluster",
            ),
            # ... and at most one waits for an operator: a newer proposal supersedes it.
            models.UniqueConstraint(
                fields=["cluster"],
                condition=Q(status="proposed"),
                name="plan_one_proposed_per_cluster",
            ),
        ]

    def __str__(self) -> str:
        return f"plan {self.pk} ({self.status})"


class PlanStep(models.Model):
    """One idempotent step of applying or rolling back a plan (drain an instance, wait until
    it is empty, flip its role, activate it, publish the policy): done exactly once whatever
    the retries, with its start and end times."""

    class Phase(models.TextChoices):
        APPLY = "apply"
        ROLLBACK = "rollback"

    class Action(models.TextChoices):
        DRAIN = "drain"
        WAIT = "wait"
        FLIP = "flip"
        ACTIVATE = "activate"
        POLICY = "policy"

    class Status(models.TextChoices):
        PENDING = "pending"
        DONE = "done"
        FAILED = "failed"

    plan = models.ForeignKey(Plan, on_delete=models.CASCADE, related_name="steps")
    phase = models.CharField(max_length=10, choices=Phase.choices)
    index = models.PositiveIntegerField()
    action = models.CharField(max_length=10, choices=Action.choices)
    instance = models.ForeignKey(
        "clusters.Instance", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    to_role = models.CharField(max_length=10, blank=True, default="")
    threshold = models.FloatField(null=True, blank=True)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    detail = models.TextField(blank=True, default="")
    # What the actuator must remember between polls and across a worker crash (the replica
    # counts it decided before it patched, the pods it removed and added): written before it
    # acts, so that a retried step finishes the same change instead of making another.
    actuation = models.JSONField(default=dict, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["plan_id", "phase", "index"]
        constraints = [
            models.UniqueConstraint(
                fields=["plan", "phase", "index"], name="planstep_unique_plan_phase_index"
            ),
        ]

    def __str__(self) -> str:
        return f"plan {self.plan_id} {self.phase} step {self.index}: {self.action}"


class DesiredReplicas(models.Model):
    """A role's replica count as the ``metrics`` actuator publishes it on ``/metrics`` for an
    HPA or KEDA to act on, with the plan whose step set it."""

    cluster = models.ForeignKey("clusters.Cluster", on_delete=models.CASCADE, related_name="+")
    role = models.CharField(max_length=10)
    replicas = models.PositiveIntegerField()
    plan = models.ForeignKey(Plan, null=True, on_delete=models.SET_NULL, related_name="+")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["cluster_id", "role"]
        verbose_name_plural = "desired replicas"
        constraints = [
            models.UniqueConstraint(fields=["cluster", "role"], name="desiredreplicas_unique"),
            models.CheckConstraint(
                condition=Q(role__in=["prefill", "decode"]), name="desiredreplicas_role_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.cluster_id} {self.role}: {self.replicas}"


class AlertEpisode(models.Model):
    """One alert from the tick that raised it to the tick that saw it clear: the alert
    history. At most one open episode (``cleared_at`` empty) per ``(code, subject)``; the
    message is the one it was raised with (the live banner shows the latest wording)."""

    code = models.CharField(max_length=40)
    subject = models.CharField(max_length=200)
    message = models.TextField()
    raised_at = models.DateTimeField()
    cleared_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-raised_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["code", "subject"],
                condition=Q(cleared_at__isnull=True),
                name="alertepisode_one_open_per_subject",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.code} {self.subject} at {self.raised_at:%Y-%m-%d %H:%M:%S}"


class DecisionRecord(models.Model):
    """One routing decision with its inputs, as the recent-decisions list held it, kept for
    ``DECISION_LOG_RETENTION_S`` (and at most ``DECISION_LOG_MAX_ROWS`` rows) so that an
    operator can still ask "why was this request offloaded?" hours later. ``digest`` (of the
    entry's JSON) makes archiving the same entry twice a no-op."""

    ts = models.FloatField(help_text="unix seconds of the decision")
    request_id = models.CharField(max_length=200, blank=True, default="")
    origin = models.CharField(max_length=100)
    route = models.CharField(max_length=10)
    reason = models.CharField(max_length=40)
    digest = models.CharField(max_length=32, unique=True)
    entry = models.JSONField()

    class Meta:
        ordering = ["-ts", "-id"]
        indexes = [
            models.Index(fields=["-ts"], name="decisionrecord_ts"),
            models.Index(fields=["request_id"], name="decisionrecord_request"),
            models.Index(fields=["reason", "-ts"], name="decisionrecord_reason_ts"),
        ]

    def __str__(self) -> str:
        return f"{self.request_id or '?'}: {self.route} ({self.reason})"
