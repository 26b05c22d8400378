"""How the emulator runs (:class:`EmulatorConfig`), what it counts (:class:`EmulatorStats`) and
the error it refuses to start with; waiting for the control plane to answer."""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx


class EmulatorError(ValueError):
    """The emulator cannot start as asked (message says why)."""


@dataclass
class EmulatorConfig:
    """How to emulate: the control plane, tokens, pace and reporting periods (wall seconds)."""

    base_url: str
    router_token: str
    agent_token: str
    admin_token: str = ""
    speed: float = 4.0
    telemetry_s: float = 1.0
    policy_s: float = 2.0
    batch_window_s: float = 0.2
    status_s: float = 10.0
    duration_s: float | None = None  # wall seconds; None: until stopped
    requests: int | None = None
    loop: bool = True
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.speed > 0 or not math.isfinite(self.speed):
            raise EmulatorError("speed must be a positive number")
        for name in ("telemetry_s", "policy_s", "batch_window_s", "status_s"):
            if not getattr(self, name) > 0:
                raise EmulatorError(f"{name} must be positive")
        if not self.router_token or not self.agent_token:
            raise EmulatorError("a router token and an agent token are needed")


@dataclass
class EmulatorStats:
    """Counters for the status line."""

    routed: int = 0
    remote: int = 0
    local: int = 0
    offloaded: int = 0
    replaced: int = 0
    unroutable: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    telemetry_posts: int = 0
    kv_posts: int = 0
    post_errors: int = 0
    faults: int = 0
    flips: int = 0


def control_plane_wait(base_url: str, wait_s: float) -> None:
    """Wait until the control plane answers ``/api/v1/health`` (it may still be starting: the
    demo starts both at once); :class:`EmulatorError` after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    url = base_url.rstrip("/") + "/api/v1/health"
    while True:
        try:
            if httpx.get(url, timeout=2.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() >= deadline:
            raise EmulatorError(f"the control plane at {base_url} did not answer")
        time.sleep(0.5)
