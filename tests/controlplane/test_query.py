"""Strict query strings: what an operation does not declare, or a single value given twice, is a
422 naming the parameter; what it declares passes; operations without query parameters are
left alone."""

from __future__ import annotations

import pytest
from django.test import Client

from tests.factories import api_token, bearer

pytestmark = pytest.mark.django_db


@pytest.fixture
def reader() -> dict[str, str]:
    return bearer(api_token("read")[1])


def test_a_declared_parameter_passes(client: Client, reader: dict[str, str]) -> None:
    answer = client.get("/api/v1/plans?limit=5&status=proposed", headers=reader)
    assert answer.status_code == 200, answer.content


def test_an_undeclared_parameter_is_a_422_naming_it(client: Client, reader: dict[str, str]) -> None:
    answer = client.get("/api/v1/plans?limit=5&limmit=6", headers=reader)
    assert answer.status_code == 422
    body = answer.json()
    assert body["code"] == "invalid"
    assert "limmit" in body["detail"] and "not a parameter of this operation" in body["detail"]


def test_a_single_valued_parameter_given_twice_is_a_422(
    client: Client, reader: dict[str, str]
) -> None:
    answer = client.get("/api/v1/plans?limit=5&limit=6", headers=reader)
    assert answer.status_code == 422
    assert "limit" in answer.json()["detail"] and "more than once" in answer.json()["detail"]


def test_a_malformed_query_string_is_refused_before_credentials_are_read(client: Client) -> None:
    assert client.get("/api/v1/plans?bogus=1").status_code == 422
    assert client.get("/api/v1/plans?limit=5").status_code == 401


def test_an_operation_without_query_parameters_ignores_a_query_string(client: Client) -> None:
    assert client.get("/api/v1/health/live?cache-buster=1").status_code == 200


def test_an_async_operation_refuses_an_undeclared_parameter_too(
    client: Client, reader: dict[str, str]
) -> None:
    answer = client.get("/api/v1/decisions/recent?limit=5&bogus=1", headers=reader)
    assert answer.status_code == 422 and "bogus" in answer.json()["detail"]
    assert client.get("/api/v1/decisions/recent?limit=5", headers=reader).status_code == 200
