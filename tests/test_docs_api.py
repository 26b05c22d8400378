"""Every command and request of README.md and docs/*.md, run as written against a live stack.

What counts as a command (the README says once how commands run: in the activated virtualenv,
so ``python`` is the project's):

* every line of a fenced block tagged ``sh`` or ``bash`` (a trailing ``\\`` continues it, ``#``
  starts a comment); such a block runs as one shell session, in order;
* every inline code span that starts with a program (``python``, ``make``, ``curl``,
  ``docker``, ``pip``, ``celery``, ``uvicorn``, ``kubectl``, ``vllm``), possibly after
  ``NAME=value`` assignments.

A fenced block tagged otherwise (``text``, ``yaml``, none) holds no line that starts with one of
those programs: a command cannot hide from this test by its block's tag.

The stack is ``python manage.py demo`` (web, worker, beat, the fleet emulator, the PD gateway)
with its own VAR_DIR, ports, database and Redis db. The documents' default addresses
(``127.0.0.1:8000`` or ``localhost:8000``, and ``:8001`` for the gateway) are rewritten to the
stack's; ``$BASE`` and ``$TOKEN`` are those docs/api.md exports with its own commands. Commands
run from the checkout with the virtualenv first on ``PATH``, as in an activated one, and must
exit 0; every ``curl`` must get a 2xx.

``NOT_RUN`` lists the few commands that cannot run here, each with the reason; an entry that no
documented command matches any more is an error too.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from django.conf import settings

from tests.demo_support import Demo, demo_running, wait_for
from tests.support.servers import free_port

ROOT = Path(settings.BASE_DIR)
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
API_DOC = ROOT / "docs" / "api.md"
TOKEN_COMMAND = "python manage.py token create --name docs-examples"
pytestmark = pytest.mark.timeout(1500)

PROGRAMS = r"(?:python|make|curl|docker|docker-compose|pip|celery|uvicorn|kubectl|vllm)"
# A program and at least one argument (a program's bare name in prose is a reference).
COMMAND = re.compile(rf"^(?:[A-Z][A-Z0-9_]*=\S*\s+)*(?:time\s+)?{PROGRAMS}\s+\S")

# The commands that cannot run here, by pattern, and why. Everything else runs.
NOT_RUN: dict[str, str] = {
    r"^(TEST_WORKERS=0 |time )?make (test|test-cluster|test-fuzz|test-engines|lint)$": (
        "the suite and CI's own stages: run from inside the suite they would run it again"
    ),
    r"^make (demo|setup)\b": (
        "make setup, then `python manage.py demo`: the stack these commands run against is that "
        "command; tests/test_fresh_clone.py runs `make demo` from a clone"
    ),
    r"^(\S+=\S* )*docker(-compose| compose) ": (
        "no Docker daemon here; tests/test_deploy.py validates the compose file and its roles"
    ),
    r"^kubectl ": "no Kubernetes cluster here",
    r"^vllm serve ": "a GPU engine (make test-engines runs vLLM's CPU build: tests/engines)",
    r"^pip ": "changes the environment this run uses (make setup installs it)",
    r"^(\S+=\S* )*python -m (fleet\.agent|fleet\.gateway|fleet\.supervisor|controlplane\.serve)\b"
    r"|^celery ": (
        "long-running daemons (beside real engines, or the stack's own roles): tests/fleet, "
        "tests/engines and tests/controlplane/test_serve.py run them"
    ),
    r"^python bench/(agreement|slo_brute_force|instructions|route_api|route_profile|gateway|"
    r"kv_ingest|login_isolation|ingest_isolation|rebalancer_drift|prefix_layout|scale|"
    r"oversize_offloads)\.py\b": (
        "a measurement of minutes on this 2-core machine (make bench runs every bench); its "
        "figures live in one place, with the command and the date"
    ),
    r"^python manage\.py simulate scenarios/paper-case-study\.yaml --capacity --requests 8000": (
        "three capacity searches of 8,000 simulated requests each: minutes"
    ),
    r"^python -m pytest ": "a part of the suite this test belongs to",
    r"^cp \.env\.example \.env$": (
        "writes a deployment's .env into the checkout under test (tests/test_deploy.py checks "
        "that .env.example lists every setting)"
    ),
    r"^git pull$": "would change the checkout under test",
}
# Entries kept although no document has such a command yet (the Kubernetes deployment's
# section is being written beside this change).
NOT_RUN_AHEAD = {r"^kubectl "}


@dataclass(frozen=True)
class Command:
    """One documented command (or a fenced block of them, run as one session)."""

    where: str
    text: str
    block: bool

    def lines(self) -> list[str]:
        joined = re.sub(r"\\\n\s*", " ", self.text)
        out = []
        for line in joined.splitlines():
            code = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
            if code:
                out.append(code)
        return out


def documented_commands() -> list[Command]:
    """Every command of the documents, in order (see the module)."""
    out: list[Command] = []
    for doc in DOCUMENTS:
        text = doc.read_text()
        name = doc.relative_to(ROOT)
        for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            lang, body = match.group(1), match.group(2)
            line = text[: match.start()].count("\n") + 1
            if lang in ("sh", "bash"):
                out.append(Command(f"{name}:{line}", body, block=True))
        prose = re.sub(
            r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M
        )
        for number, row in enumerate(prose.splitlines(), 1):
            for span in re.findall(r"`([^`]+)`", row):
                if COMMAND.match(span.strip()):
                    out.append(Command(f"{name}:{number}", span.strip(), block=False))
    return out


def hidden_commands() -> list[str]:
    """Lines of blocks not tagged sh/bash that start like a command."""
    out = []
    for doc in DOCUMENTS:
        text = doc.read_text()
        for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            if match.group(1) in ("sh", "bash"):
                continue
            for line in match.group(2).splitlines():
                if COMMAND.match(line.strip()):
                    out.append(f"{doc.relative_to(ROOT)}: {line.strip()}")
    return out


def not_run_reason(line: str) -> str | None:
    return next((why for pattern, why in NOT_RUN.items() if re.search(pattern, line)), None)


def test_every_command_is_where_this_test_finds_it_and_written_one_way() -> None:
    commands = documented_commands()
    assert len(commands) >= 30, len(commands)
    assert not hidden_commands(), hidden_commands()
    one_way = [c.where for c in commands if ".venv/bin/python" in c.text]
    assert not one_way, f"write `python ...` in the activated venv, as the README says: {one_way}"
    lines = [line for c in commands for line in c.lines()]
    unused = [
        p
        for p in NOT_RUN
        if p not in NOT_RUN_AHEAD and not any(re.search(p, line) for line in lines)
    ]
    assert not unused, f"NOT_RUN entries no documented command matches: {unused}"
    joined = "\n".join(lines)
    for path in (
        "/api/v1/route ",
        "/api/v1/route/batch",
        "/api/v1/policy",
        "/api/v1/telemetry",
        "/api/v1/kv-events",
        "/api/v1/decisions/recent",
        "/api/v1/health",
    ):
        assert path in joined, path
    assert TOKEN_COMMAND in API_DOC.read_text()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Demo, str]]:
    gateway = free_port()
    with demo_running(
        tmp_path_factory.mktemp("docs-stack"),
        suffix="docs",
        redis_dbs=(13, 12),
        extra_args=("--gateway-port", str(gateway)),
    ) as demo:
        wait_for(
            "web server", lambda: httpx.get(demo.base + "/api/v1/health").is_success, demo, 120
        )
        gateway_base = f"http://127.0.0.1:{gateway}"
        wait_for(
            "the PD gateway", lambda: httpx.get(gateway_base + "/health").is_success, demo, 120
        )
        wait_for("the emulator's status", lambda: _emulator_reported(demo), demo, 120)
        yield demo, gateway_base


def _emulator_reported(demo: Demo) -> bool:
    done = demo.manage("emulate_fault", "status", "--max-age", "30")
    return done.returncode == 0


def _as_here(text: str, demo: Demo, gateway: str) -> str:
    """The documents' default addresses, as this stack's."""
    web = demo.base.removeprefix("http://")
    text = re.sub(r"(127\.0\.0\.1|localhost):8000\b", web, text)
    return re.sub(r"(127\.0\.0\.1|localhost):8001\b", gateway.removeprefix("http://"), text)


# Each curl reports its status on stderr, marked, whatever it writes to stdout.
CURL = "curl() { command curl -w '%{stderr}HTTP_STATUS %{http_code}\\n' \"$@\"; }\n"


def _run(
    command: Command, demo: Demo, gateway: str, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    lines = [line for line in command.lines()]
    script = CURL + "\n".join(_as_here(line, demo, gateway) for line in lines)
    if command.block:
        script += '\necho "DOCS_TOKEN=${TOKEN:-}"'
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_documented_command_runs_against_a_live_stack(stack: tuple[Demo, str]) -> None:
    demo, gateway = stack
    venv = str(Path(sys.executable).parent)
    env = {**demo.env, "PATH": f"{venv}:{demo.env.get('PATH', '')}", "BASE": demo.base}
    env.pop("VIRTUAL_ENV", None)
    failures: list[str] = []
    skipped: dict[str, str] = {}
    ran = 0
    # docs/api.md's own commands make $TOKEN: run its blocks before the curl examples need it.
    commands = sorted(documented_commands(), key=lambda c: "TOKEN=$(" not in c.text)
    done_already: set[str] = set()
    for command in commands:
        runnable = Command(
            command.where,
            "\n".join(line for line in command.lines() if not _skip(line, skipped, command.where)),
            command.block,
        )
        # A command documented in several places runs once (the first place it is found).
        if not runnable.lines() or (not command.block and runnable.text in done_already):
            continue
        done_already.add(runnable.text)
        started = time.monotonic()
        done = _run(runnable, demo, gateway, env)
        ran += len(runnable.lines())
        statuses = re.findall(r"HTTP_STATUS (\d+)", done.stderr)
        token = re.findall(r"^DOCS_TOKEN=(\S+)$", done.stdout, re.M)
        if token:
            env["TOKEN"] = token[-1]
        bad = [s for s in statuses if not s.startswith("2")]
        if done.returncode != 0 or bad:
            failures.append(
                f"{command.where}: {runnable.text.strip()[:300]}\n  -> exit {done.returncode}, "
                f"statuses {statuses}\n  {done.stderr.strip()[-800:]}"
            )
        print(
            f"{command.where}: {len(runnable.lines())} line(s) in {time.monotonic() - started:.1f} s"
        )
    print(f"ran {ran} documented command lines; not run: {len(skipped)}")
    for where, why in sorted(skipped.items()):
        print(f"  not run {where}: {why}")
    assert ran >= 40, ran
    assert not failures, "\n".join(failures)


def _skip(line: str, skipped: dict[str, str], where: str) -> bool:
    why = not_run_reason(line)
    if why is not None:
        skipped[f"{where} {line[:80]}"] = why
    return why is not None


def test_a_documented_example_without_its_token_is_refused(stack: tuple[Demo, str]) -> None:
    demo, _ = stack
    response = httpx.post(
        demo.base + "/api/v1/route", json={"origin": "pd-h20", "prompt_tokens": 24000}, timeout=10
    )
    assert response.status_code == 401
    assert response.json()["code"] == "unauthorized"
