"""``python -m fleet.agent --config agent.yaml``: run the agent until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import logging
import signal
from pathlib import Path

from fleet.agent.agent import Agent
from fleet.agent.config import config_load
from fleet.config_read import config_or_exit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleet.agent")
    parser.add_argument("--config", required=True, type=Path, help="agent.yaml")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = config_or_exit(config_load, args.config, "fleet.agent")
    agent = Agent(config)
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    signal.signal(signal.SIGINT, lambda *_: agent.stop())
    agent.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
