"""Faults recorded in the inventory, as a network or health monitor would record them: a
link's new capacity, an instance that went down or came back. Only with an ``admin`` token;
a refused or failed write is logged and the fleet keeps running."""

from __future__ import annotations

import logging
from typing import Any

import httpx

log = logging.getLogger(__name__)


class InventoryRecorder:
    def __init__(self, http: httpx.Client, admin_token: str) -> None:
        self.http = http
        self.admin_token = admin_token

    def _admin(self, method: str, path: str, **kwargs: Any) -> httpx.Response | None:
        if not self.admin_token:
            return None
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        try:
            response = self.http.request(method, path, headers=headers, **kwargs)
        except httpx.HTTPError as exc:
            log.warning("emulator: %s %s failed: %s", method, path, exc)
            return None
        if response.status_code >= 400:
            log.warning("emulator: %s %s: %s %s", method, path, response.status_code, response.text)
            return None
        return response

    def link(self, key: str, gbps: float) -> None:
        """Record the link's new capacity in the inventory (admin token only)."""
        source, target = key.split("->", 1)
        listing = self._admin("GET", "/api/v1/links", params={"limit": 1000})
        if listing is None:
            return
        body = listing.json()
        items = body.get("items", body) if isinstance(body, dict) else body
        for row in items:
            if row.get("source") == source and row.get("target") == target:
                self._admin(
                    "PATCH",
                    f"/api/v1/links/{row['id']}",
                    json={"version": row["version"], "gbps": gbps},
                )

    def instance(self, name: str, state: str) -> None:
        """Record an instance that went down or came back (admin token only)."""
        listing = self._admin("GET", "/api/v1/instances", params={"name": name})
        if listing is None:
            return
        body = listing.json()
        items = body.get("items", body) if isinstance(body, dict) else body
        for row in items:
            if row.get("name") == name and row.get("state") != state:
                self._admin(
                    "PATCH",
                    f"/api/v1/instances/{row['id']}",
                    json={"version": row["version"], "state": state},
                )
