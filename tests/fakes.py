"""In-memory fakes of the services' two interfaces to the world, for unit tests without servers.

- `InMemoryNats` / `InMemoryBus`: a server and its client connections with the four calls of
  `shared.bus.Bus` (publish, request, serve, subscribe) on one event loop. Messages go through
  `encode()` / `decode()` as on NATS, a handler runs in its own task, a request nobody serves
  fails at once (NATS's "no responders"), and closing a client drops its subscriptions.
- `ManualWorker`: `EngineWorker`'s interface around a real `Engine`, with no thread: commands
  run at once, and the engine steps only when the test calls `step()`, so a test decides
  exactly what happens between two steps.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from shared import subjects
from shared.bus import BusTimeout, NoResponders
from shared.messages import BadMessage, M, Message
from shared.runtime.engine import Engine, TokenOutput


class _Sub:
    def __init__(self, client: InMemoryBus, subject: str, deliver: Callable[[bytes, Any], None]) -> None:
        self.client, self.subject, self.deliver = client, subject, deliver

    async def unsubscribe(self) -> None:
        self.client.drop(self)


class InMemoryNats:
    """The server: subjects, subscriptions, and a log of every message, for assertions."""

    def __init__(self) -> None:
        self.subs: dict[str, list[_Sub]] = defaultdict(list)
        self.tasks: set[asyncio.Task] = set()  # handler tasks of every client
        self.published: list[tuple[str, Message]] = []

    def client(self, name: str) -> InMemoryBus:
        return InMemoryBus(self, name)

    def sent(self, subject: str) -> list[Message]:
        return [m for s, m in self.published if s == subject]


class InMemoryBus:
    """One client connection; `close()` removes its subscriptions, as a dead process's would go."""

    def __init__(self, server: InMemoryNats, name: str) -> None:
        self.server, self.name = server, name
        self._subs: list[_Sub] = []
        self._tasks: set[asyncio.Task] = set()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        for tasks in (self._tasks, self.server.tasks):
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        return task

    def _add(self, subject: str, deliver: Callable[[bytes, Any], None]) -> _Sub:
        sub = _Sub(self, subject, deliver)
        self._subs.append(sub)
        self.server.subs[subject].append(sub)
        return sub

    def drop(self, sub: _Sub) -> None:
        if sub in self._subs:
            self._subs.remove(sub)
            self.server.subs[sub.subject].remove(sub)

    def _matching(self, subject: str) -> list[_Sub]:
        """The subscriptions `subject` reaches, a `*` in theirs matching one token."""
        tokens = subject.split(".")
        return [
            sub
            for pattern, subs in self.server.subs.items()
            if len(parts := pattern.split(".")) == len(tokens) and all(p in ("*", t) for p, t in zip(parts, tokens))
            for sub in subs
        ]

    async def publish(self, subject: str, msg: Message) -> None:
        self.server.published.append((subject, msg))
        data = msg.encode()
        for sub in self._matching(subject):
            sub.deliver(data, (subject, None))

    async def request(self, subject: str, msg: Message, reply_type: type[M], timeout: float) -> M:
        subs = self._matching(subject)
        if not subs:
            raise NoResponders(f"no reply on {subject}: no responders")
        self.server.published.append((subject, msg))
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        subs[0].deliver(msg.encode(), (subject, future))
        try:
            return reply_type.decode(await asyncio.wait_for(future, timeout))
        except TimeoutError:
            raise BusTimeout(f"no reply on {subject} within {timeout:.1f}s") from None

    async def serve(
        self,
        subject: str,
        msg_type: type[M],
        handler: Callable[..., Awaitable[Message | None]],
        queue: str = "",
        by_reporter: bool = False,
    ) -> None:
        async def handle(data: bytes, sent: tuple[str, asyncio.Future | None]) -> None:
            subject, reply = sent
            try:
                msg = msg_type.decode(data)
                response = await (handler(msg, subjects.reporter(subject)) if by_reporter else handler(msg))
            except BadMessage:
                return
            if response is not None and reply is not None and not reply.done():
                reply.set_result(response.encode())

        self._add(subject, lambda data, sent: self._spawn(handle(data, sent)))

    async def subscribe(
        self, subject: str, msg_type: type[M], callback: Callable[..., None], by_reporter: bool = False
    ) -> _Sub:
        def deliver(data: bytes, sent: tuple[str, Any]) -> None:
            msg = msg_type.decode(data)
            if by_reporter:
                callback(msg, subjects.reporter(sent[0]))
            else:
                callback(msg)

        return self._add(subject, deliver)

    async def close(self) -> None:
        for sub in list(self._subs):
            self.drop(sub)
        for task in list(self._tasks):
            task.cancel()


class ManualWorker:
    """EngineWorker without a thread: `call` runs now, `step` runs one engine step."""

    def __init__(self, engine: Engine, on_outputs: Callable[[list[TokenOutput]], Any]) -> None:
        self.engine = engine
        self.on_outputs = on_outputs
        self.figures = engine.figures()

    def start(self) -> None:
        self.engine.emit = self.on_outputs  # a streaming prefill's layers, during the step (here: at once)

    def stop(self) -> None: ...

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        try:
            return fn(self.engine)
        finally:
            self.figures = self.engine.figures()

    def submit(self, fn: Callable[[Engine], Any]) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        try:
            future.set_result(fn(self.engine))
        except Exception as e:
            future.set_exception(e)
        finally:
            self.figures = self.engine.figures()
        return future

    def step(self) -> list[TokenOutput]:
        outputs = self.engine.step()
        self.figures = self.engine.figures()
        if outputs:
            self.on_outputs(outputs)
        return outputs
