"""The emulator's loop: :class:`FleetEmulator` builds the fleet from the control plane's policy,
paces the simulated clock on the wall clock, and is the simulation's dispatcher
(``assign``/``tick``/``fleet_changed``): it routes through the control plane
(:mod:`fleet.emulator.routes`), reports as the agents (:mod:`fleet.emulator.reporting`),
follows the policy (a role change drains the instance and flips it; one marked ``down``
stops) and applies faults (:mod:`fleet.emulator.faults`)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from fleet.agent.metrics import AgentMetrics
from fleet.agent.register import Registrar
from fleet.agent.uplink import Uplink
from fleet.client import RouterApiError, RouterClient, RouterUnavailableError
from fleet.emulator.config import EmulatorConfig, EmulatorError, EmulatorStats
from fleet.emulator.engines import engines_to_register, fleet_build, sim_role, sim_state
from fleet.emulator.faults import STATUS_KEY, emulator_faults_pop, scenario_faults
from fleet.emulator.inventory import InventoryRecorder
from fleet.emulator.reporting import Reporter
from fleet.emulator.routes import EmulatorRouter
from fleet.emulator.workload import RequestStream
from scheduling.core.scenario import Scenario
from scheduling.core.simulator.engine import Assignment, FleetEvent, Simulation
from scheduling.core.simulator.fleet import DOWN, SimRequest
from scheduling.core.simulator.workload import Workload

log = logging.getLogger(__name__)

# Wall seconds the emulator may fall behind its clock before it stops trying to catch up.
MAX_LAG_S = 5.0


class _Stop(Exception):
    """Internal: unwinds the simulation when the emulator is asked to stop."""


class FleetEmulator:
    """Emulates the fleet of ``scenario`` against the control plane at ``config.base_url``.

    Also the simulation's dispatcher (``assign``/``tick``/``fleet_changed``): it asks the
    control plane where each request goes and paces the simulated clock on the wall clock.
    """

    def __init__(
        self,
        scenario: Scenario,
        workload: Workload,
        config: EmulatorConfig,
        *,
        faults: Any = None,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        out: Callable[[str], None] | None = None,
    ) -> None:
        self.scenario = scenario
        self.config = config
        self.faults = faults  # redis-py client of the fault channel (None: scenario events only)
        self._clock = clock
        self._sleep = sleep
        self._out = out or (lambda line: log.info("%s", line))
        self.stats = EmulatorStats()
        self.stopping = False
        # Simulated seconds between ticks: ``batch_window_s`` of wall time.
        self.tick_s: float | None = config.batch_window_s * config.speed
        self.client = RouterClient(
            config.base_url,
            config.router_token,
            timeout_s=config.timeout_s,
            retries=1,
            cooldown_s=2.0,
            transport=transport,
        )
        self.http = httpx.Client(
            base_url=config.base_url.rstrip("/"),
            timeout=httpx.Timeout(config.timeout_s),
            transport=transport,
        )
        self.inventory = InventoryRecorder(self.http, config.admin_token)
        # The agent's uplink and streams: the same code a real engine's agent runs.
        self.agent_metrics = AgentMetrics()
        self.uplink = Uplink(
            config.base_url,
            config.agent_token,
            self.agent_metrics,
            client=httpx.Client(
                base_url=config.base_url.rstrip("/"),
                headers={"Authorization": f"Bearer {config.agent_token}"},
                timeout=httpx.Timeout(config.timeout_s),
                transport=transport,
            ),
        )
        try:
            self.client.refresh_policy()
        except (RouterUnavailableError, RouterApiError, httpx.HTTPError) as exc:
            raise EmulatorError(f"cannot read the policy from {config.base_url}: {exc}") from exc
        snapshot = self.client.policy_snapshot
        assert snapshot is not None
        # The engines join: each one's agent registers it, as a real agent does at start.
        self.registrar = Registrar(
            config.base_url,
            config.agent_token,
            engines_to_register(scenario, snapshot.topology),
            every_s=None,
            client=httpx.Client(
                base_url=config.base_url.rstrip("/"),
                headers={"Authorization": f"Bearer {config.agent_token}"},
                timeout=httpx.Timeout(config.timeout_s),
                transport=transport,
            ),
            registry=self.agent_metrics.registry,
        )
        self.topology = self._join()
        self.block_tokens = self.topology.model.block_tokens
        pd = sorted(c.name for c in self.topology.clusters if c.kind == "pd")
        if not pd:
            raise EmulatorError("the control plane's inventory has no pd cluster to emulate")
        self.pd_clusters = pd
        self.stream = RequestStream(
            workload,
            lambda origin: origin if origin in pd else pd[0],
            self.block_tokens,
            loop=config.loop,
            limit=config.requests,
        )
        self.sim = fleet_build(self.topology, scenario, workload, self.stream, self)
        self.router = EmulatorRouter(self.client, self.stream, config, self.stats)
        self.reporter = Reporter(
            self.uplink,
            self.agent_metrics,
            speed=config.speed,
            block_tokens=self.block_tokens,
            faults=faults,
            clock=clock,
        )
        self._inventory_roles = {i.name: i.role for i in self.topology.instances}
        self._down_by_inventory: set[str] = set()
        members: dict[str, list[str]] = {}
        for p in self.sim.prefill_instances:
            members.setdefault(p.cluster, []).append(p.name)
        self._events = scenario_faults(scenario.events, members)
        self._wall0 = 0.0
        self._started = 0.0
        self._sim0 = 0.0
        self._next_telemetry = 0.0
        self._next_policy = 0.0
        self._next_status = 0.0

    def _join(self) -> Any:
        """Register every engine, then read the fleet back from the control plane."""
        joined = [name for name in sorted(self.registrar.engines) if self.registrar.register(name)]
        refused = {e.last_error for e in self.registrar.engines.values() if not e.registered}
        if joined:
            self._out(f"emulator: {len(joined)} engines registered through their agents")
        if refused:
            self._out(f"emulator: registrations refused: {'; '.join(sorted(refused))}")
        try:
            self.client.refresh_policy()
        except (RouterUnavailableError, RouterApiError, httpx.HTTPError) as exc:
            raise EmulatorError(
                f"cannot read the policy from {self.config.base_url}: {exc}"
            ) from exc
        snapshot = self.client.policy_snapshot
        assert snapshot is not None
        if not snapshot.topology.instances:
            raise EmulatorError(
                "the control plane's inventory has no instance to emulate and none registered"
            )
        return snapshot.topology

    # -- running ----------------------------------------------------------------------------

    def run(self) -> EmulatorStats:
        """Emulate until stopped (:meth:`stop`), ``duration_s`` passed or the workload ended."""
        self._wall0 = self._started = self._clock()
        self._sim0 = self.sim.now
        self._next_telemetry = self._wall0
        self._next_policy = self._wall0 + self.config.policy_s
        self._next_status = self._wall0 + self.config.status_s
        # Written at once (printed from the first interval on): emulate_fault refuses faults
        # while no emulator has a fresh status.
        self._status_store(final=False)
        self.reporter.kv_reset_all(self.sim)
        try:
            self.sim.run()
        except _Stop:
            pass
        finally:
            self._status(final=True)
            self.uplink.flush(force=True)
            self.reporter.post_stats(self.stats)
            self.client.close()
            self.http.close()
            self.uplink.close()
            self.registrar.close()
        return self.stats

    def stop(self) -> None:
        self.stopping = True

    def _pace(self) -> None:
        """Wait until the wall clock reaches the simulated time; stop when asked."""
        if self.stopping:
            raise _Stop
        now = self._clock()
        if self.config.duration_s is not None and now - self._started >= self.config.duration_s:
            raise _Stop
        target = self._wall0 + (self.sim.now - self._sim0) / self.config.speed
        if target > now:
            self._sleep(min(target - now, 1.0))
            if self.stopping:
                raise _Stop
        elif now - target > MAX_LAG_S:
            # Fell behind (a stalled control plane, a suspended process): carry on from now
            # rather than replay the backlog as a burst the fleet never offered.
            self._wall0 += now - target
            self._out(f"emulator: {now - target:.0f} s behind the wall clock; continuing from now")

    # -- Dispatcher protocol ----------------------------------------------------------------

    def fleet_changed(self, sim: Simulation) -> None:
        return None

    def tick(self, sim: Simulation) -> None:
        self._pace()
        now = self._clock()
        while self._events and self._events[0][0] <= sim.now - self._sim0:
            _, fault = self._events.pop(0)
            self.fault_apply(fault)
        if self.faults is not None:
            try:
                for fault in emulator_faults_pop(self.faults):
                    self.fault_apply(fault)
            except Exception as exc:  # the channel is optional; the fleet keeps running
                log.warning("emulator: fault channel unreadable: %s", exc)
        if now >= self._next_policy:
            self._next_policy = now + self.config.policy_s
            self._policy_follow()
        if now >= self._next_telemetry:
            self._next_telemetry = now + self.config.telemetry_s
            self.reporter.report(self.sim, now)
            self.reporter.post_stats(self.stats)
        if now >= self._next_status:
            self._next_status = now + self.config.status_s
            self._status()

    def assign(self, sim: Simulation, request: SimRequest) -> Assignment | None:
        if request.index not in self.router.decisions:
            self._pace()
            self.router.route_upcoming(request)
        decision = self.router.decisions.pop(request.index, None)
        self.reporter.arrival(request)
        if decision is None:
            return None
        return self.router.assignment(sim, request, decision, self.topology)

    # -- obeying the control plane ----------------------------------------------------------

    def _policy_follow(self) -> None:
        """Re-read the policy (ETag); follow role changes and instances marked down/active."""
        try:
            changed = self.client.refresh_policy()
        except (RouterUnavailableError, RouterApiError, httpx.HTTPError) as exc:
            log.warning("emulator: policy not refreshed: %s", exc)
            return
        snapshot = self.client.policy_snapshot
        if not changed or snapshot is None:
            return
        self.topology = snapshot.topology
        sim = self.sim
        for inst in snapshot.topology.instances:
            name = inst.name
            known = sim.prefill_by_name.get(name) or sim.decode_by_name.get(name)
            if known is None:
                continue  # added after start: the emulator only runs the fleet it started with
            if self._inventory_roles.get(name) != inst.role:
                self._inventory_roles[name] = inst.role
                if sim_role(sim, name) != inst.role and name in sim.decode_by_name:
                    sim.role_flip(name, inst.role)
                    self.stats.flips += 1
                    self._out(f"emulator: {name} drains, then serves {inst.role}")
            down = sim_state(sim, name) == DOWN
            if inst.state == DOWN and not down:
                sim.instance_fail(name)
                self._down_by_inventory.add(name)
            elif inst.state != DOWN and down and name in self._down_by_inventory:
                self._down_by_inventory.discard(name)
                sim.instance_recover(name)

    # -- faults -----------------------------------------------------------------------------

    def fault_apply(self, fault: Mapping[str, Any]) -> None:
        """Inject one fault now (already validated); unknown names are reported and skipped."""
        sim = self.sim
        kind = fault["kind"]
        self.stats.faults += 1
        if kind == "link":
            key = fault["link"]
            if key not in sim.links:
                self._out(f"emulator: no link {key} (known: {', '.join(sorted(sim.links))})")
                return
            sim._fleet_event(FleetEvent(sim.now, link=key, gbps=float(fault["gbps"])))
            self._out(f"emulator: link {key} now carries {fault['gbps']:g} Gbps")
            self.inventory.link(key, float(fault["gbps"]))
        elif kind == "instance":
            name = fault["instance"]
            if name not in sim.prefill_by_name and name not in sim.decode_by_name:
                self._out(f"emulator: no instance {name}")
                return
            if fault["state"] == DOWN:
                sim.instance_fail(name)
            else:
                self._down_by_inventory.discard(name)
                sim.instance_recover(name)
                # The engine restarted: its agent registers it again (back from unreachable).
                if name in self.registrar.engines:
                    self.registrar.register(name)
            self._out(f"emulator: instance {name} is {fault['state']}")
            self.inventory.instance(name, fault["state"])
        elif kind == "surge":
            cluster = fault.get("cluster")
            if cluster is not None and cluster not in self.stream.streams:
                self._out(f"emulator: no traffic arrives at {cluster}")
                return
            self.stream.rate_scale(float(fault["rate_scale"]), cluster)
            self._out(f"emulator: traffic x{fault['rate_scale']:g} at {cluster or 'every origin'}")
        else:
            self.stream.prompt_scale = float(fault["scale"])
            self._out(f"emulator: prompt lengths x{fault['scale']:g}")

    # -- status -----------------------------------------------------------------------------

    def _status(self, final: bool = False) -> None:
        s = self.stats
        elapsed = max(1e-9, self._clock() - self._started)
        lag = (self._wall0 + (self.sim.now - self._sim0) / self.config.speed) - self._clock()
        mix = ", ".join(f"{k} {v}" for k, v in s.reasons.most_common(4))
        line = (
            f"emulator: {elapsed:.0f} s, fleet clock {self.sim.now:.0f} s, {s.routed} routed "
            f"({s.routed / elapsed:.1f}/s, {s.offloaded} offloaded, {s.local} decided locally), "
            f"in system {self.sim.in_system}, dropped {self.sim.dropped}; {mix}"
        )
        if lag < -5:
            line += f"; {-lag:.0f} s behind the wall clock"
        self._out(line + (" (stopped)" if final else ""))
        self._status_store(final)

    def _status_store(self, final: bool) -> None:
        """The status line's figures in Redis (``STATUS_KEY``), for ``emulate_fault``."""
        s = self.stats
        if self.faults is not None:
            status = {
                "ts": self._clock(),
                "fleet_clock_s": self.sim.now,
                "routed": s.routed,
                "offloaded": s.offloaded,
                "local_decisions": s.local,
                "dropped": self.sim.dropped,
                "in_system": self.sim.in_system,
                "reasons": dict(s.reasons),
                "stopped": final,
            }
            try:
                self.faults.set(STATUS_KEY, json.dumps(status), ex=3600)
            except Exception as exc:
                log.warning("emulator: status not written: %s", exc)
