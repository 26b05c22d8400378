"""The scenario reader's field checks: each takes a raw YAML value and its location (the key
path an error names), and returns the typed value or raises :class:`ScenarioError`.
Pure Python: no Django import here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from scheduling.core import bounds
from scheduling.core.bounds import Bound
from scheduling.core.scenario_types import (
    Distribution,
    EmpiricalDist,
    FixedDist,
    LognormalDist,
    ScenarioError,
    TableT,
    location_path,
)


def kind_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__


Loc = tuple[str | int, ...]


def error_at(loc: Loc, message: str) -> ScenarioError:
    return ScenarioError(location_path(loc), message)


def mapping_read(
    value: Any, loc: Loc, *, required: Sequence[str] = (), optional: Sequence[str] = ()
) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise error_at(loc, f"expected a mapping, got {kind_name(value)}")
    allowed = (*required, *optional)
    for key in value:
        if key not in allowed:
            raise error_at((*loc, str(key)), f"unknown key (allowed: {', '.join(allowed)})")
    for key in required:
        if key not in value:
            raise error_at((*loc, key), "required key is missing")
    return value


def list_read(value: Any, loc: Loc, *, nonempty: bool = False) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise error_at(loc, f"expected a list, got {kind_name(value)}")
    if nonempty and not value:
        raise error_at(loc, "must not be empty")
    return list(value)


def str_read(value: Any, loc: Loc, *, choices: Sequence[str] | None = None) -> str:
    if not isinstance(value, str) or not value:
        raise error_at(loc, f"expected a non-empty string, got {kind_name(value)}")
    if choices is not None and value not in choices:
        raise error_at(loc, f"expected one of {', '.join(choices)}, got {value!r}")
    return value


def number_read(
    value: Any,
    loc: Loc,
    *,
    minimum: float | None = 0.0,
    positive: bool = False,
    maximum: float | None = None,
) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise error_at(loc, f"expected a number, got {kind_name(value)}")
    number = float(value)
    if not np.isfinite(number):
        raise error_at(loc, "must be a finite number")
    if positive and number <= 0:
        raise error_at(loc, f"must be positive, got {value}")
    if minimum is not None and number < minimum:
        word = "negative" if minimum == 0 else f"below {minimum}"
        raise error_at(loc, f"must not be {word}, got {value}")
    if maximum is not None and number > maximum:
        raise error_at(loc, f"must be at most {maximum}, got {value}")
    return number


def number_within(value: Any, loc: Loc, bound: Bound) -> float:
    """A number within a physical bound (scheduling.core.bounds)."""
    number = number_read(value, loc, minimum=None)
    problem = bound.error(number)
    if problem is not None:
        raise error_at(loc, f"{problem}, got {value}")
    return number


def int_within(value: Any, loc: Loc, bound: Bound) -> int:
    number = int_read(value, loc, minimum=int(bound.low))
    if number > bound.high:
        raise error_at(loc, f"must be at most {bound.high:g} {bound.unit}, got {value}")
    return number


def table_within(value: Any, loc: Loc, values: Bound) -> TableT:
    table = table_read(value, loc)
    for i, (tokens, val) in enumerate(table):
        number_within(tokens, (*loc, i, 0), bounds.TABLE_TOKENS)
        number_within(val, (*loc, i, 1), values)
    return table


def int_read(value: Any, loc: Loc, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise error_at(loc, f"expected an integer, got {kind_name(value)}")
    if value < minimum:
        word = "negative" if minimum == 0 else f"below {minimum}"
        raise error_at(loc, f"must not be {word}, got {value}")
    return value


def bool_read(value: Any, loc: Loc) -> bool:
    if not isinstance(value, bool):
        raise error_at(loc, f"expected true or false, got {kind_name(value)}")
    return value


def table_read(value: Any, loc: Loc, *, min_points: int = 2) -> TableT:
    rows = list_read(value, loc)
    if len(rows) < min_points:
        raise error_at(loc, f"needs at least {min_points} [tokens, value] points, got {len(rows)}")
    points: list[tuple[float, float]] = []
    for i, row in enumerate(rows):
        if not isinstance(row, list | tuple) or len(row) != 2:
            raise error_at((*loc, i), f"expected a [tokens, value] pair, got {kind_name(row)}")
        tokens = number_read(row[0], (*loc, i, 0))
        val = number_read(row[1], (*loc, i, 1))
        if points and tokens <= points[-1][0]:
            raise error_at(
                (*loc, i),
                f"table not sorted by tokens: {row[0]} follows {points[-1][0]:g}",
            )
        points.append((tokens, val))
    return tuple(points)


def distribution_read(value: Any, loc: Loc) -> Distribution:
    body = mapping_read(
        value, loc, optional=("distribution", "mu", "sigma", "min", "max", "value", "points")
    )
    if "distribution" not in body:
        raise error_at((*loc, "distribution"), "required key is missing")
    kind = str_read(
        body["distribution"], (*loc, "distribution"), choices=("lognormal", "fixed", "empirical")
    )
    if kind == "lognormal":
        body = mapping_read(value, loc, required=("distribution", "mu", "sigma", "min", "max"))
        mu = number_read(body["mu"], (*loc, "mu"), minimum=None)
        sigma = number_read(body["sigma"], (*loc, "sigma"), positive=True)
        lo = number_read(body["min"], (*loc, "min"), positive=True)
        hi = number_read(body["max"], (*loc, "max"), positive=True)
        if hi <= lo:
            raise error_at((*loc, "max"), f"must exceed min ({lo:g}), got {hi:g}")
        return LognormalDist(mu=mu, sigma=sigma, min=lo, max=hi)
    if kind == "fixed":
        body = mapping_read(value, loc, required=("distribution", "value"))
        return FixedDist(value=number_read(body["value"], (*loc, "value")))
    body = mapping_read(value, loc, required=("distribution", "points"))
    points = table_read(body["points"], (*loc, "points"), min_points=1)
    if sum(w for _, w in points) <= 0:
        raise error_at((*loc, "points"), "weights must not all be zero")
    return EmpiricalDist(points=points)
