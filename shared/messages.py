"""Control-plane messages (msgpack), named for what they ask of their receiver.

Messages carry ids and changes, never KV (KV travels on the TCP plane, see kv_transport).
Every message is a dataclass; `encode()` gives msgpack bytes and `Cls.decode(data)` rebuilds it.
Decoding checks every field against its annotation (nested messages included) and raises
`BadMessage` naming the field, so a malformed message fails only its own handler; unknown
fields are ignored, so a newer sender does not break an older receiver.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from functools import cache
from typing import Any, TypeVar

import msgpack

from shared.model_info import WireFormat
from shared.pipelines import Role

M = TypeVar("M", bound="Message")


class BadMessage(ValueError):
    pass


class Message:
    def encode(self) -> bytes:
        return msgpack.packb(_plain(self), use_bin_type=True)

    @classmethod
    def decode(cls: type[M], data: bytes) -> M:
        try:
            raw = msgpack.unpackb(data, raw=False)
        except Exception as e:  # msgpack raises several types for garbage
            raise BadMessage(f"{cls.__name__}: not msgpack ({type(e).__name__})") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls: type[M], raw: Any) -> M:
        if not isinstance(raw, dict):
            raise BadMessage(f"{cls.__name__}: expected a map, got {type(raw).__name__}")
        kwargs = {name: check(raw[name], where) for name, check, where in _field_checks(cls) if name in raw}
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:  # a required field missing, or __post_init__ refused it
            raise BadMessage(f"{cls.__name__}: {e}") from None


_SCALARS = frozenset({int, float, str, bool, bytes, type(None)})


def _plain(value: Any) -> Any:
    """`dataclasses.asdict` without its deep copies: a list of numbers or strings (a prompt's
    token ids, in every task the scheduler sends) goes to msgpack as it is."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if (names := _field_names(kind)) is not None:
        return {name: _plain(getattr(value, name)) for name in names}
    if kind is list:
        return value if not value or type(value[0]) in _SCALARS else [_plain(v) for v in value]
    if kind is dict:
        return {k: _plain(v) for k, v in value.items()}
    if kind is tuple:
        return [_plain(v) for v in value]
    return value  # an Enum (str or int) packs as its value


@cache
def _field_names(cls: type) -> tuple[str, ...] | None:
    """A dataclass's field names; None for any other type."""
    return tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else None


Check = Callable[[Any, str], Any]


