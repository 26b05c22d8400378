"""Bad input of issue 13 through the real API: every one a 4xx in the error shape (never an
HTML 500), and nothing written. The strict JSON parser (controlplane/parser.py), the NUL
refusal, the JSON handler of unexpected failures and the strict route counts."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client

from clusters.models import Accelerator
from controlplane.models import ChangeRecord
from scheduling.models import RebalanceSettings
from tests.factories import AcceleratorFactory, ClusterFactory, api_token, bearer

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin() -> dict[str, str]:
    return bearer(api_token("admin")[1])


def assert_shape(response: Any, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.content
    assert response["Content-Type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"detail", "code"}
    if code is not None:
        assert body["code"] == code
    return dict(body)


def accelerator_post(admin: dict[str, str], data: bytes | str, content_type: str) -> Any:
    return Client().post(
        "/api/v1/accelerators", data=data, content_type=content_type, headers=admin
    )


@pytest.mark.parametrize(
    ("number", "status"), [("Infinity", 400), ("-Infinity", 400), ("NaN", 400), ("1e400", 422)]
)
def test_a_non_finite_number_is_refused_before_the_audit_write(
    admin: dict[str, str], number: str, status: int
) -> None:
    # Infinity and NaN are not JSON (400); 1e400 is JSON, but no finite number (422).
    records = ChangeRecord.objects.count()
    body = f'{{"name": "B300", "gpu_hour_cost": {number}}}'
    assert_shape(accelerator_post(admin, body, "application/json"), status)
    assert not Accelerator.objects.exists()
    assert ChangeRecord.objects.count() == records


def test_a_body_declared_as_text_is_a_415(admin: dict[str, str]) -> None:
    body = json.dumps({"name": "B300", "gpu_hour_cost": 2.0})
    assert_shape(accelerator_post(admin, body, "text/plain"), 415, "unsupported_media_type")
    assert not Accelerator.objects.exists()


def test_a_utf16_body_is_a_400(admin: dict[str, str]) -> None:
    body = json.dumps({"name": "B300", "gpu_hour_cost": 2.0}).encode("utf-16")
    assert_shape(accelerator_post(admin, body, "application/json"), 400, "invalid_encoding")
    assert not Accelerator.objects.exists()


def test_a_nul_in_a_body_is_a_422(admin: dict[str, str]) -> None:
    body = json.dumps({"name": "B3\u000000", "gpu_hour_cost": 2.0})
    assert_shape(accelerator_post(admin, body, "application/json"), 422, "invalid")
    assert not Accelerator.objects.exists()


def test_a_body_nested_beyond_the_parser_is_a_400(admin: dict[str, str]) -> None:
    body = "[" * 100_000 + "]" * 100_000
    assert_shape(accelerator_post(admin, body, "application/json"), 400)


@pytest.mark.parametrize("url", ["/api/v1/sites?name=a%00b", "/api/v1/sites/1%00", "/api/v1/s%00"])
def test_a_nul_in_the_query_or_path_is_a_422_with_read_scope(url: str) -> None:
    reader = bearer(api_token("read")[1])
    assert_shape(Client().get(url, headers=reader), 422, "invalid")


def test_a_nul_in_a_page_path_is_a_plain_400() -> None:
    assert Client().get("/tokens/%00/").status_code == 400


@pytest.mark.parametrize("body", ["[null, null]", "[]", '"x"', "{}", '{"colour": "red"}'])
def test_a_settings_patch_that_is_no_object_of_settings_is_a_422_and_bumps_nothing(
    admin: dict[str, str], body: str
) -> None:
    ClusterFactory(name="pd-s")
    before = Client().get("/api/v1/rebalance/settings/pd-s", headers=admin).json()["version"]
    response = Client().patch(
        "/api/v1/rebalance/settings/pd-s", data=body, content_type="application/json", headers=admin
    )
    assert_shape(response, 422)
    after = Client().get("/api/v1/rebalance/settings/pd-s", headers=admin).json()["version"]
    assert after == before
    assert not RebalanceSettings.objects.filter(version__gt=before).exists()


@pytest.mark.parametrize("tokens", [True, 5.0, "5"])
def test_prompt_tokens_must_be_an_integer(tokens: Any) -> None:
    router = bearer(api_token("router")[1])
    body = json.dumps({"origin": "pd-a", "prompt_tokens": tokens})
    response = Client().post(
        "/api/v1/route", data=body, content_type="application/json", headers=router
    )
    assert_shape(response, 422, "invalid")
    assert "prompt_tokens" in response.json()["detail"]


def test_an_unexpected_failure_is_a_json_500_not_an_html_page(
    admin: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fault of our own code (here: the selector raising), not an input problem.
    AcceleratorFactory()
    monkeypatch.setattr(Accelerator, "__str__", lambda self: 1 / 0)
    response = Client(raise_request_exception=False).delete(
        f"/api/v1/accelerators/{Accelerator.objects.get().pk}?version=1", headers=admin
    )
    assert_shape(response, 500, "internal_error")
