"""The NinjaAPI root at ``/api/v1``: one router per app, one error shape for all of them."""

from __future__ import annotations

from django.core.exceptions import ObjectDoesNotExist, PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, HttpError, ValidationError

from controlplane.errors import ApiError, location_path

api = NinjaAPI(
    title="PrfaaS control plane",
    version="1",
    description="Inventory, routing decisions, telemetry and plans for PrfaaS-PD serving.",
    urls_namespace="api-v1",
    docs_url="/docs",
)


def _error(request: HttpRequest, status: int, detail: str, code: str) -> HttpResponse:
    return api.create_response(request, {"detail": detail, "code": code}, status=status)


@api.exception_handler(ApiError)
def on_api_error(request: HttpRequest, exc: ApiError) -> HttpResponse:
    return _error(request, exc.status, exc.detail, exc.code)


@api.exception_handler(ValidationError)
def on_validation_error(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    messages = []
    for err in exc.errors:
        # ninja prefixes locations with where the value came from ("body", "query", ...)
        loc = [p for p in err.get("loc", ()) if p not in ("body", "query", "path", "payload")]
        path = location_path(loc)
        messages.append(f"{path}: {err.get('msg', 'invalid')}" if path else err.get("msg", ""))
    return _error(request, 422, "; ".join(messages) or "invalid input", "invalid")


@api.exception_handler(AuthenticationError)
def on_authentication_error(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    return _error(request, 401, "missing, invalid, expired or revoked API token", "unauthorized")


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


@api.get("/health", auth=None, tags=["meta"])
def health(request: HttpRequest) -> dict[str, str]:
    """Liveness: the process answers. No database or Redis call."""
    return {"status": "ok"}


# App routers are added here, one per app (see each app's api.py).
from clusters.api import router as clusters_router  # noqa: E402
from controlplane.audit_api import router as audit_router  # noqa: E402

api.add_router("", clusters_router)
api.add_router("", audit_router)

from scheduling.api import router as scheduling_router  # noqa: E402

api.add_router("", scheduling_router)
