"""Scheduling pages: decisions, policies, the KV calculator and what-if runs."""

from __future__ import annotations

import json
import time
from typing import cast

import numpy as np
import pytest
from django.urls import reverse

from clusters.models import Accelerator, Link, PerformanceProfile
from controlplane.audit import CLI_ACTOR
from controlplane.redis_connection import redis_sync
from scheduling import whatif
from scheduling.decision_log import decision_log_archive
from scheduling.outcomes import ttft_key
from scheduling.policies import policy_create
from scheduling.traffic import recent_queue
from tests.factories import (
    AcceleratorFactory,
    ClusterFactory,
    LinkFactory,
    ModelProfileFactory,
    PerformanceProfileFactory,
)
from tests.scheduling.rebalance_support import inventory_load, traffic_record

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("redis_client")]


def _decision(origin: str, reason: str, route: str) -> str:
    return json.dumps(
        {
            "ts": 1.7e9,
            "inputs": {"origin": origin, "prompt_tokens": 40000, "request_id": f"r-{reason}"},
            "decision": {
                "route": route,
                "reason": reason,
                "incremental_tokens": 40000,
                "cached_tokens": 0,
                "threshold": 19400,
                "policy_version": 3,
                "ttft_estimate_s": {"local": 4.0, "prfaas": 2.0},
            },
        }
    )


def test_logged_decisions_show_inputs_and_reason_and_filter_by_reason_and_request_id(
    client_as,
) -> None:
    pipe = redis_sync().pipeline()
    recent_queue(pipe, _decision("pd-a", "above_threshold", "prfaas"))
    recent_queue(pipe, _decision("pd-a", "link_congested", "local"))
    pipe.execute()
    decision_log_archive(now=1.7e9 + 1)
    client = client_as("viewer")
    page = client.get(reverse("decision-list")).content.decode()
    assert "r-above_threshold" in page and "r-link_congested" in page
    filtered = client.get(reverse("decision-list"), {"reason": "link_congested"})
    assert [d["inputs"]["request_id"] for d in filtered.context["page"].rows] == [
        "r-link_congested"
    ]
    assert "the link is congested" in filtered.content.decode()  # the reason explained
    found = client.get(reverse("decision-list"), {"request_id": "r-above_threshold", "rows": "1"})
    assert "r-above_threshold" in found.content.decode()
    assert "r-link_congested" not in found.content.decode()


def test_the_decisions_page_compares_predicted_and_observed_ttft_per_cluster(client_as) -> None:
    ClusterFactory(name="pd-a")
    pipe = redis_sync().pipeline()
    for observed, predicted in ((0.3, 0.2), (0.5, 0.2)):
        pipe.hincrbyfloat(ttft_key("pd-a"), "osum", observed)
        pipe.hincrbyfloat(ttft_key("pd-a"), "psum", predicted)
        pipe.hincrbyfloat(ttft_key("pd-a"), "abserr", observed - predicted)
        pipe.hincrby(ttft_key("pd-a"), "count", 1)
    pipe.execute()
    response = client_as("viewer").get(reverse("decision-list"))
    (row,) = response.context["ttft"]
    assert (row.cluster, row.count) == ("pd-a", 2)
    assert row.observed_mean_s == pytest.approx(0.4) and row.ratio == pytest.approx(2.0)
    assert "Predicted vs observed TTFT" in response.content.decode()


def test_the_policy_history_shows_what_changed_between_versions(client_as) -> None:
    ClusterFactory(name="pd-a")
    ClusterFactory(name="pd-b")
    policy_create(actor=CLI_ACTOR, thresholds={"pd-a": 10000})
    policy_create(actor=CLI_ACTOR, thresholds={"pd-a": 19400, "pd-b": 5000})
    page = client_as("viewer").get(reverse("policy-list")).content.decode()
    assert "~ thresholds.pd-a: 10000 → 19400" in page
    assert "+ thresholds.pd-b: 5000" in page
    assert "The first version." in page


def _profile() -> PerformanceProfile:
    return cast(
        PerformanceProfile,
        PerformanceProfileFactory(
            model=ModelProfileFactory(kv_cache_mib=[[1024, 100.0], [65536, 6400.0]]),
            prefill_seconds=[[1024, 0.1], [65536, 6.4]],
        ),
    )


