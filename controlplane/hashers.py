"""Password hashing that cannot starve routing: bounded in number and lowest in CPU priority.

A password check costs a few hundred milliseconds of CPU by design (PBKDF2). Under ASGI each
login runs on a thread of its own, so concurrent logins (bad ones included, until the lockout
stops them) would hash in parallel and take the CPUs the route path's event loop needs. Here
every hash runs on a small pool (``LOGIN_HASH_THREADS`` per process) whose threads have the
lowest scheduling priority (nice 19, Linux applies it per thread), so hashing waits its turn
and a busy event loop is always scheduled first. Same algorithm and encoding as Django's
PBKDF2 hasher: existing hashes verify unchanged.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from django.conf import settings
from django.contrib.auth.hashers import PBKDF2PasswordHasher

LOWEST_PRIORITY = 19

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _thread_deprioritise() -> None:
    # On Linux a "process" priority set on a thread id applies to that thread alone.
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)


def hash_pool() -> ThreadPoolExecutor:
    """The process's hashing threads (made on first use, after any fork)."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                max_workers=int(settings.LOGIN_HASH_THREADS),
                thread_name_prefix="password-hash",
                initializer=_thread_deprioritise,
            )
        return _pool


class BoundedPBKDF2PasswordHasher(PBKDF2PasswordHasher):
    """Django's PBKDF2-SHA256, computed on :func:`hash_pool` (the caller waits for it).

    Only ``encode`` hops: ``verify`` and ``harden_runtime`` compute through it, so a hash never
    waits on the pool from inside the pool."""

    def encode(self, password: str, salt: str, iterations: int | None = None) -> str:
        parent = super().encode
        return hash_pool().submit(parent, password, salt, iterations).result()
