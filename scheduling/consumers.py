"""The live-view websocket: one consumer per browser tab, subscribed to one group.

On connect it sends a full snapshot with the group's current sequence number, then frames in
strict sequence order. A frame that arrives ahead of a missing one waits a moment
(``REORDER_WINDOW_S``: two publishers may reach Redis in one order and the channel layer in the
other); if the missing frame never comes, the client gets a fresh snapshot instead. A client can
also ask for one (``{"type": "resync"}``), e.g. after it reconnects or sees a gap itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import redis
from channels.consumer import get_handler_name
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from controlplane.live import Frame, asequence_current, group_valid
from controlplane.models import TokenScope
from controlplane.roles import user_has_scope
from scheduling.overview import live_snapshot

logger = logging.getLogger(__name__)
# Longest client message read (the only one, {"type": "resync"}, is 18 characters).
MAX_CLIENT_MESSAGE_CHARS = 4096

CLOSE_UNAUTHENTICATED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_UNKNOWN_GROUP = 4404

REORDER_WINDOW_S = 0.25
# How often a consumer checks its group's position in Redis. It catches what no frame can show:
# a last frame that was lost, and a Redis that restarted (new epoch, group membership gone)
# while the channel layer's client reconnected silently.
HEARTBEAT_S = 2.0
# Group membership in the channel layer expires; long-lived sockets renew it.
GROUP_RENEW_S = 600.0


class _Heartbeat:
    """The websocket's ``receive``, which also yields ``{"type": "live.heartbeat"}`` every
    ``interval`` seconds, however busy the client: the consumer's messages stay one sequence,
    handled one at a time. A client message still on its way when a beat is due is kept for
    the next call."""

    def __init__(self, receive: Any, interval: float) -> None:
        self.receive = receive
        self.interval = interval
        self.beat_at = time.monotonic() + interval
        self.waiting: asyncio.Future[Any] | None = None

    async def __call__(self) -> Any:
        if self.waiting is None:
            self.waiting = asyncio.ensure_future(self.receive())
        wait = self.beat_at - time.monotonic()
        done = False
        if wait > 0:
            finished, _ = await asyncio.wait({self.waiting}, timeout=wait)
            done = bool(finished)
        if not done:
            self.beat_at = time.monotonic() + self.interval
            return {"type": "live.heartbeat"}
        message, self.waiting = self.waiting.result(), None
        return message

    def close(self) -> None:
        if self.waiting is not None:
            self.waiting.cancel()


class LiveConsumer(AsyncJsonWebsocketConsumer):
    """Streams one live group (``/ws/live/<group>/``) to an authenticated user."""

    group: str = ""
    epoch: str = ""
    seq: int = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.pending: dict[int, Frame] = {}
        self.gap_check_scheduled = False
        self.lag_seen = 0
        self.group_added_at = 0.0
        beating = _Heartbeat(receive, HEARTBEAT_S)
        try:
            await super().__call__(scope, beating, send)
        finally:
            beating.close()

    async def dispatch(self, message: dict[str, Any]) -> None:
        # AsyncConsumer.dispatch hops to a thread before every handler to close stale database
        # connections. Frames touch no database (snapshots go through database_sync_to_async,
        # which does that itself), and with many sockets per process that hop per frame per
        # socket dominates the latency.
        if message.get("type", "").startswith("live."):
            await getattr(self, get_handler_name(message))(message)
        else:
            await super().dispatch(message)

    # -- websocket side ----------------------------------------------------------------------

    async def connect(self) -> None:
        await self.accept()
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        if not await database_sync_to_async(user_has_scope)(user, TokenScope.READ):
            await self.close(code=CLOSE_FORBIDDEN)  # logged in, but in no access group
            return
        group = self.scope["url_route"]["kwargs"]["group"]
        if not group_valid(group):
            await self.close(code=CLOSE_UNKNOWN_GROUP)
            return
        self.group = group
        await self._group_add()
        await self.snapshot_send("connect")

    async def _group_add(self) -> None:
        await self.channel_layer.group_add(self.group, self.channel_name)
        self.group_added_at = time.monotonic()

    async def disconnect(self, code: int) -> None:
        if self.group:
            # On failure the membership expires on its own.
            with contextlib.suppress(redis.RedisError, OSError):
                await self.channel_layer.group_discard(self.group, self.channel_name)

    @classmethod
    async def decode_json(cls, text_data: str) -> Any:
        # The only client message is {"type": "resync"}: anything longer is not one, and is
        # not parsed (a message nested 200,000 deep crashed the consumer in the parser).
        if len(text_data) > MAX_CLIENT_MESSAGE_CHARS:
            return None
        try:
            return json.loads(text_data)
        except (ValueError, RecursionError):
            return None  # answered as an unknown message, the socket stays open

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        if not self.group:
            return
        if isinstance(content, dict) and content.get("type") == "resync":
            await self.snapshot_send("requested")
        else:
            await self.send_json(
                {"type": "error", "detail": 'unknown message; send {"type": "resync"}'}
            )

    # -- channel-layer side ------------------------------------------------------------------

    async def live_frame(self, event: dict[str, Any]) -> None:
        frame: Frame = event["frame"]
        if frame["epoch"] != self.epoch:
            # Redis was reset: the numbers of the old epoch and the new one can't be compared.
            await self.snapshot_send("epoch")
            return
        if frame["seq"] <= self.seq:
            return  # already sent, or already part of the snapshot
        self.pending[frame["seq"]] = frame
        await self._flush()

    async def live_gap_check(self, event: dict[str, Any]) -> None:
        self.gap_check_scheduled = False
        if self.pending:
            await self.snapshot_send("gap")

    async def live_heartbeat(self, event: dict[str, Any]) -> None:
        if not self.group:
            return
        try:
            epoch, seq = await asequence_current(self.group)
            if epoch != self.epoch:
                await self._group_add()
                await self.snapshot_send("epoch")
                return
            if time.monotonic() - self.group_added_at > GROUP_RENEW_S:
                await self._group_add()
        except (redis.RedisError, OSError):
            return  # Redis away: the next beat tries again
        if self.lag_seen and self.seq < self.lag_seen:
            # Still short of where the group was a whole beat ago: lost, not late.
            self.lag_seen = 0
            await self.snapshot_send("gap")
            return
        self.lag_seen = seq if seq > self.seq else 0

    async def layer_reconnected(self, event: dict[str, Any]) -> None:
        """The channel layer's Redis came back (:mod:`controlplane.channel_layer`): frames sent
        meanwhile are lost and group membership lived in the old Redis."""
        if not self.group:
            return
        try:
            await self._group_add()
            await self.snapshot_send("reconnected")
        except (redis.RedisError, OSError) as exc:
            # The heartbeat sees the stale epoch and tries again.
            logger.warning("snapshot after reconnect failed: %s", exc)
            self.epoch = ""

    # -- internals ---------------------------------------------------------------------------

    async def _flush(self) -> None:
        while self.seq + 1 in self.pending:
            frame = self.pending.pop(self.seq + 1)
            self.seq = frame["seq"]
            await self.send_json(frame)
        if self.pending and not self.gap_check_scheduled:
            self.gap_check_scheduled = True
            asyncio.get_running_loop().call_later(REORDER_WINDOW_S, self._gap_check_enqueue)

    def _gap_check_enqueue(self) -> None:
        # Through our own channel, so that the check runs in the dispatch loop like any event.
        self.gap_check_task = asyncio.ensure_future(self._gap_check_send())

    async def _gap_check_send(self) -> None:
        try:
            await self.channel_layer.send(self.channel_name, {"type": "live.gap_check"})
        except (redis.RedisError, OSError):
            self.gap_check_scheduled = False

    async def snapshot_send(self, reason: str) -> None:
        # The position is read before the data, so every frame after it is newer than the data
        # or (at worst) already in it; pages apply frames idempotently.
        epoch, seq = await asequence_current(self.group)
        data = await database_sync_to_async(live_snapshot)(self.group, self.scope["user"])
        self.epoch, self.seq = epoch, seq
        self.pending = {s: f for s, f in self.pending.items() if s > seq and f["epoch"] == epoch}
        await self.send_json(
            {
                "type": "snapshot",
                "group": self.group,
                "epoch": epoch,
                "seq": seq,
                "reason": reason,
                "data": data,
            }
        )
        await self._flush()
