"""``manage.py emulate [SCENARIO]``: an emulated PrfaaS fleet driving the control plane over HTTP.

The logic is :mod:`fleet.emulator` (``python -m fleet.emulator`` runs it without Django); this
command adds the demo's defaults: the Mooncake scenario, the tokens the demo stored, the
control plane's Redis as the fault channel. Runs until Ctrl-C (or ``--duration``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.redis_connection import redis_sync
from fleet.emulator import EmulatorError
from fleet.emulator.cli import emulator_start, emulator_tokens, parser_add_arguments


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
            default=settings.EMULATOR_BASE_URL,
            help="the control plane (env EMULATOR_BASE_URL)",
        )
        parser.add_argument(
            "--token",
            default=settings.EMULATOR_TOKEN,
            help="one token for every role it has (else EMULATOR_ROUTER_TOKEN, "
            "EMULATOR_AGENT_TOKEN, EMULATOR_ADMIN_TOKEN)",
        )
        parser_add_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        # One line per HTTP call would drown the status lines.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        path = Path(options["scenario"] or default_scenario())
        try:
            emulator = emulator_start(
                options,
                path,
                self._tokens(options["token"]),
                faults=redis_sync(),
                out=self._say,
            )
        except EmulatorError as exc:
            raise CommandError(str(exc), returncode=2) from exc
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
        return emulator_tokens(token, settings.EMULATOR_ROLE_TOKENS, stored)

    def _say(self, line: str) -> None:
        self.stdout.write(line)
        self.stdout.flush()
