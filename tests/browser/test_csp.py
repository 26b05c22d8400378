"""The pages' Content-Security-Policy in a real browser: the page's own scripts run, a script
injected into the page (what a stored XSS would do) does not, and no page needs inline code."""

from __future__ import annotations

from typing import Any, cast

import pytest

from clusters.models import Link
from tests.factories import LinkFactory

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_the_page_scripts_run_and_an_injected_script_does_not(page_as: Any, live_url: str) -> None:
    link = cast(Link, LinkFactory(gbps=100.0))
    page = page_as("viewer", enforce_csp=True)
    violations: list[str] = []
    page.on(
        "console", lambda m: violations.append(m.text) if "Content Security" in m.text else None
    )
    response = page.goto(f"{live_url}/links/{link.pk}/")
    assert "script-src 'self' 'nonce-" in response.headers["content-security-policy"]
    # The page's own inline script (it carries the nonce) drew the chart.
    page.locator("#history-chart .uplot").wait_for()
    # An injected inline script and an inline handler, as an XSS payload would add them.
    page.evaluate(
        """() => {
          const s = document.createElement("script");
          s.textContent = "window.__injected = 1";
          document.body.appendChild(s);
          const img = document.createElement("img");
          img.setAttribute("onerror", "window.__handler = 1");
          img.src = "data:,broken";
          document.body.appendChild(img);
        }"""
    )
    page.wait_for_timeout(300)
    assert page.evaluate("window.__injected") is None
    assert page.evaluate("window.__handler") is None
    assert violations, "the browser reports the blocked scripts"
