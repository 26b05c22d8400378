"""``manage.py demo``: the control plane on embedded defaults, in one command.

Migrates, loads the paper's case-study topology without its instances (sites, clusters,
profiles, the link: the emulated engines join by themselves, registered by their agents when
the emulator starts; with ``--no-emulator`` the file declares them), makes sure an operator account and the emulator's API tokens exist, then
supervises the web server (uvicorn, ASGI), a Celery worker,
beat and the fleet emulator (``manage.py emulate``) as child processes, each in its own
process group. The rebalancer runs every ``REBALANCE_INTERVAL_S`` (60 s in the demo unless set).
Ctrl-C stops every child; manage.py then stops the embedded Redis it started for the demo. A
second run reuses the database, the account, its password and the tokens (all kept in
``var/demo-credentials.json``, readable only by its owner).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from clusters.models import ClusterKind, Instance, Link
from controlplane.audit import CLI_ACTOR
from controlplane.models import ApiToken, token_hash
from controlplane.services import token_create
from fleet.gateway.demo import TOKEN_ENV as GATEWAY_TOKEN_ENV
from fleet.gateway.demo import demo_gateway_commands
from scheduling.core.planner import plan_scenario
from scheduling.core.scenario import ScenarioError, scenario_load
from scheduling.policies import policy_create, policy_current

# The emulator's credentials: a router, an agent, and an admin token it uses only to record
# the link and instance faults it injects in the inventory (as a network monitor would).
DEMO_TOKENS = {
    "EMULATOR_ROUTER_TOKEN": ("demo-emulator-router", ["router"]),
    # Its agents post telemetry and KV events, and register the engines they run beside.
    "EMULATOR_AGENT_TOKEN": ("demo-emulator-agent", ["agent", "register"]),
    "EMULATOR_ADMIN_TOKEN": ("demo-emulator-admin", ["admin"]),
    # The PD gateway in front of the demo's fake engines (fleet/gateway/demo.py).
    GATEWAY_TOKEN_ENV: ("demo-gateway", ["router"]),
}
DEMO_REBALANCE_INTERVAL_S = "60"


class Command(BaseCommand):
    help = "Run the control plane with a live demo on embedded defaults (Ctrl-C stops it)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--host", default=settings.DEMO_HOST, help="address to serve on (env DEMO_HOST)"
        )
        parser.add_argument(
            "--port", type=int, default=settings.DEMO_PORT, help="web port (env DEMO_PORT)"
        )
        parser.add_argument(
            "--scenario",
            default=str(Path(settings.SCENARIOS_DIR) / "paper-case-study.yaml"),
            help="scenario file whose topology is loaded (default: the paper's case study)",
        )
        parser.add_argument(
            "--no-workers", action="store_true", help="serve the web only (no worker, no beat)"
        )
        parser.add_argument(
            "--no-emulator", action="store_true", help="do not start the fleet emulator"
        )
        parser.add_argument(
            "--no-gateway",
            action="store_true",
            help="do not start the PD gateway and its fake engines",
        )
        parser.add_argument(
            "--gateway-port",
            type=int,
            default=settings.DEMO_GATEWAY_PORT,
            help="the gateway's port (env DEMO_GATEWAY_PORT; default: the web port + 1)",
        )
        parser.add_argument(
            "--setup-only",
            action="store_true",
            help="migrate, load the topology, create the account and tokens, then exit "
            "(the compose demo profile runs this once)",
        )
        parser.add_argument(
            "--emulate",
            default=str(Path(settings.SCENARIOS_DIR) / "mooncake-conversation.yaml"),
            help="scenario the emulator replays (default: the Mooncake conversation trace)",
        )
        parser.add_argument(
            "--speed",
            type=float,
            default=settings.EMULATOR_SPEED,
            help="emulator clock speed (fleet seconds per wall second; env EMULATOR_SPEED); "
            "the control plane's processes get it as FLEET_CLOCK_SPEED",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        scenario = Path(options["scenario"])
        if not scenario.is_file():
            raise CommandError(f"scenario file not found: {scenario}", returncode=2)
        if not options["setup_only"]:
            self._lock = self._single_instance_lock()

        call_command("migrate", interactive=False, verbosity=0)
        # The instances are the agents' to register (the emulator's, at its start); without
        # the emulator nobody would, so the file declares them.
        instances = ["--no-instances"] if not options["no_emulator"] else []
        call_command("topology", "apply", str(scenario), *instances)
        self._initial_policy(scenario)
        username, password = self._operator_account()
        tokens = self._emulator_tokens()

        if options["setup_only"]:
            self.stdout.write(f"demo set up; operator login: {username} / {password}")
            return
        url = f"http://{options['host']}:{options['port']}/"
        credentials = Path(settings.VAR_DIR) / "demo-credentials.json"
        self.stdout.write(
            self.style.SUCCESS(f"\nPrfaaS control plane: {url}\n  login: {username} / {password}\n")
            + f"  (credentials and the emulator's API tokens: {credentials})\n"
            + self._fault_hint()
        )

        env = {**os.environ, "REDIS_URL": settings.REDIS_URL}
        # Demo-length rebalancer period (children read settings from the environment).
        env.setdefault("REBALANCE_INTERVAL_S", DEMO_REBALANCE_INTERVAL_S)
        # The emulated fleet's clock runs this much faster than the wall clock: the plane reads
        # the rates it counts in the fleet's clock (none without the emulator).
        env["FLEET_CLOCK_SPEED"] = "1" if options["no_emulator"] else str(options["speed"])
        python = sys.executable
        commands = {
            "web": [
                python,
                "-m",
                "uvicorn",
                "controlplane.asgi:application",
                "--host",
                options["host"],
                "--port",
                str(options["port"]),
                "--no-access-log",
                "--http",
                "controlplane.http_protocol:HeaderDeadlineProtocol",
            ],
        }
        if not options["no_workers"]:
            commands["worker"] = [
                python,
                "-m",
                "celery",
                "-A",
                "controlplane",
                "worker",
                "--loglevel",
                "WARNING",
                # One process for the long tasks (a rebalance tick simulates for up to
                # REBALANCE_SIMULATION_WALL_S, a what-if run longer), the others free for the
                # 2 s overview tick and decision-log copy: no process reserves tasks it cannot
                # start, so alerts never wait behind a simulation.
                "--concurrency",
                "3",
                "--prefetch-multiplier",
                "1",
                "-O",
                "fair",
            ]
            commands["beat"] = [
                python,
                "-m",
                "celery",
                "-A",
                "controlplane",
                "beat",
                "--loglevel",
                "WARNING",
                "--schedule",
                str(Path(settings.VAR_DIR) / "celerybeat-schedule"),
            ]
        optional: set[str] = set()
        if not options["no_emulator"]:
            commands["emulator"] = [
                python,
                str(Path(settings.BASE_DIR) / "manage.py"),
                "emulate",
                options["emulate"],
                "--base-url",
                f"http://{options['host']}:{options['port']}",
                "--speed",
                str(options["speed"]),
            ]
            optional.add("emulator")
        env.update(tokens)
        if not options["no_gateway"]:
            commands.update(self._gateway_commands(python, options))
            optional.update(("engines", "gateway"))
        self._supervise(commands, env, optional)

    def _fault_hint(self) -> str:
        """A fault to try, quoted for a shell (a bare ``a->b`` would redirect into a file)."""
        link = Link.objects.select_related("source", "target").order_by("id").first()
        if link is None:
            return ""
        argv = ["python", "manage.py", "emulate_fault", "link"]
        argv += [link.key, "--gbps", "2"]
        return f"  inject a fault (in the activated venv): {shlex.join(argv)}\n"

    def _gateway_commands(self, python: str, options: dict[str, Any]) -> dict[str, list[str]]:
        """Fake engines for every instance (the scenario's, which join when the emulator
        starts, and the inventory's) and the gateway for the first PD cluster."""
        roles: dict[str, str] = {}
        origin = ""
        for cluster in scenario_load(Path(options["scenario"])).clusters:
            roles.update(cluster.instance_roles())
            if cluster.kind == ClusterKind.PD and not origin:
                origin = cluster.name
        for name, role in Instance.objects.values_list("name", "role"):
            roles.setdefault(name, role)
        if not origin:
            return {}
        port = options["gateway_port"] or options["port"] + 1
        self.stdout.write(
            f"  OpenAI API through the PD gateway: http://{options['host']}:{port}/v1 "
            f"(origin {origin}, fake engines)\n"
        )
        return demo_gateway_commands(
            python,
            sorted(roles.items()),
            origin,
            f"http://{options['host']}:{options['port']}",
            options["host"],
            port,
            Path(settings.VAR_DIR),
        )

    def _initial_policy(self, scenario: Path) -> None:
        """On a first run, publish the offline plan's thresholds for the scenario's own
        workload, as an operator deploying the paper's design would; the rebalancer then
        corrects it from the traffic the emulator really sends."""
        if policy_current() is not None:
            return
        try:
            plan = plan_scenario(scenario_load(scenario))
        except (ScenarioError, ValueError) as exc:
            self.stderr.write(f"no initial policy (the scenario cannot be planned: {exc})")
            return
        thresholds = {c.name: int(c.threshold_tokens) for c in plan.prfaas.clusters}
        policy_create(
            actor=CLI_ACTOR,
            thresholds=thresholds,
            note=f"initial: offline plan of {scenario.name}",
        )
        self.stdout.write(f"initial policy: thresholds {thresholds}")

    def _single_instance_lock(self) -> Any:
        """One demo per VAR_DIR: a second one would share the first one's database and embedded
        Redis. The lock lives as long as this process (the OS drops it however we exit)."""
        path = Path(settings.VAR_DIR) / "demo.lock"
        handle = path.open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise CommandError(
                f"a demo is already running with VAR_DIR={settings.VAR_DIR} (pid {holder}); "
                "stop it first, or give this one its own VAR_DIR",
                returncode=2,
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        return handle

    def _credentials(self) -> dict[str, Any]:
        path = Path(settings.VAR_DIR) / "demo-credentials.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def _credentials_save(self, data: dict[str, Any]) -> None:
        path = Path(settings.VAR_DIR) / "demo-credentials.json"
        path.touch(mode=0o600, exist_ok=True)
        path.chmod(0o600)
        path.write_text(json.dumps(data, indent=2))

    def _emulator_tokens(self) -> dict[str, str]:
        """The emulator's tokens: reused while valid, created (with a fresh name) otherwise."""
        data = self._credentials()
        kept: dict[str, str] = data.get("tokens", {})
        out: dict[str, str] = {}
        for env_name, (name, scopes) in DEMO_TOKENS.items():
            secret = kept.get(env_name, "")
            stored = (
                ApiToken.objects.filter(secret_sha256=token_hash(secret), revoked_at__isnull=True)
                .values_list("scopes", flat=True)
                .first()
                if secret
                else None
            )
            # A token from an older demo lacking a scope this one needs is replaced.
            valid = stored is not None and set(scopes) <= set(stored)
            if not valid:
                taken = set(
                    ApiToken.objects.filter(name__startswith=name).values_list("name", flat=True)
                )
                fresh = name if name not in taken else f"{name}-{len(taken) + 1}"
                while fresh in taken:
                    fresh += "x"
                # The emulator's agent reports for the whole demo fleet.
                secret = token_create(
                    name=fresh, scopes=scopes, actor=CLI_ACTOR, fleet_wide="agent" in scopes
                ).secret
            out[env_name] = secret
        if out != kept:
            self._credentials_save({**self._credentials(), "tokens": out})
        return out

    def _operator_account(self) -> tuple[str, str]:
        """Create the demo operator once; later runs print the same password."""
        data = self._credentials()
        username = "operator"
        if "password" in data:
            password = data["password"]
        else:
            password = secrets.token_urlsafe(12)
            self._credentials_save({**data, "username": username, "password": password})
        user_model = get_user_model()
        user, created = user_model.objects.get_or_create(username=username)
        if created or not user.check_password(password):
            user.set_password(password)
            user.is_staff = True
            user.save()
        for name in ("operator", "admin"):
            group = Group.objects.filter(name=name).first()
            if group is not None:
                user.groups.add(group)
        return username, password

    def _supervise(
        self, commands: dict[str, list[str]], env: dict[str, str], optional: set[str]
    ) -> None:
        children: dict[str, subprocess.Popen[bytes]] = {}
        stopping = False

        def stop(signum: int, frame: object) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        try:
            for name, argv in commands.items():
                # Own process group per child, so Ctrl-C reaches us first and we stop them in order.
                children[name] = subprocess.Popen(argv, env=env, start_new_session=True)
            reported: set[str] = set()
            while not stopping:
                for name, child in children.items():
                    if child.poll() is not None and name not in reported:
                        reported.add(name)
                        if name in optional:
                            # The control plane is still useful without its emulated fleet.
                            self.stderr.write(f"{name} exited with status {child.returncode}")
                        else:
                            self.stderr.write(
                                f"{name} exited with status {child.returncode}; stopping"
                            )
                            stopping = True
                time.sleep(0.5)
        finally:
            self.stdout.write("stopping ...")
            for child in children.values():
                if child.poll() is None:
                    os.killpg(child.pid, signal.SIGTERM)
            deadline = time.monotonic() + 15
            for child in children.values():
                try:
                    child.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    os.killpg(child.pid, signal.SIGKILL)
                    child.wait()
            self.stdout.write("stopped")
