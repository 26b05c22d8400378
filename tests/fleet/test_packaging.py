"""The fleet package an operator installs beside engines (``pip install '.[fleet]'``): the
extra brings every distribution the fleet programs import (agent, gateway, emulator, fake
engine), none of Django's, and each program is installed as a command."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from importlib import import_module
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
PROGRAMS = (
    "fleet.agent.__main__",
    "fleet.gateway.__main__",
    "fleet.emulator.cli",
    "fleet.fake_engine.__main__",
    "fleet.supervisor.__main__",
)


def _closure(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` install, with their own dependencies."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        key = name + "[" + ",".join(sorted(req.extras)) + "]"
        if key in seen:
            continue
        seen.add(key)
        try:
            deps = requires(req.name) or []
        except PackageNotFoundError:
            continue
        for dep in deps:
            parsed = Requirement(dep)
            wanted = ["", *sorted(req.extras)]
            if parsed.marker is None or any(
                parsed.marker.evaluate({"extra": extra}) for extra in wanted
            ):
                todo.append(parsed)
    return {key.split("[")[0] for key in seen}


# Run in a fresh interpreter where a top-level module outside ``allowed`` cannot be imported,
# as if only the fleet extra were installed; optional imports (httpx's CLI) then fall back.
_PROBE = """
import importlib, importlib.abc, json, sys
allowed = set(json.loads(sys.argv[1]))
refused = set()
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in allowed or top in sys.stdlib_module_names or top.startswith("_"):
            return None
        refused.add(top)
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Refuse())
for program in sys.argv[2:]:
    importlib.import_module(program)
print(json.dumps(sorted(refused)))
"""


def test_the_fleet_programs_import_with_only_the_fleet_extra_installed() -> None:
    allowed = _closure(PROJECT["optional-dependencies"]["fleet"])
    assert "django" not in allowed
    modules = sorted(
        {
            module
            for module, dists in packages_distributions().items()
            if any(canonicalize_name(d) in allowed for d in dists)
        }
        | {"fleet", "scheduling"}
    )
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(modules), *PROGRAMS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"a fleet program needs more than the fleet extra:\n{done.stderr}"
    refused = json.loads(done.stdout)
    assert "django" not in refused  # nothing even tried


@pytest.mark.parametrize("script", sorted(PROJECT["scripts"]))
def test_each_fleet_program_is_installed_as_a_command_that_answers_help(
    script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    module, _, function = PROJECT["scripts"][script].partition(":")
    assert module in PROGRAMS
    main = getattr(import_module(module), function)
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    assert "usage:" in capsys.readouterr().out
