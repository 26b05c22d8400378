"""The signature on a step the control plane sends to an operator's automation (a webhook, a
fleet supervisor): ``sha256=<hex>`` of HMAC-SHA256(secret, ``timestamp + "." + body``), in
``X-PrfaaS-Signature`` with the timestamp in ``X-PrfaaS-Timestamp``. Pure: the sender
(:mod:`scheduling.actuators`) and the receivers (``fleet.supervisor``) share it."""

from __future__ import annotations

import hashlib
import hmac

SIGNATURE_HEADER = "X-PrfaaS-Signature"
TIMESTAMP_HEADER = "X-PrfaaS-Timestamp"
IDEMPOTENCY_HEADER = "Idempotency-Key"


def signature(secret: str, timestamp: str, body: bytes) -> str:
    """``sha256=<hex>`` of HMAC-SHA256(secret, ``timestamp + "." + body``)."""
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def signature_valid(secret: str, timestamp: str, body: bytes, header: str) -> bool:
    """For receivers (and tests): constant-time check of a signature header."""
    return hmac.compare_digest(signature(secret, timestamp, body), header)
