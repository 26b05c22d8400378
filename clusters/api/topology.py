"""Topology as code over HTTP: export the inventory as a scenario, apply a scenario to it."""

from pathlib import Path
from typing import Any

from django.conf import settings
from django.http import HttpRequest
from ninja import Body, Router, Schema

from clusters.topology import topology_apply_mapping, topology_export
from controlplane.audit import actor_from_request
from controlplane.auth import TokenAuth
from controlplane.errors import Invalid
from scheduling.core.scenario import SCENARIO_OPTIONAL_KEYS, SCENARIO_REQUIRED_KEYS, ScenarioError

router = Router(tags=["topology"])
SCENARIO_BODY = Body(..., description="a scenario mapping (the YAML file as JSON)")


class TopologyApplyOut(Schema):
    created: int
    updated: int
    deleted: int
    unchanged: int


def scenarios_dir() -> Path:
    """Where ``extends`` in a posted scenario resolves: ``settings.SCENARIOS_DIR``."""
    return Path(settings.SCENARIOS_DIR)


@router.get("/topology", response=dict[str, Any], auth=TokenAuth("read"))
def topology_get(request: HttpRequest) -> dict[str, Any]:
    """The inventory as a scenario file (JSON); POST it back and nothing changes."""
    try:
        return topology_export()
    except ScenarioError as exc:
        raise Invalid(str(exc), code="not_exportable") from exc


# The body's schema states the top level of a scenario (its keys, which are required unless
# ``extends`` names a base file that gives them); what is inside each key is the scenario format
# (scenarios/SCHEMA.md), checked by the reader with a 422 naming the key path.
SCENARIO_SCHEMA = {
    "type": "object",
    "description": "a scenario mapping (the YAML file as JSON); see scenarios/SCHEMA.md",
    "properties": {key: {} for key in (*SCENARIO_REQUIRED_KEYS, *SCENARIO_OPTIONAL_KEYS)},
    "additionalProperties": False,
    "anyOf": [{"required": list(SCENARIO_REQUIRED_KEYS)}, {"required": ["extends"]}],
}


@router.post(
    "/topology",
    response=TopologyApplyOut,
    auth=TokenAuth("admin"),
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": SCENARIO_SCHEMA}},
        }
    },
)
def topology_post(
    request: HttpRequest,
    scenario: dict[str, Any] = SCENARIO_BODY,
    dry_run: bool = False,
    prune: bool = False,
) -> dict[str, int]:
    """Make the inventory match the scenario, in one transaction; 422 names the key path.

    ``extends`` resolves in the scenarios folder and may not leave it, and a posted
    workload may not name a trace file: a posted body must not make the server read, or tell
    whether there is, any other file.
    """
    base_dir = scenarios_dir().resolve()
    extends = scenario.get("extends")
    if isinstance(extends, str) and not (base_dir / extends).resolve().is_relative_to(base_dir):
        raise Invalid(
            f"extends: must name a file in the scenarios folder, got {extends!r}",
            code="invalid_scenario",
        )
    workload = scenario.get("workload")
    if isinstance(workload, dict) and "trace" in workload:
        # Reading it would tell the caller whether a server path exists (/etc/shadow).
        raise Invalid(
            "workload.trace: a posted scenario may not name a server file; "
            "topology apply reads only the deployment (drop the workload's trace)",
            code="invalid_scenario",
        )
    try:
        result = topology_apply_mapping(
            scenario,
            base_dir=base_dir,
            actor=actor_from_request(request, source="topology"),
            dry_run=dry_run,
            prune=prune,
        )
    except ScenarioError as exc:
        raise Invalid(str(exc), code="invalid_scenario") from exc
    return result.counts()
