"""Live state on a Redis Cluster of its own (three masters, three replicas) under load: a master
killed with SIGKILL while ``/route`` runs open-loop and agents post, and two web replicas
sharing one cluster (issue 33). ``make test-cluster`` runs these (marker ``redis_cluster``);
their figures are in docs/operations.md ("Redis Cluster: failover under load")."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import redis
from django.conf import settings as django_settings

from clusters.live import prefix_index
from clusters.live.keys import prefix_instance_prefix, reservation_keys
from controlplane.redis_connection import redis_cluster_sync
from tests.factories import PREFILL_SECONDS, api_token, bearer
from tests.support.fleets import BLOCK_TOKENS, pd_prfaas_fleet
from tests.support.redis_cluster import ThrowawayRedisCluster
from tests.support.servers import control_plane_serve

pytestmark = [pytest.mark.redis_cluster, pytest.mark.timeout(600)]

BLOCK = BLOCK_TOKENS
H20_PREFILL_SECONDS = [[1024, 0.9], [8192, 2.4], [32768, 7.5], [131072, 36.0]]
# Slow prefill: every hold outlasts the run, so the bytes ever admitted on the link are the
# bytes in flight at its end, and they must fit its budget whatever happened meanwhile.
SLOWDOWN = 50.0
BUDGET = 6 * 2**30
# The servers' index read deadline: generous on this loaded 2-core machine, so a decision
# without hits is the failover's doing, not the machine's.
SERVER_ENV = {"PREFIX_READ_DEADLINE_S": "0.1"}
HIT_INSTANCE = "pd-a-p1"
LINK = "prfaas-x->pd-a"


@pytest.fixture
def cluster(tmp_path: Path, settings: Any) -> Iterator[ThrowawayRedisCluster]:
    """A cluster of this test's own (it kills one of its masters), live state on it."""
    own = ThrowawayRedisCluster(tmp_path / "cluster")
    try:
        own.start()
        settings.REDIS_CLUSTER_URL = own.url
        settings.PREFIX_INDEX_GROUPS = 3
        yield own
    finally:
        own.stop()


@dataclass
class Tokens:
    router: dict[str, str]
    agent: dict[str, str]


def fleet() -> Tokens:
    slow = [[tokens, seconds * SLOWDOWN] for tokens, seconds in H20_PREFILL_SECONDS]
    pd_prfaas_fleet(
        "pd-a",
        "prfaas-x",
        h20_prefill_seconds=slow,
        kv_budget_bytes=BUDGET,
        h200_prefill_seconds=[[t, s * SLOWDOWN] for t, s in PREFILL_SECONDS],
    )
    return Tokens(router=bearer(api_token("router")[1]), agent=bearer(api_token("agent")[1]))


@dataclass
class Agent:
    """An engine's agent: KV batches in sequence, a failed post kept and sent again (the
    replay), telemetry every tick."""

    instance: str
    chain_start: int
    seq: itertools.count[int] = field(default_factory=itertools.count)
    unsent: list[dict[str, Any]] = field(default_factory=list)
    stored: list[int] = field(default_factory=list)
    statuses: list[tuple[float, int]] = field(default_factory=list)
    made: int = 0

    def next_batch(self, blocks: int) -> None:
        self.made += 1
        start = self.chain_start + len(self.stored)
        hashes = list(range(start, start + blocks))
        self.stored += hashes
        event = ["BlockStored", hashes, None, [], BLOCK]
        self.unsent.append({"seq": next(self.seq), "batch": [time.time(), [event]]})

    async def post(self, http: httpx.AsyncClient, headers: dict[str, str], t0: float) -> None:
        if not self.unsent:
            return
        body = {"instance": self.instance, "batches": self.unsent}
        try:
            response = await http.post("/api/v1/kv-events", json=body, headers=headers)
            status = response.status_code
        except httpx.HTTPError:
            status = 599
        self.statuses.append((time.time() - t0, status))
        if status == 200:
            self.unsent = []


def telemetry_body(n: int) -> dict[str, Any]:
    ts = time.time()
    instances = [{"instance": f"pd-a-p{i}", "ts": ts, "queue_depth": 0} for i in range(2)]
    instances += [
        {"instance": f"pd-a-d{i}", "ts": ts, "running": 3, "kv_usage": 0.3} for i in range(2)
    ]
    instances += [{"instance": f"prfaas-x-p{i}", "ts": ts, "queue_depth": 0} for i in range(2)]
    link = {"source": "prfaas-x", "target": "pd-a", "ts": ts, "bytes_sent": 125_000_000}
    return {
        "idempotency_key": f"t-{n}",
        "instances": instances,
        "links": [{**link, "interval_s": 1}],
    }


