"""The actuators against a real local HTTP server: signatures, retries, backoff, refusals."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from scheduling.actuators import (
    IDEMPOTENCY_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    ActuatorError,
    RecordActuator,
    StepNotice,
    WebhookActuator,
    actuator_for,
    signature_valid,
)

SECRET = "s3cret-for-tests"


@dataclass
class Automation:
    """A stand-in for the operator's automation: answers from a script, records requests."""

    statuses: list[int] = field(default_factory=list)
    received: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    url: str = ""


@pytest.fixture
def automation() -> Iterator[Automation]:
    state = Automation()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            state.received.append((dict(self.headers.items()), body))
            status = state.statuses.pop(0) if state.statuses else 200
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}/hooks/prfaas"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


NOTICE = StepNotice(
    plan_id=7,
    step=2,
    action="flip",
    cluster="pd-h20",
    instance="pd-h20-3",
    from_role="prefill",
    to_role="decode",
)


def no_sleep(seconds: float) -> None:
    SLEPT.append(seconds)


SLEPT: list[float] = []


def test_webhook_posts_a_step_signed_with_hmac_sha256_of_timestamp_and_body(automation):
    WebhookActuator(automation.url, SECRET).notify(NOTICE)
    [(headers, body)] = automation.received
    assert signature_valid(SECRET, headers[TIMESTAMP_HEADER], body, headers[SIGNATURE_HEADER])
    assert not signature_valid("other", headers[TIMESTAMP_HEADER], body, headers[SIGNATURE_HEADER])
    payload = json.loads(body)
    assert payload["action"] == "flip"
    assert payload["instance"] == "pd-h20-3"
    assert payload["to_role"] == "decode"
    assert headers[IDEMPOTENCY_HEADER] == "plan-7-apply-step-2"


def test_webhook_retries_server_errors_with_exponential_backoff_and_keeps_the_key(automation):
    SLEPT.clear()
    automation.statuses = [503, 500, 200]
    WebhookActuator(automation.url, SECRET, backoff_s=0.1, sleep=no_sleep).notify(NOTICE)
    assert len(automation.received) == 3
    assert SLEPT == [0.1, 0.2]
    keys = {headers[IDEMPOTENCY_HEADER] for headers, _ in automation.received}
    assert keys == {"plan-7-apply-step-2"}


def test_webhook_gives_up_after_its_attempts_with_an_error_naming_the_step(automation):
    automation.statuses = [502] * 10
    actuator = WebhookActuator(automation.url, SECRET, attempts=3, backoff_s=0, sleep=no_sleep)
    with pytest.raises(ActuatorError, match=r"plan-7-apply-step-2.*HTTP 502"):
        actuator.notify(NOTICE)
    assert len(automation.received) == 3


def test_webhook_does_not_retry_a_refusal(automation):
    automation.statuses = [422]
    actuator = WebhookActuator(automation.url, SECRET, attempts=3, backoff_s=0, sleep=no_sleep)
    with pytest.raises(ActuatorError, match="HTTP 422"):
        actuator.notify(NOTICE)
    assert len(automation.received) == 1


def test_webhook_retries_when_nothing_listens_then_fails():
    actuator = WebhookActuator(
        "http://127.0.0.1:9/unreachable",
        SECRET,
        attempts=2,
        backoff_s=0,
        timeout_s=0.5,
        sleep=no_sleep,
    )
    with pytest.raises(ActuatorError, match="ConnectError"):
        actuator.notify(NOTICE)


def test_rollback_steps_have_their_own_idempotency_keys():
    rollback = StepNotice(plan_id=7, step=2, action="flip", cluster="pd", rollback=True)
    assert rollback.idempotency_key == "plan-7-rollback-step-2"
    assert rollback.idempotency_key != NOTICE.idempotency_key


@pytest.mark.parametrize(
    ("kind", "url", "secret", "message"),
    [
        ("webhook", "ftp://example.org/x", SECRET, "must be http"),
        ("webhook", "http://127.0.0.1/x", "", "secret is empty"),
        ("carrier-pigeon", "", "", "unknown actuator"),
    ],
)
def test_bad_actuator_configuration_is_refused_clearly(kind, url, secret, message):
    with pytest.raises(ActuatorError, match=message):
        actuator_for(kind, url=url, secret=secret)


def test_record_actuator_sends_nothing(automation):
    actuator = actuator_for("record")
    assert isinstance(actuator, RecordActuator)
    actuator.notify(NOTICE)
    assert automation.received == []


@dataclass
class Drip:
    url: str = ""
    written: list[int] = field(default_factory=list)
    cut: threading.Event = field(default_factory=threading.Event)


@pytest.fixture
def dripping_automation() -> Iterator[Drip]:
    """An automation that answers one byte every 0.3 s: each read is quick, the whole answer
    (1,000 bytes) would take 300 s. It records what it wrote before the caller hung up."""
    drip = Drip()
    stop = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            sent = 0
            while sent < 1000 and not stop.is_set():
                try:
                    self.wfile.write(b"x")
                    self.wfile.flush()
                except OSError:
                    drip.cut.set()  # the actuator gave up and closed the connection
                    break
                sent += 1
                stop.wait(0.3)
            drip.written.append(sent)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    drip.url = f"http://127.0.0.1:{server.server_address[1]}/hooks/prfaas"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield drip
    stop.set()
    server.shutdown()
    server.server_close()


def test_a_webhook_that_drips_its_answer_is_cut_at_the_total_deadline(dripping_automation):
    # Every read returns within the 1 s read timeout; only the total deadline can end it.
    actuator = WebhookActuator(
        dripping_automation.url, SECRET, attempts=2, timeout_s=1.0, deadline_s=1.5, sleep=no_sleep
    )
    with pytest.raises(ActuatorError, match=r"no complete answer within 1\.5 s"):
        actuator.notify(NOTICE)
    # The receiver sees the connection closed after a handful of its 1,000 bytes.
    assert dripping_automation.cut.wait(timeout=10)
    assert dripping_automation.written and max(dripping_automation.written) < 100
