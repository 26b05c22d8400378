"""``python -m fleet.gateway --config gateway.yaml``: serve the gateway (uvicorn, uvloop,
httptools; ``workers`` processes on one port, or more gateways behind a load balancer: link
reservations are atomic on the control plane, so they never exceed a link's budget together).

Exit status 2 and a message naming the key when the configuration is wrong.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

import uvicorn
from granian import Granian
from granian.constants import HTTPModes, Interfaces, Loops
from granian.http import HTTP1Settings

from fleet.config_read import config_or_exit
from fleet.gateway.app import CONFIG_ENV, Gateway
from fleet.gateway.config import config_load
from fleet.gateway.http import header_timeout_set


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleet.gateway", description=__doc__)
    parser.add_argument("--config", required=True, help="the gateway.yaml file")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    config = config_or_exit(config_load, Path(args.config), "gateway")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s %(message)s")
    if config.server == "granian":
        os.environ[CONFIG_ENV] = str(Path(args.config).resolve())
        Granian(
            "fleet.gateway.app:gateway_from_env",
            factory=True,
            address=config.listen.host,
            port=config.listen.port,
            interface=Interfaces.ASGI,
            workers=config.workers,
            loop=Loops.uvloop,
            http=HTTPModes.http1,
            http1_settings=HTTP1Settings(header_read_timeout=int(config.header_timeout_s * 1000)),
            log_level=args.log_level,
        ).serve()
        return 0
    server: dict[str, Any] = {
        "host": config.listen.host,
        "port": config.listen.port,
        "loop": "uvloop",
        # httptools, with a deadline on request headers (fleet.gateway.http)
        "http": "fleet.gateway.http:HeaderDeadlineProtocol",
        "log_level": args.log_level,
        "access_log": False,
        "lifespan": "on",
        "timeout_graceful_shutdown": 10,
        # Engines and clients talk to the gateway directly: no proxy headers to rewrite.
        "proxy_headers": False,
    }
    if config.workers > 1:
        # Each worker process builds its own gateway from the same file.
        os.environ[CONFIG_ENV] = str(Path(args.config).resolve())
        uvicorn.run(
            "fleet.gateway.app:gateway_from_env", factory=True, workers=config.workers, **server
        )
    else:
        header_timeout_set(config.header_timeout_s)
        uvicorn.run(Gateway(config), **server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
