"""The channel layer of the live views: channels-redis's, with a ``receive`` that outlives a
Redis restart.

channels-redis raises from ``receive`` when its Redis goes away, which ends every websocket of
the process at once. This layer waits instead (with back-off, up to ``GIVE_UP_S``) until Redis
answers again, then hands the consumer one ``{"type": "layer.reconnected"}`` message: what was
sent meanwhile is lost, and group membership lived in the old Redis, so the consumer re-joins
its group and starts over from a snapshot (``LiveConsumer.layer_reconnected``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

import redis
from channels_redis.core import RedisChannelLayer

logger = logging.getLogger(__name__)

RECONNECT_DELAYS_S = (0.1, 0.25, 0.5, 1.0, 2.0)
# Past this the error is raised: the socket closes and the browser reconnects on its own.
GIVE_UP_S = 1800.0
RECONNECTED = {"type": "layer.reconnected"}


class ReconnectingRedisChannelLayer(RedisChannelLayer):
    async def receive(self, channel: str) -> dict[str, Any]:
        try:
            return await super().receive(channel)
        except (redis.RedisError, OSError) as exc:
            logger.warning("channel layer receive failed (%s); reconnecting", exc)
            failure = exc
        deadline = time.monotonic() + GIVE_UP_S
        for delay in itertools.chain(RECONNECT_DELAYS_S, itertools.repeat(RECONNECT_DELAYS_S[-1])):
            if time.monotonic() + delay > deadline:
                raise failure
            await asyncio.sleep(delay)
            try:
                await self.connection(self.consistent_hash(channel)).ping()
            except (redis.RedisError, OSError) as exc:
                failure = exc
                continue
            return dict(RECONNECTED)
        raise AssertionError("unreachable")
