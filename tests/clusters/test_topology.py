"""Topology as code: scenario files in, scenario files out, through the CLI and the API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import Client

from clusters.models import (
    Accelerator,
    Cluster,
    Instance,
    Link,
    ModelProfile,
    PerformanceProfile,
    Site,
)
from controlplane.models import ChangeRecord
from tests.factories import api_token, bearer

pytestmark = pytest.mark.django_db

INVENTORY = (Site, Accelerator, ModelProfile, PerformanceProfile, Cluster, Instance, Link)


def topology(*args: str) -> str:
    out = StringIO()
    call_command("topology", *args, stdout=out, stderr=StringIO())
    return out.getvalue().strip()


def counts(text: str) -> dict[str, int]:
    """``created 1, updated 2, deleted 0, unchanged 3`` -> a dict."""
    return {k: int(v) for k, v in (part.strip().split(" ") for part in text.split(","))}


def database_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        m.__name__: sorted(m.objects.values_list("id", "version")) for m in INVENTORY
    }
    state["ChangeRecord"] = ChangeRecord.objects.count()
    return state


@pytest.fixture
def case_study(scenarios_dir: Path) -> Path:
    return scenarios_dir / "paper-case-study.yaml"


@pytest.fixture
def case_study_data(case_study: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(case_study.read_text())
    return data


@pytest.fixture
def admin_client() -> Client:
    return Client(headers=bearer(api_token("admin")[1]))


def test_applying_the_case_study_creates_two_clusters_twelve_instances_one_link(
    case_study: Path,
) -> None:
    result = counts(topology("apply", str(case_study)))
    assert Cluster.objects.count() == 2
    assert Instance.objects.count() == 12
    assert Link.objects.count() == 1
    pd = Cluster.objects.get(name="pd-h20")
    roles = list(pd.instances.order_by("name").values_list("name", "role"))
    assert roles[:4] == [(f"pd-h20-{i}", "prefill") for i in range(4)]
    assert roles[4:] == [(f"pd-h20-{i}", "decode") for i in range(4, 8)]
    total = sum(m.objects.count() for m in INVENTORY)
    assert result == {"created": total, "updated": 0, "deleted": 0, "unchanged": 0}


def test_apply_export_apply_reports_no_change(case_study: Path, tmp_path: Path) -> None:
    topology("apply", str(case_study))
    exported = tmp_path / "export.yaml"
    exported.write_text(topology("export") + "\n")
    before = database_state()
    result = counts(topology("apply", str(exported)))
    assert result["created"] == result["updated"] == result["deleted"] == 0
    assert result["unchanged"] == sum(m.objects.count() for m in INVENTORY)
    assert database_state() == before


def test_a_json_export_applies_back_with_no_change(case_study: Path, tmp_path: Path) -> None:
    topology("apply", str(case_study))
    exported = tmp_path / "export.json"
    exported.write_text(topology("export", "--format", "json"))
    data = json.loads(exported.read_text())
    assert list(data)[:3] == ["version", "name", "description"]
    assert {"model", "accelerators", "profiles", "clusters", "links"} <= set(data)
    assert counts(topology("apply", str(exported)))["updated"] == 0


def test_reapplying_the_same_file_changes_nothing(case_study: Path) -> None:
    topology("apply", str(case_study))
    again = counts(topology("apply", str(case_study)))
    assert again["created"] == again["updated"] == again["deleted"] == 0


@pytest.mark.parametrize(
    ("name", "clusters", "instances", "links"),
    [("two-pd-clusters.yaml", 3, 6 + 8 + 6, 2), ("mooncake-conversation.yaml", 2, 12, 1)],
)
def test_the_other_shared_scenarios_apply(
    scenarios_dir: Path, name: str, clusters: int, instances: int, links: int
) -> None:
    result = counts(topology("apply", str(scenarios_dir / name)))
    assert result["created"] > 0
    assert (Cluster.objects.count(), Instance.objects.count(), Link.objects.count()) == (
        clusters,
        instances,
        links,
    )


def test_dry_run_counts_but_writes_nothing(case_study: Path) -> None:
    out = topology("apply", str(case_study), "--dry-run")
    assert "dry run" in out
    assert counts(out.split(":", 1)[1])["created"] > 0
    assert all(m.objects.count() == 0 for m in INVENTORY)
    assert ChangeRecord.objects.count() == 0


def test_json_output_is_an_object_with_the_four_counts(case_study: Path) -> None:
    data = json.loads(topology("apply", str(case_study), "--json"))
    assert set(data) == {"created", "updated", "deleted", "unchanged"}
    assert data["created"] == sum(m.objects.count() for m in INVENTORY)


def test_every_applied_change_is_in_the_audit_log(case_study: Path) -> None:
    result = counts(topology("apply", str(case_study)))
    records = ChangeRecord.objects.filter(source="topology", action="create")
    assert records.count() == result["created"]
    assert set(records.values_list("object_type", flat=True)) == {
        f"clusters.{m._meta.model_name}" for m in INVENTORY
    }


def test_changed_counts_reconcile_instances_by_deterministic_name(
    case_study_data: dict[str, Any], tmp_path: Path
) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(case_study_data))
    topology("apply", str(path))
    case_study_data["clusters"][1].update(prefill_instances=3, decode_instances=5)
    path.write_text(yaml.safe_dump(case_study_data))
    result = counts(topology("apply", str(path)))
    assert result == {"created": 0, "updated": 1, "deleted": 0, "unchanged": result["unchanged"]}
    assert Instance.objects.get(name="pd-h20-3").role == "decode"
    assert Instance.objects.get(name="pd-h20-3").version == 2


def test_equal_counts_by_role_leave_renamed_instances_alone(case_study: Path) -> None:
    topology("apply", str(case_study))
    Instance.objects.filter(name="pd-h20-0").update(name="pd-h20-special")
    result = counts(topology("apply", str(case_study)))
    assert result["created"] == result["updated"] == result["deleted"] == 0
    assert Instance.objects.filter(name="pd-h20-special").exists()


def test_fewer_instances_in_the_file_delete_the_surplus(
    case_study_data: dict[str, Any], tmp_path: Path
) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(case_study_data))
    topology("apply", str(path))
    case_study_data["clusters"][0]["prefill_instances"] = 2
    path.write_text(yaml.safe_dump(case_study_data))
    result = counts(topology("apply", str(path)))
    assert result["deleted"] == 2
    names = Instance.objects.filter(cluster__name="prfaas-h200").values_list("name", flat=True)
    assert sorted(names) == ["prfaas-h200-0", "prfaas-h200-1"]


def test_a_file_of_clusters_without_instances_leaves_registered_instances_alone(
    case_study_data: dict[str, Any], tmp_path: Path
) -> None:
    for cluster in case_study_data["clusters"]:
        cluster["prefill_instances"] = 0
        if cluster["kind"] == "pd":
            cluster["decode_instances"] = 0
    path = tmp_path / "clusters-only.yaml"
    path.write_text(yaml.safe_dump(case_study_data))
    topology("apply", str(path))
    assert Cluster.objects.count() == 2 and not Instance.objects.exists()
    pd = Cluster.objects.get(name="pd-h20")
    Instance.objects.create(cluster=pd, name="pd-h20-joined", role="decode", origin="registered")
    result = counts(topology("apply", str(path)))
    assert result["deleted"] == result["created"] == 0
    assert Instance.objects.filter(name="pd-h20-joined").exists()
    # The export declares what the file owns: clusters, no instances; it applies back unchanged.
    exported = yaml.safe_load(topology("export"))
    assert {c["prefill_instances"] for c in exported["clusters"]} == {0}
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(exported))
    assert counts(topology("apply", str(again)))["updated"] == 0


def test_without_instances_apply_leaves_every_instance_to_its_agent(case_study: Path) -> None:
    result = counts(topology("apply", str(case_study), "--no-instances"))
    assert result["created"] > 0 and not Instance.objects.exists()
    assert Cluster.objects.count() == 2 and Link.objects.count() == 1


def test_a_declared_name_an_agent_registered_first_becomes_declared(case_study: Path) -> None:
    topology("apply", str(case_study), "--no-instances")
    pd = Cluster.objects.get(name="pd-h20")
    Instance.objects.create(cluster=pd, name="pd-h20-0", role="prefill", origin="registered")
    topology("apply", str(case_study))
    assert Instance.objects.filter(cluster=pd).count() == 8
    assert Instance.objects.get(name="pd-h20-0").origin == "declared"


def test_prune_deletes_what_the_file_does_not_mention(
    case_study: Path, scenarios_dir: Path
) -> None:
    topology("apply", str(scenarios_dir / "two-pd-clusters.yaml"))
    topology("apply", str(case_study))
    assert Cluster.objects.count() == 4
    result = counts(topology("apply", str(case_study), "--prune"))
    assert result["deleted"] > 0
    assert sorted(Cluster.objects.values_list("name", flat=True)) == ["pd-h20", "prfaas-h200"]
    assert sorted(Site.objects.values_list("name", flat=True)) == ["dc-compute", "dc-local"]
    assert Link.objects.count() == 1
    assert Instance.objects.count() == 12


def test_without_prune_objects_outside_the_file_stay(case_study: Path, scenarios_dir: Path) -> None:
    topology("apply", str(scenarios_dir / "two-pd-clusters.yaml"))
    result = counts(topology("apply", str(case_study)))
    assert Cluster.objects.filter(name="pd-east").exists()
    assert result["deleted"] == 2  # prfaas-h200 goes back from 6 to 4 instances


def test_a_refusal_half_way_rolls_the_whole_apply_back(
    case_study: Path, case_study_data: dict[str, Any], tmp_path: Path
) -> None:
    topology("apply", str(case_study))
    before = database_state()
    # pd-h20 becomes a prfaas cluster: its decode instances would go, then the kind change is
    # refused because the existing link (kept: no --prune) still ends there.
    case_study_data["clusters"][1] = {
        "name": "pd-h20",
        "kind": "prfaas",
        "site": "dc-local",
        "accelerator": "H20",
        "prefill_instances": 8,
    }
    case_study_data["links"] = []
    case_study_data["workload"].pop("origins", None)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(case_study_data))
    with pytest.raises(CommandError) as exc:
        topology("apply", str(path))
    assert exc.value.returncode == 2
    assert str(exc.value).startswith("clusters[1]")
    assert database_state() == before


# Bad files: each names its key path, exits 2, changes nothing; the API says the same with 422.


def _unknown_key(d: dict[str, Any]) -> None:
    d["clusters"][0]["colour"] = "blue"


def _wrong_type(d: dict[str, Any]) -> None:
    d["accelerators"][0]["gpu_hour_cost"] = "cheap"


def _unsorted_table(d: dict[str, Any]) -> None:
    table = d["profiles"][0]["prefill_seconds"]
    table[0], table[1] = table[1], table[0]


def _link_pd_to_pd(d: dict[str, Any]) -> None:
    d["links"][0]["source"] = "pd-h20"


def _duplicate_names(d: dict[str, Any]) -> None:
    d["clusters"][1]["name"] = "prfaas-h200"


def _negative_capacity(d: dict[str, Any]) -> None:
    d["links"][0]["gbps"] = -5


def _missing_extends(d: dict[str, Any]) -> None:
    d.clear()
    d.update({"extends": "no-such-base.yaml", "name": "orphan"})


BAD_FILES = {
    "unknown key": (_unknown_key, "clusters[0].colour"),
    "wrong type": (_wrong_type, "accelerators[0].gpu_hour_cost"),
    "unsorted table": (_unsorted_table, "profiles[0].prefill_seconds[1]"),
    "link pd -> pd": (_link_pd_to_pd, "links[0].source"),
    "duplicate names": (_duplicate_names, "clusters[1].name"),
    "negative capacity": (_negative_capacity, "links[0].gbps"),
    "missing extends target": (_missing_extends, "extends"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_file_exits_2_naming_the_key_path_and_changes_nothing(
    case: str,
    case_study: Path,
    case_study_data: dict[str, Any],
    tmp_path: Path,
    admin_client: Client,
    settings: Any,
) -> None:
    topology("apply", str(case_study))
    spoil, key_path = BAD_FILES[case]
    spoil(case_study_data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(case_study_data))
    before = database_state()

    with pytest.raises(CommandError) as exc:
        topology("apply", str(path))
    assert exc.value.returncode == 2
    message = str(exc.value)
    assert message.startswith(key_path + ":"), message
    assert database_state() == before

    settings.SCENARIOS_DIR = tmp_path  # where the API resolves `extends`, like the CLI here
    response = admin_client.post(
        "/api/v1/topology", data=json.dumps(case_study_data), content_type="application/json"
    )
    assert response.status_code == 422
    assert response.json() == {"detail": message, "code": "invalid_scenario"}
    assert database_state() == before


def test_the_command_exits_with_status_2_on_a_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("version: 1\nname: x\nunexpected: true\n")
    env = {**os.environ, "PYTHONPATH": str(settings.BASE_DIR)}
    proc = subprocess.run(
        [
            sys.executable,
            str(Path(settings.BASE_DIR) / "manage.py"),
            "topology",
            "apply",
            str(path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "unexpected: unknown key" in proc.stderr


def test_a_missing_file_exits_2(tmp_path: Path) -> None:
    with pytest.raises(CommandError) as exc:
        topology("apply", str(tmp_path / "nowhere.yaml"))
    assert exc.value.returncode == 2
    assert "file not found" in str(exc.value)


def test_exporting_an_empty_inventory_exits_2_saying_why() -> None:
    with pytest.raises(CommandError) as exc:
        topology("export")
    assert exc.value.returncode == 2
    assert str(exc.value).startswith("model:")


# The API


def test_api_export_is_the_cli_export(case_study: Path, admin_client: Client) -> None:
    topology("apply", str(case_study))
    response = admin_client.get("/api/v1/topology")
    assert response.status_code == 200
    assert response.json() == json.loads(topology("export", "--format", "json"))


def test_api_apply_of_the_api_export_changes_nothing(
    case_study: Path, admin_client: Client
) -> None:
    topology("apply", str(case_study))
    exported = admin_client.get("/api/v1/topology").json()
    before = database_state()
    response = admin_client.post(
        "/api/v1/topology", data=json.dumps(exported), content_type="application/json"
    )
    assert response.status_code == 200
    body = response.json()
    assert body["created"] == body["updated"] == body["deleted"] == 0
    assert database_state() == before


def test_api_apply_creates_the_case_study_and_honours_dry_run(
    case_study_data: dict[str, Any], admin_client: Client
) -> None:
    body = json.dumps(case_study_data)
    dry = admin_client.post(
        "/api/v1/topology?dry_run=true", data=body, content_type="application/json"
    )
    assert dry.status_code == 200 and dry.json()["created"] > 0
    assert Cluster.objects.count() == 0
    real = admin_client.post("/api/v1/topology", data=body, content_type="application/json")
    assert real.json() == dry.json()
    assert Instance.objects.count() == 12
    assert ChangeRecord.objects.filter(actor__startswith="token:").count() == real.json()["created"]


def test_api_apply_with_prune_deletes_the_rest(
    case_study_data: dict[str, Any], scenarios_dir: Path, admin_client: Client
) -> None:
    topology("apply", str(scenarios_dir / "two-pd-clusters.yaml"))
    response = admin_client.post(
        "/api/v1/topology?prune=true",
        data=json.dumps(case_study_data),
        content_type="application/json",
    )
    assert response.status_code == 200 and response.json()["deleted"] > 0
    assert Cluster.objects.count() == 2


@pytest.mark.parametrize(
    ("body", "words"),
    [("[1, 2]", "JSON object"), ("{not json", "parse"), ('{"version": 1}', "required key")],
)
def test_api_apply_refuses_a_body_that_is_not_a_scenario(
    admin_client: Client, body: str, words: str
) -> None:
    response = admin_client.post("/api/v1/topology", data=body, content_type="application/json")
    assert response.status_code in (400, 422)
    assert set(response.json()) == {"detail", "code"}
    assert words in response.json()["detail"]


def test_api_apply_refuses_a_bad_dry_run_flag(admin_client: Client) -> None:
    response = admin_client.post(
        "/api/v1/topology?dry_run=perhaps", data="{}", content_type="application/json"
    )
    assert response.status_code == 422
    assert "dry_run" in response.json()["detail"]


def test_api_export_of_an_empty_inventory_is_a_422(admin_client: Client) -> None:
    response = admin_client.get("/api/v1/topology")
    assert response.status_code == 422
    assert response.json()["code"] == "not_exportable"


@pytest.mark.parametrize("target", ["../secrets.yaml", "/etc/hostname"])
def test_api_apply_refuses_extends_outside_the_scenarios_folder(
    admin_client: Client, settings: Any, tmp_path: Path, target: str
) -> None:
    settings.SCENARIOS_DIR = tmp_path / "scenarios"
    response = admin_client.post(
        "/api/v1/topology",
        data=json.dumps({"extends": target, "name": "x"}),
        content_type="application/json",
    )
    assert response.status_code == 422
    assert response.json()["detail"].startswith("extends: must name a file in the scenarios")


def test_api_apply_resolves_extends_in_the_scenarios_folder(admin_client: Client) -> None:
    body = {"extends": "paper-case-study.yaml", "name": "derived", "expected": None}
    response = admin_client.post(
        "/api/v1/topology", data=json.dumps(body), content_type="application/json"
    )
    assert response.status_code == 200, response.content
    assert Instance.objects.count() == 12


def test_an_export_after_a_role_conversion_applies_back_unchanged(
    case_study: Path, tmp_path: Path
) -> None:
    from clusters.services import instance_update
    from controlplane.audit import CLI_ACTOR

    topology("apply", str(case_study))
    converted = Instance.objects.get(name="pd-h20-3")
    instance_update(
        instance_id=converted.pk, version=1, changes={"role": "decode"}, actor=CLI_ACTOR
    )
    exported = tmp_path / "export.yaml"
    exported.write_text(topology("export"))
    assert "prefill_instances: 3" in exported.read_text()
    result = counts(topology("apply", str(exported)))
    assert result["created"] == result["updated"] == result["deleted"] == 0
    assert Instance.objects.get(pk=converted.pk).role == "decode"


def test_a_links_kv_budget_and_target_utilisation_apply_and_export(
    case_study_data: dict[str, Any], tmp_path: Path, scenarios_dir: Path
) -> None:
    """Issue 12: a scenario's link may set what the router admits on it; the inventory keeps
    it, the export gives it back, and an entry that gives none leaves it alone."""
    data = dict(case_study_data)
    data["links"] = [{**data["links"][0], "kv_budget_mib": 20000, "target_utilisation": 0.6}]
    path = tmp_path / "budgeted.yaml"
    path.write_text(yaml.safe_dump(data))
    topology("apply", str(path))
    link = Link.objects.get()
    assert link.kv_budget_bytes == 20000 * 2**20 and link.target_utilisation == 0.6
    exported = yaml.safe_load(topology("export"))
    assert exported["links"][0]["kv_budget_mib"] == 20000
    assert exported["links"][0]["target_utilisation"] == 0.6
    # The shared file gives neither: the values set above stay.
    topology("apply", str(scenarios_dir / "paper-case-study.yaml"))
    link.refresh_from_db()
    assert link.kv_budget_bytes == 20000 * 2**20 and link.target_utilisation == 0.6


def test_a_target_utilisation_outside_zero_one_is_refused_by_the_api(
    case_study: Path, admin_client: Client
) -> None:
    topology("apply", str(case_study))
    link = Link.objects.get()
    for bad in (0, 1.5, -0.2):
        response = admin_client.patch(
            f"/api/v1/links/{link.pk}",
            {"target_utilisation": bad, "version": link.version},
            content_type="application/json",
        )
        assert response.status_code == 422, response.content
        assert response.json()["detail"]
    ok = admin_client.patch(
        f"/api/v1/links/{link.pk}",
        {"target_utilisation": 0.7, "version": link.version},
        content_type="application/json",
    )
    assert ok.status_code == 200, ok.content
    assert ok.json()["target_utilisation"] == 0.7


@pytest.mark.parametrize(
    ("path", "value", "where"),
    [
        (("links", 0, "gbps"), 1e308, "links[0].gbps"),
        (("links", 0, "rtt_ms"), 1e6, "links[0].rtt_ms"),
        (("model", "block_tokens"), 10**9, "model.block_tokens"),
        (("accelerators", 0, "gpu_hour_cost"), 1e300, "accelerators[0].gpu_hour_cost"),
        (("clusters", 0, "prefill_instances"), 10**7, "clusters[0].prefill_instances"),
    ],
)
def test_a_scenario_beyond_physical_bounds_is_refused_and_writes_nothing(
    admin_client: Client,
    case_study_data: dict[str, Any],
    path: tuple[Any, ...],
    value: Any,
    where: str,
) -> None:
    node: Any = case_study_data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    before = database_state()
    response = admin_client.post(
        "/api/v1/topology", data=json.dumps(case_study_data), content_type="application/json"
    )
    assert response.status_code == 422, response.content
    assert response.json()["code"] == "invalid_scenario" and where in response.json()["detail"]
    assert database_state() == before


@pytest.mark.parametrize("path", ["/etc/shadow", "/no/such/file"])
def test_a_posted_scenario_naming_a_server_file_is_refused_alike_whether_it_exists(
    admin_client: Client, case_study_data: dict[str, Any], path: str
) -> None:
    case_study_data.setdefault("workload", {})["trace"] = {"path": path, "format": "mooncake"}
    response = admin_client.post(
        "/api/v1/topology?dry_run=true",
        data=json.dumps(case_study_data),
        content_type="application/json",
    )
    assert response.status_code == 422
    assert response.json() == {
        "detail": "workload.trace: a posted scenario may not name a server file; "
        "topology apply reads only the deployment (drop the workload's trace)",
        "code": "invalid_scenario",
    }


@pytest.mark.django_db(transaction=True)
def test_concurrent_applies_of_one_file_all_succeed_and_apply_it_once(
    case_study_data: dict[str, Any],
) -> None:
    admin = bearer(api_token("admin")[1])
    body = json.dumps(case_study_data)
    barrier = threading.Barrier(4)
    statuses: list[int] = []

    def apply() -> None:
        try:
            barrier.wait()
            r = Client().post(
                "/api/v1/topology", data=body, content_type="application/json", headers=admin
            )
            statuses.append(r.status_code)
        finally:
            connection.close()

    threads = [threading.Thread(target=apply) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert statuses == [200] * 4
    assert Cluster.objects.count() == 2 and Link.objects.count() == 1
