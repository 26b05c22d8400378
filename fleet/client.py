"""A small router client for the control plane's routing API (no Django; httpx).

An LLM request router embeds :class:`RouterClient` and calls :meth:`RouterClient.route` in
front of every request. The client calls ``POST /api/v1/route`` (or ``/route/batch``) with a
timeout and a few retries. When the control plane is unreachable (connection error, timeout,
5xx or 429 after the retries), it decides locally from the last policy snapshot it fetched
from ``GET /api/v1/policy``, with the same pure function the server uses
(:func:`scheduling.core.routing.route_decide`) and live state marked stale, so the decision says
``telemetry_stale`` and follows the policy's static rule (or stays local when the policy's
``stale_mode`` is ``local``). Decisions keep flowing while the server is down; after a
failure the client stops calling the server for ``cooldown_s`` so that each request does
not pay a timeout, and goes back to it by itself afterwards.

Errors the server attributes to the caller (4xx other than 408/429: bad input, bad token,
oversized body) are raised as :class:`RouterApiError`, never answered locally: a local
answer would hide a bug in the caller. So is a 503 saying the origin has no decode or
prefill capacity (codes ``no_decode_capacity``, ``origin_unavailable``): that is the
server's knowledge of the fleet, which a stale local decision would ignore.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import httpx

from scheduling.core.routing import (
    LinkReservation,
    LiveState,
    PolicySnapshot,
    Reason,
    RouteDecision,
    RouteRequest,
    SnapshotFormatError,
    decision_from_dict,
    live_state_from_dict,
    policy_snapshot_from_dict,
    route_decide,
    route_decide_many,
)

__all__ = [
    "RouterApiError",
    "RouterClient",
    "RouterUnavailableError",
    "route_request_to_dict",
]

log = logging.getLogger(__name__)

ROUTE_PATH = "/api/v1/route"
ROUTE_BATCH_PATH = "/api/v1/route/batch"
POLICY_PATH = "/api/v1/policy"
LIVE_PATH = "/api/v1/route/live"
RESERVATIONS_PATH = "/api/v1/reservations"
OUTCOMES_PATH = "/api/v1/outcomes"
EJECTIONS_PATH = "/api/v1/ejections"

# Statuses that mean "the control plane cannot answer now", worth a retry and a fallback.
_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# A 503 with one of these codes is the control plane's answer about the fleet (the origin
# has no decode or no prefill capacity), not its own failure: deciding locally from a stale
# snapshot would send the request to instances the server knows are gone.
_FLEET_CODES = frozenset({Reason.NO_DECODE_CAPACITY, Reason.ORIGIN_UNAVAILABLE})


class RouterApiError(Exception):
    """The server refused the call for a reason of the caller's (4xx), with its error shape."""

    def __init__(self, status: int, code: str, detail: str):
        super().__init__(f"{status} {code}: {detail}")
        self.status = status
        self.code = code
        self.detail = detail


class RouterUnavailableError(Exception):
    """The server is unreachable and no policy snapshot was ever fetched to decide locally."""


class _Unreachable(Exception):
    """Internal: the server did not answer usefully after the retries."""


def route_request_to_dict(request: RouteRequest) -> dict[str, Any]:
    """The JSON body of one route request (prefix matches are the server's business: only
    block hashes and router-known cached tokens travel)."""
    body: dict[str, Any] = {"origin": request.origin, "prompt_tokens": request.prompt_tokens}
    if request.block_hashes:
        body["block_hashes"] = list(request.block_hashes)
    if request.cached_tokens:
        body["cached_tokens"] = dict(request.cached_tokens)
    if request.request_id is not None:
        body["request_id"] = request.request_id
    if request.expected_output_tokens is not None:
        body["expected_output_tokens"] = request.expected_output_tokens
    return body


def _error_of(response: httpx.Response) -> RouterApiError:
    try:
        body = response.json()
        code = str(body.get("code", f"http_{response.status_code}"))
        detail = str(body.get("detail", response.text))
    except (ValueError, AttributeError):
        code, detail = f"http_{response.status_code}", response.text[:200]
    return RouterApiError(response.status_code, code, detail)