@dataclass
class Answer:
    at: float
    status: int
    body: dict[str, Any] | None


async def open_loop(
    bases: list[str],
    tokens: Tokens,
    agents: list[Agent],
    *,
    rate: float,
    seconds: float,
    at_s: float | None = None,
    event: Any = None,
) -> list[Answer]:
    """``/route`` at ``rate`` calls a second for ``seconds`` (sent on schedule, whoever is slow),
    over ``bases`` in turn; agents post every 0.25 s; ``event()`` runs at ``at_s``."""
    answers: list[Answer] = []
    t0 = time.time()
    limits = httpx.Limits(max_connections=400)
    clients = [httpx.AsyncClient(base_url=b, timeout=30, limits=limits) for b in bases]
    hits_chain = list(range(agents[0].chain_start, agents[0].chain_start + 12))

    async def one(k: int) -> None:
        if k % 2:
            body: dict[str, Any] = {"origin": "pd-a", "prompt_tokens": 60_000}
        else:
            body = {"origin": "pd-a", "prompt_tokens": 12 * BLOCK, "block_hashes": hits_chain}
        sent = time.time() - t0
        try:
            r = await clients[k % len(clients)].post(
                "/api/v1/route", content=json.dumps(body), headers=tokens.router
            )
            answers.append(Answer(sent, r.status_code, r.json() if r.status_code == 200 else None))
        except httpx.HTTPError:
            answers.append(Answer(sent, 599, None))

    async def agents_loop() -> None:
        n = 0
        while time.time() - t0 < seconds:
            for agent in agents:
                agent.next_batch(4)
                await agent.post(clients[0], tokens.agent, t0)
            with contextlib.suppress(httpx.HTTPError):
                await clients[0].post(
                    "/api/v1/telemetry", json=telemetry_body(n), headers=tokens.agent
                )
            n += 1
            await asyncio.sleep(0.25)

    tasks: list[asyncio.Task[None]] = []
    background = asyncio.create_task(agents_loop())
    fired = False
    for k in itertools.count():
        due = t0 + k / rate
        if due - t0 >= seconds:
            break
        if at_s is not None and not fired and due - t0 >= at_s:
            fired = True
            event()
        await asyncio.sleep(max(0.0, due - time.time()))
        tasks.append(asyncio.create_task(one(k)))
    await asyncio.gather(*tasks)
    await background
    # The replay: what the outage refused is sent again until it is taken.
    for _ in range(100):
        if not any(a.unsent for a in agents):
            break
        for agent in agents:
            await agent.post(clients[0], tokens.agent, t0)
        await asyncio.sleep(0.2)
    for c in clients:
        await c.aclose()
    return answers


def admitted_bytes(answers: list[Answer]) -> int:
    return sum(
        a.body["reservation"]["bytes"]
        for a in answers
        if a.body and a.body["route"] == "prfaas" and a.body.get("reservation")
    )


def degraded(a: Answer) -> bool:
    return bool(a.body and (a.body.get("prefix_unavailable") or a.body.get("stale")))


