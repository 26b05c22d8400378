"""Rebuild tests/fleet/fixtures/vllm_0.32_block_hashes.json from a real vLLM (both algorithms).

``python -m tests.engines.capture_block_hashes [OUT]``: starts the cached vLLM once per
prefix-caching hash algorithm, sends each prompt, and records its token ids (``/tokenize``) and
the block hashes the engine published for it (``BlockStored`` over ZMQ). The fast unit test
``tests/fleet/test_blockhash.py`` checks ``fleet.blockhash`` against this file without vLLM.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import zmq

from scheduling.core import kv_vllm
from scheduling.core.kv_events import BlocksStored
from tests.engines.vllm import low_free_ports, vllm_server
from tests.engines.vllm_env import prepare

OUT = Path(__file__).resolve().parents[1] / "fleet" / "fixtures" / "vllm_0.32_block_hashes.json"
PROMPTS = {
    "sha256": [
        "The quick brown fox jumps over the lazy dog. " * 12,
        "A control plane routes requests to inference engines. " * 10,
        "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 " * 8,
    ],
    "sha256_cbor": [
        "Prefix caching reuses key value blocks across requests. " * 9,
        "Once upon a time there was a small language model. " * 9,
    ],
}


def capture(algorithm: str, prompts: list[str]) -> list[dict[str, object]]:
    http, pub, replay = low_free_ports(3)
    out = []
    with vllm_server(
        prepare(),
        port=http,
        kv_events_port=pub,
        replay_port=replay,
        extra_args=["--prefix-caching-hash-algo", algorithm],
    ) as server:
        context = zmq.Context()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        sub.connect(server.kv_events_endpoint)
        time.sleep(1.0)
        for prompt in prompts:
            tokens = server.tokenize(prompt)
            server.complete(prompt, max_tokens=1)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and sub.poll(500):
                _, _, payload = sub.recv_multipart()
                stored = [
                    e
                    for e in kv_vllm.batch_decode(payload).events
                    if isinstance(e, BlocksStored) and e.parent is None
                ]
                if stored:
                    out.append(
                        {
                            "prompt": prompt,
                            "algorithm": algorithm,
                            "token_ids": tokens,
                            "block_size": stored[0].block_size,
                            "published_block_hashes": list(stored[0].hashes),
                        }
                    )
                    break
        sub.close()
        context.term()
    return out


def main() -> int:
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    prompts = [p for algorithm, texts in PROMPTS.items() for p in capture(algorithm, texts)]
    source = json.loads(OUT.read_text())["source"] if OUT.exists() else ""
    target.write_text(json.dumps({"source": source, "prompts": prompts}, indent=1) + "\n")
    print(f"{len(prompts)} prompts written to {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
