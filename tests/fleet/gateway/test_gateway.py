"""The gateway against protocol-faithful fake vLLM engines and the real control plane."""

from __future__ import annotations

import json
import random
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from fleet.blockhash import block_keys
from tests.fleet.gateway.conftest import PD, PRFAAS, THRESHOLD, Stack, single_answer

pytestmark = pytest.mark.timeout(120)


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1024) for _ in range(n)]


def complete(stack: Stack, body: dict[str, Any], rid: str, chat: bool = False) -> httpx.Response:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return httpx.post(
        f"{stack.gateway}{path}",
        json={"model": "tiny", **body},
        headers={"X-Request-Id": rid},
        timeout=30,
    )


def sse_text(raw: str, chat: bool = False) -> tuple[str, bool]:
    """The streamed text and whether the stream ended with [DONE]."""
    text, done = [], False
    for line in raw.splitlines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            done = True
            continue
        for choice in json.loads(data)["choices"]:
            text.append(choice["delta"].get("content", "") if chat else choice["text"])
    return "".join(text), done


@pytest.mark.parametrize("connector", ["nixl", "shared_storage"])
def test_a_long_prompt_is_offloaded_prefilled_on_prfaas_and_decoded_locally(
    stack_factory: Callable[..., Stack], connector: str
) -> None:
    stack = stack_factory(connector=connector)
    prompt = ids(THRESHOLD + 2000, seed=1)
    got = complete(stack, {"prompt": prompt, "max_tokens": 8}, "offload-1")
    assert got.status_code == 200, got.text
    assert got.headers["x-prfaas-route"] == "prfaas"
    assert got.headers["x-prfaas-reason"] == "above_threshold"
    prefill, decode = got.headers["x-prfaas-prefill"], got.headers["x-prfaas-decode"]
    assert prefill.startswith(PRFAAS) and decode.startswith(f"{PD}-d")
    assert got.json()["choices"][0]["text"] == single_answer(stack, prompt, 8)

    stats = stack.engine_stats()
    if connector == "nixl":
        # Prefill kept the KV for a remote decoder; the decoder pulled it from there.
        assert stats[prefill]["prefills_held"] == 1 and stats[prefill]["kv_served"] == 1
        assert stats[decode]["kv_pulled"] == 1
        assert stats[prefill]["bodies"][-1]["kv_transfer_params"]["do_remote_decode"] is True
        assert stats[decode]["bodies"][-1]["kv_transfer_params"]["do_remote_prefill"] is True
    else:
        assert stats[prefill]["kv_stored"] == 1 and stats[decode]["kv_loaded"] == 1
        assert "kv_transfer_params" not in stats[decode]["bodies"][-1]
    assert stats[prefill]["bodies"][-1]["max_tokens"] == 1
    assert stats[prefill]["request_ids"][-1] == stats[decode]["request_ids"][-1] == "offload-1"

    outcome = stack.outcome_of("offload-1")
    assert outcome["route"] == "prfaas" and outcome["status"] == "ok"
    assert outcome["transfer"] == "finished"
    assert outcome["reservation_id"] and outcome["released_bytes"] > 0
    assert outcome["observed_ttft_s"] > 0 and outcome["predicted_ttft_s"] > 0
    # The released bytes show in the live view within its age bound (LIVE_STATE_MAX_AGE_S,
    # 0.5 s: a view read just before the release may be served until then).
    deadline = time.monotonic() + 3.0
    while True:
        live = httpx.get(
            f"{stack.control_plane}/api/v1/route/live",
            headers=stack.headers(stack.router_token),
            timeout=5,
        ).json()
        inflight = [lk["inflight_bytes"] for lk in live["links"]]
        if inflight == [0] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert inflight == [0]


