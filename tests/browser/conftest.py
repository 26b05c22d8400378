"""Browser tests: the real ASGI app (HTTP and websockets) in a thread, a real Celery worker,
and Debian's Chromium driven by Playwright, all against the test database.

The tests use ``transaction=True`` databases, so that rows they create are committed and seen
by the server thread and the worker process.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from tests.support.servers import celery_worker_start, celery_worker_stop, free_port

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
SCREENSHOTS = Path(settings.BASE_DIR) / "docs" / "screenshots"
PASSWORD = "correct horse battery"

pytestmark = pytest.mark.browser


def _wait_port(port: int, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


@pytest.fixture(scope="module")
def live_url(django_db_setup: Any, django_db_blocker: Any) -> Iterator[str]:
    """The real ASGI application (Django + Channels) served by uvicorn in a thread."""
    import uvicorn

    from controlplane.asgi import application

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            application, host="127.0.0.1", port=port, log_level="warning", lifespan="off"
        )
    )
    with django_db_blocker.unblock():
        thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
        thread.start()
        _wait_port(port)
        yield f"http://127.0.0.1:{port}"
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def celery_worker_process(django_db_setup: Any) -> Iterator[subprocess.Popen[bytes]]:
    """A real Celery worker on the same Redis and the (committed) test database.

    Module-scoped: it consumes the default queue, so it must be gone before other modules'
    tests enqueue tasks they expect no worker (or their own) to run."""
    with open(Path(settings.VAR_DIR) / "browser-test-worker.log", "wb") as log:
        proc = celery_worker_start(log)
        yield proc
        celery_worker_stop(proc)


@pytest.fixture(scope="module")
def browser(django_db_setup: Any, live_url: str) -> Iterator[Any]:
    """Headless Chromium, for one test module.

    Started after the database and the server, since Playwright's sync API keeps an event loop
    registered on the test thread while it runs; the ORM calls the tests make there (fixtures,
    assertions, the database flush) are still plain synchronous calls, so Django's async guard
    is lifted for exactly that time.
    """
    if shutil.which(CHROMIUM) is None:
        pytest.skip(f"{CHROMIUM} not installed (make setup installs it as root)")
    from playwright.sync_api import sync_playwright

    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as pw:
            chromium = pw.chromium.launch(
                executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
            )
            yield chromium
            chromium.close()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def page_as(
    browser: Any, live_url: str, transactional_db: Any, redis_client: Any
) -> Iterator[Callable[..., Any]]:
    """A fresh browser page logged in, through the login form, as a user in ``groups``
    (on an empty database and an empty Redis)."""
    from tests.factories import UserFactory

    contexts: list[Any] = []

    def login(*groups: str, enforce_csp: bool = False) -> Any:
        user = UserFactory(groups=list(groups))
        user.set_password(PASSWORD)  # saved explicitly: the factory's hook runs after its save
        user.save()
        # Playwright's wait_for_function polls with eval(), which the pages' CSP refuses; only
        # the CSP's own test keeps it enforced.
        context = browser.new_context(
            viewport={"width": 1360, "height": 900}, bypass_csp=not enforce_csp
        )
        contexts.append(context)
        page = context.new_page()
        page.set_default_timeout(10_000)
        page.on("dialog", lambda dialog: dialog.accept())
        page.goto(f"{live_url}/accounts/login/")
        page.get_by_label("Username").fill(user.username)
        page.get_by_label("Password").fill(PASSWORD)
        page.get_by_role("button", name="Log in").click()
        page.wait_for_url(f"{live_url}/", timeout=5000)
        return page

    yield login
    for context in contexts:
        context.close()
