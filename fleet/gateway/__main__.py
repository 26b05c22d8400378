"""``python -m fleet.gateway --config gateway.yaml``: serve the gateway (uvicorn, uvloop,
httptools; one process, scale out by running more behind a load balancer: link reservations
are atomic on the control plane, so replicas never exceed a link's budget together).

Exit status 2 and a message naming the key when the configuration is wrong.
"""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from fleet.gateway.app import Gateway
from fleet.gateway.config import ConfigError, config_load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleet.gateway", description=__doc__)
    parser.add_argument("--config", required=True, help="the gateway.yaml file")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    try:
        config = config_load(args.config)
    except ConfigError as exc:
        print(f"gateway: {args.config}: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s %(message)s")
    uvicorn.run(
        Gateway(config),
        host=config.host,
        port=config.port,
        loop="uvloop",
        http="httptools",
        log_level=args.log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=10,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
