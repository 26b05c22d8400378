"""Password hashing runs on a bounded pool of lowest-priority threads, hashes stay Django's."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from django.conf import settings
from django.contrib.auth.hashers import PBKDF2PasswordHasher, check_password, make_password

from controlplane.hashers import LOWEST_PRIORITY, hash_pool


def test_hashes_are_computed_on_lowest_priority_threads() -> None:
    def where() -> tuple[str, int]:
        tid = threading.get_native_id()
        return threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, tid)

    name, nice = hash_pool().submit(where).result()
    assert name.startswith("password-hash")
    assert nice == LOWEST_PRIORITY
    # The caller's own thread keeps its priority.
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < LOWEST_PRIORITY


def test_concurrent_checks_never_hash_more_than_the_pool_allows() -> None:
    encoded = make_password("correct horse battery")
    seen: set[int] = set()
    original = PBKDF2PasswordHasher.encode

    def spy(self: PBKDF2PasswordHasher, *args: object) -> str:
        seen.add(threading.get_native_id())
        return original(self, *args)  # type: ignore[arg-type]

    PBKDF2PasswordHasher.encode = spy  # type: ignore[method-assign, assignment]
    try:
        with ThreadPoolExecutor(8) as callers:
            results = list(callers.map(lambda p: check_password(p, encoded), ["bad"] * 8))
    finally:
        PBKDF2PasswordHasher.encode = original  # type: ignore[method-assign]
    assert results == [False] * 8
    assert len(seen) <= settings.LOGIN_HASH_THREADS


def test_hashes_made_by_djangos_own_hasher_still_verify() -> None:
    stock = PBKDF2PasswordHasher().encode("correct horse battery", "saltsaltsalt1234")
    assert check_password("correct horse battery", stock)
    assert not check_password("wrong", stock)
