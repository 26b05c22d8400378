"""The agent against a real vLLM (CPU) and the real control plane: KV events into the index,
``/route`` reporting the cached prefix computed by the hashing helper, the engine's load through
``/metrics``, and an agent restarted mid-stream catching up through vLLM's replay socket.

Marked ``engine``: not in ``make test``; ``make test-engines`` (its own CI stage) runs it. The
first run on a machine installs vLLM into the cache (~4 min, ``tests.engines.vllm_env``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml
import zmq

from clusters.live import prefix_index, telemetry
from fleet.blockhash import block_keys
from scheduling.core import kv_vllm
from scheduling.core.kv_events import BlocksStored
from tests.engines.vllm import VllmServer, low_free_ports, vllm_server
from tests.engines.vllm_env import VllmEnv, prepare
from tests.factories import api_token
from tests.support import waiting
from tests.support.fleets import pd_prfaas_fleet
from tests.support.servers import ROOT, control_plane_serve, free_port

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]

INSTANCE = "pd-v-p0"
BLOCK = 32
# A long shared prefix (~11 blocks), then a different tail per prompt.
PREFIX = " ".join(f"word{i} token{i * 3} block{i * 5}" for i in range(60)) + " "


def wait_for(what: str, check: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    return waiting.wait_for(what, check, timeout_s, interval_s=0.25)


@pytest.fixture(scope="module")
def vllm_env() -> VllmEnv:
    return prepare()  # cached after the first run


@pytest.fixture(scope="module")
def engine(vllm_env: VllmEnv) -> Iterator[VllmServer]:
    http, zpub, zreplay = low_free_ports(3)
    started = time.monotonic()
    # two sequences at once, so a third concurrent request waits: running and waiting both show
    with vllm_server(
        vllm_env,
        port=http,
        kv_events_port=zpub,
        replay_port=zreplay,
        extra_args=["--max-num-seqs", "2"],
    ) as server:
        print(f"vLLM healthy in {time.monotonic() - started:.0f} s")
        yield server


class EngineListener:
    """A second subscriber to the engine's KV events (PUB fans out), for the test's own view."""

    def __init__(self, engine: VllmServer) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        self.sub.connect(engine.kv_events_endpoint)
        time.sleep(1.0)

    def stored(self, timeout_s: float) -> list[int]:
        """The block hashes of the next batch that stores blocks."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.sub.poll(200):
                continue
            _, _, payload = self.sub.recv_multipart()
            out: list[int] = []
            for ev in kv_vllm.batch_decode(payload).events:
                if isinstance(ev, BlocksStored):
                    out += [h for h in ev.hashes if isinstance(h, int)]
            if out:
                return out
        raise AssertionError("the engine published no BlockStored")

    def close(self) -> None:
        self.sub.close()
        self.context.term()


