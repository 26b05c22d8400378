"""Strict query strings: a parameter the operation does not declare, or a single-valued one given
more than once, is a 422 naming it rather than silently ignored (or the last copy taken).

The OpenAPI schema lists each operation's query parameters and their types; this makes the
behaviour match it. :func:`strict_query` is a ninja view decorator, installed for the whole API
with ``api.add_decorator(strict_query, mode="view")``: it reads the operation's query models
once, when the API is built, and checks each request before the operation runs (so a malformed
query string is refused before credentials are looked at, like a malformed URL). Operations
that declare no query parameter are left as they are.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Collection
from typing import Any

from django.http import HttpRequest, HttpResponseBase
from ninja.errors import ValidationError
from ninja.params.models import QueryModel

# An operation's run: sync, or async (returning an awaitable of the response).
Run = Callable[..., Any]


def _declared_names(model: type[QueryModel]) -> set[str]:
    flatten_map = getattr(model, "__ninja_flatten_map__", None)
    if flatten_map:
        return set(flatten_map)
    return {field.alias or name for name, field in model.model_fields.items()}


def query_problems(
    declared: Collection[str], lists: Collection[str], request: HttpRequest
) -> list[dict[str, Any]]:
    """What is wrong with the request's query string for these declared names (``lists``: the
    ones that may repeat)."""
    problems = []
    for key in request.GET:
        if key not in declared:
            problems.append({"loc": ("query", key), "msg": "not a parameter of this operation"})
        elif key not in lists and len(request.GET.getlist(key)) > 1:
            problems.append({"loc": ("query", key), "msg": "given more than once"})
    return problems


def strict_query(run: Run) -> Run:
    """Wrap one operation's ``run`` (a bound method of ninja's ``Operation``)."""
    operation = run.__self__  # type: ignore[attr-defined]
    models = [m for m in operation.models if issubclass(m, QueryModel)]
    if not models:
        return run
    declared = set().union(*(_declared_names(m) for m in models))
    lists = set().union(*(getattr(m, "__ninja_collection_fields__", ()) for m in models))

    def refused(request: HttpRequest) -> HttpResponseBase | None:
        problems = query_problems(declared, lists, request)
        if problems:
            return operation.api.on_exception(request, ValidationError(problems))
        return None

    if inspect.iscoroutinefunction(run):

        @functools.wraps(run)
        async def checked_async(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            return refused(request) or await run(request, *args, **kwargs)

        return checked_async

    @functools.wraps(run)
    def checked(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        return refused(request) or run(request, *args, **kwargs)

    return checked
