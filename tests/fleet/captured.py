"""The real vLLM 0.32 frames in ``tests/fixtures/vllm-0.32-cpu/captured-kv-events.txt``.

Each published message there is a ``## X)`` section with ``frame0`` (topic), ``frame1`` (8-byte
sequence) and ``frame2`` (msgpack payload) in hex, then the payload ``decoded`` as JSON (bytes as
``{"__bytes_hex__": ...}``); section I holds a DEALER replay exchange.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tests.support.paths import FIXTURES

CAPTURE = FIXTURES / "vllm-0.32-cpu" / "captured-kv-events.txt"


@dataclass(frozen=True)
class CapturedFrame:
    section: str
    topic: bytes
    seq: int
    payload: bytes
    decoded: Any  # the capture's own JSON decoding, to compare against

    def decoded_hashes(self, event: int = 0) -> list[int | bytes]:
        hashes = self.decoded[1][event]["block_hashes"]
        return [bytes.fromhex(h["__bytes_hex__"]) if isinstance(h, dict) else h for h in hashes]


def captured_frames() -> list[CapturedFrame]:
    text = CAPTURE.read_text()
    out = []
    for match in re.finditer(
        r"^## (\w)\).*?^frame0: (\w*)\n^frame1: (\w+)\n^frame2: (\w+)\n^decoded: (.*?)$",
        text,
        re.S | re.M,
    ):
        section, topic, seq, payload, decoded = match.groups()
        out.append(
            CapturedFrame(
                section,
                bytes.fromhex(topic),
                int(seq, 16),
                bytes.fromhex(payload),
                json.loads(decoded),
            )
        )
    return out


def captured_replay() -> list[list[bytes]]:
    """The DEALER side of the replay exchange: each reply's frames (the end marker last)."""
    text = CAPTURE.read_text()
    replies = []
    for line in re.findall(r"^dealer-replay\d+:(.*)$", text, re.M):
        replies.append([bytes.fromhex(part.strip()) for part in line.split("|")])
    return replies
