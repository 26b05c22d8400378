"""Template filter that shows what changed between two JSON objects (audit, policies)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from django import template

register = template.Library()


@dataclass(frozen=True)
class DiffLine:
    kind: str  # add, del or chg (CSS classes)
    text: str


def _show(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def diff_flat(before: Any, after: Any, prefix: str = "") -> list[DiffLine]:
    """Changed keys of two (nested) mappings, as ``path: old → new`` lines, sorted by path."""
    before = before if isinstance(before, dict) else ({} if before is None else {"": before})
    after = after if isinstance(after, dict) else ({} if after is None else {"": after})
    lines: list[DiffLine] = []
    for key in sorted(set(before) | set(after), key=str):
        path = f"{prefix}.{key}" if prefix and key != "" else (str(key) or prefix)
        old, new = before.get(key), after.get(key)
        if key in before and key not in after:
            lines.append(DiffLine("del", f"- {path}: {_show(old)}"))
        elif key in after and key not in before:
            lines.append(DiffLine("add", f"+ {path}: {_show(new)}"))
        elif isinstance(old, dict) and isinstance(new, dict):
            lines.extend(diff_flat(old, new, path))
        elif old != new:
            lines.append(DiffLine("chg", f"~ {path}: {_show(old)} → {_show(new)}"))
    return lines


@register.filter
def diff_lines(before: Any, after: Any) -> list[DiffLine]:
    return diff_flat(before, after)