@cache
def _field_checks(cls: type) -> tuple[tuple[str, Check, str], ...]:
    """Each field's name, its check and where a failure says it is: made once per class."""
    names = {f.name for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    return tuple((k, _checker(v), f"{cls.__name__}.{k}") for k, v in hints.items() if k in names)


@cache
def _checker(tp: Any) -> Check:
    """The check of one annotation, made once: `check(value, where)` is `value` as `tp` wants it,
    or BadMessage. A message's decode calls one closure per field instead of taking its
    annotation apart each time (the scheduler decodes every Submit it plans)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return lambda value, where: value
    if origin in (types.UnionType, typing.Union):
        inner = _checker(next(a for a in args if a is not type(None)))
        if type(None) not in args:
            return inner
        return lambda value, where: None if value is None else inner(value, where)
    if origin is list:
        return _list_checker(args[0])
    if origin is dict:
        key, item = _checker(args[0]), _checker(args[1])

        def check_dict(value: Any, where: str) -> dict:
            if not isinstance(value, dict):
                raise BadMessage(f"{where}: expected a map, got {type(value).__name__}")
            return {key(k, where): item(v, f"{where}.{k}") for k, v in value.items()}

        return check_dict
    if isinstance(tp, type) and issubclass(tp, Message):
        return lambda value, where: tp.from_dict(value)
    if isinstance(tp, type) and issubclass(tp, Enum):

        def check_enum(value: Any, where: str) -> Enum:
            try:
                return tp(value)
            except ValueError:
                raise BadMessage(f"{where}: {value!r} is not one of {', '.join(str(m.value) for m in tp)}") from None

        return check_enum
    if tp is float:

        def check_float(value: Any, where: str) -> float:
            if type(value) is float or isinstance(value, int | float) and not isinstance(value, bool):
                return float(value)
            raise BadMessage(f"{where}: expected float, got {type(value).__name__}")

        return check_float

    def check_plain(value: Any, where: str) -> Any:
        if tp is int and isinstance(value, bool) or not isinstance(value, tp):
            raise BadMessage(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
        return value

    return check_plain


def _list_checker(item_type: Any) -> Check:
    item = _checker(item_type)
    # token ids (a prompt's thousands of them): the set of the items' types, in C, not a call each
    exactly = frozenset({item_type}) if item_type in (int, str) else None

    def check_list(value: Any, where: str) -> list:
        if not isinstance(value, list):
            raise BadMessage(f"{where}: expected a list, got {type(value).__name__}")
        if exactly is not None and set(map(type, value)) <= exactly:
            return value
        return [item(v, f"{where}[]") for v in value]

    return check_list


# -- requests -------------------------------------------------------------------------------
MAX_TTFT_SLO_MS = 3_600_000.0  # a request's own TTFT SLO: at most an hour (NaN fails the range too)
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_GRAMMAR_CHARS = 128 * 1024  # a grammar travels in every task of its request (NATS payloads: 1 MiB)


@dataclass
class Sampling(Message):
    """A request's sampling parameters: what the gateway parses, the tasks carry and the engine
    samples with (shared/runtime/sampling.py). `problem()` is its validation."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # OpenAI's: minus this once for every token already generated
    frequency_penalty: float = 0.0  # minus this times how often each token was generated
    repetition_penalty: float = 1.0  # vLLM's: logits of prompt and generated tokens divided (or multiplied) by it
    min_tokens: int = 0  # no EOS or stop token before this many tokens
    # log-probabilities of each sampled token, with this many most likely alternatives (None:
    # none wanted); from the model's raw logits, before penalties and temperature, as vLLM's
    logprobs: int | None = None
    # constrained decoding: llguidance's grammar (the gateway builds it from `response_format` or
    # `tools`; shared/runtime/grammar.py applies it); "" for none
    grammar: str = ""
    # how many of the prompt's last tokens are this request's own output: a migrated attempt's
    # prompt ends with what the client already has, and penalties, min_tokens, the seeded step
    # and the grammar count those tokens as generated, so the attempt goes on exactly
    resumed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.min_tokens
        )

    def problem(self, vocab_size: int, context_len: int) -> str:
        """What is out of range ("" when nothing): a stage refuses such a request, alone."""
        if not 1 <= self.max_tokens <= context_len:
            return f"max_tokens {self.max_tokens} not in [1, {context_len}]"
        if not (0.0 <= self.temperature <= 2.0 and 0.0 < self.top_p <= 1.0 and 0 <= self.top_k <= vocab_size):
            return f"sampling out of range: temperature {self.temperature}, top_p {self.top_p}, top_k {self.top_k}"
        if not (
            abs(self.presence_penalty) <= 2
            and abs(self.frequency_penalty) <= 2
            and 0 < self.repetition_penalty <= 2
            and 0 <= self.min_tokens <= self.max_tokens + self.resumed
        ):
            return "penalties or min_tokens out of range"
        if len(self.stop) > 16 or any(len(s) > 256 for s in self.stop):
            return "too many or too long stop strings"
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            return f"logprobs {self.logprobs} not in [0, {MAX_TOP_LOGPROBS}]"
        if len(self.grammar) > MAX_GRAMMAR_CHARS:
            return f"grammar of {len(self.grammar)} characters, more than {MAX_GRAMMAR_CHARS}"
        if not 0 <= self.resumed < context_len:
            return f"resumed {self.resumed} not in [0, {context_len})"
        return token_problem(self.stop_token_ids, vocab_size, "stop_token_ids", 1024)


def token_problem(ids: list[int], vocab_size: int, what: str, max_len: int) -> str:
    """Why `ids` cannot be fed to a model with `vocab_size` tokens ("" when they can): one id
    out of range would fail the forward of every sequence batched with it."""
    if len(ids) > max_len:
        return f"{what}: {len(ids)} tokens, more than {max_len}"
    if ids and not 0 <= min(ids) <= max(ids) < vocab_size:
        return f"{what}: token id out of [0, {vocab_size})"
    return ""


