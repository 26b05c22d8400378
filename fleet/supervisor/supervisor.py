"""Keeps the engines of one host running, and flips one when a plan says so.

Contract: :meth:`Supervisor.start` starts every engine in its role (the last flip's, kept in
``work_dir/roles.json`` across restarts of the supervisor, else the file's), waits until each
answers ``/health`` and then starts its agent, which registers it. :meth:`Supervisor.flip`
restarts one engine in a new role: its agent stops, the engine stops (TERM, then KILL), starts
again with the role's ``kv_role``, is waited for until healthy, and its agent starts again and
registers the instance in the new role. A flip is done once per idempotency key (a repeated
step answers what the first did; one arriving while it runs waits for it) and one at a time per
instance. :meth:`Supervisor.watch` restarts an engine or an agent that exited by itself.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fleet.supervisor.config import ROLES, SupervisorConfig
from fleet.supervisor.processes import AgentProcess, EngineProcess

log = logging.getLogger(__name__)

WATCH_S = 2.0
KEYS_KEPT = 1000


class FlipError(RuntimeError):
    """The engine could not be restarted in the new role (the message says why)."""


class UnknownInstance(LookupError):
    """No engine of this host is that instance."""


@dataclass(frozen=True)
class FlipResult:
    instance: str
    role: str
    restarted: bool
    seconds: float


class Supervisor:
    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        work = Path(config.work_dir)
        (work / "logs").mkdir(parents=True, exist_ok=True)
        self._roles_path = work / "roles.json"
        self.engines = {e.instance: EngineProcess(e, work / "logs") for e in config.engines}
        self.agents = {e.instance: AgentProcess(config, e, work) for e in config.engines}
        kept = self._roles_read()
        self.roles = {e.instance: kept.get(e.instance, e.role) for e in config.engines}
        self.restarts = dict.fromkeys(self.engines, 0)
        self._locks = {name: threading.Lock() for name in self.engines}
        self._busy: set[str] = set()
        self._done: dict[str, FlipResult] = {}
        self._stop = threading.Event()

    def _roles_read(self) -> dict[str, str]:
        try:
            data = json.loads(self._roles_path.read_text())
        except (OSError, ValueError):
            return {}
        return {k: v for k, v in data.items() if isinstance(v, str) and v in ROLES}

    def _roles_write(self) -> None:
        tmp = self._roles_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.roles, sort_keys=True))
        tmp.replace(self._roles_path)

    # -- bringing engines up ----------------------------------------------------------------

    def _bring_up(self, name: str) -> float:
        """Start the engine in its role, wait until healthy, then start its agent."""
        role = self.roles[name]
        engine = self.engines[name]
        engine.start(role)
        try:
            seconds = engine.wait_healthy()
        except RuntimeError as exc:
            engine.stop()
            raise FlipError(str(exc)) from None
        self.agents[name].start(role)
        log.info("%s: up as %s (%s) in %.0f s", name, role, engine.engine.kv_role(role), seconds)
        return seconds

    def start(self) -> None:
        """Every engine up (started together, waited for each), then its agent."""
        errors: list[str] = []

        def up(name: str) -> None:
            with self._locks[name]:
                self._busy.add(name)
                try:
                    self._bring_up(name)
                except Exception as exc:  # reported below; the watch retries it
                    errors.append(f"{name}: {exc}")
                finally:
                    self._busy.discard(name)

        threads = [threading.Thread(target=up, args=(n,)) for n in self.engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            log.error("engines that did not start: %s", "; ".join(errors))

    # -- the flip ---------------------------------------------------------------------------

    def flip(self, name: str, role: str, key: str = "") -> FlipResult:
        """Restart ``name`` as ``role`` (see the module docstring)."""
        if name not in self.engines:
            raise UnknownInstance(name)
        if role not in ROLES:
            raise FlipError(f"role: prefill or decode, not {role!r}")
        with self._locks[name]:
            if key and key in self._done:
                return self._done[key]
            engine = self.engines[name]
            if self.roles[name] == role and engine.running() and engine.healthy():
                result = FlipResult(name, role, False, 0.0)
            else:
                self._busy.add(name)
                started = time.monotonic()
                try:
                    self.agents[name].stop()
                    engine.stop()
                    self.roles[name] = role
                    self._roles_write()
                    self._bring_up(name)
                finally:
                    self._busy.discard(name)
                result = FlipResult(name, role, True, time.monotonic() - started)
            if key:
                self._done[key] = result
                while len(self._done) > KEYS_KEPT:
                    self._done.pop(next(iter(self._done)))
            return result

    # -- watching ---------------------------------------------------------------------------

    def watch(self) -> None:
        """Until :meth:`stop`: restart what exited by itself."""
        while not self._stop.wait(WATCH_S):
            for name, engine in self.engines.items():
                if name in self._busy or not self._locks[name].acquire(blocking=False):
                    continue
                try:
                    if not engine.running():
                        self.restarts[name] += 1
                        log.warning("%s: engine exited; restarting: %s", name, engine.tail(500))
                        self.agents[name].stop()
                        engine.stop()
                        self._bring_up(name)
                    elif not self.agents[name].running():
                        log.warning("%s: agent exited; restarting it", name)
                        self.agents[name].start(self.roles[name])
                except Exception as exc:  # one engine's trouble must not stop the watch
                    log.error("%s: %s", name, exc)
                finally:
                    self._locks[name].release()

    def states(self) -> list[dict[str, Any]]:
        out = []
        for name, engine in self.engines.items():
            role = self.roles[name]
            out.append(
                {
                    "instance": name,
                    "cluster": engine.engine.cluster,
                    "role": role,
                    "kv_role": engine.engine.kv_role(role),
                    "url": engine.engine.url,
                    "running": engine.running(),
                    "pid": engine.proc.pid if engine.proc is not None else None,
                    "busy": name in self._busy,
                    "agent_running": self.agents[name].running(),
                    "restarts": self.restarts[name],
                }
            )
        return out

    def stop(self) -> None:
        self._stop.set()
        for name in self.engines:
            self.agents[name].stop()
        for engine in self.engines.values():
            engine.stop()


def flip_result_json(result: FlipResult) -> dict[str, Any]:
    return asdict(result)
