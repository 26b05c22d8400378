"""Who may call the API: bearer tokens for machines, the Django session for browsers.

Use ``auth=TokenAuth("read")`` on a sync operation and ``auth=AsyncTokenAuth("router")`` on an
async one (``require_scope`` picks for you). Both accept ``Authorization: Bearer <token>`` or,
without that header, a logged-in session (unsafe methods then need the CSRF token). A request
without valid credentials gets 401; valid credentials without the scope get 403.

Scopes: a token holds the scopes it was created with, and ``admin`` implies all of them. A
session user gets them from the user's groups: ``viewer`` -> read; ``operator`` -> read and
operate; ``admin`` (and superusers) -> everything.

Agent tokens are bound to the instances, clusters and links they report for (``ApiToken``: a
bound token gets 403 ``outside_binding`` for anything else, :func:`binding_check`); register
tokens to the clusters they register into (:func:`cluster_binding_check`); users, admin
tokens and tokens marked ``fleet_wide`` are not bound.

Hot path: validated tokens are cached in process for ``API_TOKEN_CACHE_S`` seconds (default 5),
so a busy router costs no database query per request. Consequence: revoking a token takes
effect immediately in the process that revoked it and within that TTL everywhere else. Expiry
is checked on every request against the cached expiry time. ``last_used_at`` is written at
most once per ``API_TOKEN_LAST_USED_WRITE_S`` seconds (default 60) per token and process.

Database outage: when the check of an expired cache entry cannot reach the database, the
entry keeps standing for up to ``API_TOKEN_OUTAGE_S`` seconds since it was last confirmed
(default 15 minutes), and the database is not asked again for ``DB_RETRY_S``, so routing keeps
answering. A token never seen before gets 503 meanwhile; ``last_used_at`` writes are skipped.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import Error as DatabaseError
from django.http import HttpRequest
from django.utils import timezone
from ninja.security.base import AuthBase
from ninja.utils import check_csrf

from controlplane.errors import UNAUTHORIZED_DETAIL, ApiError, Forbidden, Unauthorized
from controlplane.health import db_call, db_connection_reset
from controlplane.models import ApiToken, TokenScope, token_hash

ALL_SCOPES = frozenset(TokenScope.values)
GROUP_SCOPES: dict[str, frozenset[str]] = {
    "viewer": frozenset({TokenScope.READ}),
    "operator": frozenset({TokenScope.READ, TokenScope.OPERATE}),
    "admin": ALL_SCOPES,
}
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})


@dataclass(frozen=True)
class Binding:
    """What an agent token may report for (``ApiToken`` instances, links and clusters: every
    instance of a bound cluster)."""

    instances: frozenset[str] = frozenset()
    links: frozenset[str] = frozenset()
    clusters: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Principal:
    """The authenticated caller, set as ``request.auth`` by the auth classes. ``binding``:
    None for a caller that may report for the whole fleet (users, admin and fleet-wide
    tokens)."""

    name: str
    scopes: frozenset[str]
    token_id: int | None = None
    user_id: int | None = None
    binding: Binding | None = None

    def has_scope(self, scope: str) -> bool:
        return scope in self.scopes or TokenScope.ADMIN in self.scopes


def binding_of(principal: Any) -> Binding | None:
    """The caller's binding (None: it may act for the whole fleet)."""
    return principal.binding if isinstance(principal, Principal) else None


def binding_check(
    principal: Any,
    *,
    instances: Iterable[str] = (),
    links: Iterable[str] = (),
    cluster_of: Mapping[str, str] | None = None,
) -> None:
    """Forbidden (403) naming the first instance or link outside the caller's binding; an
    instance of a bound cluster is inside it (``cluster_of``: instance -> cluster, needed
    only for a binding that names clusters)."""
    binding = binding_of(principal)
    if binding is None:
        return
    for name in instances:
        if name in binding.instances:
            continue
        if cluster_of is not None and cluster_of.get(name) in binding.clusters:
            continue
        raise Forbidden(f"this token is not bound to instance {name!r}", code="outside_binding")
    for key in links:
        if key not in binding.links:
            raise Forbidden(f"this token is not bound to link {key!r}", code="outside_binding")


def cluster_binding_check(principal: Any, cluster: str) -> None:
    """Forbidden (403) unless the caller may act for ``cluster`` (a register token's
    clusters)."""
    binding = binding_of(principal)
    if binding is not None and cluster not in binding.clusters:
        raise Forbidden(f"this token is not bound to cluster {cluster!r}", code="outside_binding")


