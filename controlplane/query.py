"""Strict query strings: a parameter the operation does not declare, or a single-valued one given
more than once, is a 422 naming it rather than silently ignored (or the last copy taken).

The OpenAPI schema lists each operation's query parameters and their types; this makes the
behaviour match it. ninja builds one query model per operation, so the check sits where that
model reads the request.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja.errors import ValidationError
from ninja.params.models import QueryModel

_read_query = QueryModel.get_request_data.__func__  # type: ignore[attr-defined]


def _declared_names(model: type[QueryModel]) -> set[str]:
    flatten_map = getattr(model, "__ninja_flatten_map__", None)
    if flatten_map:
        return set(flatten_map)
    return {field.alias or name for name, field in model.model_fields.items()}


def query_problems(model: type[QueryModel], request: HttpRequest) -> list[dict[str, Any]]:
    """What is wrong with the request's query string for this operation's query model."""
    declared = _declared_names(model)
    lists = set(getattr(model, "__ninja_collection_fields__", ()))
    problems = []
    for key in request.GET:
        if key not in declared:
            problems.append({"loc": ("query", key), "msg": "not a parameter of this operation"})
        elif key not in lists and len(request.GET.getlist(key)) > 1:
            problems.append({"loc": ("query", key), "msg": "given more than once"})
    return problems


def _strict_get_request_data(
    cls: type[QueryModel], request: HttpRequest, api: Any, path_params: Any
) -> Any:
    problems = query_problems(cls, request)
    if problems:
        raise ValidationError(problems)
    return _read_query(cls, request, api, path_params)


QueryModel.get_request_data = classmethod(_strict_get_request_data)  # type: ignore[method-assign,assignment]
