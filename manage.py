#!/usr/bin/env python
"""Django's command-line utility, and the supervisor of the embedded Redis for one command
(started only when ``REDIS_URL`` is unset and the command uses Redis, stopped when it ends)."""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    from django.core.management import execute_from_command_line

    from controlplane.embedded_redis import embedded_redis_for

    with embedded_redis_for(sys.argv):
        execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
