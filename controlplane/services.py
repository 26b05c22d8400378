"""Writes for access control: API tokens (created, bound, revoked), each one recorded in the
audit."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.utils import timezone

from controlplane.audit import Actor, change_record_create, snapshot
from controlplane.auth import token_cache_clear
from controlplane.errors import Conflict, Invalid, NotFound
from controlplane.models import ApiToken, TokenScope, token_hash
from scheduling.core.link import link_key, link_parse

TOKEN_PREFIX = "prfaas_"
# Characters of the token kept in clear for display; the rest of the 256-bit secret stays hidden.
DISPLAY_PREFIX_CHARS = 12


@dataclass(frozen=True)
class IssuedToken:
    """A freshly created token: ``secret`` is the only time the plain token exists."""

    token: ApiToken
    secret: str


def scopes_validate(scopes: list[str] | tuple[str, ...]) -> list[str]:
    if not scopes:
        raise Invalid("scopes: at least one scope is required", code="invalid")
    unknown = sorted(set(scopes) - set(TokenScope.values))
    if unknown:
        raise Invalid(
            f"scopes: unknown scope {', '.join(unknown)} (choose from {', '.join(TokenScope.values)})"
        )
    return sorted(set(scopes))


# Names of the inventory (instance names, links ``source->target``) as a binding holds them.
MAX_BOUND_NAMES = 10_000
MAX_NAME_CHARS = 301

# What the inventory lacks of a binding's names: (instances, links) unknown. The inventory app
# installs its lookup when it is ready (controlplane sits below it and cannot import it); until
# then nothing is refused for being unknown.
InventoryLookup = Callable[[Sequence[str], Sequence[tuple[str, str]]], tuple[list[str], list[str]]]
_inventory_lookup: InventoryLookup | None = None


def binding_inventory_register(lookup: InventoryLookup) -> None:
    """Install the inventory's lookup of unknown names (clusters.apps calls it)."""
    global _inventory_lookup
    _inventory_lookup = lookup


def _names_validate(field: str, names: Sequence[str], *, link: bool) -> list[str]:
    if len(names) > MAX_BOUND_NAMES:
        raise Invalid(f"{field}: at most {MAX_BOUND_NAMES} names")
    for i, name in enumerate(names):
        if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_CHARS:
            raise Invalid(f"{field}: [{i}] must be a name of 1 to {MAX_NAME_CHARS} characters")
        if link and link_parse(name) is None:
            raise Invalid(
                f"{field}: [{i}] must be source->target (cluster names, as emulate_fault and "
                f"the pages write a link), got {name!r}"
            )
    if link:
        pairs = [link_parse(name) for name in names]
        return sorted({link_key(*p) for p in pairs if p is not None})
    return sorted({name.strip() for name in names})


def _names_known(instances: list[str], links: list[str]) -> None:
    """Refuse names the inventory does not have: a binding to them would only show later, as
    a 403 ``outside_binding`` for the names the agent really reports."""
    if _inventory_lookup is None or not (instances or links):
        return
    pairs = [link_parse(name) for name in links]
    missing_instances, missing_links = _inventory_lookup(
        instances, [p for p in pairs if p is not None]
    )
    if missing_instances:
        raise Invalid(
            f"instances: no instance named {', '.join(map(repr, missing_instances))} in the "
            "inventory",
            code="unknown_instance",
        )
    if missing_links:
        raise Invalid(
            f"links: no link {', '.join(map(repr, missing_links))} in the inventory",
            code="unknown_link",
        )


@dataclass(frozen=True)
class TokenBinding:
    """What an agent or register token acts for, cleaned (see ``ApiToken``)."""

    instances: list[str]
    links: list[str]
    clusters: list[str]