@dataclass
class Submit(Message):
    """gateway -> scheduler: plan and dispatch this request."""

    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    pipeline: str | None = None  # forced plan (an admin's `pdd` override), else the policy's choice
    handoff: str | None = None
    avoid: list[str] = field(default_factory=list)  # instances this request must not use (they died)
    cache_salt: str = ""  # the tenant's: its prompts share cached KV only with the same salt
    kv_wire: str | None = None  # forced WAN wire format (an admin's `pdd` override)
    ttft_slo_ms: float | None = None  # this request's TTFT SLO (an admin's `pdd` override), else the configured
    stream_key: str = ""  # the gateway's: its token stream's subject (subjects.tokens), for the planned stages only

    def __post_init__(self) -> None:
        if self.ttft_slo_ms is not None and not 0 < self.ttft_slo_ms <= MAX_TTFT_SLO_MS:
            raise ValueError(f"ttft_slo_ms {self.ttft_slo_ms!r} not in (0, {MAX_TTFT_SLO_MS}]")


@dataclass(frozen=True)
class PlanEstimates(Message):
    """The figures a plan's decision rested on (services/scheduler/policy.py): for the `pdd`
    object, the request record and the benchmarks."""

    ttft_ms: dict[str, float] = field(default_factory=dict)  # candidate pipeline -> estimated TTFT
    ttft_slo_ms: float = 0.0  # the SLO the estimates were held against
    wan_mbps: float = 0.0
    uncached_tokens: int = 0  # prompt_len - best prefill/MD hit
    backlog_tokens: int = 0  # tokens RLD produces before MD can take over (p-rld-md, relay-finishes)
    rld_busy: int = 0  # relay's busy count (policy.py `rld_busy`) when planned
    wan_backlog_bytes: float = 0.0  # KV on the line ahead of this request's, as the estimates counted it
    md_push_ms: float = 0.0  # main-decode's suffix: its KV's line time, and main-decode's extend of it (0: not weighed)
    md_extend_ms: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Plan(Message):
    """scheduler -> gateway: what was decided (or why not)."""

    request_id: str
    pipeline: str = ""
    handoff: str = "none"
    prefill: str = ""
    rld: str = ""
    md: str = ""
    md_cached_tokens: int = 0
    reason: str = ""  # why this pipeline (policy.py)
    handoff_reason: str = ""
    chunk_tokens: int = 0  # catch-up chunk size (0: the relay's configured default)
    kv_wire: WireFormat = WireFormat.NATIVE  # how KV crosses the WAN (shared/runtime/kv_wire.py)
    kv_wire_reason: str = ""
    md_computes_suffix: int = 0  # prompt tokens main-decode computes itself, none of their KV crossing (0: pushed)
    md_suffix_reason: str = ""  # why it does or does not (policy.py `choose_suffix`; "": nothing to weigh)
    estimates: PlanEstimates = field(default_factory=PlanEstimates)  # the figures the decision rested on
    # this dispatch of the request (fresh each time it is planned again under the same id): prefill
    # stamps its chunks with it, so the gateway tells the live copy's first token from a dropped one's
    dispatch_id: str = ""
    queue_ms: float = 0.0
    scheduler: str = ""  # which scheduler planned it (several may run)
    stream_key: str = ""  # the Submit's: where the stages publish its tokens (never shown to a client)
    error: str = ""
    status: int = 200  # HTTP status the gateway should use when error is set

    def instances(self) -> dict[Role, str]:
        """The instance of each role ("" for a role the plan does not use)."""
        return {role: getattr(self, role) for role in Role}


@dataclass
class KVTarget(Message):
    """Where prefill pushes KV: a decoder's advertised endpoint (across the WAN when `wan`)."""

    instance_id: str  # the TLS peer must prove to be this instance
    role: Role  # a decoder's: md or rld
    host: str
    port: int
    start: int = 0  # send positions [start, prompt_len): the decoder already holds [0, start)
    transfer_secret: str = ""  # what the decoder was told to expect (its DecodeTask's)
    wan: bool = False
    wire: WireFormat = WireFormat.NATIVE  # the KV's wire format on this link


