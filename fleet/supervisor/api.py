"""The supervisor's HTTP door (standard library server, one thread per request):

* ``POST /v1/steps``: a plan step from the ``process`` actuator, signed as the control plane
  signs webhooks (``X-PrfaaS-Signature`` over ``X-PrfaaS-Timestamp`` and the body, the
  timestamp within ``MAX_SKEW_S``; else 401). A ``flip`` restarts the instance in ``to_role``
  and answers when it is healthy again (200 ``{instance, role, restarted, seconds}``; 404 for
  an instance this host does not run, 422 for a bad body, 502 when the engine did not come
  up); any other step is the control plane's own (200, nothing done).
* ``GET /v1/engines``: each engine's role, ``kv_role``, process and agent (for operators).
* ``GET /health``.

Errors have the control plane's shape, ``{"detail", "code"}``.
"""

from __future__ import annotations

import json
import logging
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from fleet.supervisor.supervisor import FlipError, Supervisor, UnknownInstance, flip_result_json
from scheduling.core.signing import (
    IDEMPOTENCY_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    signature_valid,
)

log = logging.getLogger(__name__)

MAX_SKEW_S = 300.0
MAX_BODY = 64 * 1024


class _Refused(Exception):
    def __init__(self, status: int, detail: str, code: str) -> None:
        super().__init__(detail)
        self.status, self.detail, self.code = status, detail, code


def step_handle(supervisor: Supervisor, headers: Any, body: bytes) -> dict[str, Any]:
    """Check and carry out one signed step; :class:`_Refused` says why not."""
    stamp = headers.get(TIMESTAMP_HEADER, "")
    mark = headers.get(SIGNATURE_HEADER, "")
    try:
        fresh = abs(time.time() - float(stamp)) <= MAX_SKEW_S
    except ValueError:
        fresh = False
    if not fresh or not signature_valid(supervisor.config.secret, stamp, body, mark):
        raise _Refused(401, "missing, stale or wrong step signature", "bad_signature")
    try:
        step = json.loads(body)
    except ValueError:
        raise _Refused(422, "body: not JSON", "invalid") from None
    if not isinstance(step, dict) or not isinstance(step.get("action"), str):
        raise _Refused(422, "action: required", "invalid")
    if step["action"] != "flip":
        return {"done": False, "action": step["action"]}
    instance, role = step.get("instance"), step.get("to_role")
    if not isinstance(instance, str) or not isinstance(role, str):
        raise _Refused(422, "instance and to_role: required for a flip", "invalid")
    key = headers.get(IDEMPOTENCY_HEADER, "") or str(step.get("idempotency_key", ""))
    try:
        result = supervisor.flip(instance, role, key)
    except UnknownInstance:
        raise _Refused(
            404, f"instance: this host runs no {instance!r}", "unknown_instance"
        ) from None
    except FlipError as exc:
        raise _Refused(502, str(exc)[:2000], "engine_unhealthy") from None
    return {"done": True, **flip_result_json(result)}


def server_make(supervisor: Supervisor) -> ThreadingHTTPServer:
    """The server on the configured address (``serve_forever`` runs it)."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, payload: Any) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._answer(200, {"status": "ok"})
            elif self.path == "/v1/engines":
                self._answer(200, supervisor.states())
            else:
                self._answer(404, {"detail": f"no route {self.path}", "code": "not_found"})

        def do_POST(self) -> None:
            if self.path != "/v1/steps":
                self._answer(404, {"detail": f"no route {self.path}", "code": "not_found"})
                return
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_BODY:
                self._answer(413, {"detail": "body: 1 byte to 64 KiB", "code": "invalid"})
                return
            try:
                self._answer(200, step_handle(supervisor, self.headers, self.rfile.read(length)))
            except _Refused as exc:
                self._answer(exc.status, {"detail": exc.detail, "code": exc.code})

        def log_message(self, format: str, *args: Any) -> None:
            log.info("%s %s", self.address_string(), format % args)

    config = supervisor.config
    server = ThreadingHTTPServer((config.listen.host, config.listen.port), Handler)
    server.daemon_threads = True
    return server