def test_the_kv_calculator_gives_phi_kv_and_the_egress_of_n_instances(client_as) -> None:
    profile = _profile()
    link = cast(Link, LinkFactory(gbps=100.0))
    response = client_as("viewer").get(
        reverse("kv-calculator"),
        {
            "model": profile.model_id,
            "accelerator": profile.accelerator_id,
            "tokens": 32768,
            "instances": 4,
            "link": link.pk,
        },
    )
    result = response.context["result"]
    # 3200 MiB in 3.2 s: 8 * 3200 * 2^20 / 3.2 / 1e9 Gbps per instance.
    phi = 8 * 3200 * 2**20 / 3.2 / 1e9
    assert result.phi_kv_gbps == pytest.approx(phi)
    assert result.egress_gbps == pytest.approx(4 * phi)
    assert result.utilisation == pytest.approx(4 * phi / 100.0)
    assert result.fits is True


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        ({"tokens": "0"}, "tokens", "greater than or equal to 1"),
        ({"tokens": "many"}, "tokens", "Enter a whole number."),
        ({"instances": "-2"}, "instances", "greater than or equal to 1"),
        ({"model": "999999"}, "model", "Select a valid choice."),
        ({"link_gbps": "nan"}, "link_gbps", "Enter a number."),
        ({"link_gbps": "0"}, "link_gbps", "greater than or equal to 0.001"),
        ({"other_accelerator": True}, "accelerator", "no performance profile"),
        ({"both_link_and_gbps": True}, "link_gbps", "not both"),
    ],
)
def test_the_kv_calculator_rejects_bad_input_next_to_the_field(
    client_as, change, field, message
) -> None:
    profile = _profile()
    link = cast(Link, LinkFactory(gbps=100.0))
    data = {
        "model": profile.model_id,
        "accelerator": profile.accelerator_id,
        "tokens": 32768,
        "instances": 4,
    }
    if change.pop("other_accelerator", False):
        data["accelerator"] = cast(Accelerator, AcceleratorFactory()).pk
    if change.pop("both_link_and_gbps", False):
        data.update({"link": link.pk, "link_gbps": 50})
    data.update(change)
    response = client_as("viewer").get(reverse("kv-calculator"), data)
    assert response.status_code == 422
    assert response.context["result"] is None
    assert any(message in e for e in response.context["form"].errors[field])
    assert f'id="id_{field}_error"' in response.content.decode()


def _whatif_data(**change: object) -> dict[str, object]:
    data: dict[str, object] = {
        "source": "paper-case-study.yaml",
        "workload": "paper-case-study.yaml",
        "rate_per_s": "2",
        "requests": "300",
        "seed": "1",
        "link_gbps": "",
        "threshold": "",
        "prfaas_instances": "",
        "pd_prefill_instances": "",
        "pd_decode_instances": "",
    }
    data.update(change)
    return data


def test_a_viewer_sees_the_what_if_form_without_a_run_button_and_cannot_post(client_as) -> None:
    client = client_as("viewer")
    assert b"Run simulation" not in client.get(reverse("whatif")).content
    assert client.post(reverse("whatif-start"), _whatif_data()).status_code == 403
    assert redis_sync().get(whatif.NEXT_KEY) is None


def test_starting_a_what_if_stores_a_queued_run_and_shows_its_page(
    client_as, django_capture_on_commit_callbacks
) -> None:
    client = client_as("operator")
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = client.post(reverse("whatif-start"), _whatif_data(link_gbps="25"))
    assert response.status_code == 302
    run_id = int(response["Location"].rstrip("/").rsplit("/", 1)[1])
    assert len(callbacks) == 1  # the Celery task is enqueued only after commit
    run = whatif.whatif_get(run_id)
    assert run["status"] == "queued"
    assert run["params"]["link_gbps"] == 25.0
    page = client.get(response["Location"]).content.decode()
    assert 'role="progressbar"' in page


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        ({"source": "../../etc/passwd"}, "source", "Select a valid choice."),
        ({"requests": "0"}, "requests", "greater than or equal to 1"),
        ({"requests": "1000000"}, "requests", "less than or equal to"),
        ({"rate_per_s": "-1"}, "rate_per_s", "greater than or equal to"),
        ({"rate_per_s": ""}, "rate_per_s", "gives no arrival rate"),
        ({"link_gbps": "-5"}, "link_gbps", "greater than or equal to 0"),
        ({"link_gbps": "inf"}, "link_gbps", "Enter a number."),
        ({"pd_decode_instances": "0"}, "pd_decode_instances", "greater than or equal to 1"),
        ({"threshold": "lots"}, "threshold", "Enter a number."),
    ],
)
def test_a_bad_what_if_is_rejected_next_to_the_field_and_starts_nothing(
    client_as, change, field, message
) -> None:
    response = client_as("operator").post(reverse("whatif-start"), _whatif_data(**change))
    assert response.status_code == 422
    assert any(message in e for e in response.context["form"].errors[field])
    assert f'id="id_{field}_error"' in response.content.decode()
    assert redis_sync().get(whatif.NEXT_KEY) is None


def test_an_unknown_what_if_run_is_404(client_as) -> None:
    assert client_as("viewer").get(reverse("whatif-run", args=[424242])).status_code == 404


