"""A bounded memory of request ids: what a service must remember after a request is gone.

Core NATS is at-most-once and messages race, so a service remembers ids it is done with for a
while: an abort that came before its task (the task is refused), a task delivered twice (acked
once). Remembering forever would grow without bound under a flood of unknown ids, so the
memory keeps the newest `capacity` ids and forgets any older than `ttl_s`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class RecentIds:
    def __init__(self, capacity: int = 10_000, ttl_s: float = 600.0, clock: Callable[[], float] = time.monotonic):
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()

    def add(self, request_id: str) -> None:
        self._seen[request_id] = self._clock()
        self._seen.move_to_end(request_id)
        self._trim()

    def __contains__(self, request_id: str) -> bool:
        self._trim()
        return request_id in self._seen

    def __len__(self) -> int:
        return len(self._seen)

    def _trim(self) -> None:
        cutoff = self._clock() - self.ttl_s
        while self._seen and (len(self._seen) > self.capacity or next(iter(self._seen.values())) < cutoff):
            self._seen.popitem(last=False)