@dataclass
class PrefillTask(Message):
    """scheduler -> prefill: compute the prompt's KV and push it to `targets`."""

    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    targets: list[KVTarget]
    plan: Plan
    cache_salt: str = ""


@dataclass
class DecodeTask(Message):
    """scheduler -> md / rld: expect this request's KV [kv_start, prompt) and decode it. Only a
    transfer carrying `transfer_secret` is accepted (the scheduler mints one per request and
    decoder)."""

    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    plan: Plan
    kv_start: int = 0
    transfer_secret: str = ""
    cache_salt: str = ""


@dataclass
class Ack(Message):
    request_id: str
    ok: bool = True
    error: str = ""
    busy: bool = False  # refused for lack of room, not a fault: the client may retry (429)


@dataclass
class Abort(Message):
    """anyone -> every stage (`pdd.abort`): the request is over; each stage lets go of it."""

    request_id: str
    reason: str = "client disconnected"
    # the request is over (it finished on the relay), but main-decode's copy of its prompt KV may
    # still land, into main-decode's prefix cache only: the session's next turn will hit it
    keep_kv: bool = False


@dataclass
class Drop(Message):
    """scheduler or prefill -> one instance (`pdd.decode.<id>.drop`, `pdd.prefill.<id>.drop`): let go
    of this copy only (its KV push failed, or the request was planned again elsewhere); the
    request goes on. A decoder that holds another copy (a re-plan's task came first) keeps it."""

    request_id: str
    reason: str = ""
    # the copy it abandons, by its transfer secret (a prefill copy: any of its targets'); empty: any copy
    transfer_secret: str = ""


@dataclass
class Warm(Message):
    """gateway -> the prefill that served a finished request (`pdd.prefill.<id>.warm`): its prompt
    and answer, as token ids; prefill computes the answer's KV into its prefix cache while idle,
    so the session's next turn finds it there (`ClusterConfig.warm_prefill`)."""

    request_id: str
    token_ids: list[int]
    cache_salt: str = ""  # the tenant's: the cache keeps tenants apart


# -- what a request measured ----------------------------------------------------------------
@dataclass
class RequestStats(Message):
    """What the stages measured for one request. Each stage fills its own fields; prefill's
    travel with the KV to every decoder, and the relay's travel with its final handoff chunk to
    main-decode, so copies overlap: `merge` keeps the larger figure of each field."""

    prefill_ms: float = 0.0  # prefill accepted the task -> its first token
    kv_local_ms: float = 0.0  # in-DC KV transfer (to the relay), first byte to last
    kv_wan_ms: float = 0.0  # KV over the WAN (to main-decode)
    extend_ms: float = 0.0  # main-decode computing the relay's tokens (all chunks)
    handoff_stop_ms: float = 0.0  # relay stopping its sequence for the final chunk
    local_kv_bytes: int = 0
    wan_kv_bytes: int = 0
    prefill_hit_tokens: int = 0  # prompt tokens found in each role's prefix cache
    rld_hit_tokens: int = 0
    md_hit_tokens: int = 0
    recomputed_tokens: int = 0  # planned prefix evicted from main-decode meanwhile
    handoff_chunks: int = 0
    streamed_kv_tokens: int = 0  # prompt tokens whose KV prefill pushed before its first token (`stream_kv`)

    def merge(self, other: RequestStats | None) -> RequestStats:
        if other is not None:
            for f in dataclasses.fields(self):
                setattr(self, f.name, max(getattr(self, f.name), getattr(other, f.name)))
        return self


@dataclass
class Logprob(Message):
    """A sampled token's log-probability and the most likely tokens at its position (the number a
    request asked for, most likely first), from the raw logits of the role that sampled it."""

    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.top_ids) != len(self.top_logprobs) or len(self.top_ids) > MAX_TOP_LOGPROBS:
            raise ValueError(f"{len(self.top_ids)} top ids for {len(self.top_logprobs)} logprobs")


