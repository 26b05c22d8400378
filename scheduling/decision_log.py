"""The decision log: routing decisions kept for hours, searchable by request id and reason.

The request path keeps only a short capped Redis list of recent decisions (``traffic:recent``,
one write in its pipeline, no database). A beat task copies what is new in that list into
:class:`~scheduling.models.DecisionRecord` rows every couple of seconds, so the hot path stays as
it is and the log holds ``DECISION_LOG_RETENTION_S`` of decisions, bounded by
``DECISION_LOG_MAX_ROWS`` rows whatever the traffic. Entries are matched by a digest of their
JSON, so a copy that overlaps the previous one adds nothing twice. If more decisions arrive
between two copies than the list keeps, the oldest of them are lost to the log; the copy says
how many it may have missed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db.models import Q

from controlplane.redis_connection import redis_sync
from scheduling.models import DecisionRecord
from scheduling.traffic import RECENT_CAP, RECENT_KEY

logger = logging.getLogger(__name__)

# Entries this much older than the newest archived one are still compared (several web
# processes push to the list, so the list is only roughly in time order).
OVERLAP_S = 10.0
PAGE_SIZE = 50


@dataclass(frozen=True)
class ArchiveResult:
    """What one copy did: rows added, and whether the list had turned over since the last."""

    added: int
    overflowed: bool


def _record(raw: bytes) -> DecisionRecord | None:
    try:
        entry = json.loads(raw)
        inputs, decision = entry.get("inputs") or {}, entry.get("decision") or {}
        return DecisionRecord(
            ts=float(entry["ts"]),
            request_id=str(inputs.get("request_id") or "")[:200],
            origin=str(inputs.get("origin") or "")[:100],
            route=str(decision.get("route") or "")[:10],
            reason=str(decision.get("reason") or "")[:40],
            digest=hashlib.blake2b(raw, digest_size=16).hexdigest(),
            entry=entry,
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None  # not a decision entry: nothing to keep


def decision_log_archive(now: float | None = None) -> ArchiveResult:
    """Copy the new entries of the recent-decisions list into the log, then prune it."""
    now = time.time() if now is None else now
    raw: Sequence[bytes] = redis_sync().lrange(RECENT_KEY, 0, RECENT_CAP - 1)  # type: ignore[assignment]
    newest = DecisionRecord.objects.order_by("-ts").values_list("ts", flat=True).first()
    records = [r for r in map(_record, raw) if r is not None]
    if newest is not None:
        records = [r for r in records if r.ts >= newest - OVERLAP_S]
    overflowed = newest is not None and len(raw) >= RECENT_CAP and len(records) == len(raw)
    if overflowed:
        logger.warning("decision log: more than %d decisions since the last copy", RECENT_CAP)
    before = DecisionRecord.objects.count() if records else 0
    DecisionRecord.objects.bulk_create(records, ignore_conflicts=True, batch_size=500)
    added = DecisionRecord.objects.count() - before if records else 0
    decision_log_prune(now)
    return ArchiveResult(added=added, overflowed=overflowed)


def decision_log_prune(now: float | None = None) -> int:
    """Drop rows older than the retention, then the oldest beyond the row cap."""
    now = time.time() if now is None else now
    dropped, _ = DecisionRecord.objects.filter(
        ts__lt=now - settings.DECISION_LOG_RETENTION_S
    ).delete()
    cap = settings.DECISION_LOG_MAX_ROWS
    cut = DecisionRecord.objects.order_by("-ts").values_list("ts", flat=True)[cap : cap + 1]
    if cut:
        more, _ = DecisionRecord.objects.filter(ts__lte=cut[0]).delete()
        dropped += more
    return dropped


@dataclass(frozen=True)
class DecisionPage:
    """One page of the log, newest first; ``older``: the cursor of the next page, if any."""

    rows: list[dict[str, Any]]
    older: str | None
    total: int


def decision_log_page(
    request_id: str = "",
    origin: str = "",
    reason: str = "",
    before: str = "",
    limit: int = PAGE_SIZE,
) -> DecisionPage:
    """Decisions matching the filters (request id: exact), older than the cursor ``before``
    (``"{ts}:{id}"`` of the last row of the previous page; anything else means the newest)."""
    qs = DecisionRecord.objects.all()
    if request_id:
        qs = qs.filter(request_id=request_id)
    if origin:
        qs = qs.filter(origin=origin)
    if reason:
        qs = qs.filter(reason=reason)
    total = qs.count()
    cursor = _cursor_parse(before)
    if cursor is not None:
        ts, pk = cursor
        qs = qs.filter(Q(ts__lt=ts) | Q(ts=ts, id__lt=pk))
    rows = list(qs.order_by("-ts", "-id")[: limit + 1])
    last = rows[limit - 1] if len(rows) > limit else None
    older = f"{last.ts!r}:{last.pk}" if last is not None else None
    return DecisionPage(rows=[r.entry for r in rows[:limit]], older=older, total=total)


def _cursor_parse(raw: str) -> tuple[float, int] | None:
    ts, _, pk = raw.partition(":")
    try:
        value = float(ts)
    except ValueError:
        return None
    return (value, int(pk)) if pk.isdigit() and math.isfinite(value) else None


def decision_log_span() -> tuple[float | None, float | None]:
    """The oldest and the newest decision the log holds (unix seconds)."""
    qs = DecisionRecord.objects.order_by("ts").values_list("ts", flat=True)
    return qs.first(), DecisionRecord.objects.order_by("-ts").values_list("ts", flat=True).first()
