"""The control-plane client: typed messages over NATS, every request with a timeout.

Core NATS is at-most-once, so callers treat a timeout as "unknown" and retry idempotently
(handlers de-duplicate by request id). Reconnection is nats-py's: a service keeps running
through a NATS restart and its subscriptions are restored. A message that does not decode
(`BadMessage`) is logged and dropped: it fails nothing but itself.

The services use four calls: `publish`, `request`, `serve` (a handler per message, its reply
sent back) and `subscribe` (a typed stream). tests/fakes.py has an in-memory bus with the same
four, for unit tests without a server.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from shared import subjects
from shared.messages import BadMessage, M, Message
from shared.security import Secrets

log = logging.getLogger(__name__)


class BusTimeout(TimeoutError):
    pass


class NoResponders(BusTimeout):
    """No subscriber had the subject at the server: its owner is dead, or moving to another server
    of the cluster (its subscriptions follow it within a reconnect)."""


def _link_callbacks(on_link: Callable[[bool], None] | None) -> dict:
    if on_link is None:
        return {}

    async def lost() -> None:
        on_link(False)

    async def back() -> None:
        on_link(True)

    return {"disconnected_cb": lost, "reconnected_cb": back}


class Bus:
    def __init__(self, nc: Client, name: str) -> None:
        self.nc = nc
        self.name = name
        self._tasks: set[asyncio.Task] = set()  # handler tasks, referenced so they are not collected

    @classmethod
    async def connect(
        cls,
        url: str,
        name: str,
        user: str = "",
        secrets: Secrets | None = None,
        on_link: Callable[[bool], None] | None = None,
    ) -> Bus:
        """Connect to a NATS server as `user` (a model instance's id, or gateway, scheduler, ...;
        its NKEY from `secrets`, when the cluster has them: the servers then refuse anyone
        without credentials). `url` may list
        several servers of one cluster, comma-separated: when one dies the client moves to
        another and its subscriptions with it. `on_link(False)` runs when the connection is
        lost and `on_link(True)` once it is back: whatever was published meanwhile is gone."""

        async def on_error(e: Exception) -> None:
            log.warning("%s: NATS error: %s", name, e)

        creds: dict = secrets.nats_login(user) if secrets and user else {}  # its NKEY seed signs the nonce
        if user:  # replies come on the user's own inbox prefix: no one can read another's replies
            creds["inbox_prefix"] = f"_INBOX.{user}"
        nc = await nats.connect(
            url.split(","),
            name=name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            error_cb=on_error,
            allow_reconnect=True,
            **creds,
            **_link_callbacks(on_link),
        )
        return cls(nc, name)

    async def publish(self, subject: str, msg: Message) -> None:
        await self.nc.publish(subject, msg.encode())

    async def request(self, subject: str, msg: Message, reply_type: type[M], timeout: float) -> M:
        try:
            reply = await self.nc.request(subject, msg.encode(), timeout=timeout)
        except NoRespondersError:
            raise NoResponders(f"no reply on {subject}: no responders") from None
        except (TimeoutError, NatsTimeout) as e:
            raise BusTimeout(f"no reply on {subject} within {timeout:.1f}s ({type(e).__name__})") from None
        return reply_type.decode(reply.data)

    async def serve(
        self,
        subject: str,
        msg_type: type[M],
        handler: Callable[..., Awaitable[Message | None]],
        queue: str = "",
        by_reporter: bool = False,
    ) -> None:
        """Subscribe; each message runs `handler` in its own task; a returned message is the reply.
        Returns once the server has the subscription: a service that then announces itself (its
        heartbeat) is reachable, never answered "no responders". `by_reporter`: the handler also
        gets the instance the subject names (`subjects.reporter`), which only it may publish on."""

        async def on_msg(raw: Msg) -> None:
            task = asyncio.create_task(self._handle(raw, msg_type, handler, by_reporter))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        await self.nc.subscribe(subject, queue=queue, cb=on_msg)
        await self.sync()

    async def sync(self) -> None:
        """Return once the server has processed everything this client sent so far (a SUB, so
        other clients' messages reach it). nats-py's `flush()` writes its PING straight to the
        socket, ahead of commands still queued for its flusher task, so one PONG can come back
        before the server saw a SUB just made: a request to it from another client was then
        answered "no responders" (about one subscription in thirty here). The first flush has the
        flusher write the queue before its own PONG is read; the second PING follows it."""
        await self.nc.flush()
        await self.nc.flush()

    async def subscribe(
        self, subject: str, msg_type: type[M], callback: Callable[..., None], by_reporter: bool = False
    ) -> Subscription:
        """Call `callback(msg)` on the event loop for each message on `subject`, in order
        (`callback(msg, reporter)` with `by_reporter`, as `serve`)."""

        async def on_msg(raw: Msg) -> None:
            try:
                msg = msg_type.decode(raw.data)
                if by_reporter:
                    callback(msg, subjects.reporter(raw.subject))
                else:
                    callback(msg)
            except BadMessage as e:
                log.warning("%s: dropped a bad message on %s: %s", self.name, raw.subject, e)

        return await self.nc.subscribe(subject, cb=on_msg)

    async def _handle(
        self, raw: Msg, msg_type: type[M], handler: Callable[..., Awaitable[Message | None]], by_reporter: bool
    ) -> None:
        try:
            msg = msg_type.decode(raw.data)
            reply = await (handler(msg, subjects.reporter(raw.subject)) if by_reporter else handler(msg))
            if reply is not None and raw.reply:
                await raw.respond(reply.encode())
        except BadMessage as e:
            log.warning("%s: dropped a bad message on %s: %s", self.name, raw.subject, e)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s: handler for %s failed", self.name, raw.subject)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        try:
            await self.nc.drain()
        except Exception:
            await self.nc.close()
