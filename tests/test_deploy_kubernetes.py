"""deploy/kubernetes: ``kubectl kustomize`` renders the base and every overlay, and every object
it renders validates (strictly: no unknown field) against the Kubernetes OpenAPI schemas, with
the roles, probes and RBAC the docs promise."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from django.conf import settings

ROOT = Path(settings.BASE_DIR) / "deploy" / "kubernetes"
TREES = ["base", *(f"overlays/{p.name}" for p in sorted((ROOT / "overlays").iterdir()))]
# The schemas the manifests are checked against (kubernetes-validate ships them).
KUBERNETES_VERSION = "1.32"


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail(
            "kubectl is not installed: deploy/kubernetes is rendered with `kubectl kustomize` "
            "(kubectl 1.21 or newer; see `make system-deps`)",
            pytrace=False,
        )
    return found


def rendered(tree: str) -> list[dict[str, Any]]:
    result = subprocess.run(
        [kubectl(), "kustomize", str(ROOT / tree)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"kubectl kustomize {tree}: {result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.mark.parametrize("tree", TREES)
def test_every_rendered_object_validates_against_the_kubernetes_schemas(tree):
    objects = rendered(tree)
    assert objects
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            name = f"{obj['kind']}/{obj['metadata']['name']}"
            pytest.fail(f"{tree}: {name}: {exc.message} at {list(exc.path)}", pytrace=False)


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def test_the_base_runs_every_role_with_probes_on_the_health_endpoints():
    objects = rendered("base")
    deployments = by_kind(objects, "Deployment")
    assert set(deployments) == {"web", "ingest", "worker", "beat", "gateway"}
    assert set(by_kind(objects, "Job")) == {"prfaas-migrate"}
    assert set(by_kind(objects, "Service")) == {"web", "ingest", "gateway"}
    assert deployments["beat"]["spec"]["replicas"] == 1
    assert deployments["beat"]["spec"]["strategy"]["type"] == "Recreate"
    for name in ("web", "ingest"):
        (container,) = deployments[name]["spec"]["template"]["spec"]["containers"]
        assert container["livenessProbe"]["httpGet"]["path"] == "/api/v1/health/live"
        assert container["readinessProbe"]["httpGet"]["path"] == "/api/v1/health"
    (gateway,) = deployments["gateway"]["spec"]["template"]["spec"]["containers"]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    for name, deployment in deployments.items():
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            assert "livenessProbe" in container, name


def test_postgres_and_redis_are_external_services_given_by_url():
    objects = rendered("base")
    images = {
        c["image"]
        for o in objects
        if o["kind"] in ("Deployment", "Job")
        for c in o["spec"]["template"]["spec"]["containers"]
    }
    assert not any(re.match(r"(postgres|redis)", image) for image in images)
    settings_map = by_kind(objects, "ConfigMap")["prfaas-settings"]["data"]
    assert "DATABASE_URL" not in settings_map  # a secret: from the Secret prfaas-controlplane
    for deployment in by_kind(objects, "Deployment").values():
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        refs = [e.get("secretRef", {}).get("name") for e in container.get("envFrom", [])]
        if deployment["metadata"]["name"] != "gateway":
            assert "prfaas-controlplane" in refs


def test_the_actuator_role_grants_scale_and_pods_and_nothing_broader():
    objects = rendered("base")
    role = by_kind(objects, "Role")["prfaas-actuator"]
    verbs: dict[str, set[str]] = {}
    for rule in role["rules"]:
        for resource in rule["resources"]:
            verbs.setdefault(resource, set()).update(rule["verbs"])
    assert verbs["deployments/scale"] == {"get", "patch"}
    assert verbs["leaderworkersets/scale"] == {"get", "patch"}
    assert verbs["disaggregatedsetrolescalers/scale"] == {"get", "patch"}
    assert verbs["dynamographdeploymentscalingadapters/scale"] == {"get", "patch"}
    assert verbs["rolebasedgroupscalingadapters/scale"] == {"get", "patch"}
    assert verbs["pods"] == {"get", "list", "patch"}
    assert all(v <= {"get", "list", "patch"} for v in verbs.values())
    assert not any("*" in r["verbs"] or "*" in r["resources"] for r in role["rules"])
    binding = by_kind(objects, "RoleBinding")["prfaas-actuator"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "prfaas-controlplane", "namespace": "prfaas"}
    ]
    worker = by_kind(objects, "Deployment")["worker"]["spec"]["template"]["spec"]
    assert worker["serviceAccountName"] == "prfaas-controlplane"
    assert worker["automountServiceAccountToken"] is True


def test_the_demo_overlay_has_its_namespace_setup_and_an_agent_sidecar_example():
    objects = rendered("overlays/demo")
    assert {o["metadata"].get("namespace", "prfaas-demo") for o in objects} == {"prfaas-demo"}
    assert "prfaas-demo-setup" in by_kind(objects, "Job")
    engines = by_kind(objects, "Deployment")["pd-h20-decode"]["spec"]["template"]["spec"]
    names = [c["name"] for c in engines["containers"]]
    assert names == ["engine", "agent"]
    agent = engines["containers"][1]
    assert "fleet.agent" in agent["command"][-1]
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in agent[
        "env"
    ]
