"""``manage.py emulate_fault``: inject a fault into the running fleet emulator.

The fault goes on the emulator's Redis list (:data:`fleet.emulator.FAULTS_KEY`); the
emulator applies it at its next tick (a fraction of a second). Names are checked against the
inventory first, so a typo is an error here rather than a warning in the emulator's log, and
a fault is refused when no emulator is running (no fresh status in Redis), rather than queued
for whichever emulator starts next.

    manage.py emulate_fault link 'prfaas-h200->pd-h20' --gbps 2
    manage.py emulate_fault instance pd-h20-3 down
    manage.py emulate_fault surge --rate-scale 2 [--cluster pd-h20]
    manage.py emulate_fault prompts --scale 1.5
    manage.py emulate_fault status
"""

from __future__ import annotations

import json
import time
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from clusters.models import Cluster, ClusterKind, Instance, Link
from controlplane.redis_connection import redis_sync
from fleet.emulator import (
    STATUS_FRESH_S,
    FaultError,
    emulator_fault_push,
    emulator_status_read,
    fault_validate,
)
from scheduling.core.link import link_parse


class Command(BaseCommand):
    help = "Inject a fault into the running fleet emulator (link, instance, surge, prompts)."

    def add_arguments(self, parser: ArgumentParser) -> None:
        sub = parser.add_subparsers(dest="kind", required=True)
        link = sub.add_parser("link", help="set a link's capacity (degrade or restore it)")
        link.add_argument("link", help="source->target")
        link.add_argument("--gbps", type=float, required=True)
        inst = sub.add_parser("instance", help="take an instance down or bring it back")
        inst.add_argument("instance")
        inst.add_argument("state", choices=["down", "active"])
        surge = sub.add_parser("surge", help="scale the arrival rate")
        surge.add_argument("--rate-scale", type=float, required=True)
        surge.add_argument("--cluster", help="only the traffic arriving at this pd cluster")
        prompts = sub.add_parser("prompts", help="scale prompt lengths")
        prompts.add_argument("--scale", type=float, required=True)
        status = sub.add_parser("status", help="print the emulator's last status")
        status.add_argument(
            "--max-age",
            type=float,
            help="fail (status 2) when the last status is older than this many seconds "
            "(a health check)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        kind = options["kind"]
        client = redis_sync()
        if kind == "status":
            status = emulator_status_read(client)
            if status is None:
                raise CommandError("no emulator has reported a status", returncode=2)
            age = time.time() - float(status.get("ts", 0))
            if options["max_age"] is not None and (age > options["max_age"] or status["stopped"]):
                raise CommandError(
                    f"the emulator's last status is {age:.0f} s old"
                    + (" and says it stopped" if status["stopped"] else ""),
                    returncode=2,
                )
            self.stdout.write(json.dumps(status, indent=2, sort_keys=True))
            return
        if kind == "link":
            fault: dict[str, Any] = {"kind": kind, "link": options["link"], "gbps": options["gbps"]}
            source, target = link_parse(options["link"]) or ("", "")
            if not Link.objects.filter(source__name=source, target__name=target).exists():
                raise CommandError(
                    f"link: no link {options['link']} in the inventory", returncode=2
                )
        elif kind == "instance":
            fault = {"kind": kind, "instance": options["instance"], "state": options["state"]}
            if not Instance.objects.filter(name=options["instance"]).exists():
                raise CommandError(
                    f"instance: no instance {options['instance']!r} in the inventory", returncode=2
                )
        elif kind == "surge":
            fault = {"kind": kind, "rate_scale": options["rate_scale"]}
            if options["cluster"]:
                if not Cluster.objects.filter(
                    name=options["cluster"], kind=ClusterKind.PD
                ).exists():
                    raise CommandError(
                        f"cluster: no pd cluster {options['cluster']!r} in the inventory",
                        returncode=2,
                    )
                fault["cluster"] = options["cluster"]
        else:
            fault = {"kind": kind, "scale": options["scale"]}
        try:
            fault_validate(fault)
        except FaultError as exc:
            raise CommandError(str(exc), returncode=2) from exc
        self._emulator_running(client)
        queued = emulator_fault_push(client, fault)
        self.stdout.write(f"queued for the emulator: {json.dumps(queued, sort_keys=True)}")

    def _emulator_running(self, client: Any) -> None:
        """Refuse a fault no emulator would apply (it would wait in Redis for the next one)."""
        status = emulator_status_read(client)
        if status is None:
            why = "none has reported a status"
        elif status.get("stopped"):
            why = "the last one stopped"
        elif (age := time.time() - float(status.get("ts", 0))) > STATUS_FRESH_S:
            why = f"the last status is {age:.0f} s old"
        else:
            return
        raise CommandError(
            f"no fleet emulator is running ({why}), so the fault was not queued: start one "
            "with `python manage.py demo` (or `python manage.py emulate`) on the same Redis",
            returncode=2,
        )