class AgentProcess:
    """``python -m fleet.agent`` as its own process, as deployed."""

    def __init__(self, config_path: Path, token: str, metrics_port: int) -> None:
        self.config_path = config_path
        self.token = token
        self.metrics_port = metrics_port
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = config_path.with_suffix(".log")

    def start(self) -> None:
        env = {**os.environ, "PRFAAS_AGENT_TOKEN": self.token}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleet.agent", "--config", str(self.config_path)],
            cwd=ROOT,
            env=env,
            stdout=open(self.log, "ab"),  # noqa: SIM115 (closed with the process)
            stderr=subprocess.STDOUT,
        )
        wait_for("the agent's /metrics", lambda: self.metrics_text() is not None, 30)
        time.sleep(1.0)  # the SUB socket's subscription reaches the publisher

    def metrics_text(self) -> str | None:
        try:
            return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2).text
        except httpx.HTTPError:
            return None

    def metric(self, name: str) -> float:
        text = self.metrics_text() or ""
        found = re.findall(rf"^{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        return sum(float(v) for v in found)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=20)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@pytest.fixture
def plane(transactional_db: None, redis_client: redis.Redis, settings: Any) -> Iterator[Any]:
    from django.db import connection

    pd_prfaas_fleet(
        "pd-v", "prfaas-v", h20_prefill_seconds=[[32, 0.01], [2048, 0.5]], block_tokens=BLOCK
    )
    with control_plane_serve(connection.settings_dict, settings.REDIS_URL) as (base, _proc):
        yield base


def test_the_agent_feeds_a_real_vllm_into_the_index_route_and_load(
    engine: VllmServer, plane: str, tmp_path: Path, redis_client: redis.Redis
) -> None:
    agent_secret = api_token("agent")[1]
    router_secret = api_token("router")[1]
    metrics_port = free_port()
    config = {
        "control_plane": {"url": plane, "token_env": "PRFAAS_AGENT_TOKEN"},
        "listen": {"host": "127.0.0.1", "port": metrics_port},
        "interval_s": 0.1,
        "flush_s": 0.05,
        "engines": [
            {
                "instance": INSTANCE,
                "metrics_url": f"{engine.url}/metrics",
                "kv_events": {
                    "endpoint": engine.kv_events_endpoint,
                    "replay_endpoint": engine.replay_endpoint,
                    "topic": "kv-events",
                },
            }
        ],
    }
    config_path = tmp_path / "agent.yaml"
    config_path.write_text(yaml.safe_dump(config))
    agent = AgentProcess(config_path, agent_secret, metrics_port)
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    agent.start()
    try:
        # -- 1. two prompts sharing a long prefix: the index holds the engine's real blocks --
        # The test listens to the engine too, to know what it really published.
        published = EngineListener(engine)
        prompt_a, prompt_b = PREFIX + "alpha beta gamma", PREFIX + "one two three four"
        tokens_a, tokens_b = engine.tokenize(prompt_a), engine.tokenize(prompt_b)
        engine.complete(prompt_a, max_tokens=1)
        stored_a = published.stored(timeout_s=30)
        engine.complete(prompt_b, max_tokens=1)
        stored_b = published.stored(timeout_s=30)
        published.close()
        # the helper computes from the token ids the very hashes vLLM published
        keys_a, keys_b = block_keys(tokens_a, BLOCK), block_keys(tokens_b, BLOCK)
        assert stored_a == keys_a[: len(stored_a)] and len(stored_a) >= len(keys_a) - 1
        assert keys_b[: len(keys_b) - len(stored_b)] == keys_a[: len(keys_b) - len(stored_b)]
        assert stored_b == keys_b[len(keys_b) - len(stored_b) :][: len(stored_b)]
        chain_a = [prefix_index.block_hash_key(k) for k in stored_a]
        chain_b = [prefix_index.block_hash_key(k) for k in keys_b[: len(keys_b) - len(stored_b)]]
        chain_b += [prefix_index.block_hash_key(k) for k in stored_b]
        shared = sum(1 for x, y in zip(chain_a, chain_b, strict=False) if x == y)
        assert shared >= 8 and len(stored_b) >= 1

        def matched(chain: list[str]) -> int:
            return prefix_index.prefix_match(chain, BLOCK).tokens_by_instance.get(INSTANCE, 0)

        wait_for("A's blocks in the index", lambda: matched(chain_a) == len(chain_a) * BLOCK)
        wait_for("B's blocks in the index", lambda: matched(chain_b) == len(chain_b) * BLOCK)
        state = prefix_index.prefix_index_states([INSTANCE])[0]
        assert state.state == "exact" and state.gaps == 0
        assert state.blocks == len(set(chain_a) | set(chain_b))
        timings["kv_events_indexed_s"] = time.monotonic() - t0

        # -- 2. /route for a third prompt with that prefix reports the cached tokens --------
        prompt_c = PREFIX + "something else entirely here"
        tokens_c = engine.tokenize(prompt_c)
        hashes_c = block_keys(tokens_c, BLOCK)
        chain_c = [prefix_index.block_hash_key(k) for k in hashes_c]
        held = set(chain_a) | set(chain_b)
        cached_c = next(i for i, h in enumerate([*chain_c, ""]) if h not in held) * BLOCK
        assert cached_c >= 8 * BLOCK
        now = time.time()
        others = ["pd-v-p1", "pd-v-d0", "pd-v-d1", "prfaas-v-p0", "prfaas-v-p1"]
        posted = httpx.post(
            f"{plane}/api/v1/telemetry",
            json={
                "idempotency_key": "others",
                "instances": [{"instance": n, "ts": now} for n in others],
            },
            headers={"Authorization": f"Bearer {agent_secret}"},
            timeout=10,
        )
        assert posted.status_code == 200, posted.text
        route = httpx.post(
            f"{plane}/api/v1/route",
            json={"origin": "pd-v", "prompt_tokens": len(tokens_c), "block_hashes": hashes_c},
            headers={"Authorization": f"Bearer {router_secret}"},
            timeout=10,
        )
        assert route.status_code == 200, route.text
        decision = route.json()
        assert decision["prefill"]["instance"] == INSTANCE, decision
        assert decision["cached_tokens"] == cached_c, decision
        assert decision["incremental_tokens"] == len(tokens_c) - cached_c

        # -- 3. the engine's running and waiting, scraped from its /metrics, reach the plane --
        # Eight requests through two slots: on an idle machine the tiny model decodes 400
        # tokens in well under a second, so three requests could come and go between two
        # scrapes; four rounds keep both running and waiting up for several scrapes.
        long_prompts = [f"Once upon a time {i} " * 8 for i in range(8)]
        seen: dict[str, int] = {"running": 0, "waiting": 0}
        series: list[tuple[float, float, int, int]] = []  # (read at, sample ts, running, waiting)
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                sample = telemetry.instance_states_read([INSTANCE]).get(INSTANCE)
                if sample is not None:
                    if not series or series[-1][1] != sample.ts:
                        series.append((time.time(), sample.ts, sample.running, sample.waiting))
                    seen["running"] = max(seen["running"], sample.running)
                    seen["waiting"] = max(seen["waiting"], sample.waiting)
                time.sleep(0.1)

        watcher = threading.Thread(target=watch)
        watcher.start()
        workers = [
            threading.Thread(
                target=engine.complete, args=(p,), kwargs={"max_tokens": 400, "ignore_eos": True}
            )
            for p in long_prompts
        ]
        load_from = time.time()
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=300)
        load_to = time.time()
        time.sleep(1.0)
        stop.set()
        watcher.join()
        assert seen["running"] == 2 and seen["waiting"] >= 1, (
            f"{seen} under a load from {load_from:.2f} to {load_to:.2f}; "
            f"samples read (read at, sample ts, running, waiting): {series}"
        )
        assert agent.metric("prfaas_agent_engine_requests_running") == 0  # all done
        timings["load_seen_s"] = time.monotonic() - t0

        # -- 4. the agent dies mid-stream; what the engine publishes meanwhile is replayed ---
        wait_for(
            "the agent's buffer empty", lambda: agent.metric("prfaas_agent_buffered_items") == 0
        )
        agent.kill()
        # prompts of their own (no shared prefix), so their blocks are new to the index
        missed_prompts = [
            f"while the agent was down {i}: " + " ".join(f"w{i}x{j} t{j * 7}" for j in range(40))
            for i in range(3)
        ]
        missed_chains = []
        for p in missed_prompts:
            engine.complete(p, max_tokens=1)
            # vLLM may not report the block holding the prompt's last token: leave it out
            keys = block_keys(engine.tokenize(p), BLOCK)[:-1]
            missed_chains.append([prefix_index.block_hash_key(k) for k in keys])
        before = prefix_index.prefix_index_states([INSTANCE])[0]
        assert any(matched(c) < len(c) * BLOCK for c in missed_chains)  # not indexed yet
        agent.start()  # it catches up from the replay socket at once
        back = "after the agent came back: " + " ".join(f"b{j} q{j * 3}" for j in range(40))
        engine.complete(back, max_tokens=1)
        missed_chains.append(
            [prefix_index.block_hash_key(k) for k in block_keys(engine.tokenize(back), BLOCK)[:-1]]
        )

        def all_missed_indexed() -> bool:
            return all(matched(c) == len(c) * BLOCK for c in missed_chains)

        wait_for("the missed and the new blocks in the index", all_missed_indexed)
        after = wait_for(
            "the index past the new frame",
            lambda: (
                s
                if (s := prefix_index.prefix_index_states([INSTANCE])[0]).last_seq
                and before.last_seq is not None
                and s.last_seq >= before.last_seq + len(missed_prompts) + 1
                else None
            ),
        )
        assert after.state == "exact" and after.gaps == 0, after
        assert agent.metric("prfaas_agent_kv_replayed_batches_total") >= len(missed_prompts)
        assert agent.metric("prfaas_agent_kv_unrecovered_batches_total") == 0
        timings["replay_recovered_s"] = time.monotonic() - t0
    finally:
        agent.stop()
        print("timings:", {k: round(v, 1) for k, v in timings.items()})
        if agent.proc is not None and agent.proc.returncode not in (0, -9, None):
            print(agent.log.read_text()[-3000:])