def binding_validate(
    scopes: list[str],
    instances: Sequence[str],
    links: Sequence[str],
    fleet_wide: bool,
    clusters: Sequence[str] = (),
) -> TokenBinding:
    """The binding's names, cleaned and known to the inventory; an agent token must be bound or
    explicitly fleet-wide, and a register token bound to clusters or fleet-wide."""
    binding = TokenBinding(
        instances=_names_validate("instances", instances, link=False),
        links=_names_validate("links", links, link=True),
        clusters=_names_validate("clusters", clusters, link=False),
    )
    _names_known(binding.instances, binding.links)
    if TokenScope.ADMIN in scopes or fleet_wide:
        return binding
    if TokenScope.AGENT in scopes and not (binding.instances or binding.links or binding.clusters):
        raise Invalid(
            "instances: an agent token must be bound to its instances, clusters or links, "
            "or be marked fleet-wide",
            code="binding_required",
        )
    if TokenScope.REGISTER in scopes and not binding.clusters:
        raise Invalid(
            "clusters: a register token must be bound to the clusters it registers into, "
            "or be marked fleet-wide",
            code="binding_required",
        )
    return binding


def token_create(
    *,
    name: str,
    scopes: list[str] | tuple[str, ...],
    actor: Actor,
    expires_in_days: float | None = None,
    created_by: User | None = None,
    instances: Sequence[str] = (),
    links: Sequence[str] = (),
    fleet_wide: bool = False,
    clusters: Sequence[str] = (),
) -> IssuedToken:
    """Create a named token with the given scopes (and, for an agent, its binding); return it
    with its one-time secret."""
    name = name.strip()
    if not name:
        raise Invalid("name: must not be empty")
    clean_scopes = scopes_validate(scopes)
    binding = binding_validate(clean_scopes, instances, links, fleet_wide, clusters)
    if expires_in_days is not None and expires_in_days <= 0:
        raise Invalid("expires: must be a positive number of days")
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    expires_at = (
        timezone.now() + timedelta(days=expires_in_days) if expires_in_days is not None else None
    )
    try:
        with transaction.atomic():
            token = ApiToken.objects.create(
                name=name,
                prefix=secret[:DISPLAY_PREFIX_CHARS],
                secret_sha256=token_hash(secret),
                scopes=clean_scopes,
                expires_at=expires_at,
                created_by=created_by,
                instances=binding.instances,
                links=binding.links,
                clusters=binding.clusters,
                fleet_wide=fleet_wide,
            )
            change_record_create(
                actor=actor, action="create", obj=token, before=None, after=token_audit_view(token)
            )
    except IntegrityError as exc:
        raise Conflict(f"name: a token named {name!r} already exists") from exc
    return IssuedToken(token=token, secret=secret)


def token_revoke(*, name: str, actor: Actor) -> ApiToken:
    """Revoke a token by name. Other processes notice within the auth cache TTL."""
    with transaction.atomic():
        token = ApiToken.objects.select_for_update().filter(name=name).first()
        if token is None:
            raise NotFound(f"no token named {name!r}")
        if token.revoked_at is None:
            before = token_audit_view(token)
            token.revoked_at = timezone.now()
            token.save(update_fields=["revoked_at"])
            change_record_create(
                actor=actor,
                action="revoke",
                obj=token,
                before=before,
                after=token_audit_view(token),
            )
    token_cache_clear()
    return token


def token_bind(
    *,
    name: str,
    instances: Sequence[str],
    links: Sequence[str],
    fleet_wide: bool,
    actor: Actor,
    clusters: Sequence[str] = (),
) -> ApiToken:
    """Set what a token reports for and registers into (replacing its binding). Other
    processes notice within the auth cache TTL, as for a revocation."""
    with transaction.atomic():
        token = ApiToken.objects.select_for_update().filter(name=name).first()
        if token is None:
            raise NotFound(f"no token named {name!r}")
        binding = binding_validate(list(token.scopes), instances, links, fleet_wide, clusters)
        before = token_audit_view(token)
        token.instances, token.links = binding.instances, binding.links
        token.clusters, token.fleet_wide = binding.clusters, fleet_wide
        token.save(update_fields=["instances", "links", "clusters", "fleet_wide"])
        change_record_create(
            actor=actor, action="update", obj=token, before=before, after=token_audit_view(token)
        )
    token_cache_clear()
    return token


def token_audit_view(token: ApiToken) -> dict[str, object]:
    """What the audit keeps of a token: everything except the secret's hash."""
    data = snapshot(token)
    data.pop("secret_sha256", None)
    return data
