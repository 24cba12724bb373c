"""The fleet bench's own processes (benchmarks/fleet_bench.py starts them):

    python -m benchmarks.fleet_load sim --nats URL --out FILE
    python -m benchmarks.fleet_load client --nats URL --redis URL --prompts FILE --out FILE ...

`sim`: every instance of the fleet at once, as far as the scheduler sees them: it takes each
`PrefillTask` and `DecodeTask` (`pdd.prefill.*.task`, `pdd.decode.*.task`) and acks it at once,
`Ack(request_id)` as prefill and the decoders do when they accept a task, and counts the drops
and aborts. Several sims share the subjects in one queue group. On SIGTERM it writes its counts.

`client`: the gateway's side of `pdd.scheduler.submit`, from many concurrent requests:
1. Each prompt's `Submit` is encoded once, its request id a fixed-width placeholder that each
   send replaces (msgpack's string header keeps its length), so the client's own CPU goes to
   sending, not encoding 4k-token prompts.
2. Submits are published with a reply subject of the client's own (`_INBOX.fleet.<id>.<n>`), so
   every scheduler's answer is seen: the first completes the request, any later one is counted
   as a duplicate (several schedulers that each plan every request).
3. `closed`: `concurrency` requests in flight, each sent when the last returned; `open`: sent at
   `rate` per second whatever the answers. Only requests sent in the `duration` after `warmup`
   count; latency is from the publish to the first reply, on this client's clock.
4. A planned request's record (`pdd:request:<id>`) is deleted `request_s` after its plan, as
   the gateway does when the request ends, so Redis holds about as many as a live fleet would.
5. The answers are decoded after the run and written as plain lists (the bench pools them).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import secrets
import signal
import time
from pathlib import Path

import msgpack
import nats

from shared import subjects
from shared.messages import Ack, Plan, Sampling, Submit
from shared.registry import REQUEST, connect

PLACEHOLDER = "fleet-XXXX-XX-XXXXXXXXX"  # the width of every request id: fleet-<run>-<client>-<number>
MAX_TOKENS = (64, 128, 256, 512, 1024)


def request_id(run: str, client: int, n: int) -> str:
    """Unique across runs (`run`: 4 hex digits of each client process's own): a scheduler
    answers an id it planned before with that plan, unplanned."""
    return f"fleet-{run}-{client:02d}-{n:09d}"


# -- the simulated instances ------------------------------------------------------------------
async def simulate(url: str, out: Path) -> None:
    nc = await nats.connect(url, name="fleet-sim")
    counts: collections.Counter[str] = collections.Counter()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    def acker(kind: str):
        async def on_task(msg) -> None:
            counts[kind] += 1
            await msg.respond(Ack(msgpack.unpackb(msg.data)["request_id"]).encode())

        return on_task

    def counter(kind: str):
        async def on_msg(_) -> None:
            counts[kind] += 1

        return on_msg

    await nc.subscribe(subjects.prefill_task("*"), queue="fleet-sim", cb=acker("prefill_tasks"))
    await nc.subscribe(subjects.decode_task("*"), queue="fleet-sim", cb=acker("decode_tasks"))
    await nc.subscribe(subjects.prefill_drop("*"), queue="fleet-sim", cb=counter("prefill_drops"))
    await nc.subscribe(subjects.decode_drop("*"), queue="fleet-sim", cb=counter("decode_drops"))
    await nc.subscribe(subjects.ABORT, queue="fleet-sim", cb=counter("aborts"))
    await nc.flush()
    await nc.flush()  # the second PING follows the SUBs out (shared/bus.py `sync`)
    out.with_suffix(".ready").touch()
    await stop.wait()
    await nc.drain()
    out.write_text(json.dumps(dict(counts)))


# -- the load -------------------------------------------------------------------------------
class Load:
    """One client process's requests: sent, answered, and what each answer said."""

    def __init__(self, nc, client: int, templates: list[bytes], request_s: float, redis_url: str) -> None:
        self.nc, self.client, self.templates = nc, client, templates
        self.inbox = f"_INBOX.fleet.{client}"
        self.run = secrets.token_hex(2)
        self.pending: dict[int, tuple[float, asyncio.Future]] = {}
        self.answered: set[int] = set()
        self.counted: set[int] = set()  # requests sent in the window
        self.duplicates = 0
        self.results: list[tuple[float, float, bytes]] = []  # (sent, latency s, the plan) in the window
        self.window = (0.0, 0.0)
        self.cpu_s = 0.0  # this process's CPU over the window
        self.sent = self.timeouts = 0
        self.n = 0
        self.rng = random.Random(client)
        self.redis = connect(redis_url)
        self.request_s = request_s
        self.planned: collections.deque[tuple[float, str]] = collections.deque()

    async def start(self) -> None:
        await self.nc.subscribe(self.inbox + ".*", cb=self._on_reply)
        await self.nc.flush()

    async def _on_reply(self, msg) -> None:
        n = int(msg.subject.rsplit(".", 1)[1])
        if n in self.answered:
            self.duplicates += n in self.counted  # another scheduler's answer to a request in the window
            return
        self.answered.add(n)
        entry = self.pending.pop(n, None)
        if entry and not entry[1].done():
            entry[1].set_result((time.perf_counter(), msg.data))

    async def one(self, timeout: float) -> None:
        n, self.n = self.n, self.n + 1
        rid = request_id(self.run, self.client, n)
        payload = self.rng.choice(self.templates).replace(PLACEHOLDER.encode(), rid.encode())
        future = asyncio.get_running_loop().create_future()
        sent = time.perf_counter()
        self.pending[n] = (sent, future)
        counted = self.window[0] <= sent < self.window[1]
        if counted:
            self.counted.add(n)
            self.sent += 1
        await self.nc.publish(subjects.SUBMIT, payload, reply=f"{self.inbox}.{n}")
        try:
            at, data = await asyncio.wait_for(future, timeout)
        except TimeoutError:
            self.pending.pop(n, None)
            self.timeouts += counted
            return
        self.planned.append((time.monotonic(), rid))
        if counted:
            self.results.append((sent, at - sent, data))

    async def closed(self, concurrency: int, until: float, timeout: float) -> None:
        async def worker() -> None:
            while time.perf_counter() < until:
                await self.one(timeout)

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    async def open(self, rate: float, until: float, timeout: float) -> None:
        tasks, start, i = set(), time.perf_counter(), 0
        while (at := start + i / rate) < until:
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            task = asyncio.create_task(self.one(timeout))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
        await asyncio.gather(*tasks)

    async def meter(self) -> None:
        await asyncio.sleep(max(0.0, self.window[0] - time.perf_counter()))
        start = time.process_time()
        await asyncio.sleep(max(0.0, self.window[1] - time.perf_counter()))
        self.cpu_s = time.process_time() - start

    async def end_requests(self, every_s: float = 0.5) -> None:
        """Delete the records of requests planned `request_s` ago (the gateway, at their end)."""
        while True:
            await asyncio.sleep(every_s)
            await self.flush_records(time.monotonic() - self.request_s)

    async def flush_records(self, before: float) -> None:
        done = []
        while self.planned and self.planned[0][0] <= before:
            done.append(REQUEST + self.planned.popleft()[1])
        if done:
            await self.redis.delete(*done)

    def summary(self) -> dict:
        latency, queue, errors, pipelines, first_error = [], [], collections.Counter(), collections.Counter(), ""
        for _, seconds, data in self.results:
            plan = Plan.decode(data)
            if plan.error:
                errors[str(plan.status)] += 1
                first_error = first_error or plan.error
                continue
            latency.append(seconds * 1000)
            queue.append(plan.queue_ms)
            pipelines[plan.pipeline] += 1
        return {
            "client": self.client,
            "window_s": self.window[1] - self.window[0],
            "sent": self.sent,
            "planned": len(latency),
            "errors": dict(errors),
            "first_error": first_error,
            "timeouts": self.timeouts,
            "cpu_s": self.cpu_s,
            "duplicates": self.duplicates,
            "pipelines": dict(pipelines),
            "latency_ms": latency,
            "queue_ms": queue,
        }


def templates(prompts: list[list[int]], seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [Submit(PLACEHOLDER, p, Sampling(max_tokens=rng.choice(MAX_TOKENS))).encode() for p in prompts]


async def drive(a: argparse.Namespace) -> None:
    prompts = msgpack.unpackb(Path(a.prompts).read_bytes())
    nc = await nats.connect(a.nats, name=f"fleet-client-{a.client}", pending_size=64 * 1024 * 1024)
    load = Load(nc, a.client, templates(prompts, a.client), a.request_s, a.redis)
    await load.start()
    ender = asyncio.create_task(load.end_requests())
    await asyncio.sleep(max(0.0, a.start_at - time.time()))  # every client starts together
    t0 = time.perf_counter()
    load.window = (t0 + a.warmup, t0 + a.warmup + a.duration)
    meter = asyncio.create_task(load.meter())
    if a.mode == "closed":
        await load.closed(a.concurrency, load.window[1], a.timeout)
    else:
        await load.open(a.rate, load.window[1], a.timeout)
    await meter
    await asyncio.sleep(0.2)  # a second scheduler's late answers are still counted
    ender.cancel()
    await load.flush_records(float("inf"))
    await load.redis.aclose()
    await nc.drain()
    Path(a.out).write_text(json.dumps(load.summary()))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["sim", "client"])
    p.add_argument("--nats", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--redis", default="")
    p.add_argument("--prompts", default="")
    p.add_argument("--client", type=int, default=0)
    p.add_argument("--mode", choices=["closed", "open"], default="closed")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rate", type=float, default=100.0)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--request-s", type=float, default=10.0)
    p.add_argument("--start-at", type=float, default=0.0)
    a = p.parse_args(argv)
    asyncio.run(simulate(a.nats, Path(a.out)) if a.what == "sim" else drive(a))


if __name__ == "__main__":
    main()