class RouterClient:
    """Routing decisions from the control plane, with a local fallback.

    ``base_url``: the control plane (``https://cp.example``); ``token``: a ``router`` API
    token; ``timeout_s``: per HTTP attempt; ``retries``: extra attempts after the first
    (with ``backoff_s`` doubling between them); ``cooldown_s``: how long to decide locally
    without trying the server after it failed. One instance per process can be shared by
    threads (the counters are then approximate).

    Counters ``remote_decisions`` and ``local_decisions`` say how each answer was made.
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        timeout_s: float = 0.5,
        retries: int = 2,
        *,
        backoff_s: float = 0.05,
        cooldown_s: float = 2.0,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        if retries < 0:
            raise ValueError("retries must not be negative")
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {token}", "Accept": "application/json"},
            timeout=httpx.Timeout(timeout_s),
            transport=transport,
        )
        self.retries = retries
        self.backoff_s = backoff_s
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._snapshot: PolicySnapshot | None = None
        self._etag: str | None = None
        self._down_until = 0.0
        self._live: LiveState | None = None
        self._live_fetched = 0.0  # time.monotonic() of the last live-state fetch
        self.remote_decisions = 0
        self.local_decisions = 0

    # -- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- policy snapshot ------------------------------------------------------------------

    @property
    def policy_snapshot(self) -> PolicySnapshot | None:
        """The last policy snapshot fetched (None before the first successful fetch)."""
        return self._snapshot

    def refresh_policy(self) -> bool:
        """Fetch ``GET /api/v1/policy`` with ``If-None-Match``; True when it changed.

        Raises RouterApiError for a 4xx, and httpx errors / ``RouterUnavailableError`` when
        the server cannot be reached after the retries (the cached snapshot is kept).
        """
        headers = {"If-None-Match": self._etag} if self._etag else {}
        try:
            response = self._send("GET", POLICY_PATH, headers=headers)
        except _Unreachable as exc:
            raise RouterUnavailableError(f"policy snapshot not reachable: {exc}") from exc
        if response.status_code == 304:
            return False
        try:
            snapshot = policy_snapshot_from_dict(response.json())
        except (ValueError, SnapshotFormatError) as exc:
            raise RouterApiError(response.status_code, "bad_snapshot", str(exc)) from exc
        with self._lock:
            self._snapshot = snapshot
            self._etag = response.headers.get("ETag")
        return True

    def _ensure_snapshot(self) -> PolicySnapshot:
        snapshot = self._snapshot
        if snapshot is None:
            try:
                self.refresh_policy()
            except (RouterUnavailableError, RouterApiError) as exc:
                raise RouterUnavailableError(
                    "the control plane is unreachable and no policy snapshot is cached"
                ) from exc
            snapshot = self._snapshot
            assert snapshot is not None
        return snapshot

    # -- decisions ------------------------------------------------------------------------

    def route(
        self,
        origin: str,
        prompt_tokens: int,
        *,
        block_hashes: Sequence[int | str] = (),
        cached_tokens: Mapping[str, int] | None = None,
        request_id: str | None = None,
        expected_output_tokens: int | None = None,
    ) -> RouteDecision:
        """Decide one request: from the server, or locally when it cannot answer."""
        request = RouteRequest(
            origin=origin,
            prompt_tokens=prompt_tokens,
            cached_tokens=dict(cached_tokens or {}),
            block_hashes=tuple(block_hashes),
            request_id=request_id,
            expected_output_tokens=expected_output_tokens,
        )
        if self.server_usable():
            try:
                response = self._send("POST", ROUTE_PATH, json=route_request_to_dict(request))
                decision = decision_from_dict(response.json())
            except (_Unreachable, ValueError) as exc:
                self._mark_down(exc)
            else:
                self._after_remote(decision.policy_version)
                self.remote_decisions += 1
                return decision
        return self.decide_locally(request)

    def route_batch(self, requests: Sequence[RouteRequest]) -> list[RouteDecision]:
        """Decide many requests in one call (``POST /api/v1/route/batch``), in order."""
        if not requests:
            return []
        if self.server_usable():
            body = {"requests": [route_request_to_dict(r) for r in requests]}
            try:
                response = self._send("POST", ROUTE_BATCH_PATH, json=body)
                payload = response.json()
                items = payload["decisions"] if isinstance(payload, Mapping) else payload
                decisions = [decision_from_dict(item) for item in items]
                if len(decisions) != len(requests):
                    raise ValueError("the batch answer does not match the batch")
            except (_Unreachable, ValueError, KeyError, TypeError) as exc:
                self._mark_down(exc)
            else:
                if decisions:
                    self._after_remote(decisions[0].policy_version)
                self.remote_decisions += len(decisions)
                return decisions
        return self.decide_locally_many(requests)

    def decide_locally(self, request: RouteRequest, live: LiveState | None = None) -> RouteDecision:
        """Decide ``request`` here from the cached policy, with ``live`` (e.g. from
        :meth:`live_state`) or else stale live state (the pure router's static rule, or
        all-local per the policy). Raises RouterUnavailableError when no snapshot was ever
        fetched and the server cannot give one now."""
        snapshot = self._ensure_snapshot()
        if live is None:
            live = LiveState(now=self._clock(), stale=True)
        decision = route_decide(request, snapshot.policy, snapshot.topology, live)
        self.local_decisions += 1
        return decision

    def decide_locally_many(self, requests: Sequence[RouteRequest]) -> list[RouteDecision]:
        """:meth:`decide_locally` for a batch."""
        snapshot = self._ensure_snapshot()
        live = LiveState(now=self._clock(), stale=True)
        decisions = route_decide_many(requests, snapshot.policy, snapshot.topology, live)
        self.local_decisions += len(decisions)
        return decisions

    # -- live state, reservations, outcomes (routers that decide in process) -------------

    def refresh_live(self) -> LiveState:
        """Fetch ``GET /api/v1/route/live`` (the fleet's loads, links and control state now).

        Raises RouterApiError for a 4xx and RouterUnavailableError when the server cannot be
        reached after the retries (the last live state is kept, and ages)."""
        try:
            response = self._send("GET", LIVE_PATH)
            live = live_state_from_dict(response.json())
        except _Unreachable as exc:
            self._mark_down(exc)
            raise RouterUnavailableError(f"live state not reachable: {exc}") from exc
        except (ValueError, SnapshotFormatError) as exc:
            raise RouterApiError(response.status_code, "bad_live_state", str(exc)) from exc
        with self._lock:
            self._live = live
            self._live_fetched = time.monotonic()
        return live

    def live_state(self, max_age_s: float) -> LiveState | None:
        """The last live state fetched, if younger than ``max_age_s`` (None: too old or never
        fetched; decide with stale state then), with ``now`` set to this client's clock."""
        live = self._live
        age = time.monotonic() - self._live_fetched
        if live is None or age > max_age_s:
            return None
        return LiveState(
            now=self._clock(),
            instances=live.instances,
            links=live.links,
            control=live.control,
            stale=live.stale,
            telemetry_at=live.telemetry_at,
        )

    @property
    def live_age_s(self) -> float | None:
        """Seconds since the last live-state fetch (None: never)."""
        return None if self._live is None else time.monotonic() - self._live_fetched

    def link_reserve(self, reservation: LinkReservation, hold_s: float) -> LinkReservation | None:
        """Take ``reservation`` atomically on the control plane (``POST /api/v1/reservations``)
        for at most ``hold_s`` seconds: the reservation with its ``id`` when admitted, None
        when the link's budget has no room. Raises RouterUnavailableError when the server
        cannot answer (then nothing is reserved: the caller must not offload), at once while
        the client's cooldown after a failure lasts: one attempt, no retry, so that a dead
        control plane costs a request one timeout at most, and the requests after it none."""
        if not self.server_usable():
            raise RouterUnavailableError("reservation not possible: the control plane is away")
        body = {
            "source": reservation.source,
            "target": reservation.target,
            "bytes": reservation.bytes,
            "hold_s": hold_s,
        }
        try:
            answer = self._send("POST", RESERVATIONS_PATH, json=body, attempts=1).json()
        except _Unreachable as exc:
            self._mark_down(exc)
            raise RouterUnavailableError(f"reservation not possible: {exc}") from exc
        if not answer.get("admitted"):
            return None
        return LinkReservation(
            reservation.source, reservation.target, reservation.bytes, str(answer["id"])
        )

    def outcomes_report(
        self, outcomes: Sequence[bytes], groups: Sequence[bytes] = ()
    ) -> dict[str, Any]:
        """Send served requests' outcomes (``POST /api/v1/outcomes``): at most 1,000 whole
        ones and 1,000 summed groups, each already JSON-encoded, all within the API's body
        limit. Releases their reservations on the control plane. Raises
        RouterUnavailableError when the server cannot answer (the caller keeps them)."""
        body = b'{"outcomes":[' + b",".join(outcomes) + b'],"groups":[' + b",".join(groups) + b"]}"
        headers = {"Content-Type": "application/json"}
        try:
            return dict(self._send("POST", OUTCOMES_PATH, content=body, headers=headers).json())
        except _Unreachable as exc:
            self._mark_down(exc)
            raise RouterUnavailableError(f"outcomes not delivered: {exc}") from exc

    def instance_eject(self, instance: str, for_s: float, reason: str) -> None:
        """Tell the control plane that ``instance`` failed or hung here and should not be
        decided onto for ``for_s`` seconds (``POST /api/v1/ejections``)."""
        body = {"ejections": [{"instance": instance, "for_s": for_s, "reason": reason[:200]}]}
        try:
            self._send("POST", EJECTIONS_PATH, json=body, attempts=1)
        except _Unreachable as exc:
            self._mark_down(exc)
            raise RouterUnavailableError(f"ejection not reported: {exc}") from exc

    # -- transport ------------------------------------------------------------------------

    def server_usable(self) -> bool:
        """False during the cooldown after a call found the server unreachable (calls that
        would wait for it are not made then)."""
        return time.monotonic() >= self._down_until

    def _mark_down(self, exc: BaseException) -> None:
        if self.server_usable():
            log.warning("control plane unreachable, deciding locally: %s", exc)
        self._down_until = time.monotonic() + self.cooldown_s

    def _after_remote(self, policy_version: int) -> None:
        """Keep the fallback snapshot current: fetch it when the server's version moved."""
        snapshot = self._snapshot
        if snapshot is not None and snapshot.policy.version == policy_version:
            return
        try:
            self.refresh_policy()
        except (RouterUnavailableError, RouterApiError, httpx.HTTPError) as exc:
            log.warning("policy snapshot refresh failed: %s", exc)

    def _send(
        self, method: str, path: str, *, attempts: int | None = None, **kwargs: Any
    ) -> httpx.Response:
        """One call with retries (``attempts`` in all; default: 1 + ``retries``). Returns a
        2xx/304 response; raises RouterApiError for a caller's 4xx and _Unreachable when the
        server cannot answer. An answer ends the cooldown of an earlier failure."""
        delay = self.backoff_s
        last: BaseException | None = None
        for attempt in range(self.retries + 1 if attempts is None else attempts):
            if attempt:
                time.sleep(delay)
                delay *= 2
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.RequestError as exc:  # connect errors, timeouts, protocol errors
                last = exc
                continue
            if response.status_code in _RETRYABLE_STATUS:
                error = _error_of(response)
                if error.code in _FLEET_CODES:
                    raise error
                last = error
                continue
            self._down_until = 0.0
            if response.status_code >= 400:
                raise _error_of(response)
            return response
        raise _Unreachable(repr(last))
