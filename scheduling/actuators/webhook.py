"""The ``webhook`` actuator: a JSON POST to the operator's automation URL per step.

Signed with HMAC-SHA256 over ``"{timestamp}.{body}"`` in ``X-PrfaaS-Signature: sha256=<hex>``
(timestamp in ``X-PrfaaS-Timestamp``, so a receiver can refuse replays), retried with
exponential backoff on connection errors, timeouts and 5xx answers. ``Idempotency-Key`` is the
same on every retry of a step, including a retry after a worker crash, so the receiver can act
once. Each attempt has a total deadline (``deadline_s``, not only a timeout per read): a
receiver that drips its answer a byte at a time cannot hold a plan step longer than that.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from scheduling.actuators.base import ActuatorError, StepNotice
from scheduling.core.signing import (
    IDEMPOTENCY_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    signature,
)
from scheduling.core.signing import signature_valid as signature_valid  # receivers' check


async def _post_within(
    url: str, body: bytes, headers: dict[str, str], timeout_s: float, deadline_s: float
) -> httpx.Response:
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        async with asyncio.timeout(deadline_s):
            return await client.post(url, content=body, headers=headers)


def webhook_post(
    url: str, body: bytes, headers: dict[str, str], *, timeout_s: float, deadline_s: float
) -> httpx.Response:
    """POST and read the answer within ``deadline_s`` in all (``TimeoutError`` past it): the
    request is cancelled and its connection closed, whatever pace the receiver keeps."""
    call = _post_within(url, body, headers, timeout_s, deadline_s)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(call)
    # Called from a thread with an event loop: the request gets a loop of its own.
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, call).result()


class WebhookActuator:
    """Signed POST to the operator's automation, with retries and exponential backoff."""

    name = "webhook"
    replaces_instances = False

    def __init__(
        self,
        url: str,
        secret: str,
        *,
        attempts: int = 4,
        backoff_s: float = 0.5,
        timeout_s: float = 5.0,
        deadline_s: float = 10.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ActuatorError(f"webhook URL must be http(s): {url!r}")
        if not secret:
            raise ActuatorError("webhook secret is empty")
        self.url = url
        self.secret = secret
        self.attempts = max(1, attempts)
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self._sleep = sleep

    def notify(self, notice: StepNotice) -> None:
        body = json.dumps(notice.payload(), sort_keys=True, separators=(",", ":")).encode()
        last = ""
        for attempt in range(self.attempts):
            if attempt:
                self._sleep(self.backoff_s * 2 ** (attempt - 1))
            timestamp = str(int(time.time()))
            headers = {
                "Content-Type": "application/json",
                TIMESTAMP_HEADER: timestamp,
                SIGNATURE_HEADER: signature(self.secret, timestamp, body),
                IDEMPOTENCY_HEADER: notice.idempotency_key,
            }
            try:
                response = webhook_post(
                    self.url, body, headers, timeout_s=self.timeout_s, deadline_s=self.deadline_s
                )
            except TimeoutError:
                last = f"no complete answer within {self.deadline_s:g} s"
                continue
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code < 300:
                return
            last = f"HTTP {response.status_code}"
            if response.status_code < 500 and response.status_code not in (408, 429):
                break  # the receiver refused this step; retrying will not change its mind
        raise ActuatorError(f"webhook {self.url} failed for {notice.idempotency_key}: {last}")
