"""The scenario reader: the shared files load, extends merges as SCHEMA.md says, and every kind
of bad file is refused with the key path of the problem."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from scheduling.core.scenario import (
    EmpiricalDist,
    FixedDist,
    LognormalDist,
    ScenarioError,
    empirical_from_lengths,
    scenario_load,
    scenario_merge,
    scenario_parse,
    scenario_to_dict,
    trace_lengths,
    workload_length_distributions,
)


@pytest.fixture(scope="module")
def case_study_raw(scenarios_dir: Path) -> dict[str, Any]:
    return yaml.safe_load((scenarios_dir / "paper-case-study.yaml").read_text())


def write(tmp_path: Path, data: Any, name: str = "bad.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_the_case_study_loads_with_every_section(scenarios_dir: Path) -> None:
    s = scenario_load(scenarios_dir / "paper-case-study.yaml")
    assert s.name == "paper-case-study"
    assert [c.name for c in s.clusters] == ["prfaas-h200", "pd-h20"]
    assert s.cluster("prfaas-h200").decode_instances == 0
    assert s.cluster("pd-h20").instances == 8
    assert s.profile_for("H20").decode is not None
    assert s.profile_for("H20").decode.max_batch == 20  # type: ignore[union-attr]
    assert s.accelerator("H200").gpu_hour_cost == 2.0
    assert s.links[0].key == "prfaas-h200->pd-h20"
    assert s.workload is not None
    assert s.workload.input_tokens == LognormalDist(mu=9.9, sigma=1.0, min=128, max=131072)
    assert s.workload.output_tokens == FixedDist(value=1024)
    assert s.workload.origins == {"pd-h20": 1.0}
    assert s.expected is not None and s.expected["prfaas"]["n_p"] == 3
    assert s.source == (scenarios_dir / "paper-case-study.yaml").resolve()


def test_lookups_of_unknown_names_raise_key_error(scenarios_dir: Path) -> None:
    s = scenario_load(scenarios_dir / "paper-case-study.yaml")
    with pytest.raises(KeyError):
        s.cluster("nowhere")
    with pytest.raises(KeyError):
        s.profile_for("B200")
    with pytest.raises(KeyError):
        s.accelerator("B200")


def test_extends_replaces_lists_and_merges_mappings(scenarios_dir: Path) -> None:
    s = scenario_load(scenarios_dir / "two-pd-clusters.yaml")
    assert [c.name for c in s.clusters] == ["prfaas-h200", "pd-east", "pd-south"]
    assert [link.gbps for link in s.links] == [100, 10]
    assert s.workload is not None
    # workload merged key by key: origins from the child, distributions from the base.
    assert s.workload.origins == {"pd-east": 0.6, "pd-south": 0.4}
    assert isinstance(s.workload.input_tokens, LognormalDist)
    assert s.expected is None  # `expected: null` removed the base's key


def test_null_removes_a_key_and_a_trace_path_resolves_against_its_own_file(
    scenarios_dir: Path,
) -> None:
    s = scenario_load(scenarios_dir / "mooncake-conversation.yaml")
    assert s.workload is not None
    assert s.workload.input_tokens is None and s.workload.output_tokens is None
    assert s.workload.trace is not None
    assert s.workload.trace.path.is_absolute() and s.workload.trace.path.is_file()
    assert s.workload.trace.dequantize == "uniform"
    assert s.caches["pd-h20"].gib_per_instance == 1024


def test_a_trace_path_inherited_through_extends_still_points_at_the_trace(
    scenarios_dir: Path, tmp_path: Path
) -> None:
    child = write(
        tmp_path,
        {"extends": str(scenarios_dir / "mooncake-conversation.yaml"), "name": "child"},
        "c.yaml",
    )
    s = scenario_load(child)
    assert s.workload is not None and s.workload.trace is not None
    assert (
        s.workload.trace.path
        == (scenarios_dir.parent / "traces/mooncake/conversation_trace.jsonl").resolve()
    )


def test_drift_phases_are_read_in_order(scenarios_dir: Path) -> None:
    s = scenario_load(scenarios_dir / "drift.yaml")
    assert s.workload is not None
    assert [p.duration_s for p in s.workload.phases] == [3600, 10800, 7200]
    assert s.workload.phases[1].ramp is True
    assert (
        s.workload.phases[2].arrival is not None and s.workload.phases[2].arrival.rate_per_s == 2.7
    )


@pytest.mark.parametrize(
    "name", ["paper-case-study", "two-pd-clusters", "mooncake-conversation", "drift"]
)
def test_every_shared_scenario_round_trips_through_the_file_format(
    scenarios_dir: Path, name: str
) -> None:
    s = scenario_load(scenarios_dir / f"{name}.yaml")
    again = scenario_parse(scenario_to_dict(s), base_dir=Path("/"))
    assert again == s.__class__(**{**s.__dict__, "source": None})


def test_merge_follows_the_schema_rules() -> None:
    base = {"a": {"x": 1, "y": 2}, "l": [1, 2], "s": "keep", "gone": 3}
    over = {"a": {"y": 20, "z": 30}, "l": [9], "gone": None}
    assert scenario_merge(base, over) == {"a": {"x": 1, "y": 20, "z": 30}, "l": [9], "s": "keep"}


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(d: dict[str, Any]) -> None:
        target = d
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


def _append(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(d: dict[str, Any]) -> None:
        target: Any = d
        for key in path:
            target = target[key]
        target.append(copy.deepcopy(value))

    return mutate


BAD_FILES = [
    # kind, mutation, expected path, fragment of the message
    ("unknown key", _set(("colour",), "blue"), "colour", "unknown key"),
    ("unknown nested key", _set(("model", "heads"), 8), "model.heads", "unknown key"),
    (
        "wrong type",
        _set(("profiles", 1, "gpus_per_instance"), "8"),
        "profiles[1].gpus_per_instance",
        "expected an integer",
    ),
    (
        "wrong type of table",
        _set(("model", "kv_cache_mib"), "big"),
        "model.kv_cache_mib",
        "expected a list",
    ),
    (
        "unsorted table",
        _set(("profiles", 1, "prefill_seconds", 3), [2000, 1.0]),
        "profiles[1].prefill_seconds[3]",
        "not sorted",
    ),
    (
        "link pd -> pd",
        _set(("links", 0, "source"), "pd-h20"),
        "links[0].source",
        "prfaas cluster to a pd cluster",
    ),
    (
        "link prfaas -> prfaas",
        _set(("links", 0, "target"), "prfaas-h200"),
        "links[0].target",
        "prfaas cluster to a pd cluster",
    ),
    (
        "link to an unknown cluster",
        _set(("links", 0, "target"), "pd-mars"),
        "links[0].target",
        "unknown cluster",
    ),
    (
        "duplicate cluster names",
        _set(("clusters", 1, "name"), "prfaas-h200"),
        "clusters[1].name",
        "duplicate cluster",
    ),
    (
        "duplicate accelerators",
        _set(("accelerators", 1, "name"), "H200"),
        "accelerators[1].name",
        "duplicate accelerator",
    ),
    (
        "duplicate links",
        _append(("links",), {"source": "prfaas-h200", "target": "pd-h20", "gbps": 1}),
        "links[1]",
        "duplicate link",
    ),
    ("negative capacity", _set(("links", 0, "gbps"), -5), "links[0].gbps", "negative"),
    (
        "negative instances",
        _set(("clusters", 1, "prefill_instances"), -1),
        "clusters[1].prefill_instances",
        "negative",
    ),
    (
        "negative cost",
        _set(("accelerators", 0, "gpu_hour_cost"), -2.0),
        "accelerators[0].gpu_hour_cost",
        "positive",
    ),
    (
        "decode on a prfaas cluster",
        _set(("clusters", 0, "decode_instances"), 2),
        "clusters[0].decode_instances",
        "only prefills",
    ),
    (
        "unknown accelerator",
        _set(("clusters", 1, "accelerator"), "B200"),
        "clusters[1].accelerator",
        "unknown accelerator",
    ),
    (
        "missing required key",
        _set(
            ("clusters", 1),
            {
                "name": "pd-h20",
                "kind": "pd",
                "site": "x",
                "accelerator": "H20",
                "prefill_instances": 4,
            },
        ),
        "clusters[1].decode_instances",
        "required key is missing",
    ),
    ("bad kind", _set(("clusters", 1, "kind"), "decode"), "clusters[1].kind", "expected one of"),
    (
        "truncation upside down",
        _set(("workload", "input_tokens", "max"), 64),
        "workload.input_tokens.max",
        "must exceed min",
    ),
    (
        "unknown distribution",
        _set(("workload", "output_tokens"), {"distribution": "pareto"}),
        "workload.output_tokens.distribution",
        "expected one of",
    ),
    (
        "origins not summing to one",
        _set(("workload", "origins"), {"pd-h20": 0.5}),
        "workload.origins",
        "sum to 1",
    ),
    (
        "origin at a prfaas cluster",
        _set(("workload", "origins"), {"prfaas-h200": 1.0}),
        "workload.origins.prfaas-h200",
        "unknown key",
    ),
    (
        "hit fraction above one",
        _set(("workload", "prefix_hit_fraction"), 1.5),
        "workload.prefix_hit_fraction",
        "at most 1",
    ),
    ("unsupported version", _set(("version",), 2), "version", "unsupported schema version"),
    (
        "boolean for a number",
        _set(("links", 0, "rtt_ms"), True),
        "links[0].rtt_ms",
        "expected a number",
    ),
    (
        "event on an unknown link",
        _set(("events",), [{"at_s": 1, "link": "a->b", "gbps": 1}]),
        "events[0].link",
        "unknown link",
    ),
    (
        "cache of an unknown cluster",
        _set(("caches",), {"nowhere": {"gib_per_instance": 1}}),
        "caches.nowhere",
        "unknown key",
    ),
]


@pytest.mark.parametrize(
    ("kind", "mutate", "path", "fragment"), BAD_FILES, ids=[b[0] for b in BAD_FILES]
)
def test_a_bad_scenario_names_the_key_path(
    tmp_path: Path,
    case_study_raw: dict[str, Any],
    kind: str,
    mutate: Callable[[dict[str, Any]], None],
    path: str,
    fragment: str,
) -> None:
    data = copy.deepcopy(case_study_raw)
    mutate(data)
    with pytest.raises(ScenarioError) as info:
        scenario_load(write(tmp_path, data))
    assert info.value.path == path, kind
    assert fragment in info.value.message
    assert str(info.value) == f"{path}: {info.value.message}"


def test_a_missing_required_key_removed_by_null_is_reported(
    scenarios_dir: Path, tmp_path: Path
) -> None:
    child = {
        "extends": str(scenarios_dir / "paper-case-study.yaml"),
        "model": {"kv_cache_mib": None},
    }
    with pytest.raises(ScenarioError, match=r"^model\.kv_cache_mib: required key is missing$"):
        scenario_load(write(tmp_path, child))


def test_a_missing_extends_target_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError) as info:
        scenario_load(write(tmp_path, {"extends": "no-such-file.yaml", "name": "x"}))
    assert info.value.path == "extends"
    assert "no-such-file.yaml" in info.value.message


def test_circular_extends_is_reported(tmp_path: Path) -> None:
    write(tmp_path, {"extends": "b.yaml"}, "a.yaml")
    write(tmp_path, {"extends": "a.yaml"}, "b.yaml")
    with pytest.raises(ScenarioError) as info:
        scenario_load(tmp_path / "a.yaml")
    assert info.value.path == "extends"
    assert "circular extends" in info.value.message


def test_invalid_yaml_is_reported_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("version: 1\nname: [unclosed\n")
    with pytest.raises(ScenarioError, match=r"invalid YAML .* line"):
        scenario_load(path)


def test_a_file_that_is_not_a_mapping_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ScenarioError, match="expected a mapping at the top level"):
        scenario_load(path)


def test_a_missing_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="file not found"):
        scenario_load(tmp_path / "absent.yaml")


def test_a_missing_trace_file_is_reported(scenarios_dir: Path, tmp_path: Path) -> None:
    child = {
        "extends": str(scenarios_dir / "mooncake-conversation.yaml"),
        "workload": {"trace": {"path": "nowhere.jsonl"}},
    }
    with pytest.raises(ScenarioError) as info:
        scenario_load(write(tmp_path, child))
    assert info.value.path == "workload.trace.path"


def test_a_trace_and_distributions_together_are_refused(
    scenarios_dir: Path, tmp_path: Path
) -> None:
    child = {
        "extends": str(scenarios_dir / "mooncake-conversation.yaml"),
        "workload": {"input_tokens": {"distribution": "fixed", "value": 10}},
    }
    with pytest.raises(ScenarioError, match=r"^workload\.input_tokens: give either"):
        scenario_load(write(tmp_path, child))


def test_several_pd_clusters_need_origins(scenarios_dir: Path, tmp_path: Path) -> None:
    child = {"extends": str(scenarios_dir / "two-pd-clusters.yaml"), "workload": {"origins": None}}
    with pytest.raises(ScenarioError, match=r"^workload\.origins: required when there are several"):
        scenario_load(write(tmp_path, child))


def test_scenario_parse_resolves_extends_against_the_given_directory(scenarios_dir: Path) -> None:
    s = scenario_parse(
        {"extends": "paper-case-study.yaml", "name": "inline"}, base_dir=scenarios_dir
    )
    assert s.name == "inline"
    assert s.source is None


def test_trace_lengths_read_every_mooncake_row(scenarios_dir: Path) -> None:
    s = scenario_load(scenarios_dir / "mooncake-conversation.yaml")
    assert s.workload is not None and s.workload.trace is not None
    inputs, outputs = trace_lengths(s.workload.trace)
    assert len(inputs) == len(outputs) == 12031  # rows counted in traces/mooncake/SOURCE.md
    assert inputs.min() == 891 and inputs.max() == 126195


def test_a_trace_becomes_an_empirical_distribution_with_the_exact_mean(scenarios_dir: Path) -> None:
    s = scenario_load(scenarios_dir / "mooncake-conversation.yaml")
    assert s.workload is not None and s.workload.trace is not None
    inp, _ = workload_length_distributions(s.workload, bin_tokens=64)
    assert isinstance(inp, EmpiricalDist)
    inputs, _ = trace_lengths(s.workload.trace)
    weights = sum(w for _, w in inp.points)
    mean = sum(x * w for x, w in inp.points) / weights
    assert weights == len(inputs)
    assert mean == pytest.approx(inputs.mean(), rel=1e-12)


def test_empirical_from_lengths_counts_each_distinct_length() -> None:
    dist = empirical_from_lengths([5, 1, 5, 3])
    assert dist.points == ((1.0, 1.0), (3.0, 1.0), (5.0, 2.0))


def test_empirical_from_lengths_refuses_no_data_and_negative_lengths() -> None:
    with pytest.raises(ValueError, match="no lengths"):
        empirical_from_lengths([])
    with pytest.raises(ValueError, match="non-negative"):
        empirical_from_lengths([3, -1])


def test_a_null_inside_a_new_mapping_also_means_absent(scenarios_dir: Path, tmp_path: Path) -> None:
    child = {
        "extends": str(scenarios_dir / "paper-case-study.yaml"),
        "workload": {
            "input_tokens": None,
            "output_tokens": None,
            "trace": {
                "path": str(scenarios_dir.parent / "traces/mooncake/conversation_trace.jsonl"),
                "format": "mooncake",
                "dequantize": None,
            },
        },
    }
    s = scenario_load(write(tmp_path, child))
    assert s.workload is not None and s.workload.trace is not None
    assert s.workload.trace.dequantize == "none"


def test_a_link_may_set_its_kv_budget_and_target_utilisation(
    case_study_raw: dict[str, Any], tmp_path: Path
) -> None:
    data = copy.deepcopy(case_study_raw)
    data["links"][0].update(kv_budget_mib=12000, target_utilisation=0.7)
    scenario = scenario_load(write(tmp_path, data, "ok.yaml"))
    (link,) = scenario.links
    assert (link.kv_budget_bytes, link.target_utilisation) == (12000 * 2**20, 0.7)
    again = scenario_parse(scenario_to_dict(scenario), base_dir=tmp_path)
    assert again.links == scenario.links
    assert scenario_to_dict(scenario)["links"][0]["kv_budget_mib"] == 12000


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("kv_budget_mib", 0, "links[0].kv_budget_mib: must be positive"),
        ("kv_budget_mib", "lots", "links[0].kv_budget_mib: expected a number"),
        ("target_utilisation", 1.5, "links[0].target_utilisation: must be at most 1.0"),
        ("target_utilisation", 0, "links[0].target_utilisation: must be positive"),
    ],
)
def test_a_bad_link_limit_names_its_key(
    case_study_raw: dict[str, Any], tmp_path: Path, key: str, value: Any, message: str
) -> None:
    data = copy.deepcopy(case_study_raw)
    data["links"][0][key] = value
    with pytest.raises(ScenarioError, match=message.replace("[", r"\[").replace("]", r"\]")):
        scenario_load(write(tmp_path, data))
