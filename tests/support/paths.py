"""Where the repository's own material is: the scenarios and traces the product ships, and the
captured engine output the tests decode (``tests/fixtures/*/SOURCE.md`` says where each is from).
Nothing in the suite reads anything outside the repository."""

from __future__ import annotations

from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
SCENARIOS = REPOSITORY / "scenarios"
TRACES = REPOSITORY / "traces"
FIXTURES = REPOSITORY / "tests" / "fixtures"