def test_a_what_if_run_compares_the_edit_against_the_current_plan() -> None:
    params = whatif.WhatIfParams(
        source="paper-case-study.yaml",
        workload="paper-case-study.yaml",
        requests=300,
        seed=1,
        rate_per_s=2.0,
        link_gbps=0.0,
    )
    run_id = whatif.whatif_start(params, actor=CLI_ACTOR)
    result = whatif.whatif_execute(run_id)
    run = whatif.whatif_get(run_id)
    assert run["status"] == "finished"
    assert run["result"] == json.loads(json.dumps(result))
    current, edited = result["current"], result["whatif"]
    assert current["offload_fraction"] > 0
    assert edited["offload_fraction"] == 0  # a link that is down carries nothing
    assert all(link["mean_gbps"] == 0 for link in edited["links"])
    assert {"mean", "p50", "p90", "p99"} <= set(current["ttft"])


def test_an_inventory_run_without_traffic_asks_for_a_rate(client_as, scenarios_dir) -> None:
    inventory_load(scenarios_dir)
    response = client_as("operator").post(
        reverse("whatif-start"), _whatif_data(source="inventory", rate_per_s="")
    )
    assert response.status_code == 422
    assert any("no traffic observed" in e for e in response.context["form"].errors["rate_per_s"])
    assert redis_sync().get(whatif.NEXT_KEY) is None


def test_an_inventory_run_takes_the_rate_of_the_observed_traffic_window(
    client_as, scenarios_dir
) -> None:
    inventory_load(scenarios_dir)
    now = time.time()
    traffic_record(now, np.full(1800, 20000.0), span=whatif.TRAFFIC_WINDOW_S)
    response = client_as("operator").post(
        reverse("whatif-start"), _whatif_data(source="inventory", rate_per_s="")
    )
    assert response.status_code == 302
    run_id = int(response["Location"].rstrip("/").rsplit("/", 1)[1])
    assert whatif.whatif_get(run_id)["params"]["rate_per_s"] == pytest.approx(2.0, rel=0.05)
    result = whatif.whatif_execute(run_id)
    assert "error" not in result, result
    assert result["whatif"]["finished"] == 300


@pytest.mark.parametrize(("n_p", "n_d"), [(1, 7), (7, 1)])
def test_a_what_if_runs_the_split_its_knobs_ask_for(n_p: int, n_d: int) -> None:
    params = whatif.WhatIfParams(
        source="paper-case-study.yaml",
        workload="paper-case-study.yaml",
        requests=200,
        seed=1,
        rate_per_s=1.0,
        pd_prefill_instances=n_p,
        pd_decode_instances=n_d,
    )
    result = whatif.whatif_execute(whatif.whatif_start(params, actor=CLI_ACTOR))
    assert "error" not in result, result
    # The scenario file's own split (4/4) is the current one; the knobs' is the what-if's.
    assert result["current"]["split"] == {"pd-h20": [4, 4]}
    assert result["whatif"]["split"] == {"pd-h20": [n_p, n_d]}


def test_an_inventory_what_if_compares_against_the_deployed_policy_and_roles(
    scenarios_dir,
) -> None:
    inventory_load(scenarios_dir, n_p=5, n_d=3)
    policy_create(actor=CLI_ACTOR, thresholds={"pd-h20": 30_000})
    params = whatif.WhatIfParams(
        source="inventory",
        workload="paper-case-study.yaml",
        requests=200,
        seed=1,
        rate_per_s=1.0,
        threshold=12_000,
    )
    result = whatif.whatif_execute(whatif.whatif_start(params, actor=CLI_ACTOR))
    assert "error" not in result, result
    assert result["current"]["split"] == {"pd-h20": [5, 3]}
    assert result["current"]["thresholds"] == {"pd-h20": 30_000}
    assert result["whatif"]["split"] == {"pd-h20": [5, 3]}
    assert result["whatif"]["thresholds"] == {"pd-h20": 12_000}


def test_a_what_if_gives_sizing_advice_the_page_shows(client_as) -> None:
    params = whatif.WhatIfParams(
        source="paper-case-study.yaml",
        workload="paper-case-study.yaml",
        requests=100,
        seed=1,
        rate_per_s=1.0,
    )
    run_id = whatif.whatif_start(params, actor=CLI_ACTOR)
    result = whatif.whatif_execute(run_id)
    advice = result["advice"]
    # The case study's PrfaaS cluster is compute-bound: more instances raise the planned rate.
    assert advice["changes"] and advice["changes"][0]["kind"] == "prfaas_instances"
    assert all(c["rate_rps"] > advice["rate_rps"] for c in advice["changes"])
    page = (
        client_as("viewer")
        .get(reverse("whatif-run", args=[run_id]), HTTP_HX_REQUEST="true")
        .content.decode()
    )
    assert "Sizing advice" in page and advice["changes"][0]["change"] in page
    # Each change with the share of requests its link guards would refuse (none here).
    assert "Refused by the link guard" in page and "0% &rarr; 0%" in page
