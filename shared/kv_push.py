"""A KV push's frames, as prefill has them (shared/kv_transport.py has the wire format): built
whole, or growing as prefill computes the prompt's chunks (`stream_kv`). shared/kv_send.py
sends one on a connection; a retry sends it again from its first frame."""

from __future__ import annotations

import asyncio

from shared.kv_transport import PART_WAIT_S, FirstToken, Frame, KVPart, KVTransferError, TransferHead, frame, packed


class KVPush:
    """One push: a decoder's range of a request's KV, in parts, and prefill's first token after
    them. Built whole (`KVPush(head, layers, first)`: one part) or as prefill computes it
    (`KVPush(head)`, then `add` per computed chunk and `finish`): a push, and a retry of it on a
    new connection, sends its frames from the beginning and waits for those not computed yet.
    The frames are kept until the push ends, as the whole push's layers were."""

    def __init__(
        self,
        head: TransferHead,
        layers: list[bytes] | None = None,
        first: FirstToken | None = None,
        wait_s: float = PART_WAIT_S,
    ) -> None:
        self.head = head
        self.wait_s = wait_s  # the most it waits for a next part (`PART_WAIT_S`)
        self.first: FirstToken | None = None
        self._frames = [packed(Frame.HEADER, head)]
        self._covered = head.kv.start  # the parts added tile [start, _covered)
        self._layer_part: tuple[int, int] | None = None  # a part coming layer by layer: (its end, next layer)
        self._changed = asyncio.Event()
        self._abandoned = ""  # why its producer gave it up (the request ended): no part will come
        if layers is not None and head.kv.end > head.kv.start:
            self.add(head.kv.end, layers)
        if first is not None:
            self.finish(first)

    @property
    def covered(self) -> int:
        """Where the parts added so far end (a part coming layer by layer counts once whole)."""
        return self._covered

    @property
    def has_kv(self) -> bool:
        """Whether any part (or a part's first layer) was added: the push may start."""
        return self._layer_part is not None or self._covered > self.head.kv.start

    def add(self, end: int, layers: list[bytes]) -> None:
        """The next part: tokens [covered, end), one wire-format bytes object per layer."""
        kv = self.head.kv
        if (
            self._layer_part
            or self.first is not None
            or not self._covered < end <= kv.end
            or len(layers) != kv.num_layers
        ):
            raise ValueError(f"part [{self._covered}, {end}) of {len(layers)} layers does not fit {kv}")
        self._frames += [packed(Frame.PART, KVPart(end)), *(frame(Frame.LAYER, d) for d in layers)]
        self._covered = end
        self._wake()

    def add_layers(self, end: int, first: int, layers: list[bytes]) -> None:
        """Layers `first`, `first` + 1, ... of the next part, tokens [covered, end), as prefill's
        forward computed them (its last chunk: the layers go a few at a time, in order). The
        part's PART frame goes with its layer 0; the part is covered once its last layer came.
        The frames are those `add` makes."""
        kv, (part_end, expected) = self.head.kv, self._layer_part or (end, 0)
        last = first + len(layers)
        if self.first is not None or end != part_end or first != expected or not self._covered < end <= kv.end:
            raise ValueError(
                f"layer {first} of part [{self._covered}, {end}) does not follow {self._layer_part} of {kv}"
            )
        if not layers or last > kv.num_layers:
            raise ValueError(f"layers [{first}, {last}) of part [{self._covered}, {end}) do not fit {kv}")
        if first == 0:
            self._frames.append(packed(Frame.PART, KVPart(end)))
        self._frames += [frame(Frame.LAYER, d) for d in layers]
        self._layer_part = (end, last)
        if last == kv.num_layers:
            self._covered, self._layer_part = end, None
        self._wake()

    def finish(self, first: FirstToken) -> None:
        """The first token, once the parts cover the whole range: the push's last frame."""
        if self._covered != self.head.kv.end:
            raise ValueError(f"parts cover [{self.head.kv.start}, {self._covered}) of {self.head.kv}")
        self.first = first
        self._frames.append(packed(Frame.FIRST_TOKEN, first))
        self._wake()

    @property
    def abandoned(self) -> bool:
        return bool(self._abandoned)

    def abandon(self, why: str) -> None:
        """No more parts will come (the request was aborted or failed): a push waiting for one
        fails now, whatever became of its task's cancellation."""
        self._abandoned = why
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def frames(self):
        """Every frame from the first, waiting for those not added yet (at most `wait_s` for each);
        ends after FIRST_TOKEN."""
        i = 0
        while True:
            while i < len(self._frames):
                yield self._frames[i]
                i += 1
            if self.first is not None:
                return
            if self._abandoned:
                raise KVTransferError(f"the push was given up: {self._abandoned}")
            try:
                await asyncio.wait_for(self._changed.wait(), self.wait_s)
            except TimeoutError:
                raise KVTransferError(f"no KV computed for {self.wait_s:.0f}s") from None
