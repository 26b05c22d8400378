"""``manage.py demo``: the control plane on embedded defaults, in one command.

Migrates, loads the paper's case-study topology, makes sure an operator account exists, then
supervises the web server (uvicorn, ASGI), a Celery worker and beat as child processes. Ctrl-C
stops every child, then the embedded Redis if this command is the one that uses it. A second run
reuses the database, the account and its password.
"""

from __future__ import annotations

import json
import os
import secrets
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

from controlplane.embedded_redis import embedded_redis_stop


class Command(BaseCommand):
    help = "Run the control plane with a live demo on embedded defaults (Ctrl-C stops it)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default=os.environ.get("DEMO_HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("DEMO_PORT", "8000")))
        parser.add_argument(
            "--scenario",
            default=str(Path(settings.SHARED_DIR) / "scenarios" / "paper-case-study.yaml"),
            help="scenario file whose topology is loaded (default: the paper's case study)",
        )
        parser.add_argument(
            "--no-workers", action="store_true", help="serve the web only (no worker, no beat)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        scenario = Path(options["scenario"])
        if not scenario.is_file():
            raise CommandError(f"scenario file not found: {scenario}", returncode=2)

        call_command("migrate", interactive=False, verbosity=0)
        call_command("topology", "apply", str(scenario))
        username, password = self._operator_account()

        url = f"http://{options['host']}:{options['port']}/"
        self.stdout.write(
            self.style.SUCCESS(f"\nPrfaaS control plane: {url}\n  login: {username} / {password}\n")
        )

        env = {**os.environ, "REDIS_URL": settings.REDIS_URL}
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
                "--concurrency",
                "2",
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
        self._supervise(commands, env)

    def _operator_account(self) -> tuple[str, str]:
        """Create the demo operator once; later runs print the same password."""
        credentials = Path(settings.VAR_DIR) / "demo-credentials.json"
        username = "operator"
        if credentials.exists():
            password = json.loads(credentials.read_text())["password"]
        else:
            password = secrets.token_urlsafe(12)
            credentials.write_text(json.dumps({"username": username, "password": password}))
            credentials.chmod(0o600)
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

    def _supervise(self, commands: dict[str, list[str]], env: dict[str, str]) -> None:
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
            while not stopping:
                for name, child in children.items():
                    if child.poll() is not None:
                        self.stderr.write(f"{name} exited with status {child.returncode}; stopping")
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
            if not os.environ.get("REDIS_URL"):
                embedded_redis_stop(Path(settings.VAR_DIR))
            self.stdout.write("stopped")