def test_route_answers_through_a_master_killed_under_load(
    transactional_db: None, cluster: ThrowawayRedisCluster
) -> None:
    from django.db import connection

    tokens = fleet()
    agents = [Agent(HIT_INSTANCE, 10_000), Agent("pd-a-p0", 50_000), Agent("prfaas-x-p0", 90_000)]
    client = redis_cluster_sync(cluster.url)
    group = prefix_instance_prefix(HIT_INSTANCE, 3)
    # The master of the hit instance's index group: its shard is the one lost.
    victim = cast(redis.RedisCluster, client).get_node_from_key(group)
    assert victim is not None and victim.port in cluster.master_ports()
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.time())
        cluster.kill(victim.port)

    served = control_plane_serve(
        connection.settings_dict, django_settings.REDIS_URL, extra_env=SERVER_ENV
    )
    with served as (base, _):
        t0 = time.time()
        answers = asyncio.run(
            open_loop([base], tokens, agents, rate=40, seconds=14, at_s=4, event=kill)
        )
    cluster.wait_ok(time.monotonic() + 30)

    # /route answered 200 throughout.
    errors = [a for a in answers if a.status != 200]
    assert not errors, errors[:3]
    # No link was ever admitted beyond its budget (every hold outlasts the run).
    assert admitted_bytes(answers) <= BUDGET
    client = redis_cluster_sync(cluster.url)
    assert int(client.get(reservation_keys(LINK)[2]) or 0) <= BUDGET
    # Ingest resumed on the promoted replica and the replay brought the lost shard back.
    assert all(not a.unsent for a in agents)
    assert any(status != 200 for agent in agents for _, status in agent.statuses)
    state = prefix_index.prefix_index_states([HIT_INSTANCE], client=client)[0]
    assert state.last_seq == agents[0].made - 1
    chain = [prefix_index.block_hash_key(h) for h in agents[0].stored[:12]]
    match = prefix_index.prefix_match(chain, BLOCK, client=client)
    assert match.tokens_by_instance.get(HIT_INSTANCE) == 12 * BLOCK
    # Decisions before the kill and after recovery found the hits.
    hits = [a for a in answers if a.body and "prefix_unavailable" not in a.body]
    assert any(a.at > 12 and a.body and a.body["cached_tokens"] > 0 for a in hits)

    kill_s = killed_at[0] - t0
    # (the first calls, before the agents' first telemetry arrives, are stale too: not counted)
    bad = [a for a in answers if degraded(a) and a.at >= kill_s]
    report = {
        "route_calls": len(answers),
        "errors": len(errors),
        "decisions_without_hits": sum(
            1 for a in bad if a.body and a.body.get("prefix_unavailable")
        ),
        "stale_decisions": sum(1 for a in bad if a.body and a.body.get("stale")),
        "seconds_degraded": round(max(a.at for a in bad) - min(a.at for a in bad), 2) if bad else 0,
        "kill_at_s": round(kill_s, 2),
        "ingest_failed_posts": sum(1 for ag in agents for _, s in ag.statuses if s != 200),
        "index_state_after": state.state,
        "degraded_per_second": {
            str(k): sum(1 for a in bad if int(a.at) == k) for k in range(int(kill_s), 14)
        },
        "admitted_gib": round(admitted_bytes(answers) / 2**30, 2),
        "budget_gib": BUDGET / 2**30,
    }
    print("FAILOVER " + json.dumps(report))


def test_two_web_replicas_share_one_budget_and_one_policy(
    transactional_db: None, cluster: ThrowawayRedisCluster
) -> None:
    from django.db import connection

    from controlplane.audit import CLI_ACTOR
    from scheduling.policies import policy_create

    tokens = fleet()
    with (
        control_plane_serve(connection.settings_dict, django_settings.REDIS_URL) as (a, _),
        control_plane_serve(connection.settings_dict, django_settings.REDIS_URL) as (b, _),
    ):

        async def burst() -> list[dict[str, Any]]:
            limits = httpx.Limits(max_connections=200)
            async with (
                httpx.AsyncClient(base_url=a, timeout=30, limits=limits) as ha,
                httpx.AsyncClient(base_url=b, timeout=30, limits=limits) as hb,
            ):
                r = await ha.post("/api/v1/telemetry", json=telemetry_body(0), headers=tokens.agent)
                assert r.status_code == 200, r.text
                body = json.dumps({"origin": "pd-a", "prompt_tokens": 60_000})
                calls = [
                    (ha if k % 2 else hb).post("/api/v1/route", content=body, headers=tokens.router)
                    for k in range(200)
                ]
                responses = await asyncio.gather(*calls)
            assert all(r.status_code == 200 for r in responses), responses[0].text
            return [r.json() for r in responses]

        got = asyncio.run(burst())
        offloaded = [d for d in got if d["route"] == "prfaas"]
        kept = [d for d in got if d["route"] == "local"]
        assert offloaded and kept  # the budget binds
        assert sum(d["reservation"]["bytes"] for d in offloaded) <= BUDGET
        client = redis_cluster_sync(cluster.url)
        assert int(client.get(reservation_keys(LINK)[2]) or 0) <= BUDGET

        # A policy change reaches both replicas within their live-state bound.
        policy_create(actor=CLI_ACTOR, thresholds={"pd-a": 100_000})
        changed = time.time()
        seen: dict[str, float] = {}
        with httpx.Client(timeout=10) as http:
            while len(seen) < 2 and time.time() - changed < 10:
                for base in (a, b):
                    if base in seen:
                        continue
                    body = {"origin": "pd-a", "prompt_tokens": 20_000}
                    d = http.post(f"{base}/api/v1/route", json=body, headers=tokens.router).json()
                    if d["policy_version"] == 1:
                        assert (d["route"], d["reason"]) == ("local", "below_threshold")
                        seen[base] = time.time() - changed
        assert set(seen) == {a, b}
        report = {
            "offloaded": len(offloaded),
            "kept_local": len(kept),
            "admitted_gib": round(sum(d["reservation"]["bytes"] for d in offloaded) / 2**30, 2),
            "budget_gib": BUDGET / 2**30,
            "policy_seen_after_s": {k[-5:]: round(v, 3) for k, v in seen.items()},
        }
        print("REPLICAS " + json.dumps(report))