@dataclass
class TokenChunk(Message):
    """decoder -> gateway: generated tokens [index, index + len(token_ids)), or the end."""

    request_id: str
    index: int
    token_ids: list[int]
    role: Role | None = None  # who sent it (None: the gateway's own, in process)
    instance_id: str = ""
    finish_reason: str | None = None
    error: str = ""
    stats: RequestStats | None = None  # set on the final chunk
    blame: str = ""  # with an error: the instance it came from (the gateway moves the request off it)
    dispatch_id: str = ""  # prefill's chunks: the plan's dispatch they belong to (`Plan.dispatch_id`)
    logprobs: list[Logprob] | None = None  # one per token id, when the request asked for them

    def __post_init__(self) -> None:
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"{len(self.logprobs)} logprobs for {len(self.token_ids)} tokens")


@dataclass
class Resend(Message):
    """gateway -> decoder: a chunk of this request did not come (core NATS is at-most-once): send
    again what you sent from `index` on (request-reply; a decoder keeps a finished request's
    tokens for a while, `shared/decoder.py`)."""

    request_id: str
    index: int


@dataclass
class Resent(Message):
    """decoder -> gateway: what it sent of the request from the asked index (its final chunk's
    finish reason, error and stats with it, once it ended), or `held=False`: it has nothing of it."""

    held: bool
    chunk: TokenChunk | None = None


# -- the handoff (services/rld/service.py sends, services/md/service.py receives) ------------
# A `p-rld-md` request runs on both decoders at once: the relay streams to the user while
# main-decode's copy of the prompt KV crosses the WAN; main-decode holds it as a *shadow*
# (computes KV, samples nothing). Then, token ids only, never KV:
#
#     md  -> rld   KVReady(request, md)        the shadow holds the prompt KV: hand over
#     rld -> md    HandoffChunk(start, ids)    catch-up only: a chunk of the relay's tokens, while
#                  <- Ack once extended        the relay keeps streaming; repeated until the gap
#                                              is at most `final_tokens`
#     rld -> md    HandoffChunk(..., final)    the relay stops; every token md lacks; acked at once
#                  <- Ack                      md samples from the next index on; the relay lets go
#
# One-shot is the final chunk alone. If a chunk cannot be delivered (md died or dropped its copy)
# the relay keeps the request and finishes it: the user's stream never breaks. When main-decode
# will never get the request (its KV push failed, or never came), `FinishOnRelay` tells the relay
# so; a request that ends on the relay tells md (an `Abort` with `keep_kv`) it is over: md lets the
# KV on its way land into its prefix cache (`handoff.warm_md_cache`) and drops the rest.
@dataclass
class KVReady(Message):
    """md -> rld: main-decode holds this request's prompt KV; hand the request over."""

    request_id: str
    md: str


@dataclass
class FinishOnRelay(Message):
    """prefill or md -> rld: main-decode will not get this request; the relay finishes it."""

    request_id: str
    reason: str = ""


@dataclass
class HandoffChunk(Message):
    """rld -> md: generated tokens [start_index, start_index + len(token_ids)), ids only.

    Main-decode recomputes their KV in one extend. A non-final chunk is acked once main-decode
    has caught up with it (relay keeps streaming meanwhile); the final chunk is acked at once,
    relay stops, and main-decode samples from `start_index + len(token_ids)` on — the sampling
    step that a seeded request needs is exactly that index.
    """

    request_id: str
    start_index: int
    token_ids: list[int]
    final: bool = False
    stats: RequestStats | None = None  # relay's figures, on the final chunk


# -- instances report to the registry (services/scheduler/registrar.py) ---------------------
@dataclass(frozen=True)
class EngineFigures(Message):
    """The engine's figures at a step boundary (shared/runtime/engine.py fills them): what
    heartbeats, metrics, `pdd status` and an `Inspect` read. The worker adds its measured pace
    (`step_ms`, `prefill_tok_s`, `busy_s`, `lent_steps`, `yielded_s`)."""

    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    cached_blocks: int = 0  # held only by the prefix cache (reusable)
    prefix_queried: int = 0  # prompt tokens of admitted sequences, and of those found cached
    prefix_hit: int = 0
    queued_tokens: int = 0  # known tokens not computed yet, decode steps aside
    mirror_bytes: int = 0  # the runner's contiguous KV mirror (capped)
    step_ms: float = 0.0
    prefill_tok_s: float = 0.0
    busy_s: float = 0.0
    lent_steps: int = 0  # steps run on idle neighbours' cores too (shared/cores.py)
    yielded_s: float = 0.0  # a decoder's waits for prompts computed on its host (shared/cores.py)


