"""One request's life in the gateway, from submit to the last text delta.

1. Subscribe to `pdd.tokens.<id>.<key>` first (a key minted per attempt, which the plan gives
   to its stages alone: no other instance can publish into the stream), so no token can be
   missed, then submit to the schedulers (request-reply with a timeout, asked twice: the one
   that had it may have died). An error plan becomes an HTTP error. A submission the gateway
   stops waiting for (timeout, client gone) is aborted: it may still be dispatched. The stages
   know a request by its id in its key's namespace (`auth.scoped_request_id`). A request id the
   schedulers planned already gets that plan back, so a client that lost its gateway and sends
   the same request to another with the same `X-Request-Id` and key is picked up where it is
   (under the plan's stream key; the decoders send the tokens it missed, as for a lost chunk,
   below) or, when they no longer hold it, moved (5.).
2. Token chunks arrive from whichever decoder holds the request (relay, then main); they are
   put in index order and de-duplicated, detokenized incrementally, and cut at stop strings.
3. The stream ends when the final chunk and every token before it have arrived; the last
   delta carries finish_reason and the `pdd` object.
4. Core NATS is at-most-once (a leaf reconnect, a NATS restart, a slow consumer lose messages):
   when the next token has not come within a bound set by the request's step time and the
   line's round trip (a later one may have: a gap), the plan's decoders are asked for what they
   sent from that index on (`Resend`); their answers join the stream like any chunk. A holder
   that answers it holds nothing of the request lost it: the request moves, as below.
5. While no token comes, the instances that may still be needed are checked each second; if
   one died (its heartbeat expired), the request moves: the attempt is aborted and prompt +
   tokens so far are resubmitted avoiding the dead instance (recompute, up to
   `max_migrations`); the stream continues at the next index. So does a request whose KV could
   not be delivered to its decoder (the error names it: `blame`). If every survivor is full
   (429), the move retries with backoff rather than failing a stream already admitted.
6. `close()` always runs: it unsubscribes, deletes the request state in Redis, and — if the
   request did not finish (client gone, error, stop string hit early) — broadcasts an abort so
   every stage frees what it holds. Cleanup is shielded from the caller's cancellation. A
   request that finished sends its prompt and answer to its prefill instead (`Warm`,
   `warm_prefill`): the session's next turn finds the answer in prefill's cache.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from services.gateway.auth import Key, scoped_request_id
from services.gateway.detokenize import IncrementalDetokenizer, StopChecker
from services.gateway.errors import APIError
from services.gateway.gaps import GapWatch
from services.gateway.openai_api import ParsedRequest
from services.gateway.pdd_object import FlowStats, build_pdd
from services.gateway.reassembly import TokenReassembler
from shared import subjects
from shared.bus import BusTimeout
from shared.messages import Abort, Logprob, Plan, Resend, Resent, Sampling, Submit, TokenChunk, Warm
from shared.pipelines import Role

log = logging.getLogger(__name__)
SUBMIT_RETRY_S = 0.5  # before asking again: "no responders" while a NATS server fails over comes at once


class StreamError(Exception):
    """The request failed after it was admitted (a stage reported an error, or a timeout)."""


@dataclass
class Delta:
    text: str
    finish_reason: str | None = None
    pdd: dict[str, Any] | None = None
    # the tokens this delta's text came from, each with its logprobs (requests that asked for them)
    logprobs: list[tuple[int, Logprob | None]] = field(default_factory=list)


class RequestFlow:
    def __init__(self, gateway, parsed: ParsedRequest, key: Key, request_id: str = "") -> None:
        self.gw = gateway
        self.parsed = parsed
        self.key = key  # who asked: their limits, their tenant's cache salt, what of `pdd` they see
        # the client's id (its headers and bodies); the stages know it in its key's namespace
        self.request_id = request_id or ("chatcmpl-" if parsed.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.scoped_id = scoped_request_id(key, self.request_id)
        self.created = int(time.time())  # one value for every chunk of the response
        self.attempt_id = self.scoped_id  # the id the stages know; a migration starts a new one
        self.stream_key = ""  # the attempt's token stream's (subjects.tokens)
        self.offset = 0  # client index of the current attempt's token 0
        self.generated: list[int] = []  # tokens the client has, in order
        self.holders: set[str] = set()  # instances that may still be needed to finish it
        self.avoid: set[str] = set()  # instances this request failed on: not planned again ...
        self.vanished: set[str] = set()  # ... unless it only dropped out of the registry and is back
        self.plan: Plan | None = None
        self.stats = FlowStats()
        self.finished = False  # every stage is done with it (else close() aborts it everywhere)
        self.finish_reason: str | None = None  # what the client was told: stop, length
        self.error = ""  # why it failed after admission (set by the HTTP layer that reports it)
        self._queue: asyncio.Queue[TokenChunk] = asyncio.Queue()
        self._sub = None
        self._reassembler = TokenReassembler()
        self._logprobs: dict[int, Logprob] = {}  # client index -> its token's logprobs, until it is returned
        self._gap: GapWatch | None = None  # when a chunk is presumed lost (set as the stream starts)
        self._checked_at = 0.0  # when the holders' heartbeats were last checked
        self._asks: set[asyncio.Task] = set()

    # -- 1. submit ------------------------------------------------------------------------
    async def start(self) -> None:
        await self._submit(self.parsed.prompt_ids, self.parsed.sampling, self.parsed.pipeline)

    async def _submit(self, prompt_ids: list[int], sampling: Sampling, pipeline: str | None) -> None:
        self.stream_key = secrets.token_urlsafe(16)
        await self._listen()
        try:
            self.plan = await self._plan(
                Submit(
                    self.attempt_id,
                    prompt_ids=prompt_ids,
                    sampling=sampling,
                    pipeline=pipeline,
                    handoff=self.parsed.handoff,
                    avoid=sorted(self.avoid),
                    cache_salt=self.gw.cache_salt(self.key),
                    kv_wire=self.parsed.kv_wire,
                    ttft_slo_ms=self.parsed.ttft_slo_ms,
                    stream_key=self.stream_key,
                )
            )
            if self.plan.stream_key and self.plan.stream_key != self.stream_key:  # planned before, elsewhere
                self.stream_key = self.plan.stream_key  # what it missed meanwhile comes as a gap's resend
                await self._sub.unsubscribe()
                await self._listen()
        except BaseException:
            await self._sub.unsubscribe()
            self._sub = None
            raise
        self.holders = {i for i in (self.plan.prefill, self.plan.rld, self.plan.md) if i}

    async def _listen(self) -> None:
        subject = subjects.tokens(self.attempt_id, self.stream_key)
        self._sub = await self.gw.bus.subscribe(subject, TokenChunk, self._queue.put_nowait)

    async def _plan(self, submit: Submit) -> Plan:
        """The plan, asked of the schedulers' queue group; asked once more when no answer came
        within a control round (the scheduler that had it may have died: another takes its claim
        over once its presence expired and plans it; a live one that is only slow answers the
        second ask with its plan), then waited for up to three rounds (a plan around a dead
        instance takes up to three)."""
        control_s = self.gw.cfg.timeouts.control_s
        try:
            for attempt, timeout in enumerate((control_s, 3 * control_s)):
                try:
                    plan = await self.gw.bus.request(subjects.SUBMIT, submit, Plan, timeout)
                    break
                except BusTimeout as e:
                    if attempt == 1:
                        await self._abandon(submit.request_id)
                        raise APIError(503, f"scheduler unavailable: {e}", type="service_unavailable") from None
                    log.warning("%s: no plan yet (%s); submitting it again", submit.request_id, e)
                    await asyncio.sleep(SUBMIT_RETRY_S)
        except asyncio.CancelledError:  # the client left while its request was being planned
            await asyncio.shield(self._abandon(submit.request_id))
            raise
        if plan.status == 429:  # a stage's bounded queue is full everywhere: come back shortly
            raise APIError(429, plan.error, type="rate_limit_error", code="overloaded")
        if plan.error:
            raise APIError(plan.status, plan.error, type="service_unavailable")
        return plan

    async def _abandon(self, attempt_id: str) -> None:
        """The scheduler may still dispatch a submission the gateway stopped waiting for: abort it
        (a stage refuses a task after its abort, or drops it) and forget its record."""
        await self.gw.bus.publish(subjects.ABORT, Abort(attempt_id, reason="the gateway stopped waiting for its plan"))
        await self.gw.forget_request(attempt_id)

    # -- 2./3. tokens -> text ---------------------------------------------------------------
    async def deltas(self) -> AsyncIterator[Delta]:
        reassembler = self._reassembler
        wan = self.gw.cfg.wan
        self._gap = GapWatch(self.stats.token_gaps, 2 * (wan.delay_ms + wan.jitter_ms) / 1000, time.perf_counter())
        detok = IncrementalDetokenizer(self.gw.tokenizer)
        stops = StopChecker(list(self.parsed.sampling.stop))
        end: int | None = None  # client index just past the final token, once known
        final_reason = None
        told: list[tuple[int, Logprob | None]] = []  # tokens whose logprobs go with the next delta
        while end is None or reassembler.next_index < end:
            chunk = await self._next_chunk()
            self._recover_gap()
            if chunk is None or chunk.request_id != self.attempt_id:
                continue  # a liveness tick, or a late chunk of an abandoned attempt
            if chunk.role == Role.PREFILL and chunk.dispatch_id != self.plan.dispatch_id:
                continue  # from a copy the scheduler dropped and planned again (elsewhere, or here anew)
            if problem := self._not_ours(chunk):
                self.stats.refused_chunks += 1
                log.warning("%s: chunk refused: %s", self.request_id, problem)
                continue
            if chunk.error:
                if chunk.blame and self.stats.migrations < self.gw.cfg.max_migrations:
                    await self._migrate({chunk.blame})  # e.g. its KV could not reach that decoder (died?)
                    continue
                raise StreamError(chunk.error)
            self._count(chunk)
            if chunk.finish_reason is not None:
                end, final_reason = self.offset + chunk.index + len(chunk.token_ids), chunk.finish_reason
            at = reassembler.next_index
            self._keep_logprobs(chunk)
            new = reassembler.add(self.offset + chunk.index, chunk.token_ids)
            if self.parsed.sampling.logprobs is not None:
                told += [(t, self._logprobs.pop(at + i, None)) for i, t in enumerate(new)]
            if new:
                self._gap.advanced(time.perf_counter())
                self.generated += new
                self._record_tokens(len(new), chunk.role)
                piece = detok.add(new)  # stop strings count only from min_tokens on, as in the engine
                armed = len(self.generated) >= self.parsed.sampling.min_tokens
                text, hit = stops.add(piece) if armed else (piece, False)
                if hit:  # the decoders may still be running: close() aborts them
                    self.finish_reason = "stop"
                    yield Delta(text, "stop", self._pdd(), told)
                    return
                if text:
                    yield Delta(text, logprobs=told)
                    told = []
        text, hit = stops.add(detok.flush())
        self.finished = True
        self.finish_reason = "stop" if hit else final_reason
        yield Delta(text + stops.flush(), self.finish_reason, self._pdd(), told)

    def _not_ours(self, chunk: TokenChunk) -> str:
        """Why a chunk cannot be part of this stream ("" when it can): from an instance the plan
        does not name, past the request's token budget (the reorder buffer stays bounded), or with
        ids outside the vocabulary. It is dropped; the stream goes on."""
        plan = self.plan
        if chunk.instance_id not in {plan.prefill, plan.rld, plan.md} - {""}:
            return f"from {chunk.instance_id!r}, which the plan does not name"
        if not 0 <= chunk.index or self.offset + chunk.index + len(chunk.token_ids) > self.parsed.sampling.max_tokens:
            return (
                f"tokens [{chunk.index}, +{len(chunk.token_ids)}) past the budget of {self.parsed.sampling.max_tokens}"
            )
        if chunk.token_ids and not 0 <= min(chunk.token_ids) <= max(chunk.token_ids) < self.gw.vocab_size:
            return f"a token id outside the vocabulary of {self.gw.vocab_size}"
        return ""

    def _keep_logprobs(self, chunk: TokenChunk) -> None:
        """A chunk's logprobs, by client index, for the positions not returned yet (the first copy
        of a position wins, as its token does), within the request's budget."""
        if chunk.logprobs is None or self.parsed.sampling.logprobs is None:
            return
        start, limit = self.offset + chunk.index, self.parsed.sampling.max_tokens  # client indices
        for pos, lp in enumerate(chunk.logprobs, start):
            if self._reassembler.next_index <= pos < limit:
                self._logprobs.setdefault(pos, lp)

    @property
    def outcome(self) -> str:
        """How it ended for the client: finished (told a finish reason), error, or aborted (gone)."""
        return "finished" if self.finish_reason else "error" if self.error else "aborted"

    async def _next_chunk(self) -> TokenChunk | None:
        """The next chunk, or None after a quiet moment (at most a second, less when a gap is
        due to be asked about); each quiet second the holders are checked (and the request
        moved if one of them died)."""
        limit = self.gw.cfg.timeouts.request_s
        due = self._gap.due(time.perf_counter())
        try:
            return await asyncio.wait_for(self._queue.get(), min(1.0, max(0.05, due)))
        except TimeoutError:
            pass
        now = time.perf_counter()
        if now - self.stats.last_progress > limit:
            raise StreamError(f"no token for {limit:.0f}s")
        if now - self._checked_at >= 1.0:
            self._checked_at = now
            dead = self.holders - await self.gw.alive_ids()
            if dead:
                self.vanished |= dead
                await self._migrate(dead)
        return None

    # -- 4. a lost chunk: ask again ---------------------------------------------------------
    def _recover_gap(self) -> None:
        """Ask the plan's decoders for everything from the first missing index, once the next
        token is late (services/gateway/gaps.py). Asked without waiting: the answers come back
        on the chunk queue."""
        if self.plan is None or not self._gap.ask_now(time.perf_counter()):
            return
        index = self._reassembler.next_index - self.offset
        for iid in {i for i in (self.plan.rld, self.plan.md) if i}:
            task = asyncio.create_task(self._ask(iid, self.attempt_id, index))
            self._asks.add(task)
            task.add_done_callback(self._asks.discard)

    async def _ask(self, instance_id: str, attempt_id: str, index: int) -> None:
        timeout = self.gw.cfg.timeouts.control_s
        try:
            reply = await self.gw.bus.request(
                subjects.decode_resend(instance_id), Resend(attempt_id, index), Resent, timeout
            )
        except Exception as e:  # dead or unreachable: the heartbeat check moves the request
            log.info("%s: %s did not answer a resend: %s", attempt_id, instance_id, e)
            return
        chunk = reply.chunk
        if reply.held and chunk is not None and (chunk.token_ids or chunk.finish_reason is not None or chunk.error):
            self.stats.resends += 1
            self._queue.put_nowait(chunk)
        elif not reply.held and instance_id in self.holders and attempt_id == self.attempt_id:
            error = f"{instance_id} no longer holds the request"  # e.g. it was told to forget it
            self._queue.put_nowait(
                TokenChunk(attempt_id, 0, [], instance_id=instance_id, error=error, blame=instance_id)
            )

    # -- 5. an instance died: recompute elsewhere -------------------------------------------
    async def _migrate(self, dead: set[str]) -> None:
        """Abandon the attempt and resend prompt + generated tokens to other instances; their
        KV is recomputed (prefix caches help) and the stream goes on at the next index."""
        if self.stats.migrations >= self.gw.cfg.max_migrations:
            raise StreamError(f"{', '.join(sorted(dead))} failed and the migration limit is reached")
        self.stats.migrations += 1
        self.avoid |= dead
        await self.gw.bus.publish(subjects.ABORT, Abort(self.attempt_id, reason=f"{sorted(dead)} failed"))
        await self._sub.unsubscribe()
        await self.gw.forget_request(self.attempt_id)
        # the prompt ends with the output so far: penalties, seeds and the grammar count it as output
        done = len(self.generated)
        sampling = replace(self.parsed.sampling, max_tokens=self.parsed.sampling.max_tokens - done, resumed=done)
        self.offset = len(self.generated)
        self._logprobs.clear()  # the next attempt samples the positions not yet returned anew
        self.stats.last_progress = time.perf_counter()
        cfg = self.gw.cfg
        now = time.perf_counter()
        # how long an admitted stream waits: for room (429) while the request may live; for a
        # live instance of a role (503) while one may be coming back (its bus reconnecting, a
        # restart registering), two heartbeat TTLs and a control round
        deadline = {429: now + cfg.timeouts.request_s, 503: now + 2 * cfg.heartbeat_ttl_s + cfg.timeouts.control_s}
        wait_s = 0.1
        pipeline = self.parsed.pipeline  # a forced plan is kept while it can be served at all
        for retry in itertools.count():
            self.attempt_id = f"{self.scoped_id}.m{self.stats.migrations}" + (f".r{retry}" if retry else "")
            try:
                # the policy replans among the survivors (p-rld when no main-decode is reachable)
                await self._submit(self.parsed.prompt_ids + self.generated, sampling, pipeline)
                return
            except APIError as e:
                if e.status == 503 and pipeline is not None:  # the forced plan lost its role: any plan
                    pipeline = None
                    continue
                if e.status not in deadline or time.perf_counter() + wait_s > deadline[e.status]:
                    raise StreamError(f"could not move the request after {sorted(dead)} failed: {e.message}") from None
                if e.status == 503:  # a holder whose heartbeats only paused (its bus reconnected) is fine again
                    self.avoid -= self.vanished & await self.gw.alive_ids()
            await asyncio.sleep(wait_s)
            wait_s = min(wait_s * 2, 2.0)

    def _count(self, chunk: TokenChunk) -> None:
        s = self.stats
        s.last_progress = time.perf_counter()
        if chunk.token_ids and chunk.role == Role.RLD:
            s.last_rld_at = time.perf_counter()
            self.holders.discard(self.plan.prefill)
        elif chunk.token_ids and chunk.role == Role.MD:
            self.holders -= {self.plan.prefill, self.plan.rld}  # handed over: only md is needed now
            if s.last_rld_at and not s.handoff_gap_s:
                s.handoff_gap_s = time.perf_counter() - s.last_rld_at
        if chunk.stats is not None:
            self.stats.decoder_stats.merge(chunk.stats)

    def _record_tokens(self, n: int, role: Role | None, now: float | None = None) -> None:
        s, now = self.stats, time.perf_counter() if now is None else now
        if not s.first_token_at:
            s.first_token_at = now
        else:  # n tokens in one chunk share its gap: none of them came 0 s after another
            s.token_gaps.extend([(now - s.last_token_at) / n] * n)
        s.last_token_at = now
        s.token_marks.extend([(now - s.arrived, role)] * n)
        s.completion_tokens += n
        if role in s.tokens_by_role:  # new tokens only: one asked for again and sent twice counts once
            s.tokens_by_role[role] += n

    def _pdd(self) -> dict[str, Any]:
        return build_pdd(self.request_id, self.plan, self.stats)

    # -- 6. cleanup ---------------------------------------------------------------------------
    async def close(self) -> None:
        await asyncio.shield(self._cleanup())

    async def _cleanup(self) -> None:
        for task in list(self._asks):
            task.cancel()
        if self._sub is not None:
            await self._sub.unsubscribe()
        if not self.finished and self.plan is not None:
            await self.gw.bus.publish(subjects.ABORT, Abort(self.attempt_id))
        elif self.finished and self.gw.cfg.warm_prefill and self.plan.prefill:  # the next turn holds this answer
            warm = Warm(self.attempt_id, self.parsed.prompt_ids + self.generated, self.gw.cache_salt(self.key))
            await self.gw.bus.publish(subjects.prefill_warm(self.plan.prefill), warm)
        await self.gw.forget_request(self.attempt_id)
