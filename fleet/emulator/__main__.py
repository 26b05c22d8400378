"""``python -m fleet.emulator SCENARIO --base-url URL``: see :mod:`fleet.emulator.cli`."""

from fleet.emulator.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