@dataclass(frozen=True)
class InstanceFigures(Message):
    """An instance's figures: its engine's at the last step boundary, and what the service holds."""

    engine: EngineFigures = field(default_factory=EngineFigures)
    held: int = 0  # requests the instance holds anything for
    tasks: int = 0  # its background tasks
    pending: int = 0  # decoders: tasks accepted whose KV has not landed (committed: they will run here)
    handing: int = 0  # relay: requests handing off now

    def report_to(self, info: InstanceInfo, sampled_at: float) -> None:
        """Fill a heartbeat's figures (the rest are for `pdd status`, metrics and `Inspect` only)."""
        e = self.engine
        info.running, info.waiting, info.pending, info.held = e.running, e.waiting, self.pending, self.held
        info.queued_tokens, info.step_ms, info.prefill_tok_s, info.busy_s = (
            e.queued_tokens,
            e.step_ms,
            e.prefill_tok_s,
            e.busy_s,
        )
        info.free_blocks, info.total_blocks, info.cached_blocks = e.free_blocks, e.total_blocks, e.cached_blocks
        info.updated_at = sampled_at


@dataclass
class InstanceInfo(Message):
    """An instance's heartbeat: who it is, where its KV listener is, and its load figures."""

    id: str
    role: Role
    dc: str
    kv_host: str = ""
    kv_port: int = 0
    dtype: str = "float32"
    block_size: int = 16
    running: int = 0
    waiting: int = 0
    pending: int = 0  # decoders: tasks accepted whose KV has not landed (they will run here)
    queued_tokens: int = 0  # prompt tokens accepted and not yet computed
    step_ms: float = 0.0  # measured step time (moving average); 0 = not measured yet
    prefill_tok_s: float = 0.0  # measured prefill throughput; 0 = not measured yet
    held: int = 0  # requests the instance holds anything for
    capacity: int = 0  # most it will hold (max_running + max_waiting); 0 = unbounded
    free_blocks: int = 0
    total_blocks: int = 0
    cached_blocks: int = 0  # held only by the prefix cache (reusable)
    busy_s: float = 0.0  # engine steps since start, in seconds (busy fraction = its rate)
    started_at: float = 0.0
    updated_at: float = 0.0  # when the figures were sampled (wall clock)
    pid: int = 0  # its process on its host (`pdd status`)


@dataclass
class Heartbeat(Message):
    """instance -> registrar: its figures, and the requests it has held for a while."""

    info: InstanceInfo
    holding: list[str] = field(default_factory=list)
    held_s: list[float] = field(default_factory=list)  # how long each of `holding` has been held (no clocks compared)
    missed_replies: int = 0  # heartbeats in a row whose reply did not come (the line to A may be down one way)


@dataclass
class HeartbeatReply(Message):
    resync_index: bool = False  # the index lost this instance's blocks (Redis restarted): send them all
    forget: list[str] = field(default_factory=list)  # of `holding`: requests that ended or moved elsewhere


@dataclass
class IndexEvent(Message):
    """A change to an instance's prefix cache, as vLLM's KV events: blocks by chained hash."""

    kind: str  # "stored" | "removed" | "cleared"
    hashes: list[str] = field(default_factory=list)
    # every hash here opens a chain (a prompt's first block, under the namespace's root): the
    # registry also indexes these by block, so a lookup asks only their holders, not every instance
    first: bool = False


@dataclass
class IndexUpdate(Message):
    """instance -> registrar: apply these events to the instance's block set, in order.
    `seq` counts the instance's updates: a gap tells the registrar one was lost."""

    instance_id: str
    events: list[IndexEvent]
    seq: int = 0


