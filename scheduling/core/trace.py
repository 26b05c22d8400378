"""Request traces the simulator can replay: Mooncake JSONL and Azure LLM inference CSV.

A trace row becomes a :class:`TraceRow`. A row that cannot be read stops the read with a
:class:`TraceError` naming the file and line, unless ``skip_bad`` is set: then the row is
skipped and its line number recorded in :attr:`TraceRead.skipped_lines`, so that nothing is
dropped silently.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

TRACE_FORMATS = ("mooncake", "azure")
DEQUANTIZE_MODES = ("none", "uniform")


class TraceError(ValueError):
    """A trace file or one of its lines cannot be used."""

    def __init__(self, path: Path | str, line: int | None, message: str) -> None:
        self.path = str(path)
        self.line = line
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One request of a trace, with its arrival in seconds from the trace's first row."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] | None
    line: int


@dataclass(frozen=True, slots=True)
class TraceRead:
    """The usable rows of a trace (sorted by arrival) and the lines that were skipped."""

    rows: tuple[TraceRow, ...]
    skipped_lines: tuple[int, ...]


def _positive_int(value: object, key: str, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} must be a number, got {value!r}")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{key} must be a whole number of tokens, got {value!r}")
    number = int(value)
    if number < 0 or (number == 0 and not allow_zero):
        raise ValueError(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {number}")
    return number


def _mooncake_row(text: str, line: int, block_tokens: int | None) -> TraceRow:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise ValueError("expected a JSON object")
    for key in ("timestamp", "input_length", "output_length"):
        if key not in record:
            raise ValueError(f"missing key {key!r}")
    timestamp = record["timestamp"]
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float):
        raise ValueError(f"timestamp must be a number of milliseconds, got {timestamp!r}")
    if not math.isfinite(timestamp) or timestamp < 0:
        raise ValueError(f"timestamp must be finite and >= 0, got {timestamp!r}")
    input_tokens = _positive_int(record["input_length"], "input_length")
    output_tokens = _positive_int(record["output_length"], "output_length")
    hash_ids: tuple[int, ...] | None = None
    if "hash_ids" in record:
        raw = record["hash_ids"]
        if not isinstance(raw, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in raw
        ):
            raise ValueError("hash_ids must be a list of integers")
        if block_tokens is not None:
            expected = -(-input_tokens // block_tokens)
            if len(raw) != expected:
                raise ValueError(
                    f"hash_ids has {len(raw)} blocks, but input_length {input_tokens} needs "
                    f"{expected} blocks of {block_tokens} tokens"
                )
        hash_ids = tuple(raw)
    return TraceRow(timestamp / 1000.0, input_tokens, output_tokens, hash_ids, line)


def _azure_rows(
    path: Path, skip_bad: bool, skipped: list[int]
) -> Iterator[tuple[int, datetime, int, int]]:
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        wanted = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
        if header is None or [h.strip() for h in header] != wanted:
            raise TraceError(path, 1, f"expected the header {','.join(wanted)}, got {header!r}")
        for fields in reader:
            line = reader.line_num
            try:
                if len(fields) != 3:
                    raise ValueError(f"expected 3 fields, got {len(fields)}")
                when = datetime.fromisoformat(fields[0].strip())
                context = _positive_int(_int_field(fields[1], "ContextTokens"), "ContextTokens")
                generated = _positive_int(
                    _int_field(fields[2], "GeneratedTokens"), "GeneratedTokens"
                )
            except ValueError as exc:
                if not skip_bad:
                    raise TraceError(path, line, str(exc)) from None
                skipped.append(line)
                continue
            yield line, when, context, generated


def _int_field(text: str, key: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"{key} must be an integer, got {text!r}") from None


def trace_read(
    path: Path | str,
    fmt: str,
    *,
    skip_bad: bool = False,
    block_tokens: int | None = None,
) -> TraceRead:
    """Read a whole trace; arrivals are seconds after its earliest row, rows sorted by arrival.

    ``block_tokens`` (Mooncake) checks that each row has ``ceil(input_length / block_tokens)``
    prefix-block hashes.
    """
    path = Path(path)
    if fmt not in TRACE_FORMATS:
        raise TraceError(
            path, None, f"unknown trace format {fmt!r} (use {', '.join(TRACE_FORMATS)})"
        )
    if not path.is_file():
        raise TraceError(path, None, "trace file not found")
    skipped: list[int] = []
    rows: list[TraceRow] = []
    if fmt == "mooncake":
        with path.open(encoding="utf-8") as handle:
            for line, text in enumerate(handle, start=1):
                if not text.strip():
                    continue
                try:
                    rows.append(_mooncake_row(text, line, block_tokens))
                except ValueError as exc:
                    if not skip_bad:
                        raise TraceError(path, line, str(exc)) from None
                    skipped.append(line)
    else:
        parsed = list(_azure_rows(path, skip_bad, skipped))
        if parsed:
            first = min(when for _, when, _, _ in parsed)
            rows = [
                TraceRow((when - first).total_seconds(), context, generated, None, line)
                for line, when, context, generated in parsed
            ]
    if not rows:
        raise TraceError(path, None, "the trace has no usable rows")
    start = min(row.arrival_s for row in rows)
    rows.sort(key=lambda row: row.arrival_s)
    if start:
        rows = [
            TraceRow(
                row.arrival_s - start, row.input_tokens, row.output_tokens, row.hash_ids, row.line
            )
            for row in rows
        ]
    return TraceRead(tuple(rows), tuple(skipped))


def trace_dequantize(arrivals: list[float], mode: str) -> list[float]:
    """Spread requests that share a quantised timestamp evenly over their bucket.

    Mooncake's conversation trace stamps arrivals in 3 s buckets. A bucket's width is the gap
    to the next distinct timestamp (the median gap for the last one), so any quantum works.
    ``arrivals`` must be sorted; the order of requests is kept.
    """
    if mode == "none" or len(arrivals) < 2:
        return list(arrivals)
    if mode != "uniform":
        raise ValueError(f"unknown dequantize mode {mode!r} (use {', '.join(DEQUANTIZE_MODES)})")
    distinct = sorted(set(arrivals))
    gaps = [b - a for a, b in itertools.pairwise(distinct)]
    last_gap = sorted(gaps)[len(gaps) // 2] if gaps else 0.0
    width = {stamp: gap for stamp, gap in zip(distinct, [*gaps, last_gap], strict=True)}
    out: list[float] = []
    i = 0
    while i < len(arrivals):
        stamp = arrivals[i]
        j = i
        while j < len(arrivals) and arrivals[j] == stamp:
            j += 1
        count = j - i
        out.extend(stamp + width[stamp] * k / count for k in range(count))
        i = j
    return out
