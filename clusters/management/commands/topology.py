"""``manage.py topology apply FILE [--dry-run] [--prune] [--no-instances] [--json]`` and
``manage.py topology export [--format yaml|json]``: the inventory as a scenario file."""

from __future__ import annotations

import json
from argparse import ArgumentParser
from typing import Any

import yaml
from django.core.management.base import BaseCommand, CommandError

from clusters.topology import topology_apply, topology_export
from controlplane.audit import Actor
from scheduling.core.scenario import ScenarioError, scenario_load

# A bad scenario file is a usage error: exit status 2, like argparse.
BAD_INPUT = 2


class Command(BaseCommand):
    help = "Apply a scenario file to the inventory, or export the inventory as one."

    def add_arguments(self, parser: ArgumentParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        apply = sub.add_parser("apply", help="create/update the inventory from FILE")
        apply.add_argument("file", help="scenario file (YAML)")
        apply.add_argument("--dry-run", action="store_true", help="count changes, write nothing")
        apply.add_argument("--prune", action="store_true", help="delete what FILE omits")
        apply.add_argument(
            "--no-instances",
            action="store_true",
            help="leave every instance alone: agents register them (sites, clusters, profiles "
            "and links only)",
        )
        apply.add_argument("--json", action="store_true", help="print the counts as JSON")
        apply.add_argument("--verbose-changes", action="store_true", help="list every change")
        export = sub.add_parser("export", help="write the inventory as a scenario")
        export.add_argument("--format", choices=("yaml", "json"), default="yaml")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["action"] == "apply":
            self._apply(options)
        else:
            self._export(options["format"])

    def _apply(self, options: dict[str, Any]) -> None:
        try:
            scenario = scenario_load(options["file"])
            result = topology_apply(
                scenario,
                actor=Actor(label="cli", source="topology"),
                dry_run=options["dry_run"],
                prune=options["prune"],
                instances=not options["no_instances"],
            )
        except ScenarioError as exc:
            raise CommandError(str(exc), returncode=BAD_INPUT) from exc
        if options["verbose_changes"]:
            for line in result.changes:
                self.stderr.write(line)
        if options["json"]:
            self.stdout.write(json.dumps(result.counts()))
        else:
            prefix = "dry run, nothing written: " if options["dry_run"] else ""
            self.stdout.write(prefix + result.summary())

    def _export(self, fmt: str) -> None:
        try:
            data = topology_export()
        except ScenarioError as exc:
            raise CommandError(str(exc), returncode=BAD_INPUT) from exc
        if fmt == "json":
            self.stdout.write(json.dumps(data, indent=2))
        else:
            self.stdout.write(yaml.safe_dump(data, sort_keys=False, width=100), ending="")