@dataclass
class Leave(Message):
    """instance -> registrar: shutting down; forget it now rather than when its heartbeat expires."""

    instance_id: str


# -- operators and tools --------------------------------------------------------------------
@dataclass
class Inspect(Message):
    instance_id: str = ""


@dataclass
class InstanceState(Message):
    """instance -> operators and tests (`pdd.inspect.<id>`, and after a flush): what it holds now."""

    instance_id: str
    role: Role
    requests: list[str] = field(default_factory=list)  # ids this instance still holds anything for
    free_blocks: int = 0
    total_blocks: int = 0
    figures: InstanceFigures = field(default_factory=InstanceFigures)
    task_names: list[str] = field(default_factory=list)  # its background tasks' coroutines, sorted
    # sizes of its per-request maps (empty when idle) and capped memories of ids, and `bus_handlers`:
    # handlers at work besides the one answering
    state: dict[str, int] = field(default_factory=dict)


@dataclass
class ClusterStatus(Message):
    """scheduler -> operators (`pdd status`, the dashboard): what the registry knows now."""

    instances: list[InstanceInfo] = field(default_factory=list)  # alive ones, as their last heartbeat
    wan_estimate_mbps: float = 0.0  # the scheduler's measured WAN bandwidth
    plans: dict[str, int] = field(default_factory=dict)  # pipeline -> requests planned since start
    now: float = 0.0  # the scheduler's wall clock (heartbeat ages are against it)
    scheduler: str = ""  # which scheduler answered (its plan counts are its own)
    control: list[ControlProcess] = field(default_factory=list)  # the gateways and schedulers alive


@dataclass
class ControlProcess(Message):
    """A gateway or scheduler alive now, as its presence row in Redis says (`pdd status`)."""

    kind: str  # gateway | scheduler
    name: str
    dc: str
    pid: int
    url: str = ""  # a gateway's
    planned: int = 0  # a scheduler's plans since it started
    last_request: str = ""  # the request a scheduler planned last


@dataclass
class LineBacklog(Message):
    """scheduler -> the other schedulers: KV it dispatched across the WAN (`nbytes`), or 0 when
    that KV will not cross after all (its dispatch failed); samples and aborts reach them all."""

    request_id: str
    nbytes: int
    scheduler: str
    to: str = ""  # the decoder it crosses to: only its sample settles it


@dataclass
class WanSample(Message):
    """decoder -> scheduler: one KV transfer across the WAN landed, for the bandwidth estimate
    and the line's backlog (the request's bytes leave it; "" from a sender that does not say)."""

    nbytes: int
    seconds: float
    request_id: str = ""


@dataclass
class WanControl(Message):
    """Change the WAN emulator at run time; None leaves a setting as it is. The reply is its
    `WanState` after the change (an empty WanControl only asks for it)."""

    direction: str = "both"  # "both", "a-b" or "b-a"
    forward: str = ""  # stall, down and drop only this forward's connections (e.g. one decoder's KV)
    bandwidth_mbps: float | None = None
    delay_ms: float | None = None
    jitter_ms: float | None = None
    stall_s: float | None = None  # stop forwarding for this long
    down: bool | None = None  # True: the line carries nothing until `down=False`
    drop: bool = False  # cut every open connection now
    capture: bool | None = None  # record every byte that crosses, per forward and direction (wan.capture_dir)


@dataclass
class LineState(Message):
    """One direction of the emulated line."""

    bandwidth_mbps: float
    delay_ms: float
    jitter_ms: float
    down: bool = False
    stalled: bool = False
    bytes: int = 0  # carried in this direction since start
    bytes_by_forward: dict[str, int] = field(default_factory=dict)


@dataclass
class WanState(Message):
    """The WAN emulator's settings and counts: what `pdd wan show` prints."""

    name: str
    lines: dict[str, LineState] = field(default_factory=dict)  # "a-b", "b-a"
    forwards: dict[str, int] = field(default_factory=dict)  # name -> listen port
    connections: dict[str, int] = field(default_factory=dict)  # forward -> connections open now
    accepted: dict[str, int] = field(default_factory=dict)  # forward -> connections accepted since start
    error: str = ""