def test_a_short_prompt_stays_local_and_streams_through_both_local_steps(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(token_s=0.02)  # tokens apart in time: the ITL is measured
    prompt = "a short question that stays in the PD cluster"
    with httpx.stream(
        "POST",
        f"{stack.gateway}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 6, "stream": True},
        headers={"X-Request-Id": "local-1"},
        timeout=30,
    ) as got:
        assert got.status_code == 200
        assert got.headers["content-type"].startswith("text/event-stream")
        assert got.headers["x-prfaas-route"] == "local"
        assert got.headers["x-prfaas-reason"] == "below_threshold"
        prefill, decode = got.headers["x-prfaas-prefill"], got.headers["x-prfaas-decode"]
        raw = got.read().decode()
    text, done = sse_text(raw)
    assert done and text == single_answer(stack, prompt, 6)
    assert prefill.startswith(f"{PD}-p") and decode.startswith(f"{PD}-d")
    stats = stack.engine_stats()
    assert stats[prefill]["bodies"][-1]["stream"] is False
    assert stats[decode]["bodies"][-1]["stream"] is True
    assert stats[decode]["kv_pulled"] == 1
    outcome = stack.outcome_of("local-1")
    assert outcome["route"] == "local" and outcome["output_tokens"] == 6
    assert outcome["released_bytes"] is None  # nothing crossed a link
    assert stack.gateway_metric("prfaas_gateway_ttft_seconds_count", route="local") >= 1
    assert stack.gateway_metric("prfaas_gateway_itl_seconds_count") >= 1


def test_a_chat_completion_is_tokenized_by_an_engine_and_served(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory()
    messages = [{"role": "user", "content": "hello there"}]
    got = complete(stack, {"messages": messages, "max_tokens": 5}, "chat-1", chat=True)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"]["content"] == single_answer(
        stack, messages, 5, chat=True
    )
    assert got.headers["x-prfaas-route"] == "local"


def test_a_failed_prfaas_prefill_instance_falls_back_to_local_prefill_and_says_so(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory()
    for name in (f"{PRFAAS}-p0", f"{PRFAAS}-p1"):
        stack.fault(name, "error", 10)
    prompt = ids(THRESHOLD + 3000, seed=2)
    got = complete(stack, {"prompt": prompt, "max_tokens": 4}, "fallback-1")
    assert got.status_code == 200, got.text
    assert got.headers["x-prfaas-route"] == "local"
    assert got.headers["x-prfaas-reason"] == "prfaas_unavailable"
    assert got.headers["x-prfaas-fallback"] == "prefill_failed"
    assert got.headers["x-prfaas-prefill"].startswith(f"{PD}-p")
    assert got.json()["choices"][0]["text"] == single_answer(stack, prompt, 4)
    outcome = stack.outcome_of("fallback-1")
    assert outcome["decided_route"] == "prfaas" and outcome["route"] == "local"
    assert outcome["transfer"] == "failed" and outcome["error"].startswith("prefill_failed:")
    assert outcome["released_bytes"] > 0  # the offload's reservation is given back
    assert stack.gateway_metric("prfaas_gateway_errors_total", kind="fallback_local") == 1


def test_a_failed_local_prefill_instance_is_retried_once_on_another(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory()
    stack.fault(f"{PD}-p0", "error", 100)
    answers = [
        complete(stack, {"prompt": f"question {k}", "max_tokens": 3}, f"r{k}") for k in range(8)
    ]
    assert [a.status_code for a in answers] == [200] * 8
    retried = [a for a in answers if a.headers.get("x-prfaas-fallback") == "prefill_retried"]
    assert retried, "no request was decided onto the failing instance"
    assert all(a.headers["x-prfaas-prefill"] == f"{PD}-p1" for a in retried)
    assert stack.engine_stats()[f"{PD}-p0"]["faults"] == len(retried)
    # Both prefill instances failing is a clear error, not a hang.
    stack.fault(f"{PD}-p1", "error", 100)
    got = complete(stack, {"prompt": "nowhere to prefill", "max_tokens": 3}, "both-down")
    assert got.status_code == 502
    assert got.json()["code"] == "prefill_failed" and "error" in got.json()


def test_a_client_that_disconnects_mid_stream_cancels_the_decode_upstream(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(token_s=0.05)
    port = int(stack.gateway.rsplit(":", 1)[1])
    body = json.dumps(
        {"model": "tiny", "prompt": "tell me a long story", "max_tokens": 400, "stream": True}
    ).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"X-Request-Id: gone-1\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    first = sock.recv(4096)
    assert b"200" in first.split(b"\r\n", 1)[0]
    sock.close()  # 400 tokens at 50 ms each would take 20 s
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        cancelled = sum(s["cancelled"] for s in stack.engine_stats().values())
        if cancelled:
            break
        time.sleep(0.1)
    assert cancelled == 1
    assert stack.outcome_of("gone-1")["status"] == "cancelled"
    assert stack.gateway_metric("prfaas_gateway_errors_total", kind="client_disconnect") == 1


def test_a_cache_transfer_decision_moves_the_prefix_before_local_prefill(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(decide="remote")
    prompt = ids(THRESHOLD + 2000, seed=3)
    # The PrfaaS instance holds the first 4,608 tokens (9 blocks of 512), exactly.
    holder = f"{PRFAAS}-p0"
    prefix_hashes = block_keys(prompt[: 9 * 512], 512)
    event = [time.time(), [["BlockStored", prefix_hashes, None, [], 512]]]
    posted = httpx.post(
        f"{stack.control_plane}/api/v1/kv-events",
        json={"instance": holder, "batches": [{"seq": 0, "batch": event}]},
        headers=stack.headers(stack.agent_token),
        timeout=10,
    )
    assert posted.status_code == 200, posted.text
    got = complete(stack, {"prompt": prompt, "max_tokens": 4}, "ct-1")
    assert got.status_code == 200, got.text
    assert got.headers["x-prfaas-route"] == "local"
    assert got.headers["x-prfaas-reason"] == "cache_affinity"
    target = got.headers["x-prfaas-prefill"]
    assert got.json()["choices"][0]["text"] == single_answer(stack, prompt, 4)
    stats = stack.engine_stats()
    # The prefix went holder -> target by the connector's handoff, then the whole prompt
    # was prefilled on the target and decoded.
    assert stats[holder]["bodies"][0]["prompt"] == prompt[: 9 * 512]
    assert stats[holder]["kv_served"] == 1
    assert stats[target]["kv_pulled"] == 1
    assert stats[target]["bodies"][-1]["prompt"] == prompt
    outcome = stack.outcome_of("ct-1")
    assert outcome["decided_by"] == "control_plane"
    assert outcome["transfer"] == "finished" and outcome["transfer_bytes"] > 0
    assert outcome["released_bytes"] > 0


def test_bad_requests_get_a_clear_error_in_both_shapes(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory()
    bad = httpx.post(f"{stack.gateway}/v1/completions", content=b"{not json", timeout=10)
    assert bad.status_code == 400 and bad.json()["code"] == "invalid_json"
    assert bad.json()["error"]["type"] == "invalid_request_error"
    batch = complete(stack, {"prompt": ["a", "b"], "max_tokens": 2}, "batch")
    assert batch.status_code == 400 and batch.json()["code"] == "invalid_prompt"
    models = httpx.get(f"{stack.gateway}/v1/models", timeout=10).json()
    assert models["object"] == "list" and models["data"][0]["id"]
    health = httpx.get(f"{stack.gateway}/health", timeout=10).json()
    assert health["status"] == "ok" and health["origin"] == PD
