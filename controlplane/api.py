"""The NinjaAPI root at ``/api/v1``: one router per app, one error shape for all of them."""

from __future__ import annotations

import logging
from typing import Any

import redis
from django.core.exceptions import ObjectDoesNotExist, PermissionDenied
from django.db import DataError, IntegrityError, OperationalError
from django.http import Http404, HttpRequest, HttpResponse
from ninja import NinjaAPI, Status
from ninja.errors import AuthenticationError, HttpError, ValidationError

from controlplane.errors import UNAUTHORIZED_DETAIL, ApiError, validation_detail
from controlplane.health import dependencies_check
from controlplane.parser import StrictJsonParser
from controlplane.query import strict_query

log = logging.getLogger(__name__)

_ERROR_RESPONSES = {
    "400": "the body is not UTF-8 JSON",
    "401": "missing, invalid, expired or revoked credentials",
    "403": "the credentials lack the operation's scope",
    "404": "no such object (in the path, query or body)",
    "409": "stale version or conflicting state",
    "413": "request body over API_MAX_BODY_BYTES",
    "422": "input that breaks a rule (validation)",
}


class ControlPlaneApi(NinjaAPI):
    """ninja's API with the one error shape documented on every operation that can answer it
    (the handlers below produce these codes for any operation, so each operation lists them)."""

    def get_openapi_schema(
        self, *, path_prefix: str | None = None, path_params: dict[str, Any] | None = None
    ) -> Any:
        schema = super().get_openapi_schema(path_prefix=path_prefix, path_params=path_params)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components["Error"] = {
            "type": "object",
            "properties": {"detail": {"type": "string"}, "code": {"type": "string"}},
            "required": ["detail", "code"],
        }
        ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        for methods in schema.get("paths", {}).values():
            for method, op in methods.items():
                if not isinstance(op, dict) or "responses" not in op:
                    continue
                for code in _error_codes(method, op):
                    op["responses"].setdefault(code, {"description": _ERROR_RESPONSES[code], **ref})
        return schema


def _error_codes(method: str, op: dict[str, Any]) -> list[str]:
    codes = []
    if op.get("security"):
        codes += ["401", "403"]
    if op.get("parameters") or op.get("requestBody"):
        codes.append("422")
    if op.get("requestBody"):
        codes += ["400", "413"]
    if op.get("parameters") or op.get("requestBody"):
        codes.append("404")  # a path id, or an object named in the query or body
    if method in ("post", "patch", "put", "delete"):
        codes.append("409")
    return codes


api = ControlPlaneApi(
    title="PrfaaS control plane",
    version="1",
    description="Inventory, routing decisions, telemetry and plans for PrfaaS-PD serving.",
    urls_namespace="api-v1",
    docs_url="/docs",
    parser=StrictJsonParser(),
)
api.add_decorator(strict_query, mode="view")


def _error(request: HttpRequest, status: int, detail: str, code: str) -> HttpResponse:
    return api.create_response(request, {"detail": detail, "code": code}, status=status)


@api.exception_handler(ApiError)
def on_api_error(request: HttpRequest, exc: ApiError) -> HttpResponse:
    return _error(request, exc.status, exc.detail, exc.code)


@api.exception_handler(ValidationError)
def on_validation_error(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    return _error(request, 422, validation_detail(exc.errors), "invalid")


@api.exception_handler(AuthenticationError)
def on_authentication_error(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    return _error(request, 401, UNAUTHORIZED_DETAIL, "unauthorized")


@api.exception_handler(HttpError)
def on_http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
    return _error(request, exc.status_code, str(exc), f"http_{exc.status_code}")


@api.exception_handler(Http404)
def on_http404(request: HttpRequest, exc: Http404) -> HttpResponse:
    return _error(request, 404, str(exc) or "not found", "not_found")


@api.exception_handler(ObjectDoesNotExist)
def on_does_not_exist(request: HttpRequest, exc: ObjectDoesNotExist) -> HttpResponse:
    return _error(request, 404, str(exc) or "not found", "not_found")


@api.exception_handler(PermissionDenied)
def on_permission_denied(request: HttpRequest, exc: PermissionDenied) -> HttpResponse:
    return _error(request, 403, str(exc) or "permission denied", "forbidden")


@api.exception_handler(DataError)
def on_data_error(request: HttpRequest, exc: DataError) -> HttpResponse:
    # What PostgreSQL refuses to store (a NUL in a query string, a number out of its range):
    # bad input, not a server fault.
    return _error(
        request, 422, "a value cannot be stored (NUL character or out of range)", "invalid"
    )


@api.exception_handler(IntegrityError)
def on_integrity_error(request: HttpRequest, exc: IntegrityError) -> HttpResponse:
    # A write that lost a race with another (the services name the usual conflicts first).
    return _error(request, 409, "the change conflicts with a concurrent one; retry", "conflict")


@api.exception_handler(OperationalError)
def on_database_unavailable(request: HttpRequest, exc: OperationalError) -> HttpResponse:
    log.warning("database unavailable on %s: %s", request.path, exc)
    return _error(request, 503, "the database is unavailable; retry later", "database_unavailable")


@api.exception_handler(redis.exceptions.RedisError)
def on_live_store_unavailable(request: HttpRequest, exc: Exception) -> HttpResponse:
    log.warning("live store unavailable on %s: %s", request.path, exc)
    return _error(
        request, 503, "the live store is unavailable; retry later", "live_store_unavailable"
    )


@api.exception_handler(Exception)
def on_unexpected(request: HttpRequest, exc: Exception) -> HttpResponse:
    """Every other failure answers in the one error shape too (never an HTML page)."""
    log.exception("unexpected error on %s %s", request.method, request.path)
    return _error(request, 500, "internal error; it was logged", "internal_error")


@api.get("/health/live", auth=None, tags=["meta"])
def health_live(request: HttpRequest) -> dict[str, str]:
    """Liveness: the process answers. No database or Redis call (restart it when this fails)."""
    return {"status": "ok"}


@api.get("/health", auth=None, tags=["meta"], response={200: dict[str, Any], 503: dict[str, Any]})
def health(request: HttpRequest) -> Status[dict[str, Any]]:
    """Readiness, per dependency: 200 when the database, Redis and the Celery broker answer,
    503 naming the ones that do not. ``/route`` keeps answering through an outage from its
    snapshot and cached credentials (each answer says ``snapshot_age_s``), so a router's load
    balancer should probe liveness, and alerting readiness."""
    checks = dependencies_check()
    ready = all(c.up for c in checks)
    body = {
        "status": "ok" if ready else "degraded",
        "dependencies": {c.name: c.as_dict() for c in checks},
    }
    return Status(200 if ready else 503, body)


# App routers are added here, one per app (see each app's api.py).
from clusters.api import router as clusters_router  # noqa: E402
from controlplane.audit_api import router as audit_router  # noqa: E402
from controlplane.tokens_api import router as tokens_router  # noqa: E402

api.add_router("", clusters_router)
api.add_router("", audit_router)
api.add_router("", tokens_router)

from scheduling.api import router as scheduling_router  # noqa: E402

api.add_router("", scheduling_router)
