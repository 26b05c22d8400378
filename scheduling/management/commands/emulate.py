"""``manage.py emulate [SCENARIO]``: an emulated PrfaaS fleet driving the control plane over HTTP.

The logic is :mod:`fleet.emulator`; this command reads the scenario, builds its workload,
finds the tokens and the control plane's address, and runs until Ctrl-C (or ``--duration``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.redis_connection import redis_sync
from fleet.emulator import EmulatorConfig, EmulatorError, FleetEmulator
from scheduling.core.scenario import ScenarioError, scenario_load
from scheduling.core.simulator.workload import WorkloadError, workload_build


def default_scenario() -> Path:
    return Path(settings.SCENARIOS_DIR) / "mooncake-conversation.yaml"


class Command(BaseCommand):
    help = (
        "Emulate a PrfaaS fleet from a scenario: routes every request through POST "
        "/api/v1/route, simulates the engines, reports telemetry and KV events (Ctrl-C stops)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "scenario", nargs="?", help="scenario file (default: the Mooncake conversation trace)"
        )
        parser.add_argument(
            "--speed",
            type=float,
            default=settings.EMULATOR_SPEED,
            help="fleet seconds per wall second (default 4, env EMULATOR_SPEED)",
        )
        parser.add_argument(
            "--base-url",
            default=os.environ.get("EMULATOR_BASE_URL", "http://127.0.0.1:8000"),
            help="the control plane (env EMULATOR_BASE_URL)",
        )
        parser.add_argument(
            "--token",
            default=os.environ.get("EMULATOR_TOKEN", ""),
            help="one token for every role it has (else EMULATOR_ROUTER_TOKEN, "
            "EMULATOR_AGENT_TOKEN, EMULATOR_ADMIN_TOKEN)",
        )
        parser.add_argument("--rate", type=float, help="arrivals per second (distributions)")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument(
            "--span",
            type=float,
            default=3600.0,
            help="fleet seconds of arrivals drawn from a scenario's distributions before they "
            "loop (default 3600; a trace replays whole)",
        )
        parser.add_argument("--duration", type=float, help="stop after this many wall seconds")
        parser.add_argument("--requests", type=int, help="stop after this many requests")
        parser.add_argument(
            "--no-loop", action="store_true", help="stop at the end of the workload"
        )
        parser.add_argument(
            "--wait", type=float, default=60.0, help="seconds to wait for the control plane"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        # One line per HTTP call would drown the status lines.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        path = Path(options["scenario"] or default_scenario())
        if not path.is_file():
            raise CommandError(f"scenario file not found: {path}", returncode=2)
        try:
            scenario = scenario_load(path)
            has_trace = scenario.workload is not None and scenario.workload.trace is not None
            workload = workload_build(
                scenario,
                rate_per_s=options["rate"],
                seed=options["seed"],
                # Distributions: one hour of arrivals, looped (a trace brings its own length).
                duration_s=None if has_trace else options["span"],
            )
        except (ScenarioError, WorkloadError) as exc:
            raise CommandError(f"{path}: {exc}", returncode=2) from exc
        if not workload.requests:
            raise CommandError(f"{path}: the workload has no requests", returncode=2)
        tokens = self._tokens(options["token"])
        try:
            config = EmulatorConfig(
                base_url=options["base_url"],
                router_token=tokens["EMULATOR_ROUTER_TOKEN"],
                agent_token=tokens["EMULATOR_AGENT_TOKEN"],
                admin_token=tokens["EMULATOR_ADMIN_TOKEN"],
                speed=options["speed"],
                duration_s=options["duration"],
                requests=options["requests"],
                loop=not options["no_loop"],
            )
        except EmulatorError as exc:
            raise CommandError(str(exc), returncode=2) from exc
        self._wait_for(config.base_url, options["wait"])
        try:
            emulator = FleetEmulator(scenario, workload, config, faults=redis_sync(), out=self._say)
        except EmulatorError as exc:
            raise CommandError(str(exc), returncode=2) from exc

        def stop(signum: int, frame: object) -> None:
            emulator.stop()

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        self._say(
            f"emulating {scenario.name} ({len(workload.requests)} requests per loop) "
            f"at x{config.speed:g} against {config.base_url}"
        )
        emulator.run()

    def _tokens(self, token: str) -> dict[str, str]:
        """Per role: its env variable, else ``--token``/``EMULATOR_TOKEN``, else the token the
        demo set-up stored in ``VAR_DIR/demo-credentials.json``."""
        stored: dict[str, str] = {}
        credentials = Path(settings.VAR_DIR) / "demo-credentials.json"
        if credentials.is_file():
            try:
                stored = json.loads(credentials.read_text()).get("tokens", {})
            except (ValueError, OSError):
                stored = {}
        names = ("EMULATOR_ROUTER_TOKEN", "EMULATOR_AGENT_TOKEN", "EMULATOR_ADMIN_TOKEN")
        return {n: os.environ.get(n) or token or stored.get(n, "") for n in names}

    def _say(self, line: str) -> None:
        self.stdout.write(line)
        self.stdout.flush()

    def _wait_for(self, base_url: str, wait_s: float) -> None:
        """The web server may still be starting (``make demo`` starts both at once)."""
        deadline = time.monotonic() + wait_s
        url = base_url.rstrip("/") + "/api/v1/health"
        while True:
            try:
                if httpx.get(url, timeout=2.0).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                raise CommandError(f"the control plane at {base_url} did not answer", returncode=2)
            time.sleep(0.5)
