"""An agent token bound to instances and links reports for those only: every way an agent
could steer the fleet (a huge PrfaaS queue, a saturated link, fake cached prefixes, a wiped
prefix index) is refused with 403 and the error shape for anything outside its binding."""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec
import pytest
import redis
from django.test import Client

from clusters.live import prefix_index, telemetry
from clusters.models import InstanceRole
from controlplane.auth import token_cache_clear
from controlplane.models import ApiToken
from tests.factories import (
    ClusterFactory,
    InstanceFactory,
    LinkFactory,
    PrfaasClusterFactory,
    UserFactory,
    api_token,
    bearer,
)

OWN, OTHER, PRFAAS = "pd-a-p0", "pd-b-p0", "prfaas-x-p0"
# Links as bindings, pages and the live stores name them (one spelling).
OWN_LINK, OTHER_LINK = "prfaas-x->pd-a", "prfaas-x->pd-b"


@pytest.fixture
def fleet(db: None, redis_client: redis.Redis, route_state_clean: None) -> None:
    pd_a = ClusterFactory(name="pd-a", model__block_tokens=32)
    pd_b = ClusterFactory(name="pd-b", model=pd_a.model)
    pf = PrfaasClusterFactory(name="prfaas-x", model=pd_a.model)
    InstanceFactory(cluster=pd_a, name=OWN, role=InstanceRole.PREFILL)
    InstanceFactory(cluster=pd_b, name=OTHER, role=InstanceRole.PREFILL)
    InstanceFactory(cluster=pf, name=PRFAAS, role=InstanceRole.PREFILL)
    LinkFactory(source=pf, target=pd_a)
    LinkFactory(source=pf, target=pd_b)
    token_cache_clear()


@pytest.fixture
def bound(fleet: None) -> dict[str, str]:
    return bearer(api_token("agent", name="agent-a", instances=(OWN,), links=(OWN_LINK,))[1])


def post(path: str, body: Any, headers: dict[str, str]) -> Any:
    return Client().post(
        f"/api/v1{path}", data=json.dumps(body), content_type="application/json", headers=headers
    )


def telemetry_body(instance: str | None = None, link: str | None = None, **load: Any) -> Any:
    now = time.time()
    body: dict[str, Any] = {"idempotency_key": f"k-{now}-{instance}-{link}"}
    if instance is not None:
        body["instances"] = [{"instance": instance, "ts": now, **load}]
    if link is not None:
        source, target = link.split("->")
        body["links"] = [
            {"source": source, "target": target, "ts": now, "bytes_sent": 10**12, "interval_s": 1}
        ]
    return body


def assert_refused(response: Any, name: str) -> None:
    assert response.status_code == 403, response.content
    got = response.json()
    assert set(got) == {"detail", "code"}
    assert got["code"] == "outside_binding" and name in got["detail"]


def test_a_token_bound_to_a_cluster_reports_for_its_instances_only(fleet: None) -> None:
    headers = bearer(api_token("agent", name="agent-cluster-a", clusters=("pd-a",))[1])
    assert post("/telemetry", telemetry_body(OWN, queue_depth=1), headers).status_code == 200
    assert_refused(post("/telemetry", telemetry_body(OTHER, queue_depth=1), headers), OTHER)
    frames = msgspec.msgpack.encode({"instance": OTHER, "batches": [[0, b"x"]]})
    refused = Client().post(
        "/api/v1/kv-events/msgpack",
        data=frames,
        content_type="application/msgpack",
        headers=headers,
    )
    assert_refused(refused, OTHER)


def test_a_bound_agent_reports_for_its_own_instance_and_link(bound: dict[str, str]) -> None:
    response = post("/telemetry", telemetry_body(OWN, OWN_LINK, queue_depth=4), bound)
    assert response.status_code == 200, response.content
    assert telemetry.instance_states_read([OWN])[OWN].queue_depth == 4
    key = OWN_LINK
    assert telemetry.link_states_read([key])[key].gbps == pytest.approx(8000.0)


def test_a_huge_prfaas_queue_reported_for_another_instance_is_refused(
    bound: dict[str, str],
) -> None:
    body = telemetry_body(PRFAAS, queued_prefill_tokens=10**12)
    assert_refused(post("/telemetry", body, bound), PRFAAS)
    assert telemetry.instance_states_read([PRFAAS]) == {}


def test_a_saturated_link_reported_outside_the_binding_is_refused(bound: dict[str, str]) -> None:
    assert_refused(post("/telemetry", telemetry_body(link=OTHER_LINK), bound), OTHER_LINK)
    assert telemetry.link_states_read([OTHER_LINK]) == {}


def test_one_foreign_sample_refuses_the_whole_batch(bound: dict[str, str]) -> None:
    body = telemetry_body(OWN, queue_depth=1)
    body["instances"].append({"instance": OTHER, "ts": time.time(), "queue_depth": 9})
    assert_refused(post("/telemetry", body, bound), OTHER)
    assert telemetry.instance_states_read([OWN, OTHER]) == {}


def stored(seq: int, *blocks: int) -> dict[str, Any]:
    return {"seq": seq, "batch": [time.time(), [["BlockStored", list(blocks), None, [], 32]]]}


