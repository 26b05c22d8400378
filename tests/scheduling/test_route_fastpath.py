"""The route fast path (ASGI, no Django middleware) answers exactly like the ninja operations:
same decisions, same auth rules, same error shapes and limits."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from django.test import AsyncClient

from tests.scheduling.api.test_route import BAD_ROUTE_INPUTS, Fleet, _fleet, telemetry


@pytest.fixture
def fleet(transactional_db: None, route_state_clean: None) -> Fleet:
    return _fleet(budget_bytes=50 * 2**30)


@pytest.fixture
async def fast() -> AsyncIterator[httpx.AsyncClient]:
    from controlplane.asgi import application

    transport = httpx.ASGITransport(app=application)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        yield client


async def test_fast_path_decides_like_the_django_path(
    fast: httpx.AsyncClient, fleet: Fleet
) -> None:
    await telemetry(AsyncClient(), fleet)
    body = {"origin": "pd-a", "prompt_tokens": 2000, "request_id": "same"}
    via_fast = await fast.post("/api/v1/route", json=body, headers=fleet.router)
    via_django = await AsyncClient().post(
        "/api/v1/route",
        data=json.dumps(body),
        content_type="application/json",
        headers={} | {"Authorization": fleet.router["Authorization"], "X-Test": "django"},
    )
    assert via_fast.status_code == via_django.status_code == 200
    a, b = via_fast.json(), via_django.json()
    for key in ("route", "reason", "incremental_tokens", "threshold", "policy_version"):
        assert a[key] == b[key]
    assert via_fast.headers["x-request-id"]


async def test_fast_path_batch(fast: httpx.AsyncClient, fleet: Fleet) -> None:
    await telemetry(AsyncClient(), fleet)
    requests = [{"origin": "pd-a", "prompt_tokens": n} for n in (100, 60_000)]
    r = await fast.post("/api/v1/route/batch", json={"requests": requests}, headers=fleet.router)
    assert r.status_code == 200
    assert [d["route"] for d in r.json()["decisions"]] == ["local", "prfaas"]


@pytest.mark.parametrize(
    ("headers_of", "body", "status", "code"),
    [
        ("unknown", {"origin": "pd-a", "prompt_tokens": 1}, 401, "unauthorized"),
        ("agent", {"origin": "pd-a", "prompt_tokens": 1}, 403, "forbidden"),
        ("router", {"origin": "pd-a", "prompt_tokens": -1}, 422, "invalid"),
        ("router", {"origin": "pd-a", "prompt_tokens": 1, "block_hashes": ["zz"]}, 422, "invalid"),
        ("router", {"origin": "nowhere", "prompt_tokens": 1}, 404, "unknown_origin"),
        ("router", [1, 2], 422, "invalid"),
    ],
)
async def test_fast_path_errors_have_the_shape(
    fast: httpx.AsyncClient,
    fleet: Fleet,
    headers_of: str,
    body: Any,
    status: int,
    code: str,
) -> None:
    headers = {
        "unknown": {"Authorization": "Bearer prfaas_nobody"},
        "agent": fleet.agent,
        "router": fleet.router,
    }[headers_of]
    r = await fast.post("/api/v1/route", json=body, headers=headers)
    assert r.status_code == status, r.text
    got = r.json()
    assert set(got) == {"detail", "code"} and got["code"] == code


@pytest.mark.parametrize(("body", "status", "code", "detail_part"), BAD_ROUTE_INPUTS)
async def test_fast_path_refuses_bad_input_like_the_django_path(
    fast: httpx.AsyncClient, fleet: Fleet, body: Any, status: int, code: str, detail_part: str
) -> None:
    via_fast = await fast.post("/api/v1/route", json=body, headers=fleet.router)
    assert via_fast.status_code == status, via_fast.text
    got = via_fast.json()
    assert set(got) == {"detail", "code"} and got["code"] == code
    assert detail_part in got["detail"]
    batch = {"requests": [{"origin": "pd-a", "prompt_tokens": 1}, body]}
    via_fast = await fast.post("/api/v1/route/batch", json=batch, headers=fleet.router)
    assert via_fast.status_code == status, via_fast.text
    assert via_fast.json()["code"] == code and "requests[1]" in via_fast.json()["detail"]


async def test_fast_path_decodes_every_field_like_the_django_path(
    fast: httpx.AsyncClient, fleet: Fleet
) -> None:
    await telemetry(AsyncClient(), fleet)
    body = {
        "origin": "pd-a",
        "prompt_tokens": 20_000,
        "block_hashes": [7, -1, "00000000000000ff", "0x" + "ab" * 32],
        "cached_tokens": {"pd-a": 50_000},
        "request_id": "every-field",
        "expected_output_tokens": 64,
    }
    via_fast = (await fast.post("/api/v1/route", json=body, headers=fleet.router)).json()
    via_django = await AsyncClient().post(
        "/api/v1/route", data=json.dumps(body), content_type="application/json",
        headers={"Authorization": fleet.router["Authorization"]},
    )  # fmt: skip
    # Decided a moment apart: only the estimates' clock and the live state's age may differ.
    same_moment = {k: via_fast[k] for k in ("ttft_estimate_s", "live_age_s", "snapshot_age_s")}
    assert via_fast == via_django.json() | same_moment
    assert via_fast["cached_tokens"] < 20_000  # capped at the prompt, then one token computed


async def test_fast_path_refuses_bad_json_and_big_bodies(
    fast: httpx.AsyncClient, fleet: Fleet
) -> None:
    r = await fast.post("/api/v1/route", content=b"{not json", headers=fleet.router)
    assert (r.status_code, r.json()["code"]) == (400, "http_400")
    huge = json.dumps({"origin": "pd-a", "prompt_tokens": 1, "pad": "x" * 300_000})
    r = await fast.post("/api/v1/route", content=huge.encode(), headers=fleet.router)
    assert (r.status_code, r.json()["code"]) == (413, "payload_too_large")


async def test_calls_without_a_bearer_token_go_through_django(
    fast: httpx.AsyncClient, fleet: Fleet
) -> None:
    r = await fast.post(
        "/api/v1/route",
        json={"origin": "pd-a", "prompt_tokens": 1},
        headers={"X-Request-ID": "abc"},
    )
    assert (r.status_code, r.json()["code"]) == (401, "unauthorized")
    assert r.headers["x-request-id"] == "abc"


async def test_fast_path_answers_carry_the_security_headers(
    fast: httpx.AsyncClient, fleet: Fleet
) -> None:
    r = await fast.post(
        "/api/v1/route", json={"origin": "pd-a", "prompt_tokens": 1}, headers=fleet.router
    )
    assert r.status_code == 200
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["x-frame-options"] == "DENY"
    assert r.headers["referrer-policy"] == "same-origin"
    assert "frame-ancestors 'none'" in r.headers["content-security-policy"]


async def test_fast_path_refuses_a_host_outside_allowed_hosts(
    fast: httpx.AsyncClient, fleet: Fleet, settings: Any
) -> None:
    # Issue 13: this door skipped Django's ALLOWED_HOSTS check.
    body = {"origin": "pd-a", "prompt_tokens": 1}
    evil = {**fleet.router, "Host": "evil.example"}
    assert "*" in settings.ALLOWED_HOSTS
    assert (await fast.post("/api/v1/route", json=body, headers=evil)).status_code == 200
    # The door remembers the hosts it has checked, until a setting changes.
    settings.ALLOWED_HOSTS = ["cp.example.org"]
    r = await fast.post(
        "/api/v1/route", json=body, headers={**fleet.router, "Host": "evil.example"}
    )
    assert (r.status_code, r.json()["code"]) == (400, "bad_host")
    ok = await fast.post(
        "/api/v1/route", json=body, headers={**fleet.router, "Host": "cp.example.org"}
    )
    assert ok.status_code == 200, ok.text


async def test_fast_path_answers_carry_a_request_id_of_their_own_or_the_callers(
    fast: httpx.AsyncClient, fleet: Fleet
) -> None:
    body = {"origin": "pd-a", "prompt_tokens": 1}
    made = [
        (await fast.post("/api/v1/route", json=body, headers=fleet.router)).headers["x-request-id"]
        for _ in range(3)
    ]
    assert len(set(made)) == 3
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in made)
    given = {**fleet.router, "X-Request-ID": "router-42"}
    r = await fast.post("/api/v1/route", json=body, headers=given)
    assert r.headers["x-request-id"] == "router-42"
