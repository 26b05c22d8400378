"""Instructions per routing decision, this working tree against another commit, in one run.

Wall-clock and CPU-time figures on a shared machine move by 30% or more from one run to the
next (other tenants, frequency scaling, cache contention): more than most changes to the
decision code. The count of instructions executed barely moves (a few percent: hash seeds are
fixed, addresses are not). So this script counts, with valgrind's cachegrind, the pure
decision (``route_decide`` one request at a time, and ``route_decide_many`` in batches of 100)
on ``bench/router_pure.py``'s fleet (64 prefill + 64 decode instances, two PrfaaS clusters)
and Mooncake conversation requests, for the working tree and for ``--against`` (default HEAD,
checked out in a temporary git worktree), and prints instructions per decision and the ratio.
The set-up (fleet, requests, prefix matches) is counted alone and subtracted.

It needs valgrind (Debian: ``apt-get install valgrind``). About a minute and a half per
``--repeat`` (six runs under cachegrind, each ~50x slower than native). It measures, it never
gates.

    python bench/instructions.py [--against REF] [--requests 2000] [--loops 3]
                                           [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "traces" / "mooncake" / "conversation_trace.jsonl"
LOOP = ROOT / "bench" / "support" / "decide_loop.py"


def instructions(root: Path, mode: str, args: argparse.Namespace) -> int:
    """Instructions the decide loop executes (cachegrind's I refs)."""
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    argv = [
        "valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
        sys.executable, str(LOOP), str(root), mode, str(args.requests), str(args.loops),
        str(args.trace),
    ]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"{mode} at {root} failed:\n{done.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def per_decision(root: Path, args: argparse.Namespace) -> dict[str, float]:
    base = instructions(root, "none", args)
    decisions = args.requests * args.loops
    return {
        mode: (instructions(root, mode, args) - base) / decisions for mode in ("single", "batch")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default="HEAD", help="git ref to compare with")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--loops", type=int, default=3, help="passes over the requests")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each; the median")
    parser.add_argument("--trace", type=Path, default=TRACE)
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (Debian: apt-get install valgrind)")
    if not args.trace.is_file():
        raise SystemExit(f"trace not found: {args.trace} (see --trace)")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", args.against], cwd=ROOT, capture_output=True, text=True
    )
    if commit.returncode != 0:
        raise SystemExit(f"not a commit: {args.against!r}")
    ref = commit.stdout.strip()
    with tempfile.TemporaryDirectory(prefix="prfaas-instructions-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "worktree", "add", "--quiet", "--detach", str(tree), ref], cwd=ROOT, check=True
        )
        try:
            runs: dict[str, list[dict[str, float]]] = {ref: [], "working tree": []}
            for _ in range(args.repeat):
                # Alternately, so that whatever drifts drifts for both.
                runs[ref].append(per_decision(tree, args))
                runs["working tree"].append(per_decision(ROOT, args))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
    median = {
        name: {m: statistics.median(r[m] for r in rs) for m in ("single", "batch")}
        for name, rs in runs.items()
    }
    decisions = args.requests * args.loops
    print(f"instructions per decision (cachegrind; {decisions} decisions per mode, the median")
    print(f"of {args.repeat} run(s); set-up subtracted)")
    print(f"  {'':14} {'single':>10} {'batch':>10}")
    for name, m in median.items():
        print(f"  {name:14} {m['single']:10.0f} {m['batch']:10.0f}")
    ratio = {m: median["working tree"][m] / median[ref][m] for m in ("single", "batch")}
    print(f"  ratio working tree / {ref}: single {ratio['single']:.3f}, batch {ratio['batch']:.3f}")
    print(
        json.dumps(
            {
                "against": ref,
                "single": round(median["working tree"]["single"]),
                "batch": round(median["working tree"]["batch"]),
                "single_against": round(median[ref]["single"]),
                "batch_against": round(median[ref]["batch"]),
                "ratio_single": round(ratio["single"], 3),
                "ratio_batch": round(ratio["batch"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