def test_fake_cached_prefixes_and_a_wipe_of_another_instance_are_refused(
    bound: dict[str, str],
) -> None:
    fleet_wide = bearer(api_token("agent", name="scraper")[1])
    seeded = post("/kv-events", {"instance": OTHER, "batches": [stored(0, 7)]}, fleet_wide)
    assert seeded.status_code == 200, seeded.content
    chain = [prefix_index.block_hash_key(7)]

    fake = {"instance": OTHER, "batches": [stored(1, 8)]}
    assert_refused(post("/kv-events", fake, bound), OTHER)
    wipe = {
        "instance": OTHER,
        "batches": [{"seq": 1, "batch": [time.time(), [["AllBlocksCleared"]]]}],
    }
    assert_refused(post("/kv-events", wipe, bound), OTHER)
    frames = {
        "instance": OTHER,
        "batches": [[1, msgspec.msgpack.encode([0.0, [["AllBlocksCleared"]]])]],
    }
    refused = Client().post(
        "/api/v1/kv-events/msgpack",
        data=msgspec.msgpack.encode(frames),
        content_type="application/msgpack",
        headers=bound,
    )
    assert_refused(refused, OTHER)
    assert prefix_index.prefix_match(chain, 32).tokens_by_instance == {OTHER: 32}
    assert prefix_index.prefix_index_states([OTHER])[0].last_seq == 0


def test_the_index_state_of_another_instance_is_refused(bound: dict[str, str]) -> None:
    own = Client().get(f"/api/v1/kv-events/state?instance={OWN}", headers=bound)
    assert own.status_code == 200
    assert_refused(Client().get(f"/api/v1/kv-events/state?instance={OTHER}", headers=bound), OTHER)


def test_the_api_rebinds_a_token_and_the_agent_reports_for_its_new_instance(
    bound: dict[str, str],
) -> None:
    admin = bearer(api_token("admin")[1])
    response = Client().put(
        "/api/v1/tokens/agent-a/binding",
        data=json.dumps({"instances": [OTHER], "links": []}),
        content_type="application/json",
        headers=admin,
    )
    assert response.status_code == 200, response.content
    assert response.json()["instances"] == [OTHER] and response.json()["fleet_wide"] is False
    assert post("/telemetry", telemetry_body(OTHER), bound).status_code == 200
    assert_refused(post("/telemetry", telemetry_body(OWN), bound), OWN)
    listed = Client().get("/api/v1/tokens", headers=admin).json()["items"]
    assert {t["name"]: t["instances"] for t in listed}["agent-a"] == [OTHER]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"instances": [], "links": []}, 422, "binding_required"),
        ({"links": ["prfaas-x-pd-a"]}, 422, "invalid"),
        # The live stores' spelling is not the product's: refused when written, not as a 403
        # for every sample the agent later sends.
        ({"links": ["prfaas-x>pd-a"]}, 422, "invalid"),
        ({"instances": ["pd-a-p9"]}, 422, "unknown_instance"),
        ({"links": ["prfaas-x->pd-z"]}, 422, "unknown_link"),
        ({"instances": [OWN], "colour": "red"}, 422, "invalid"),
    ],
)
def test_a_binding_that_binds_nothing_or_is_malformed_is_refused(
    bound: dict[str, str], body: Any, status: int, code: str
) -> None:
    admin = bearer(api_token("admin")[1])
    response = Client().put(
        "/api/v1/tokens/agent-a/binding",
        data=json.dumps(body),
        content_type="application/json",
        headers=admin,
    )
    assert response.status_code == status, response.content
    assert set(response.json()) == {"detail", "code"} and response.json()["code"] == code
    assert ApiToken.objects.get(name="agent-a").instances == [OWN]


def test_an_agent_token_cannot_rebind_itself(bound: dict[str, str]) -> None:
    response = Client().put(
        "/api/v1/tokens/agent-a/binding",
        data=json.dumps({"fleet_wide": True}),
        content_type="application/json",
        headers=bound,
    )
    assert response.status_code == 403
    assert ApiToken.objects.get(name="agent-a").fleet_wide is False


def test_the_tokens_page_creates_a_bound_agent_token_and_rebinds_it(fleet: None) -> None:
    client = Client()
    client.force_login(UserFactory(groups=["admin"]))
    unbound = client.post("/tokens/new/", {"name": "agent-page", "scopes": ["agent"]})
    assert unbound.status_code == 422 and b"must be bound" in unbound.content
    made = client.post(
        "/tokens/new/", {"name": "agent-page", "scopes": ["agent"], "instances": f"{OWN}, {OTHER}"}
    )
    assert made.status_code == 201
    assert ApiToken.objects.get(name="agent-page").instances == sorted([OWN, OTHER])
    rebound = client.post(
        "/tokens/bind/", {"bind-name": "agent-page", "bind-links": OWN_LINK, "bind-instances": ""}
    )
    assert rebound.status_code == 302
    token = ApiToken.objects.get(name="agent-page")
    assert (token.instances, token.links) == ([], [OWN_LINK])
    assert b"prfaas-x-&gt;pd-a" in client.get("/tokens/").content
