"""A cluster's Kubernetes scale targets in the inventory: through the API (declarative: the
mapping sent replaces the stored one, presets resolved), and in topology-as-code (applied,
exported, and applied back with no change); bad targets refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.test import Client

from clusters.models import Cluster
from clusters.topology import topology_apply_mapping, topology_export
from controlplane.audit import CLI_ACTOR
from scheduling.core.scenario import ScenarioError
from tests.factories import ClusterFactory, PrfaasClusterFactory, api_token, bearer

pytestmark = pytest.mark.django_db

TARGETS = {
    "prefill": {"kind": "Deployment", "name": "pd-prefill", "namespace": "inference"},
    "decode": {
        "kind": "DisaggregatedSetRoleScaler",
        "name": "ds-decode",
        "namespace": "inference",
        "context": "dc-a",
    },
}


SAVED = {
    "decode": {
        "kind": "StatefulSet",
        "api_version": "apps/v1",
        "plural": "statefulsets",
        "namespace": "default",
        "name": "decode",
        "removal": "highest_ordinal",
    }
}


@pytest.fixture
def admin_client() -> Client:
    return Client(headers=bearer(api_token("admin")[1]))


def patch(client: Client, cluster: Cluster, body: dict[str, Any]) -> Any:
    return client.patch(
        f"/api/v1/clusters/{cluster.pk}",
        data=json.dumps({"version": cluster.version, **body}),
        content_type="application/json",
    )


def test_scale_targets_are_stored_with_their_presets_resolved(admin_client):
    cluster = ClusterFactory()
    response = patch(admin_client, cluster, {"scale_targets": TARGETS})
    assert response.status_code == 200, response.content
    stored = response.json()["scale_targets"]
    assert stored["prefill"] == {
        "kind": "Deployment",
        "api_version": "apps/v1",
        "plural": "deployments",
        "namespace": "inference",
        "name": "pd-prefill",
        "removal": "deletion_cost",
    }
    assert stored["decode"]["api_version"] == "disaggregatedset.x-k8s.io/v1"
    assert stored["decode"]["removal"] == "highest_ordinal"
    assert stored["decode"]["context"] == "dc-a"


def test_any_object_with_scale_is_a_target_by_its_group_version_and_plural(admin_client):
    cluster = ClusterFactory()
    body = {"decode": {"api_version": "example.com/v1", "plural": "engines", "name": "d"}}
    response = patch(admin_client, cluster, {"scale_targets": body})
    assert response.status_code == 200, response.content
    assert response.json()["scale_targets"]["decode"] == {
        "api_version": "example.com/v1",
        "plural": "engines",
        "namespace": "default",
        "name": "d",
        "removal": "deletion_cost",
    }


@pytest.mark.parametrize(
    ("target", "words"),
    [
        ({"kind": "Widget", "name": "x"}, ["decode.kind", "unknown kind 'Widget'"]),
        ({"kind": "Deployment", "name": "Bad_Name"}, ["decode.name", "not a valid object name"]),
        (
            {"api_version": "example.com", "plural": "things", "name": "x"},
            ["decode.api_version", "group/version"],
        ),
    ],
)
def test_a_bad_target_is_a_422_naming_its_key(admin_client, target, words):
    cluster = ClusterFactory()
    response = patch(admin_client, cluster, {"scale_targets": {"decode": target}})
    assert response.status_code == 422, response.content
    for word in words:
        assert word in response.json()["detail"]
    cluster.refresh_from_db()
    assert cluster.scale_targets == {}


def test_a_prfaas_cluster_names_no_decode_target(admin_client):
    cluster = PrfaasClusterFactory()
    response = patch(admin_client, cluster, {"scale_targets": {"decode": TARGETS["prefill"]}})
    assert response.status_code == 422
    assert "decode" in response.json()["detail"]


def test_topology_applies_exports_and_reapplies_scale_targets_unchanged(scenarios_dir: Path):
    data = yaml.safe_load((scenarios_dir / "paper-case-study.yaml").read_text())
    pd = next(c for c in data["clusters"] if c["kind"] == "pd")
    pd["scale_targets"] = TARGETS
    topology_apply_mapping(data, base_dir=scenarios_dir, actor=CLI_ACTOR)
    stored = Cluster.objects.get(name=pd["name"]).scale_targets
    assert stored["decode"]["name"] == "ds-decode"

    exported = topology_export()
    pd_out = next(c for c in exported["clusters"] if c["name"] == pd["name"])
    assert pd_out["scale_targets"] == stored
    again = topology_apply_mapping(exported, base_dir=scenarios_dir, actor=CLI_ACTOR)
    assert again.updated == 0 and again.created == 0


def test_a_topology_without_scale_targets_leaves_the_stored_ones_alone(scenarios_dir: Path):
    data = yaml.safe_load((scenarios_dir / "paper-case-study.yaml").read_text())
    pd = next(c for c in data["clusters"] if c["kind"] == "pd")
    topology_apply_mapping({**data}, base_dir=scenarios_dir, actor=CLI_ACTOR)
    cluster = Cluster.objects.get(name=pd["name"])
    Cluster.objects.filter(pk=cluster.pk).update(scale_targets=SAVED)
    topology_apply_mapping(data, base_dir=scenarios_dir, actor=CLI_ACTOR)
    assert Cluster.objects.get(pk=cluster.pk).scale_targets == SAVED


def test_a_bad_target_in_a_topology_file_names_its_key_path(scenarios_dir: Path):
    data = yaml.safe_load((scenarios_dir / "paper-case-study.yaml").read_text())
    index = next(i for i, c in enumerate(data["clusters"]) if c["kind"] == "pd")
    data["clusters"][index]["scale_targets"] = {"decode": {"kind": "Deployment"}}
    with pytest.raises(ScenarioError) as refused:
        topology_apply_mapping(data, base_dir=scenarios_dir, actor=CLI_ACTOR)
    assert refused.value.path == f"clusters[{index}].scale_targets.decode.name"
