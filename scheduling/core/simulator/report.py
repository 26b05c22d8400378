"""The simulation report: PNG plots and one self-contained HTML page (plots inline).

Also the optional per-request CSV. Matplotlib runs on the Agg backend (no display needed).
"""

from __future__ import annotations

import base64
import csv
import html
import io
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from scheduling.core.simulator.capacity import CapacityResult
    from scheduling.core.simulator.run import SimulationResult

CSV_COLUMNS = (
    "index",
    "origin",
    "arrival_s",
    "input_tokens",
    "output_tokens",
    "cached_tokens",
    "incremental_tokens",
    "route",
    "reason",
    "threshold",
    "prefill_instance",
    "decode_instance",
    "prefill_start_s",
    "prefill_end_s",
    "kv_ready_s",
    "first_token_s",
    "finish_s",
    "ttft_s",
    "kv_bytes",
    "cache_transfer_bytes",
    "dropped",
)


def requests_csv_write(result: SimulationResult, path: Path) -> int:
    """One row per request (kept with ``keep_requests=True``); returns the number of rows."""
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS)
        for r in result.per_request:
            writer.writerow(
                [
                    r.index,
                    r.origin,
                    f"{r.arrival_s:.6f}",
                    r.input_tokens,
                    r.output_tokens,
                    r.cached_tokens,
                    r.incremental_tokens,
                    r.route,
                    r.reason,
                    "" if math.isnan(r.threshold) or math.isinf(r.threshold) else int(r.threshold),
                    r.prefill_instance.name if r.prefill_instance else "",
                    r.decode_instance.name if r.decode_instance else "",
                    *(
                        "" if math.isnan(x) else f"{x:.6f}"
                        for x in (
                            r.prefill_start_s,
                            r.prefill_end_s,
                            r.kv_ready_s,
                            r.first_token_s,
                            r.finish_s,
                            r.first_token_s - r.arrival_s,
                        )
                    ),
                    int(r.kv_bytes),
                    int(r.cache_transfer_bytes),
                    r.dropped,
                ]
            )
    return len(result.per_request)


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def _plots(result: SimulationResult) -> dict[str, bytes]:
    plots: dict[str, bytes] = {}
    if result.per_request:
        ttft = np.array(
            [r.first_token_s - r.arrival_s for r in result.per_request if not r.dropped]
        )
        ttft = ttft[np.isfinite(ttft)]
        if ttft.size:
            fig, ax = plt.subplots(figsize=(6, 3.5))
            xs = np.sort(ttft)
            ax.plot(xs, np.arange(1, xs.size + 1) / xs.size)
            ax.set_xlabel("TTFT (s)")
            ax.set_ylabel("share of requests")
            ax.set_title("TTFT distribution")
            ax.grid(alpha=0.3)
            plots["ttft_cdf"] = _png(fig)
    if result.links:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        for link in result.links:
            series = np.asarray(link.series_gbps)
            ax.plot(
                np.arange(series.size),
                series,
                lw=0.6,
                label=f"{link.key} (cap {link.capacity_gbps:g})",
            )
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel("Gbps (1 s buckets)")
        ax.set_title("Cross-datacenter link utilisation")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        plots["link_gbps"] = _png(fig)
    if result.queue_t:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        t = np.asarray(result.queue_t)
        for cluster, depth in result.queue_prefill.items():
            ax.plot(t, depth, lw=0.7, label=f"prefill {cluster}")
        for cluster, depth in result.queue_decode.items():
            ax.plot(t, depth, lw=0.7, ls="--", label=f"decode waiting {cluster}")
        ax.plot(t, result.queue_in_system, lw=0.7, color="k", alpha=0.5, label="in system")
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel("requests")
        ax.set_title("Queue depths")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        plots["queues"] = _png(fig)
    return plots


def _rows(result: SimulationResult, capacity: CapacityResult | None) -> list[tuple[str, str]]:
    d: dict[str, Any] = result.to_dict()
    rows = [
        ("scenario / policy", f"{result.scenario} / {result.policy} (seed {result.seed})"),
        (
            "requests (finished / dropped / skipped lines)",
            f"{result.requests} ({result.finished} / {result.dropped} / {len(result.skipped_lines)})",
        ),
        (
            "offered rate / throughput (req/s)",
            f"{result.offered_rate_rps:.3f} / {result.throughput_rps:.3f}",
        ),
        (
            "TTFT mean / p50 / p90 / p99 (s)",
            " / ".join(
                f"{v:.3f}"
                for v in (result.ttft.mean, result.ttft.p50, result.ttft.p90, result.ttft.p99)
            ),
        ),
        ("TPOT mean / p99 (s)", f"{result.tpot_mean_s:.4f} / {result.tpot_p99_s:.4f}"),
        (
            "SLO attainment / goodput (req/s)",
            f"{result.slo_attainment:.3f} / {result.goodput_rps:.3f}",
        ),
        ("offload fraction", f"{result.offload_fraction:.3f}"),
        (
            "cache-hit fraction (tokens / requests)",
            f"{result.cache_hit_fraction:.3f} / {result.cache_hit_request_fraction:.3f}",
        ),
        (
            "link traffic: KV offloaded / cache transfers (GB)",
            f"{result.kv_bytes_offloaded / 1e9:.2f} / {result.cache_transfer_bytes / 1e9:.2f}",
        ),
        ("link mean / p99 (Gbps)", f"{d['link']['mean_gbps']:.2f} / {d['link']['p99_gbps']:.2f}"),
        ("thresholds", ", ".join(f"{k}: {v}" for k, v in result.thresholds.items()) or "none"),
        ("split (n_p / n_d)", ", ".join(f"{k}: {a}/{b}" for k, (a, b) in result.split.items())),
        ("backlog growth (req/s) / stable", f"{result.backlog_growth_rps:.4f} / {result.stable}"),
        ("wall time (s)", f"{result.wall_s:.2f}"),
    ]
    if capacity is not None:
        rows.insert(
            2,
            (
                "capacity (req/s), planner's Lambda_max",
                f"{capacity.capacity_rps:.3f}, {capacity.planned_capacity_rps or float('nan'):.3f}",
            ),
        )
        if capacity.goodput_capacity_rps is not None:
            rows.insert(
                3,
                (
                    "goodput capacity under the TTFT target (req/s)",
                    f"{capacity.goodput_capacity_rps:.3f}",
                ),
            )
    return rows


def report_write(
    result: SimulationResult, directory: Path, *, capacity: CapacityResult | None = None
) -> Path:
    """Write ``report.html`` (self-contained) and the PNGs into ``directory``; return the page."""
    directory.mkdir(parents=True, exist_ok=True)
    plots = _plots(result)
    for name, data in plots.items():
        (directory / f"{name}.png").write_bytes(data)
    table = "\n".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
        for k, v in _rows(result, capacity)
    )
    images = "\n".join(
        f'<figure><img alt="{name}" src="data:image/png;base64,'
        f'{base64.b64encode(data).decode()}"><figcaption>{name}</figcaption></figure>'
        for name, data in plots.items()
    )
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>Simulation: {html.escape(result.scenario)} / {html.escape(result.policy)}</title>
<style>body{{font-family:sans-serif;margin:2em}}th{{text-align:left;padding-right:1em}}
td,th{{border-bottom:1px solid #ddd;padding:.2em .5em}}figure{{display:inline-block}}</style>
</head><body>
<h1>Simulation of {html.escape(result.scenario)}, policy {html.escape(result.policy)}</h1>
<table>
{table}
</table>
{images}
</body></html>
"""
    path = directory / "report.html"
    path.write_text(page, encoding="utf-8")
    return path
