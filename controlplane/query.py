"""Strict query strings: a parameter the operation does not declare, a single-valued one given
more than once, or an integer one written as anything but an integer (``0.0``, ``1e3``, which
pydantic's lax parsing would take as 0 and 1000) is a 422 naming it rather than silently
ignored, the last copy taken, or a number guessed.

The OpenAPI schema lists each operation's query parameters and their types; this makes the
behaviour match it. ninja builds one query model per operation, so the check sits where that
model reads the request.
"""

from __future__ import annotations

import functools
import re
import types
import typing
from typing import Any

from django.http import HttpRequest
from ninja.errors import ValidationError
from ninja.params.models import QueryModel
from pydantic import BaseModel

_read_query = QueryModel.get_request_data.__func__  # type: ignore[attr-defined]


def _declared_names(model: type[QueryModel]) -> set[str]:
    flatten_map = getattr(model, "__ninja_flatten_map__", None)
    if flatten_map:
        return set(flatten_map)
    return {field.alias or name for name, field in model.model_fields.items()}


_INTEGER = re.compile(r"[+-]?[0-9]+")


def _is_int(annotation: Any) -> bool:
    """``int`` or ``int | None`` (not bool, which is an int to Python)."""
    if annotation is int:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return len(args) == 1 and args[0] is int
    return False


@functools.cache
def _integer_names(model: type[QueryModel]) -> frozenset[str]:
    """The operation's query parameters that are integers, by their name in the query string
    (a filter or pagination schema's fields are reached through ninja's flatten map)."""
    flatten_map = getattr(model, "__ninja_flatten_map__", None) or {
        field.alias or name: (name,) for name, field in model.model_fields.items()
    }
    names = set()
    for name, path in flatten_map.items():
        owner: type[BaseModel] | None = model
        annotation: Any = None
        for part in path:
            field = owner.model_fields.get(part) if owner is not None else None
            if field is None:
                annotation = None
                break
            annotation = field.annotation
            nested = isinstance(annotation, type) and issubclass(annotation, BaseModel)
            owner = annotation if nested else None
        if _is_int(annotation):
            names.add(name)
    return frozenset(names)


def query_problems(model: type[QueryModel], request: HttpRequest) -> list[dict[str, Any]]:
    """What is wrong with the request's query string for this operation's query model."""
    declared = _declared_names(model)
    lists = set(getattr(model, "__ninja_collection_fields__", ()))
    integers = _integer_names(model)
    problems = []
    for key in request.GET:
        if key not in declared:
            problems.append({"loc": ("query", key), "msg": "not a parameter of this operation"})
        elif key not in lists and len(request.GET.getlist(key)) > 1:
            problems.append({"loc": ("query", key), "msg": "given more than once"})
        elif key in integers and not _INTEGER.fullmatch(request.GET[key]):
            problems.append({"loc": ("query", key), "msg": "must be an integer"})
    return problems


def _strict_get_request_data(
    cls: type[QueryModel], request: HttpRequest, api: Any, path_params: Any
) -> Any:
    problems = query_problems(cls, request)
    if problems:
        raise ValidationError(problems)
    return _read_query(cls, request, api, path_params)


QueryModel.get_request_data = classmethod(_strict_get_request_data)  # type: ignore[method-assign,assignment]
