"""``python -m fleet.supervisor --config supervisor.yaml`` (or ``prfaas-supervisor``): run the
host's engines and their agents, and serve the process actuator, until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path

from fleet.config_read import config_or_exit
from fleet.supervisor.api import server_make
from fleet.supervisor.config import config_load
from fleet.supervisor.supervisor import Supervisor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleet.supervisor", description=__doc__)
    parser.add_argument("--config", required=True, type=Path, help="supervisor.yaml")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = config_or_exit(config_load, args.config, "fleet.supervisor")
    supervisor = Supervisor(config)
    server = server_make(supervisor)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, name="api", daemon=True).start()
    logging.getLogger(__name__).info(
        "supervising %d engine(s); steps on http://%s:%d/v1/steps",
        len(config.engines),
        config.listen.host,
        server.server_address[1],
    )

    def run() -> None:
        supervisor.start()
        supervisor.watch()

    # Engines start in the background: a signal during a slow start stops them at once.
    threading.Thread(target=run, name="engines", daemon=True).start()
    try:
        stop.wait()
    finally:
        server.shutdown()
        server.server_close()
        supervisor.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
