"""Waiting for something another process does: poll a check until it gives a true value."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(
    what: str, check: Callable[[], Any], timeout_s: float = 30.0, interval_s: float = 0.1
) -> Any:
    """The first true value ``check()`` gives; AssertionError naming ``what`` and the last
    value seen when none came within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what} (last: {last!r})")
