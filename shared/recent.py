"""A bounded memory of request ids: what a service must remember after a request is gone.

Core NATS is at-most-once and messages race, so a service remembers ids it is done with for a
while: an abort that came before its task (the task is refused), a task delivered twice (acked
once). Remembering forever would grow without bound under a flood of unknown ids, so the
memory keeps the newest `capacity` ids and forgets any older than `ttl_s`. An id may carry a
value (`add(id, value)`, `get(id)`): a decoder keeps what it sent of a finished request this
way, to send it again when the gateway lost a chunk.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any


class RecentIds:
    def __init__(self, capacity: int = 10_000, ttl_s: float = 600.0, clock: Callable[[], float] = time.monotonic):
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._clock = clock
        self._seen: OrderedDict[str, tuple[float, Any]] = OrderedDict()

    def add(self, request_id: str, value: Any = None) -> None:
        self._seen[request_id] = (self._clock(), value)
        self._seen.move_to_end(request_id)
        self._trim()

    def get(self, request_id: str) -> Any:
        """The value remembered with `request_id` (None when forgotten or never added)."""
        self._trim()
        found = self._seen.get(request_id)
        return None if found is None else found[1]

    def __contains__(self, request_id: str) -> bool:
        self._trim()
        return request_id in self._seen

    def __len__(self) -> int:
        return len(self._seen)

    def _trim(self) -> None:
        cutoff = self._clock() - self.ttl_s
        while self._seen and (len(self._seen) > self.capacity or next(iter(self._seen.values()))[0] < cutoff):
            self._seen.popitem(last=False)
