"""``manage.py plan FILE``: the planner's answer for a scenario, with the paper's baselines.

A thin wrapper: the model lives in :mod:`scheduling.core.planner`.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from scheduling.core.plan_report import (
    SplitSweep,
    ThresholdSweep,
    plan_to_dict,
    slo_plan_to_dict,
    sweep_split,
    sweep_threshold,
)
from scheduling.core.planner import (
    DEFAULT_LOAD,
    Evaluation,
    FleetSpec,
    PlannedWorkload,
    PlanResult,
    fleet_from_scenario,
    plan_for_ttft,
    plan_workload,
    workload_planned,
)
from scheduling.core.scenario import ScenarioError, scenario_load
from scheduling.core.sizing import (
    Advice,
    Sizing,
    advice_to_dict,
    sizing_advice,
    sizing_at_load,
    sizing_for_ttft,
)


def _num(x: float | None, fmt: str = ".2f") -> str:
    if x is None:
        return "-"
    if not math.isfinite(x):
        return "inf"
    return format(x, fmt)


def _guard_cost(c: dict[str, Any]) -> str:
    """What the link guard costs a PD cluster: the predicted share of its offers it refuses
    and the requests it keeps local (prefilled on the cluster, at local TTFT)."""
    refused = c.get("offload_refused_fraction") or 0.0
    kept = (c.get("link_congested_fraction") or 0.0) * (c.get("rate_rps") or 0.0)
    if refused <= 0:
        return ""
    return (
        f"; the link guard refuses {refused:.0%} of the offers (predicted), "
        f"{kept:.2f} req/s kept local"
    )


def _json_num(x: float) -> float | None:
    return x if math.isfinite(x) else None


class Command(BaseCommand):
    help = "Plan a scenario: best threshold and prefill/decode split, with baselines and gains."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", help="scenario YAML file")
        parser.add_argument("--json", action="store_true", help="print one JSON object")
        parser.add_argument(
            "--sweep", choices=("threshold", "split"), help="print a Figure-5 curve (CSV, or JSON)"
        )
        parser.add_argument("--plot", metavar="FILE.png", help="draw the Figure-5 curves")
        parser.add_argument("--cluster", help="PD cluster to sweep (default: the first)")
        parser.add_argument(
            "--threshold-step", type=float, default=100.0, help="threshold grid step in tokens"
        )
        parser.add_argument(
            "--load",
            type=float,
            default=DEFAULT_LOAD,
            metavar="F",
            help="share of the planned capacity to predict at (prfaas.at_load), and at which "
            f"link admission is judged (default {DEFAULT_LOAD})",
        )
        parser.add_argument(
            "--ttft-slo",
            type=float,
            metavar="S",
            help="goodput planning: the setting with the highest rate whose predicted P90 TTFT "
            "is within S seconds",
        )
        parser.add_argument(
            "--advise",
            action="store_true",
            help="how many more PrfaaS instances or Gbps would raise the rate (goodput with "
            "--ttft-slo, else the planned rate at --load), and by how much",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        step = opts["threshold_step"]
        if not (math.isfinite(step) and 0 < step <= 100_000):
            raise CommandError(
                f"--threshold-step: must be in (0, 100000] tokens, got {step:g}", returncode=2
            )
        load = opts["load"]
        if not (math.isfinite(load) and 0 < load < 1):
            raise CommandError(f"--load: must be within (0, 1), got {load:g}", returncode=2)
        slo = opts["ttft_slo"]
        if slo is not None and not (math.isfinite(slo) and 0 < slo <= 3600):
            raise CommandError(
                f"--ttft-slo: must be a positive number of seconds (at most 3600), got {slo:g}",
                returncode=2,
            )
        plot = Path(opts["plot"]) if opts["plot"] else None
        if plot is not None and not plot.parent.resolve().is_dir():
            raise CommandError(f"--plot: directory {plot.parent} does not exist", returncode=2)
        try:
            scenario = scenario_load(opts["file"])
            fleet = fleet_from_scenario(scenario)
            workload = workload_planned(scenario)
        except ScenarioError as exc:
            raise CommandError(str(exc), returncode=2) from None
        pd_names = [c.name for c in fleet.pd]
        cluster = opts["cluster"]
        if cluster is not None and cluster not in pd_names:
            raise CommandError(
                f"--cluster: {cluster!r} is not a pd cluster ({', '.join(pd_names)})", returncode=2
            )
        lengths, output_tokens, output_scv = (
            workload.lengths,
            workload.output_tokens,
            workload.output_scv,
        )
        slo_out: dict[str, Any] | None = None
        advice: tuple[Sizing, tuple[Advice, ...]] | None = None
        try:
            result = plan_workload(fleet, workload, threshold_step=step, load=load)
            if slo is not None:
                slo_out = slo_plan_to_dict(
                    *plan_for_ttft(
                        fleet,
                        lengths,
                        output_tokens,
                        slo,
                        threshold_step=step,
                        load=load,
                        output_scv=output_scv,
                        windows=workload.windows,
                    )
                )
            if opts["advise"]:
                advice = sizing_advice(fleet, self._sizing_of(workload, step, load, slo))
        except ValueError as exc:
            raise CommandError(f"{scenario.name}: cannot plan: {exc}", returncode=2) from None

        t_sweep = s_sweep = None
        if opts["sweep"] == "threshold" or plot is not None:
            t_sweep = sweep_threshold(
                fleet, lengths, output_tokens, result.prfaas, cluster=cluster, threshold_step=step
            )
        if opts["sweep"] == "split" or plot is not None:
            s_sweep = sweep_split(fleet, lengths, output_tokens, result.prfaas, cluster=cluster)

        if opts["sweep"] == "threshold":
            assert t_sweep is not None
            self._print_threshold_sweep(t_sweep, as_json=opts["json"])
        elif opts["sweep"] == "split":
            assert s_sweep is not None
            self._print_split_sweep(s_sweep, as_json=opts["json"])
        elif opts["json"]:
            out = plan_to_dict(result)
            out["scenario"] = scenario.name
            if slo_out is not None:
                out["slo"] = slo_out
            if advice is not None:
                out["advice"] = advice_to_dict(*advice)
            self.stdout.write(json.dumps(out, indent=2, allow_nan=False))
        else:
            self._print_table(scenario.name, result)
            if slo_out is not None:
                self._print_slo(slo_out)
            if advice is not None:
                self._print_advice(advice, slo)

        if plot is not None:
            assert t_sweep is not None and s_sweep is not None
            self._plot(plot, t_sweep, s_sweep, opts["sweep"])
            self.stderr.write(f"wrote {plot}")

    # ----------------------------------------------------------------------------------------

    @staticmethod
    def _sizing_of(
        workload: PlannedWorkload, step: float, load: float, slo: float | None
    ) -> Callable[[FleetSpec], Sizing]:
        """What sizing advice compares: goodput under the TTFT target, else the planned rate
        at the load (a trace's windows judged each, as the plan itself); with the share of
        requests the link guards refuse at that rate."""

        def sizing(fleet: FleetSpec) -> Sizing:
            if slo is not None:
                return sizing_for_ttft(
                    fleet,
                    workload.lengths,
                    workload.output_tokens,
                    slo,
                    threshold_step=step,
                    load=load,
                    output_scv=workload.output_scv,
                    windows=workload.windows,
                )
            return sizing_at_load(
                fleet,
                workload.lengths,
                workload.output_tokens,
                threshold_step=step,
                load=load,
                output_scv=workload.output_scv,
                windows=workload.windows,
            )

        return sizing

    def _print_slo(self, slo: dict[str, Any]) -> None:
        at = slo["at_rate"] or {}
        out = io.StringIO()
        out.write(
            f"\nFor a P{round(slo['quantile'] * 100)} TTFT within {slo['ttft_slo_s']:g} s: "
            f"{slo['rate_rps']:.2f} req/s (predicted P90 {_num(at.get('ttft_p90_s'))} s, "
            f"mean {_num(at.get('ttft_mean_s'))} s; Lambda_max of this setting "
            f"{slo['throughput_rps']:.2f} req/s)\n"
        )
        for name, c in slo["clusters"].items():
            here = (at.get("clusters") or {}).get(name) or {}
            out.write(
                f"  {name}: t = {c['threshold_tokens']:.0f}, N_p/N_d = {c['n_p']}/{c['n_d']}, "
                f"offload {here.get('offload_fraction', c['offload_fraction']):.3f}"
            )
            if here:
                out.write(_guard_cost(here))
            out.write("\n")
        self.stdout.write(out.getvalue().rstrip("\n"))

    def _print_advice(self, advice: tuple[Sizing, tuple[Advice, ...]], slo: float | None) -> None:
        base, changes = advice
        what = f"goodput under {slo:g} s" if slo is not None else "planned rate at the load"
        within = f" within {slo:g} s" if slo is not None else ""
        out = io.StringIO()
        out.write(f"\nSizing advice ({what}: {base.rate_rps:.2f} req/s now")
        # Shares that print as 0% are left out: a wide link's guard refuses nearly nothing.
        shown = base.refused_fraction >= 0.005
        if shown:
            out.write(f", the link guard refusing {base.refused_fraction:.0%} of requests")
        out.write("):\n")
        if not changes:
            out.write("  no added PrfaaS instance or link capacity raises it by 1% or more\n")
        for a in changes:
            out.write(f"  {a.change}: {a.rate_rps:.2f} req/s{within} ({a.gain:+.1%})")
            # What the change buys besides the rate: fewer requests kept local by the guard.
            if shown or a.refused_fraction >= 0.005:
                out.write(
                    f", refused share {base.refused_fraction:.0%} -> {a.refused_fraction:.0%}"
                )
            out.write("\n")
        self.stdout.write(out.getvalue().rstrip("\n"))

    def _print_table(self, name: str, r: PlanResult) -> None:
        def counts(ev: Evaluation, *, prfaas: bool, homog: bool) -> str:
            n_p = sum(c.n_p for c in ev.clusters)
            n_d = sum(c.n_d for c in ev.clusters)
            return f"{ev.n_prfaas if prfaas else '-'} / {'-' if not homog and n_p == 0 else n_p} / {n_d}"

        def thetas(ev: Evaluation) -> str:
            prf = sum(c.theta_prfaas or 0.0 for c in ev.clusters) if ev.n_prfaas else None
            pdp = (
                sum(c.theta_pd_p for c in ev.clusters if c.theta_pd_p is not None)
                if any(c.theta_pd_p is not None and c.n_p for c in ev.clusters)
                else None
            )
            pdd = sum(c.theta_pd_d for c in ev.clusters)
            return f"{_num(prf)} / {_num(pdp)} / {_num(pdd)}"

        cols = [
            ("PrfaaS-PD", r.prfaas, True, False),
            ("Homogeneous PD", r.homogeneous, False, True),
            ("Naive heterog.", r.naive_heterogeneous, True, False),
            (f"Equal-cost ({r.equal_cost_instances})", r.equal_cost_homogeneous, False, True),
        ]
        base = r.homogeneous.throughput_rps
        threshold = (
            _num(r.prfaas.clusters[0].threshold_tokens, ".0f")
            if len(r.prfaas.clusters) == 1
            else "per cluster"
        )
        rows = [
            ("Threshold t (tokens)", [threshold, "-", "-", "-"]),
            (
                "Offload fraction",
                [
                    _num(r.prfaas.clusters[0].offload_fraction, ".3f")
                    if len(r.prfaas.clusters) == 1
                    else "per cluster",
                    "-",
                    "1.000",
                    "-",
                ],
            ),
            ("N_prfaas / N_p / N_d", [counts(ev, prfaas=p, homog=h) for _, ev, p, h in cols]),
            (
                "Mean / P90 TTFT (s)",
                [f"{_num(ev.ttft_mean_s)} / {_num(ev.ttft_p90_s)}" for _, ev, _, _ in cols],
            ),
            ("Theta prfaas/pd-p/pd-d", [thetas(ev) for _, ev, _, _ in cols]),
            ("Lambda_max (req/s)", [_num(ev.throughput_rps) for _, ev, _, _ in cols]),
            (
                "Ratio vs homogeneous",
                [f"{ev.throughput_rps / base:.2f}x" if base > 0 else "-" for _, ev, _, _ in cols],
            ),
            ("Bottleneck", [f"{ev.bottleneck}" for _, ev, _, _ in cols]),
            (
                "Egress (Gbps)",
                [
                    _num(r.prfaas.egress_gbps, ".1f"),
                    "-",
                    _num(r.naive_heterogeneous.egress_gbps, ".1f"),
                    "-",
                ],
            ),
        ]
        width = [24, *[max(len(c[0]), 20) for c in cols]]
        out = io.StringIO()
        out.write(f"Scenario {name}: mean input {r.mean_input_tokens:.0f} tokens, ")
        out.write(f"output {r.output_tokens:.0f} tokens, threshold step {r.threshold_step:g}\n\n")
        out.write(
            "".join(
                h.ljust(w) for h, w in zip(["Metric", *[c[0] for c in cols]], width, strict=True)
            )
        )
        out.write("\n")
        for label, values in rows:
            out.write("".join(v.ljust(w) for v, w in zip([label, *values], width, strict=True)))
            out.write("\n")
        if len(r.prfaas.clusters) > 1:
            out.write("\nPer PD cluster (PrfaaS-PD):\n")
            for c in r.prfaas.clusters:
                out.write(
                    f"  {c.name}: share {c.share:.2f}, t = {c.threshold_tokens:.0f}, "
                    f"p = {c.offload_fraction:.3f}, N_p/N_d = {c.n_p}/{c.n_d}, "
                    f"{c.throughput_rps:.2f} req/s, egress {c.egress_gbps:.1f} of {c.link_gbps:g} Gbps\n"
                )
        if r.window_capacity_rps is not None:
            out.write(
                f"\nThe trace replayed window by window: its heaviest stretch sustains "
                f"{r.window_capacity_rps:.2f} req/s at this setting (its whole mix "
                f"{r.prfaas.throughput_rps:.2f}); the prediction below is made at "
                f"{r.prfaas.load:.0%} of it.\n"
            )
        if r.at_load is not None:
            a = r.at_load
            out.write(
                f"\nAt {r.prfaas.load:.0%} of Lambda_max ({a.rate_rps:.2f} req/s), with queueing: "
                f"TTFT mean {_num(a.ttft_mean_s)} s, P90 {_num(a.ttft_p90_s)} s; busiest link "
                f"{a.link_utilisation:.0%} of its line rate; {a.refused_fraction:.2%} of "
                f"decisions link_congested\n"
            )
            for at in a.clusters:
                out.write(
                    f"  {at.name}: offload {at.offload_fraction:.3f}"
                    + _guard_cost(
                        {
                            "rate_rps": at.rate_rps,
                            "link_congested_fraction": at.refused_fraction,
                            "offload_refused_fraction": at.offload_refused_fraction,
                        }
                    )
                    + "\n"
                )
        gains = r.gains
        out.write(
            "\nGains: "
            + ", ".join(f"{k.removeprefix('vs_')} {_num(v, '.3f')}x" for k, v in gains.items())
            + "\n"
        )
        self.stdout.write(out.getvalue().rstrip("\n"))

    def _print_threshold_sweep(self, sw: ThresholdSweep, *, as_json: bool) -> None:
        keys = (
            "threshold_tokens",
            "offload_fraction",
            "bound_prfaas",
            "bound_pd_p",
            "bound_pd_d",
            "throughput_rps",
        )
        rows = list(
            zip(
                sw.thresholds,
                sw.offload_fraction,
                sw.bound_prfaas,
                sw.bound_pd_p,
                sw.bound_pd_d,
                sw.throughput,
                strict=True,
            )
        )
        if as_json:
            points = [{k: _json_num(v) for k, v in zip(keys, row, strict=True)} for row in rows]
            self.stdout.write(
                json.dumps(
                    {
                        "sweep": "threshold",
                        "cluster": sw.cluster,
                        "n_p": sw.n_p,
                        "n_d": sw.n_d,
                        "points": points,
                    }
                )
            )
            return
        self._csv(keys, rows)

    def _print_split_sweep(self, sw: SplitSweep, *, as_json: bool) -> None:
        keys = ("n_p", "n_d", "bound_prfaas", "bound_pd_p", "bound_pd_d", "throughput_rps")
        total = sw.n_p[-1]
        rows = [
            (n, total - n, a, b, c, d)
            for n, a, b, c, d in zip(
                sw.n_p, sw.bound_prfaas, sw.bound_pd_p, sw.bound_pd_d, sw.throughput, strict=True
            )
        ]
        if as_json:
            points = [
                {k: _json_num(float(v)) for k, v in zip(keys, row, strict=True)} for row in rows
            ]
            for p in points:
                p["n_p"], p["n_d"] = int(p["n_p"] or 0), int(p["n_d"] or 0)
            self.stdout.write(
                json.dumps(
                    {
                        "sweep": "split",
                        "cluster": sw.cluster,
                        "threshold_tokens": sw.threshold_tokens,
                        "points": points,
                    }
                )
            )
            return
        self._csv(keys, rows)

    def _csv(self, keys: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(keys)
        for row in rows:
            writer.writerow([v if isinstance(v, int) else f"{v:.6g}" for v in row])
        self.stdout.write(buf.getvalue().rstrip("\n"))

    def _plot(
        self, path: Path, t_sweep: ThresholdSweep, s_sweep: SplitSweep, which: str | None
    ) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        panels = ["split", "threshold"] if which is None else [which]
        fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)

        def finite(values: tuple[float, ...]) -> list[float]:
            return [v if math.isfinite(v) else float("nan") for v in values]

        for ax, panel in zip(axes[0], panels, strict=True):
            if panel == "split":
                x: list[float] = [float(n) for n in s_sweep.n_p]
                ax.plot(x, finite(s_sweep.bound_prfaas), label="Theta_prfaas / p")
                ax.plot(x, finite(s_sweep.bound_pd_p), label="Theta_pd-p / (1-p)")
                ax.plot(x, finite(s_sweep.bound_pd_d), label="Theta_pd-d")
                ax.plot(x, finite(s_sweep.throughput), "k--", label="Lambda_max")
                ax.set_xlabel(f"N_p (prefill instances of {s_sweep.cluster})")
                ax.set_title(f"(a) split at t = {s_sweep.threshold_tokens:.0f}")
            else:
                x = [t / 1000 for t in t_sweep.thresholds]
                ax.plot(x, finite(t_sweep.bound_prfaas), label="Theta_prfaas / p")
                ax.plot(x, finite(t_sweep.bound_pd_p), label="Theta_pd-p / (1-p)")
                ax.plot(x, finite(t_sweep.throughput), "k--", label="Lambda_max")
                ax.set_xlabel("threshold t (K tokens)")
                ax.set_title(f"(b) threshold at N_p = {t_sweep.n_p}, N_d = {t_sweep.n_d}")
            top = max(
                (v for v in finite(t_sweep.throughput) + finite(s_sweep.throughput) if v == v),
                default=1.0,
            )
            ax.set_ylim(0, max(top * 2.0, 1e-6))
            ax.set_ylabel("req/s")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        try:
            fig.savefig(path, dpi=100)
        except OSError as exc:
            raise CommandError(
                f"--plot: cannot write {path}: {exc.strerror}", returncode=2
            ) from None
        finally:
            plt.close(fig)
