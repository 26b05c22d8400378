"""``manage.py token create|list|bind|revoke``: API tokens for routers, agents and scripts.

An agent token is bound to the instances, clusters and links it reports for (``--instance``,
``--cluster``, ``--link source->target``, repeatable; instances and links must exist in the
inventory) or made ``--fleet-wide``; a register token to the clusters it registers instances
into (``--cluster``)."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from controlplane.audit import CLI_ACTOR
from controlplane.errors import ApiError
from controlplane.models import ApiToken, TokenScope
from controlplane.selectors import token_list
from controlplane.services import token_bind, token_create, token_revoke


def _binding_arguments(parser: ArgumentParser) -> None:
    parser.add_argument(
        "--instance", action="append", default=[], help="an instance it reports for (repeat)"
    )
    parser.add_argument(
        "--cluster",
        action="append",
        default=[],
        help="a cluster whose instances it reports for and registers (repeat)",
    )
    parser.add_argument(
        "--link", action="append", default=[], help="a link source->target it reports for (repeat)"
    )
    parser.add_argument(
        "--fleet-wide", action="store_true", help="may report for every instance and link"
    )


def _reports_for(token: ApiToken) -> str:
    if token.fleet_wide or TokenScope.ADMIN in token.scopes:
        return "fleet-wide"
    clusters = [f"cluster:{name}" for name in token.clusters]
    return ",".join([*token.instances, *clusters, *token.links]) or "nothing"


class Command(BaseCommand):
    help = "Create, list and revoke API tokens. A token is printed once, at creation."

    def add_arguments(self, parser: ArgumentParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        create = sub.add_parser("create", help="create a token and print it (only this once)")
        create.add_argument("--name", required=True)
        create.add_argument(
            "--scope",
            action="append",
            required=True,
            choices=TokenScope.values,
            help="repeat for several scopes",
        )
        create.add_argument("--expires", type=float, metavar="DAYS", help="lifetime in days")
        _binding_arguments(create)
        sub.add_parser("list", help="list tokens (never their secrets)")
        bind = sub.add_parser(
            "bind", help="replace what an agent token reports for (and registers into)"
        )
        bind.add_argument("name")
        _binding_arguments(bind)
        revoke = sub.add_parser("revoke", help="revoke a token by name")
        revoke.add_argument("name")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            if options["action"] == "create":
                issued = token_create(
                    name=options["name"],
                    scopes=options["scope"],
                    expires_in_days=options["expires"],
                    actor=CLI_ACTOR,
                    instances=options["instance"],
                    links=options["link"],
                    fleet_wide=options["fleet_wide"],
                    clusters=options["cluster"],
                )
                self.stderr.write(
                    f"token {issued.token.name!r} with scopes {', '.join(issued.token.scopes)}"
                    " (shown once; store it now):"
                )
                self.stdout.write(issued.secret)
            elif options["action"] == "list":
                for token in token_list():
                    status = "revoked" if token.revoked_at else "active"
                    self.stdout.write(
                        f"{token.name}\t{token.prefix}...\t{','.join(token.scopes)}\t{status}"
                        f"\texpires={token.expires_at or 'never'}"
                        f"\tlast_used={token.last_used_at or 'never'}"
                        f"\treports_for={_reports_for(token)}"
                    )
            elif options["action"] == "bind":
                token = token_bind(
                    name=options["name"],
                    instances=options["instance"],
                    links=options["link"],
                    fleet_wide=options["fleet_wide"],
                    actor=CLI_ACTOR,
                    clusters=options["cluster"],
                )
                self.stdout.write(f"bound {token.name} to {_reports_for(token)}")
            else:
                token_revoke(name=options["name"], actor=CLI_ACTOR)
                self.stdout.write(f"revoked {options['name']}")
        except ApiError as exc:
            raise CommandError(exc.detail, returncode=2) from exc
