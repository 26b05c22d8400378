"""Where the shared material is found: beside the checkout, or beside the checkout a clean
clone was made from."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from controlplane.settings import shared_dir


def _git(*args: str) -> None:
    subprocess.run(["git", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    """A checkout with ``shared/`` beside it."""
    (tmp_path / "work" / "shared" / "scenarios").mkdir(parents=True)
    repo = tmp_path / "work" / "main"
    repo.mkdir()
    _git("-C", str(repo), "init", "-q")
    _git("-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q",
         "--allow-empty", "-m", "x")  # fmt: skip
    return repo


def test_a_clone_elsewhere_finds_the_material_beside_its_origin(
    origin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SHARED_DIR", raising=False)
    clone = tmp_path / "elsewhere" / "clone"
    _git("clone", "-q", str(origin), str(clone))
    assert shared_dir(clone) == (origin.parent / "shared").resolve()
    assert shared_dir(origin) == origin.parent / "shared"


def test_the_variable_wins_and_a_checkout_without_origin_keeps_its_own_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHARED_DIR", str(tmp_path / "mine"))
    assert shared_dir(tmp_path / "any") == tmp_path / "mine"
    monkeypatch.delenv("SHARED_DIR")
    lone = tmp_path / "lone"
    lone.mkdir()
    assert shared_dir(lone) == tmp_path / "shared"
