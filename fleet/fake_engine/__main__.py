"""``python -m fleet.fake_engine --instance NAME:PORT:KV_ROLE ...``: fake vLLM instances, one
port each, in one process (one uvicorn server per instance on one event loop).

``KV_ROLE``: ``kv_producer`` (prefill), ``kv_consumer`` (decode) or ``kv_both`` (default).
Stops on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys

import uvicorn
from granian import Granian
from granian.constants import Interfaces, Loops

from fleet.fake_engine.app import CONFIG_ENV, CONNECTORS, EngineConfig, FakeEngine


def _instance(value: str) -> tuple[str, int, str]:
    parts = value.split(":")
    if len(parts) not in (2, 3) or not parts[0] or not parts[1].isdigit():
        raise argparse.ArgumentTypeError(f"expected NAME:PORT[:KV_ROLE], not {value!r}")
    role = parts[2] if len(parts) == 3 else "kv_both"
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise argparse.ArgumentTypeError(
            f"{value}: KV_ROLE must be kv_producer|kv_consumer|kv_both"
        )
    return parts[0], int(parts[1]), role


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleet.fake_engine", description=__doc__)
    parser.add_argument("--instance", type=_instance, action="append", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--connector", choices=CONNECTORS, default="nixl")
    parser.add_argument("--storage", default="", help="shared directory (shared_storage)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--prefill-s-per-1k", type=float, default=0.0)
    parser.add_argument("--token-s", type=float, default=0.0)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument(
        "--server",
        choices=("uvicorn", "granian"),
        default="uvicorn",
        help="granian: one instance only, served by granian (benches: a lighter server)",
    )
    args = parser.parse_args(argv)
    try:
        engines = [
            FakeEngine(
                EngineConfig(
                    name=name,
                    port=port,
                    host=args.host,
                    model=args.model,
                    connector=args.connector,
                    kv_role=role,
                    storage=args.storage,
                    block_size=args.block_size,
                    prefill_s_per_1k=args.prefill_s_per_1k,
                    token_s=args.token_s,
                    max_model_len=args.max_model_len,
                )
            )
            for name, port, role in args.instance
        ]
    except ValueError as exc:
        print(f"fake engine: {exc}", file=sys.stderr)
        return 2
    if args.server == "granian":
        if len(engines) != 1:
            print("fake engine: --server granian takes one --instance", file=sys.stderr)
            return 2
        cfg = engines[0].config
        os.environ[CONFIG_ENV] = json.dumps(dataclasses.asdict(cfg))
        Granian(
            "fleet.fake_engine.app:engine_from_env",
            factory=True,
            address=cfg.host,
            port=cfg.port,
            interface=Interfaces.ASGI,
            loop=Loops.uvloop,
            log_enabled=False,
        ).serve()
        return 0
    servers = [
        uvicorn.Server(
            uvicorn.Config(
                engine,
                host=args.host,
                port=engine.config.port,
                log_level="warning",
                access_log=False,
                loop=Loops.uvloop,
                http="httptools",
            )
        )
        for engine in engines
    ]
    for engine, server in zip(engines, servers, strict=True):
        # POST /fake/fault {"mode": "exit"}: this instance stops serving, the others go on.
        engine.exit = lambda server=server: setattr(server, "should_exit", True)

    async def serve() -> None:
        await asyncio.gather(*(s.serve() for s in servers))

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
