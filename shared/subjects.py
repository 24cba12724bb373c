"""NATS subject names: the whole control plane at a glance.

pdd.scheduler.submit            gateway -> scheduler   Submit   -> Plan (request-reply)
pdd.prefill.<instance>.task     scheduler -> prefill   PrefillTask -> Ack
pdd.decode.<instance>.task      scheduler -> md / rld  DecodeTask -> Ack
pdd.tokens.<request>.<key>      stages -> gateway      TokenChunk (stream, in index order, under the attempt's key)
pdd.decode.<instance>.resend    gateway -> md / rld    Resend -> Resent (a lost token chunk, again)
pdd.registry.<instance>.wan_sample  decoders -> schedulers WanSample (bandwidth estimate)
pdd.scheduler.status            operators -> scheduler Inspect -> ClusterStatus (`pdd status`, dashboard)
pdd.scheduler.backlog           scheduler -> schedulers LineBacklog (KV one of them sent across the line)
pdd.handoff.<rld>.ready         md -> rld              KVReady (main-decode has the KV)
pdd.handoff.<rld>.finish        prefill, md -> rld     FinishOnRelay (main-decode will not get it)
pdd.handoff.<md>.chunk          rld -> md              HandoffChunk -> Ack (token ids only)
pdd.abort                       gateway, scheduler, rld -> everyone  Abort (broadcast, idempotent)
pdd.decode.<instance>.drop      prefill, scheduler     Drop (this decoder's copy, by its secret: failed, re-planned)
pdd.prefill.<instance>.drop     scheduler -> prefill   Drop (this copy only, by its secrets: re-planned)
pdd.prefill.<instance>.warm     gateway -> prefill     Warm (a finished answer, for prefill's cache)
pdd.registry.<instance>.heartbeat  instances -> registrar InstanceInfo -> HeartbeatReply (load, liveness)
pdd.registry.<instance>.index   instances -> registrar IndexUpdate (prefix-cache block events)
pdd.registry.<instance>.leave   instances -> registrar Leave (shutting down)
pdd.inspect.<instance>          tests, tools -> any    Inspect -> InstanceState
pdd.admin.<instance>.flush      operators -> any       Inspect -> InstanceState (drop unused cache)
pdd.wanlink.<name>.control      tests, tools -> WAN    WanControl -> Ack

An instance reports on subjects named after itself, and the NATS servers let each instance's
user publish only its own (pdd/natsconf.py): the registrar and the schedulers take the sender's
identity from the subject (`reporter`), never from what the message says of itself.
"""

SUBMIT = "pdd.scheduler.submit"
STATUS = "pdd.scheduler.status"
LINE_BACKLOG = "pdd.scheduler.backlog"
ABORT = "pdd.abort"
# what the registrar and the schedulers subscribe to: every instance's reports of a kind
HEARTBEATS = "pdd.registry.*.heartbeat"
INDEXES = "pdd.registry.*.index"
LEAVES = "pdd.registry.*.leave"
WAN_SAMPLES = "pdd.registry.*.wan_sample"


def heartbeat(instance_id: str) -> str:
    return f"pdd.registry.{instance_id}.heartbeat"


def index(instance_id: str) -> str:
    return f"pdd.registry.{instance_id}.index"


def leave(instance_id: str) -> str:
    return f"pdd.registry.{instance_id}.leave"


def wan_sample(instance_id: str) -> str:
    return f"pdd.registry.{instance_id}.wan_sample"


def reporter(subject: str) -> str:
    """The instance a report came from: its subject's own name (`pdd.registry.<instance>.<kind>`)."""
    return subject.split(".")[2]


def prefill_task(instance_id: str) -> str:
    return f"pdd.prefill.{instance_id}.task"


def decode_task(instance_id: str) -> str:
    return f"pdd.decode.{instance_id}.task"


def handoff_ready(rld_id: str) -> str:
    return f"pdd.handoff.{rld_id}.ready"


def finish_on_relay(rld_id: str) -> str:
    return f"pdd.handoff.{rld_id}.finish"


def handoff_chunk(md_id: str) -> str:
    return f"pdd.handoff.{md_id}.chunk"


def decode_drop(instance_id: str) -> str:
    return f"pdd.decode.{instance_id}.drop"


def decode_resend(instance_id: str) -> str:
    return f"pdd.decode.{instance_id}.resend"


def prefill_drop(instance_id: str) -> str:
    return f"pdd.prefill.{instance_id}.drop"


def prefill_warm(instance_id: str) -> str:
    return f"pdd.prefill.{instance_id}.warm"


def tokens(request_id: str, stream_key: str = "") -> str:
    """A request's token stream. The gateway mints `stream_key` per attempt and listens on this
    subject only; the plan gives it to the stages planned for the request alone, so no other
    instance can publish into the stream (it may publish on `pdd.tokens.>`, where no one hears)."""
    return f"pdd.tokens.{request_id}.{stream_key}" if stream_key else f"pdd.tokens.{request_id}"


def inspect(instance_id: str) -> str:
    return f"pdd.inspect.{instance_id}"


def flush_cache(instance_id: str) -> str:
    return f"pdd.admin.{instance_id}.flush"


def wan_control(name: str) -> str:
    return f"pdd.wanlink.{name}.control"