@dataclass(frozen=True)
class _CachedToken:
    token_id: int
    name: str
    scopes: frozenset[str]
    expires_at: datetime | None
    binding: Binding | None = None

    @cached_property
    def principal(self) -> Principal:
        """The caller it stands for, made once (Principal is immutable): a route call checks
        a cached token on every request."""
        return Principal(
            name=self.name, scopes=self.scopes, token_id=self.token_id, binding=self.binding
        )

    @cached_property
    def expires_ts(self) -> float:
        """``expires_at`` as a POSIX time (infinity for none): compared with ``time.time()``
        per call instead of making an aware datetime each time."""
        return math.inf if self.expires_at is None else self.expires_at.timestamp()


def _cache_ttl() -> float:
    return float(settings.API_TOKEN_CACHE_S)


def _last_used_interval() -> float:
    return float(settings.API_TOKEN_LAST_USED_WRITE_S)


_lock = threading.Lock()
# token hash -> (monotonic time cached, token or None for unknown/revoked)
_token_cache: dict[str, tuple[float, _CachedToken | None]] = {}
# token id -> monotonic time of the last last_used_at write
_last_used_written: dict[int, float] = {}
_CACHE_MAX = 10_000
# monotonic time before which token checks do not try the database again (it just failed)
_db_skip_until = 0.0


class CredentialsUnavailable(ApiError):
    """A token could not be checked: the database is unreachable and the token is not cached."""

    status = 503
    code = "database_unavailable"


def token_cache_clear() -> None:
    """Forget every cached token (this process). Revocation calls it."""
    global _db_skip_until
    with _lock:
        _token_cache.clear()
        _last_used_written.clear()
        _db_skip_until = 0.0


def _cache_get(digest: str) -> tuple[bool, _CachedToken | None]:
    """(True, entry) when the cached entry stands without asking the database: fresh, or the
    database failed a moment ago and the entry is within the outage tolerance."""
    entry = _token_cache.get(digest)
    if entry is None:
        return False, None
    age = time.monotonic() - entry[0]
    if age <= _cache_ttl():
        return True, entry[1]
    if time.monotonic() < _db_skip_until and age <= float(settings.API_TOKEN_OUTAGE_S):
        return True, entry[1]
    return False, None


def _outage_fallback(digest: str, exc: DatabaseError) -> _CachedToken | None:
    """The database failed a token check: the cached entry if it is within the outage
    tolerance (the database is then left alone for ``DB_RETRY_S``), else 503."""
    global _db_skip_until
    _db_skip_until = time.monotonic() + float(settings.DB_RETRY_S)
    entry = _token_cache.get(digest)
    if entry is None or time.monotonic() - entry[0] > float(settings.API_TOKEN_OUTAGE_S):
        raise CredentialsUnavailable(
            "the credential store is unreachable and this token is not cached; retry later"
        ) from exc
    return entry[1]


def _cache_put(digest: str, cached: _CachedToken | None) -> None:
    with _lock:
        if len(_token_cache) >= _CACHE_MAX:
            _token_cache.clear()
        _token_cache[digest] = (time.monotonic(), cached)


def _token_fetch(digest: str) -> _CachedToken | None:
    row = db_call(
        lambda: (
            ApiToken.objects.filter(secret_sha256=digest, revoked_at__isnull=True)
            .values(
                "id", "name", "scopes", "expires_at", "instances", "links", "clusters", "fleet_wide"
            )
            .first()
        )
    )
    if row is None:
        return None
    scopes = frozenset(row["scopes"])
    fleet_wide = row["fleet_wide"] or TokenScope.ADMIN in scopes
    return _CachedToken(
        token_id=row["id"],
        name=row["name"],
        scopes=scopes,
        expires_at=row["expires_at"],
        binding=None
        if fleet_wide
        else Binding(
            instances=frozenset(row["instances"]),
            links=frozenset(row["links"]),
            clusters=frozenset(row["clusters"]),
        ),
    )


def _last_used_due(token_id: int) -> bool:
    now = time.monotonic()
    last = _last_used_written.get(token_id)
    if last is not None and now - last < _last_used_interval():
        return False
    _last_used_written[token_id] = now
    return True


def _last_used_write(token_id: int) -> None:
    if time.monotonic() < _db_skip_until:
        return  # the database is away; the next write after it is back records the use
    try:
        ApiToken.objects.filter(pk=token_id).update(last_used_at=timezone.now())
    except DatabaseError:
        db_connection_reset()


def _principal(cached: _CachedToken | None) -> Principal | None:
    if cached is None or cached.expires_ts <= time.time():
        return None
    return cached.principal


