"""The fleet emulator: a simulated PrfaaS fleet that drives the control plane over HTTP.

It plays the part of everything outside the control plane, through the same doors a real
deployment uses, one module per part:

* :mod:`~fleet.emulator.routes`, **the router**: every request of the scenario's workload (or
  trace) is decided by ``POST /api/v1/route`` (``/route/batch`` when several arrive together)
  through :class:`fleet.client.RouterClient`, fallback included;
* :mod:`~fleet.emulator.engines`, **the engines**: the decisions are carried out by the
  simulator's fleet model on a clock ``speed`` times faster than the wall clock;
* :mod:`~fleet.emulator.journal`, **the engines' KV events**: each emulated engine publishes
  its prefix cache's stores and evictions as vLLM 0.32 does and keeps a replay buffer like
  vLLM's;
* :mod:`~fleet.emulator.reporting`, **the agents**: the frames and the telemetry go through the
  fleet agent's own code (:class:`fleet.agent.kv.KvStream`, :class:`fleet.agent.uplink.Uplink`);
* :mod:`~fleet.emulator.workload`, **the traffic**: the workload per origin, endless and
  adjustable;
* :mod:`~fleet.emulator.faults` and :mod:`~fleet.emulator.inventory`, **the faults**: from the
  scenario's timed ``events`` and from a Redis list (``manage.py emulate_fault``): a link's
  capacity, an instance going down or coming back, a traffic surge, longer or shorter prompts;
  with an ``admin`` token a link or instance fault is also recorded in the inventory;
* :mod:`~fleet.emulator.runner`, **the loop** that obeys the control plane (the fleet is built
  from ``GET /api/v1/policy``, re-read with its ETag; a role change drains the instance and
  flips it; an instance marked ``down`` stops).

No Django here: the command (``manage.py emulate``) passes URLs, tokens and a Redis client.
"""

from fleet.emulator.config import EmulatorConfig, EmulatorError, EmulatorStats
from fleet.emulator.faults import (
    FAULT_KINDS,
    FAULTS_KEY,
    SERVICE_KEY,
    STATUS_FRESH_S,
    STATUS_KEY,
    FaultError,
    emulator_fault_push,
    emulator_faults_pop,
    emulator_status_read,
    fault_validate,
    scenario_faults,
)
from fleet.emulator.journal import EmulatedEngineEvents, ReportingPrefixCache, kv_batch_events
from fleet.emulator.runner import FleetEmulator
from fleet.emulator.workload import RequestStream

__all__ = [
    "FAULTS_KEY",
    "FAULT_KINDS",
    "SERVICE_KEY",
    "STATUS_FRESH_S",
    "STATUS_KEY",
    "EmulatedEngineEvents",
    "EmulatorConfig",
    "EmulatorError",
    "EmulatorStats",
    "FaultError",
    "FleetEmulator",
    "ReportingPrefixCache",
    "RequestStream",
    "emulator_fault_push",
    "emulator_faults_pop",
    "emulator_status_read",
    "fault_validate",
    "kv_batch_events",
    "scenario_faults",
]
