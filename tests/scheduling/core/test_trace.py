"""Trace readers: Mooncake JSONL and Azure CSV, corrupt lines, de-quantisation (acceptance 7)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scheduling.core.trace import TraceError, trace_dequantize, trace_read

GOOD = [
    {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]},
    {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 2]},
    {"timestamp": 3000, "input_length": 512, "output_length": 7, "hash_ids": [3]},
]


def _mooncake(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _good_lines() -> list[str]:
    return [json.dumps(row) for row in GOOD]


def test_mooncake_rows_are_read_in_seconds_with_their_prefix_blocks(tmp_path: Path) -> None:
    read = trace_read(_mooncake(tmp_path, _good_lines()), "mooncake", block_tokens=512)
    assert [r.arrival_s for r in read.rows] == [0.0, 0.0, 3.0]
    assert read.rows[0].hash_ids == (0, 1)
    assert [r.input_tokens for r in read.rows] == [1000, 600, 512]
    assert read.skipped_lines == ()


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"timestamp": 1, "output_length": 3}', "missing key 'input_length'"),
        ('{"timestamp": -5, "input_length": 10, "output_length": 3}', "timestamp must be finite"),
        ('{"timestamp": 1, "input_length": 0, "output_length": 3}', "input_length must be > 0"),
        ('{"timestamp": 1, "input_length": 10.5, "output_length": 3}', "whole number"),
        (
            '{"timestamp": 1, "input_length": 1000, "output_length": 3, "hash_ids": [1]}',
            "needs 2 blocks",
        ),
        (
            '{"timestamp": 1, "input_length": 10, "output_length": 3, "hash_ids": ["a"]}',
            "list of integers",
        ),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_a_corrupt_mooncake_line_stops_the_read_with_its_line_number(
    tmp_path: Path, bad: str, message: str
) -> None:
    lines = _good_lines()
    lines.insert(1, bad)
    with pytest.raises(TraceError) as caught:
        trace_read(_mooncake(tmp_path, lines), "mooncake", block_tokens=512)
    assert caught.value.line == 2
    assert ":2: " in str(caught.value)
    assert message in str(caught.value)


def test_skip_bad_skips_corrupt_lines_and_counts_them(tmp_path: Path) -> None:
    lines = _good_lines()
    lines.insert(1, "{not json")
    lines.append('{"timestamp": 9000, "input_length": -1, "output_length": 1}')
    read = trace_read(_mooncake(tmp_path, lines), "mooncake", skip_bad=True, block_tokens=512)
    assert read.skipped_lines == (2, 5)
    assert len(read.rows) == 3


def test_a_trace_with_no_usable_row_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no usable rows"):
        trace_read(_mooncake(tmp_path, ["{bad"]), "mooncake", skip_bad=True)


def test_a_missing_trace_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="not found"):
        trace_read(tmp_path / "absent.jsonl", "mooncake")


def test_azure_rows_become_seconds_after_the_first_row(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n",
        encoding="utf-8",
    )
    read = trace_read(path, "azure")
    assert read.rows[0].arrival_s == 0.0
    assert read.rows[1].arrival_s == pytest.approx(4.314579)
    assert read.rows[1].hash_ids is None


def test_a_corrupt_azure_line_names_its_line_and_skip_bad_counts_it(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "yesterday,396,109\n"
        "2023-11-16 18:15:52.0000000,12,x\n",
        encoding="utf-8",
    )
    with pytest.raises(TraceError) as caught:
        trace_read(path, "azure")
    assert caught.value.line == 3
    read = trace_read(path, "azure", skip_bad=True)
    assert read.skipped_lines == (3, 4)
    assert len(read.rows) == 1


def test_an_azure_file_with_the_wrong_header_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text("when,prompt,output\n", encoding="utf-8")
    with pytest.raises(TraceError, match="expected the header"):
        trace_read(path, "azure")


def test_uniform_dequantisation_spreads_each_bucket_over_its_width_in_order() -> None:
    spread = trace_dequantize([0.0, 0.0, 0.0, 3.0, 3.0, 6.0], "uniform")
    assert spread == pytest.approx([0.0, 1.0, 2.0, 3.0, 4.5, 6.0])
    assert trace_dequantize([0.0, 0.0, 3.0], "none") == [0.0, 0.0, 3.0]


def test_an_unknown_dequantize_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown dequantize mode"):
        trace_dequantize([0.0, 1.0], "poisson-ish")
