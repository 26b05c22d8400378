"""The router client against a real HTTP server on a local port.

The server here is a tiny ``http.server`` in a thread that speaks the route API's contract
(bearer token, ``POST /api/v1/route``, ``/route/batch``, ``GET /api/v1/policy`` with ETag)
and answers with the same pure router the control plane uses, so its answers are realistic.
Tests stop it, slow it down or make it fail to check the client's retries and fallback.

The last test runs the real control plane under uvicorn (test database, real Redis), takes
decisions from it, kills it mid-run and checks that decisions continue from the cached
policy, marked ``telemetry_stale``.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
import redis

from controlplane.audit import CLI_ACTOR
from fleet.client import (
    RouterApiError,
    RouterClient,
    RouterUnavailableError,
    route_request_to_dict,
)
from scheduling.core.routing import (
    ClusterSpec,
    DecodeProfile,
    InstanceSpec,
    Link,
    LiveState,
    ModelSpec,
    PolicySnapshot,
    Reason,
    RouteGuards,
    RouteRequest,
    RoutingPolicy,
    Topology,
    decision_to_dict,
    policy_snapshot_to_dict,
    route_decide,
)
from scheduling.policies import policy_create
from tests.factories import (
    api_token,
)
from tests.support.fleets import pd_prfaas_fleet
from tests.support.servers import control_plane_serve

TOKEN = "router-test-token"
PD = "pd-h20"
PF = "prfaas-h200"
T = 19400


def make_snapshot(version: int = 3, stale_mode: str = "static") -> PolicySnapshot:
    instances = [InstanceSpec(f"pf{i}", PF, "prefill", endpoint=f"http://pf{i}") for i in range(2)]
    instances += [InstanceSpec(f"pp{i}", PD, "prefill", endpoint=f"http://pp{i}") for i in range(2)]
    instances += [InstanceSpec(f"pd{i}", PD, "decode", endpoint=f"http://pd{i}") for i in range(2)]
    topology = Topology(
        ModelSpec("m", 512, ((1024, 190.8), (8192, 308.9), (32768, 701.3), (131072, 2316.3))),
        (
            ClusterSpec(PF, "prfaas", ((1024, 0.44), (131072, 7.4))),
            ClusterSpec(PD, "pd", ((1024, 0.6), (131072, 22.5)), decode=DecodeProfile(20, 0.025)),
        ),
        tuple(instances),
        (Link(PF, PD, 100.0, 10.0),),
    )
    return PolicySnapshot(
        RoutingPolicy(version, {PD: T}, RouteGuards(stale_mode=stale_mode)), topology
    )


class FakeControlPlane:
    """A real HTTP server speaking the route API; behaviour switchable per test."""

    def __init__(self) -> None:
        self.snapshot = make_snapshot()
        self.mode = "ok"  # ok | fail500 | slow | garbage | reject422 | no_decode
        self.slow_s = 1.0
        self.requests: list[tuple[str, str, dict[str, str], Any]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def count(self, path: str) -> int:
        return sum(1 for _, p, _, _ in self.requests if p == path)

    def _policy_body(self) -> tuple[bytes, str]:
        body = json.dumps(policy_snapshot_to_dict(self.snapshot), sort_keys=True).encode()
        return body, '"' + hashlib.sha256(body).hexdigest()[:16] + '"'

    def _decide(self, item: dict[str, Any]) -> dict[str, Any]:
        request = RouteRequest(
            origin=item["origin"],
            prompt_tokens=item["prompt_tokens"],
            cached_tokens=item.get("cached_tokens", {}),
            request_id=item.get("request_id"),
        )
        live = LiveState(now=time.time(), telemetry_at=time.time())
        d = route_decide(request, self.snapshot.policy, self.snapshot.topology, live)
        return decision_to_dict(d)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        plane = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _reply(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
                raw = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(raw)

            def _common(self) -> bool:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                plane.requests.append((self.command, self.path, dict(self.headers), body))
                self._body: Any = body
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self._reply(401, {"detail": "missing or invalid token", "code": "unauthorized"})
                    return False
                if plane.mode == "slow":
                    time.sleep(plane.slow_s)
                if plane.mode == "fail500":
                    self._reply(503, {"detail": "database unavailable", "code": "unavailable"})
                    return False
                if plane.mode == "garbage":
                    self._reply(200, b"<html>proxy error</html>")
                    return False
                return True

            def do_GET(self) -> None:
                if not self._common():
                    return
                if self.path != "/api/v1/policy":
                    self._reply(404, {"detail": "not found", "code": "not_found"})
                    return
                body, etag = plane._policy_body()
                if self.headers.get("If-None-Match") == etag:
                    self.send_response(304)
                    self.send_header("ETag", etag)
                    self.end_headers()
                    return
                self._reply(200, body, {"ETag": etag})

            def do_POST(self) -> None:
                if not self._common():
                    return
                if plane.mode == "reject422":
                    self._reply(422, {"detail": "prompt_tokens: too large", "code": "invalid"})
                    return
                if plane.mode == "no_decode":
                    detail = "pd cluster 'pd-h20' has no active decode instance"
                    self._reply(503, {"detail": detail, "code": "no_decode_capacity"})
                    return
                if self.path == "/api/v1/route":
                    self._reply(200, plane._decide(self._body))
                elif self.path == "/api/v1/route/batch":
                    decisions = [plane._decide(item) for item in self._body["requests"]]
                    self._reply(200, {"decisions": decisions})
                else:
                    self._reply(404, {"detail": "not found", "code": "not_found"})

        return Handler


@pytest.fixture
def plane() -> Iterator[FakeControlPlane]:
    server = FakeControlPlane()
    yield server
    server.stop()


def make_client(url: str, **kwargs: Any) -> RouterClient:
    options: dict[str, Any] = {"timeout_s": 0.3, "retries": 1, "backoff_s": 0.01}
    options.update(kwargs)
    return RouterClient(url, TOKEN, **options)


def test_a_decision_comes_from_the_server_with_the_token_and_the_contract_body(
    plane: FakeControlPlane,
) -> None:
    with make_client(plane.url) as client:
        d = client.route(PD, 30000, block_hashes=["00ff00ff00ff00ff", 7], request_id="r1")
    assert (d.route, d.reason, d.request_id, d.stale) == (
        "prfaas",
        Reason.ABOVE_THRESHOLD,
        "r1",
        False,
    )
    method, path, headers, body = plane.requests[0]
    assert (method, path) == ("POST", "/api/v1/route")
    assert headers["Authorization"] == f"Bearer {TOKEN}"
    assert body == {
        "origin": PD,
        "prompt_tokens": 30000,
        "block_hashes": ["00ff00ff00ff00ff", 7],
        "request_id": "r1",
    }
    assert client.remote_decisions == 1 and client.local_decisions == 0


def test_the_policy_snapshot_is_cached_and_revalidated_with_its_etag(
    plane: FakeControlPlane,
) -> None:
    with make_client(plane.url) as client:
        assert client.refresh_policy() is True
        assert client.policy_snapshot is not None
        assert policy_snapshot_to_dict(client.policy_snapshot) == policy_snapshot_to_dict(
            plane.snapshot
        )
        assert client.refresh_policy() is False
        assert plane.requests[-1][2].get("If-None-Match")
        plane.snapshot = make_snapshot(version=4)
        assert client.refresh_policy() is True
        assert client.policy_snapshot is not None
        assert client.policy_snapshot.policy.version == 4


def test_a_new_policy_version_in_an_answer_refreshes_the_cached_snapshot(
    plane: FakeControlPlane,
) -> None:
    with make_client(plane.url) as client:
        client.route(PD, 100)
        assert client.policy_snapshot is not None
        assert client.policy_snapshot.policy.version == 3
        fetched = plane.count("/api/v1/policy")
        client.route(PD, 100)
        assert plane.count("/api/v1/policy") == fetched  # same version: no refetch
        plane.snapshot = make_snapshot(version=5)
        client.route(PD, 100)
        assert client.policy_snapshot.policy.version == 5


def test_when_the_server_stops_mid_run_decisions_continue_locally_and_say_so(
    plane: FakeControlPlane,
) -> None:
    client = make_client(plane.url)
    before = [client.route(PD, n, request_id=f"a{n}") for n in (1000, 30000)]
    assert [d.stale for d in before] == [False, False]
    plane.stop()
    after = [client.route(PD, n, request_id=f"b{n}") for n in (1000, 30000, 60000)]
    # The policy's static rule: uncached length against t, and the reason says why.
    assert [d.route for d in after] == ["local", "prfaas", "prfaas"]
    assert {d.reason for d in after} == {Reason.TELEMETRY_STALE}
    assert all(d.stale and d.cache_transfer is None for d in after)
    assert all(d.policy_version == 3 for d in after)
    assert client.local_decisions == 3
    client.close()


def test_a_policy_that_says_local_keeps_fallback_decisions_local(plane: FakeControlPlane) -> None:
    plane.snapshot = make_snapshot(stale_mode="local")
    client = make_client(plane.url)
    assert client.refresh_policy()
    plane.stop()
    decisions = [client.route(PD, n) for n in (1000, 30000, 120000)]
    assert [(d.route, d.reason) for d in decisions] == [("local", Reason.TELEMETRY_STALE)] * 3
    client.close()


def test_server_errors_are_retried_then_answered_locally(plane: FakeControlPlane) -> None:
    with make_client(plane.url, retries=2) as client:
        client.refresh_policy()
        plane.mode = "fail500"
        d = client.route(PD, 30000)
    assert d.reason == Reason.TELEMETRY_STALE
    assert plane.count("/api/v1/route") == 3  # the first try and two retries


def test_a_slow_server_times_out_and_is_answered_locally(plane: FakeControlPlane) -> None:
    with make_client(plane.url, timeout_s=0.1, retries=0) as client:
        client.refresh_policy()
        plane.mode = "slow"
        d = client.route(PD, 1000)
    assert (d.route, d.reason) == ("local", Reason.TELEMETRY_STALE)


def test_a_garbled_answer_is_answered_locally(plane: FakeControlPlane) -> None:
    with make_client(plane.url) as client:
        client.refresh_policy()
        plane.mode = "garbage"
        assert client.route(PD, 1000).reason == Reason.TELEMETRY_STALE


def test_after_a_failure_the_client_waits_out_the_cooldown_then_returns_by_itself(
    plane: FakeControlPlane,
) -> None:
    with make_client(plane.url, cooldown_s=0.3, retries=0) as client:
        client.refresh_policy()
        plane.mode = "fail500"
        client.route(PD, 1000)
        calls = plane.count("/api/v1/route")
        for _ in range(5):
            assert client.route(PD, 1000).stale
        assert plane.count("/api/v1/route") == calls  # no call while cooling down
        plane.mode = "ok"
        time.sleep(0.35)
        d = client.route(PD, 1000)
    assert not d.stale and d.reason == Reason.BELOW_THRESHOLD


def test_a_refused_request_raises_the_servers_error_instead_of_deciding_locally(
    plane: FakeControlPlane,
) -> None:
    with make_client(plane.url) as client:
        client.refresh_policy()
        plane.mode = "reject422"
        with pytest.raises(RouterApiError) as err:
            client.route(PD, 10**9)
    assert (err.value.status, err.value.code) == (422, "invalid")
    assert "too large" in err.value.detail
    assert client.local_decisions == 0


def test_a_fleet_without_decode_capacity_is_reported_not_answered_from_the_snapshot(
    plane: FakeControlPlane,
) -> None:
    with make_client(plane.url, retries=2) as client:
        client.refresh_policy()
        plane.mode = "no_decode"
        with pytest.raises(RouterApiError) as err:
            client.route(PD, 1000)
        plane.mode = "ok"
        after = client.route(PD, 1000)
    assert (err.value.status, err.value.code) == (503, Reason.NO_DECODE_CAPACITY)
    assert plane.count("/api/v1/route") == 2  # no retry of a definitive answer, no cooldown
    assert client.local_decisions == 0 and not after.stale


def test_a_wrong_token_raises_unauthorized(plane: FakeControlPlane) -> None:
    client = RouterClient(plane.url, "wrong", timeout_s=0.3, retries=0)
    with client, pytest.raises(RouterApiError) as err:
        client.route(PD, 100)
    assert (err.value.status, err.value.code) == (401, "unauthorized")


def test_without_a_server_and_without_a_snapshot_the_client_says_it_cannot_decide() -> None:
    # A port nobody listens on: bind one, note it, close it.
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = server.server_address[1]
    server.server_close()
    client = make_client(f"http://127.0.0.1:{port}", retries=0)
    with client, pytest.raises(RouterUnavailableError, match="no policy snapshot"):
        client.route(PD, 100)


def test_a_batch_is_decided_remotely_then_locally_when_the_server_is_gone(
    plane: FakeControlPlane,
) -> None:
    requests = [RouteRequest(PD, n, request_id=f"r{n}") for n in (500, 25000, 90000)]
    client = make_client(plane.url)
    remote = client.route_batch(requests)
    assert [d.request_id for d in remote] == ["r500", "r25000", "r90000"]
    assert [d.route for d in remote] == ["local", "prfaas", "prfaas"]
    assert plane.requests[0][3] == {"requests": [route_request_to_dict(r) for r in requests]}
    plane.stop()
    local = client.route_batch(requests)
    assert [d.reason for d in local] == [Reason.TELEMETRY_STALE] * 3
    assert [d.request_id for d in local] == ["r500", "r25000", "r90000"]
    assert client.route_batch([]) == []
    client.close()


def test_decide_locally_uses_the_cached_policy_with_stale_live_state(
    plane: FakeControlPlane,
) -> None:
    with make_client(plane.url) as client:
        d = client.decide_locally(RouteRequest(PD, 30000, cached_tokens={PD: 20480}))
    assert (d.route, d.reason, d.cached_tokens) == ("local", Reason.TELEMETRY_STALE, 20480)
    assert plane.count("/api/v1/route") == 0


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"timeout_s": 0}, "timeout_s"), ({"retries": -1}, "retries")]
)
def test_bad_client_settings_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouterClient("http://127.0.0.1:1", TOKEN, **kwargs)


# --------------------------------------------------------------------------------------
# End to end: the real app under uvicorn, on the test database and real Redis
# --------------------------------------------------------------------------------------


def _real_fleet() -> tuple[str, str]:
    """pd-e (H20: 2 prefill, 2 decode) <- 100 Gbps <- prfaas-e (H200: 2 prefill), a policy
    with t = 19,400, and (router secret, agent secret)."""
    pd_prfaas_fleet(
        "pd-e", "prfaas-e", h20_prefill_seconds=[[1024, 0.6], [32768, 5.0], [131072, 22.5]]
    )
    policy_create(actor=CLI_ACTOR, thresholds={"pd-e": T})
    return api_token("router")[1], api_token("agent")[1]


@pytest.fixture
def real_app(
    transactional_db: None, redis_client: redis.Redis, settings: Any
) -> Iterator[tuple[str, str, str, subprocess.Popen[bytes]]]:
    """The real control plane under uvicorn (one worker) on the test database."""
    from django.db import connection

    router_secret, agent_secret = _real_fleet()
    with control_plane_serve(connection.settings_dict, settings.REDIS_URL) as (base, proc):
        yield base, router_secret, agent_secret, proc


def test_with_the_real_control_plane_stopped_mid_run_decisions_continue_locally(
    real_app: tuple[str, str, str, subprocess.Popen[bytes]],
) -> None:
    base, router_secret, agent_secret, proc = real_app
    ts = time.time()
    telemetry = {
        "idempotency_key": "client-e2e",
        "instances": [
            {"instance": name, "ts": ts}
            for name in ("pd-e-p0", "pd-e-p1", "pd-e-d0", "pd-e-d1", "prfaas-e-p0", "prfaas-e-p1")
        ],
    }
    posted = httpx.post(
        f"{base}/api/v1/telemetry",
        json=telemetry,
        headers={"Authorization": f"Bearer {agent_secret}"},
        timeout=10,
    )
    assert posted.status_code == 200, posted.text

    client = RouterClient(base, router_secret, timeout_s=5.0, retries=1, backoff_s=0.05)
    remote = [client.route("pd-e", n, request_id=f"up-{n}") for n in (1000, 30000)]
    assert [(d.route, d.reason, d.stale) for d in remote] == [
        ("local", Reason.BELOW_THRESHOLD, False),
        ("prfaas", Reason.ABOVE_THRESHOLD, False),
    ]
    assert client.remote_decisions == 2
    snapshot = client.policy_snapshot
    assert snapshot is not None and snapshot.policy.version == remote[0].policy_version
    assert client.refresh_policy() is False  # ETag: nothing changed

    proc.kill()
    proc.wait(timeout=20)
    after = [client.route("pd-e", n, request_id=f"down-{n}") for n in (1000, 30000, 90000)]
    assert [d.request_id for d in after] == ["down-1000", "down-30000", "down-90000"]
    assert all(d.stale and d.reason == Reason.TELEMETRY_STALE for d in after)
    # The policy's static rule from the cached snapshot: short local, long offloaded.
    assert [d.route for d in after] == ["local", "prfaas", "prfaas"]
    assert all(d.cache_transfer is None for d in after)
    assert all(d.decode.cluster == "pd-e" for d in after)
    assert client.local_decisions == 3
    client.close()
