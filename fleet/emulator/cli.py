"""The emulator's command line: ``python -m fleet.emulator SCENARIO`` (or ``prfaas-emulator``),
the emulated fleet against a control plane, without Django, beside (or instead of) real engines.

Tokens come from ``EMULATOR_ROUTER_TOKEN``, ``EMULATOR_AGENT_TOKEN`` and
``EMULATOR_ADMIN_TOKEN`` (the admin one is optional: it records faults in the inventory), or
one ``--token`` / ``EMULATOR_TOKEN`` for all. ``--redis-url`` opens the fault channel
(``manage.py emulate_fault``) and the status line. Runs until SIGINT/SIGTERM or
``--duration``. ``manage.py emulate`` is the same with the demo's defaults.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fleet.emulator.config import EmulatorConfig, EmulatorError, control_plane_wait
from fleet.emulator.runner import FleetEmulator
from fleet.emulator.workload import scenario_workload

TOKEN_ENVS = ("EMULATOR_ROUTER_TOKEN", "EMULATOR_AGENT_TOKEN", "EMULATOR_ADMIN_TOKEN")


def emulator_tokens(
    token: str, env: Mapping[str, str], stored: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Per role: its environment variable, else ``token``, else the ``stored`` one."""
    stored = stored or {}
    return {name: env.get(name) or token or stored.get(name, "") for name in TOKEN_ENVS}


def parser_add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``python -m fleet.emulator`` and ``manage.py emulate`` share."""
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
    parser.add_argument("--no-loop", action="store_true", help="stop at the end of the workload")
    parser.add_argument(
        "--wait", type=float, default=60.0, help="seconds to wait for the control plane"
    )


def emulator_start(
    options: Mapping[str, Any],
    scenario_path: Path,
    tokens: Mapping[str, str],
    *,
    faults: Any = None,
    out: Any = None,
) -> FleetEmulator:
    """Read the scenario, wait for the control plane, build the emulator (signals stop it);
    :class:`EmulatorError` says what is wrong."""
    scenario, workload = scenario_workload(
        scenario_path, rate_per_s=options["rate"], seed=options["seed"], span_s=options["span"]
    )
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
    control_plane_wait(config.base_url, options["wait"])
    emulator = FleetEmulator(scenario, workload, config, faults=faults, out=out)

    def stop(signum: int, frame: object) -> None:
        emulator.stop()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    if out is not None:
        out(
            f"emulating {scenario.name} ({len(workload.requests)} requests per loop) "
            f"at x{config.speed:g} against {config.base_url}"
        )
    return emulator


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleet.emulator", description=__doc__)
    parser.add_argument("scenario", type=Path, help="scenario file (topology and workload)")
    parser.add_argument("--base-url", required=True, help="the control plane")
    parser.add_argument("--speed", type=float, default=4.0, help="fleet seconds per wall second")
    parser.add_argument("--token", default="", help="one token for every role it has")
    parser.add_argument("--redis-url", default="", help="the fault channel (optional)")
    parser.add_argument("--log-level", default="INFO")
    parser_add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    faults = None
    if args.redis_url:
        import redis

        faults = redis.Redis.from_url(args.redis_url)
    tokens = emulator_tokens(args.token or os.environ.get("EMULATOR_TOKEN", ""), os.environ)
    try:
        emulator = emulator_start(
            vars(args),
            args.scenario,
            tokens,
            faults=faults,
            out=lambda line: print(line, flush=True),
        )
    except EmulatorError as exc:
        print(f"fleet.emulator: {exc}", file=sys.stderr)
        return 2
    emulator.run()
    return 0