def _bearer(request: HttpRequest) -> str | None:
    """The bearer token, '' for a malformed Authorization header, None when there is none."""
    header = request.headers.get("Authorization")
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return ""
    return token.strip()


def token_principal(token: str) -> Principal | None:
    """Validate a plain token (sync): the caller it stands for, or None."""
    digest = token_hash(token)
    hit, cached = _cache_get(digest)
    if not hit:
        try:
            cached = _token_fetch(digest)
        except DatabaseError as exc:
            cached = _outage_fallback(digest, exc)
        else:
            _cache_put(digest, cached)
    principal = _principal(cached)
    if (
        principal is not None
        and principal.token_id is not None
        and _last_used_due(principal.token_id)
    ):
        _last_used_write(principal.token_id)
    return principal


async def atoken_principal(token: str) -> Principal | None:
    """Validate a plain token (async): no thread hop and no query on a cache hit."""
    digest = token_hash(token)
    hit, cached = _cache_get(digest)
    if not hit:
        try:
            cached = await sync_to_async(_token_fetch)(digest)
        except DatabaseError as exc:
            cached = _outage_fallback(digest, exc)
        else:
            _cache_put(digest, cached)
    principal = _principal(cached)
    if (
        principal is not None
        and principal.token_id is not None
        and _last_used_due(principal.token_id)
    ):
        await sync_to_async(_last_used_write)(principal.token_id)
    return principal


def user_scopes(user: Any) -> frozenset[str]:
    """Scopes a logged-in user holds through the user's groups."""
    if not user.is_active:
        return frozenset()
    if user.is_superuser:
        return ALL_SCOPES
    scopes: set[str] = set()
    for group in user.groups.values_list("name", flat=True):
        scopes |= GROUP_SCOPES.get(group, frozenset())
    return frozenset(scopes)


def _user_principal(user: Any) -> Principal:
    return Principal(name=user.get_username(), scopes=user_scopes(user), user_id=user.pk)


class TokenAuth(AuthBase):
    """Ninja auth for sync operations: bearer token or session, holding ``scope``."""

    openapi_type = "http"
    openapi_scheme = "bearer"

    def __init__(self, scope: str) -> None:
        if scope not in ALL_SCOPES:
            raise ValueError(f"unknown scope {scope!r}")
        self.scope = scope
        super().__init__()

    def _checked(self, principal: Principal | None) -> Principal | None:
        return scope_checked(principal, self.scope) if principal is not None else None

    def _session_allowed(self, request: HttpRequest) -> bool:
        if request.method in SAFE_METHODS or getattr(request, "_ninja_csrf_exempt", False):
            return True
        if check_csrf(request) is not None:
            raise Forbidden("CSRF check failed for a session request", code="csrf_failed")
        return True

    def __call__(self, request: HttpRequest) -> Principal | None:
        token = _bearer(request)
        if token is not None:
            return self._checked(token_principal(token) if token else None)
        user = getattr(request, "user", None)
        if user is None or not user.is_authenticated:
            return None
        self._session_allowed(request)
        return self._checked(_user_principal(user))


class AsyncTokenAuth(TokenAuth):
    """Ninja auth for async operations: same rules as :class:`TokenAuth`, awaited."""

    async def __call__(self, request: HttpRequest) -> Principal | None:  # type: ignore[override]
        token = _bearer(request)
        if token is not None:
            return self._checked(await atoken_principal(token) if token else None)
        user = await request.auser()
        if not user.is_authenticated:
            return None
        self._session_allowed(request)
        principal = await sync_to_async(_user_principal)(user)
        return self._checked(principal)


def scope_checked(principal: Principal, scope: str) -> Principal:
    """``principal`` if it holds ``scope``; Forbidden naming the scope otherwise."""
    if not principal.has_scope(scope):
        raise Forbidden(f"this operation needs the {scope!r} scope", code="forbidden")
    return principal


async def abearer_authorize(token: str, scope: str) -> Principal:
    """The caller a bearer token stands for, holding ``scope`` (the ASGI fast path's auth:
    the same cache, rules and errors as the ninja operations)."""
    principal = await atoken_principal(token) if token else None
    if principal is None:
        raise Unauthorized(UNAUTHORIZED_DETAIL)
    return scope_checked(principal, scope)


def require_scope(scope: str, *, asynchronous: bool = False) -> TokenAuth:
    """The auth object for an operation needing ``scope`` (``asynchronous`` for async views)."""
    return AsyncTokenAuth(scope) if asynchronous else TokenAuth(scope)
