"""Real two-site clusters on this host (a NATS server per site, Redis, the emulated line, every
service as a process) for the end-to-end tests, plus a client that talks to them the way a user
and an operator would.

The clusters boot while the unit tests run: tests/conftest.py launches the ones the selected
tests need once the background processes started at collection have ended (tests/background.py;
`launch_after_background`), each fixture waits for its cluster only when a test first needs
it, and each cluster stops after the last test that uses it (`release`).
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import time
import uuid
from pathlib import Path

import httpx
import pytest

from pdd.launcher import Cluster
from shared import subjects
from shared.bus import Bus
from shared.messages import Inspect, InstanceState, WanControl, WanState
from shared.prefix_hash import block_hashes, namespace_of
from shared.registry import INSTANCE, KV
from tests import background
from tests.helpers import Reference

FLEET = [
    # 512-token steps (a prefill's own default is 2,048): test_migration kills one mid-prompt
    {"id": "prefill-0", "role": "prefill", "dc": "A", "kv_tokens": 8192, "max_step_tokens": 512},
    {"id": "prefill-1", "role": "prefill", "dc": "A", "kv_tokens": 8192, "max_step_tokens": 512},
    {"id": "rld-0", "role": "rld", "dc": "A", "kv_tokens": 4096},
    {"id": "md-0", "role": "md", "dc": "B", "kv_tokens": 2048, "max_running": 8, "max_waiting": 4},
    {"id": "md-1", "role": "md", "dc": "B", "kv_tokens": 2048, "max_running": 8, "max_waiting": 4},
]
SHIPPED_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "single-host.yaml"
KEYS = {"calm": "calm-key", "flooder": "flood-key", "deaf": "deaf-key", "tenant-a": "admin-a", "tenant-b": "admin-b"}
LIMITS = {"flooder": 2, "deaf": 64}  # max_concurrent per user key (none: no limit)


def _keys_file() -> str:
    """The keyed cluster's keys (hashed, as an operator writes them): three user keys, two of them
    limited in requests at once (`LIMITS`), and two admin keys, each its own tenant."""
    import hashlib
    import tempfile

    import yaml

    entries = [
        {
            "name": n,
            "sha256": hashlib.sha256(k.encode()).hexdigest(),
            "scope": "admin" if n.startswith("tenant") else "user",
            **({"max_concurrent": LIMITS[n]} if n in LIMITS else {}),
        }
        for n, k in KEYS.items()
    ]
    path = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False).name
    with open(path, "w") as f:
        yaml.safe_dump(entries, f)
    return path


# Every session cluster's model instances run one torch thread. (The single-stream `cluster` once
# ran two, when the suite ran in one process and its tests left a core idle; since `make test`
# runs two halves at once (tests/halves.py) every core is busy, and with one thread each that
# half took 514 s where it took 532 with two, the other half 670 s where it took 724.)
CLUSTERS = {  # in the order their tests run (tests/conftest.py): the shortest group first
    # the shipped config itself (configs/single-host.yaml: prefill float32, relay and main-decode
    # bfloat16, one thread each), with API keys on (services/gateway/auth.py) and a deeper queue:
    # the front door's and mixed precision's tests, on what `pdd up` runs
    "keyed": {
        "config": str(SHIPPED_CONFIG),
        "port": 0,
        # a small send buffer and a 10 s write deadline: a client that stops reading is cut
        # after ~500 tokens and 10 s, not the shipped 256 KiB (~2,000 tokens) and 30 s
        "gateway": {"keys_file": "<made at launch>", "send_buffer_kib": 8},
        "timeouts": {"client_s": 10},
        "max_queue": 128,
    },
    # two prefill and two main-decode instances (small md pools, so eviction happens; at most
    # 12 requests each, so a burst finds the stage full)
    # Both float32 clusters below push every decoder's KV (`md_suffix_max_tokens: 0`): their tests
    # hold or drop pushes on purpose, and a line held at 1 Mbps drags the scheduler's bandwidth
    # estimate down until main-decode computing a fresh ~100-token prompt itself looks cheaper
    # (tests/cluster/test_md_suffix.py tests that path on its own cluster).
    "fleet": {
        "port": 0,
        "instances": FLEET,
        "timeouts": {"kv_stall_s": 10, "kv_retries": 1, "request_s": 90},
        "scheduler": {"md_suffix_max_tokens": 0},
    },
    # small handoff chunks so a few seconds of WAN build a multi-chunk catch-up on a CPU
    # float32 everywhere: outputs must equal the model alone (transformers, float32) token for token
    "cluster": {
        "port": 0,
        "handoff": {"chunk_tokens": 12, "final_tokens": 3},
        "scheduler": {"md_suffix_max_tokens": 0},
        "stream_kv": True,  # off by default (it costs a CPU's TTFT): every push here streams, tested as it runs
        "max_queue": 12,
        "instances": [
            {"id": "prefill-0", "role": "prefill", "dc": "A", "kv_tokens": 16384, "threads": 1},
            {"id": "rld-0", "role": "rld", "dc": "A", "kv_tokens": 8192, "threads": 1},
            {"id": "md-0", "role": "md", "dc": "B", "kv_tokens": 16384, "threads": 1},
        ],
        "timeouts": {"kv_stall_s": 5, "kv_retries": 1, "request_s": 90},
    },
}
_launched: dict[str, Cluster] = {}


def prelaunch(names: set[str]) -> None:
    """Start these clusters' processes now (from the main thread), without waiting for them."""
    for name in sorted(names - set(_launched)):
        settings = CLUSTERS[name]
        if "gateway" in settings:
            settings = {**settings, "gateway": {**settings["gateway"], "keys_file": _keys_file()}}
        _launched[name] = Cluster(log=lambda m: None, failpoints=True, **settings).launch()


_waiting: set[str] = set()  # to launch once the background processes end (tests/background.py)


def launch_after_background(names: set[str]) -> None:
    _waiting.update(names)
    launch_waiting()


def launch_waiting(wait: bool = False) -> None:
    """Launch the waiting clusters if every background process has ended (with `wait`: once they
    have). From the main thread, as `prelaunch`."""
    if _waiting and (wait or background.all_done()):
        background.wait_all()
        names = set(_waiting)
        _waiting.clear()
        prelaunch(names)


def _ready(name: str):
    launch_waiting(wait=True)
    prelaunch({name})
    c = _launched[name]
    try:
        c.wait_ready(300)
        yield c
    finally:
        c.stop()
        _launched.pop(name, None)


def release(name: str) -> None:
    """Stop a session cluster once no test left needs it (tests/conftest.py); its fixture's own
    stop at the end of the session then finds nothing to stop."""
    if (c := _launched.pop(name, None)) is not None:
        c.stop()


@pytest.fixture(scope="session")
def cluster():
    yield from _ready("cluster")


@pytest.fixture(scope="session")
def fleet():
    yield from _ready("fleet")


@pytest.fixture(scope="session")
def keyed():
    yield from _ready("keyed")


@pytest.fixture(scope="session")
def fleet_operator(fleet) -> Operator:
    return Operator(fleet)


@pytest.fixture(scope="session")
def eos_ref(smol):
    """The reference model for API outputs: stock attention, stops at EOS like the server."""
    ref = copy.deepcopy(smol)
    ref.set_attn_implementation("sdpa")
    return ref


@pytest.fixture(scope="session")
def reference(eos_ref, smol_ref, smol_tokenizer):
    """The model alone, greedy: `reference(prompt_ids, n)` stops at EOS like the server;
    `ignore_eos=True` generates all n tokens, as a request with `ignore_eos` does. Pass the
    server's text as `draft` to have it verified in one forward pass instead of n
    (tests/helpers.py `Reference`); the answer is the same."""
    refs = {False: Reference(eos_ref, smol_tokenizer), True: Reference(smol_ref, smol_tokenizer)}
    cache: dict[tuple, str] = {}

    def text_for(prompt_ids: list[int], max_tokens: int, ignore_eos: bool = False, draft: str | None = None) -> str:
        key = (tuple(prompt_ids), max_tokens, ignore_eos)
        if key not in cache:
            cache[key] = refs[ignore_eos](prompt_ids, max_tokens, draft)
        return cache[key]

    return text_for


@pytest.fixture
def model_id(cluster) -> str:
    return httpx.get(cluster.url + "/v1/models").json()["data"][0]["id"]


def stream_completion(
    url: str, body: dict, timeout: float = 120, events: list[dict] | None = None, headers: dict | None = None
) -> tuple[str, dict, list[dict]]:
    """POST a streamed completion; return (text, final chunk's pdd object, all events). The
    stream must end as a complete one does: a last chunk with finish_reason and the pdd object,
    then `[DONE]`. `events`, when given, fills as chunks arrive (another thread may watch it)."""
    events, text, done = [] if events is None else events, "", False
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=timeout, headers=headers) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            events.append(event)
            assert "error" not in event, f"the stream reported an error: {event['error']}"
            if event["choices"]:  # the usage chunk (stream_options.include_usage) has none
                choice = event["choices"][0]
                text += choice.get("text") or choice.get("delta", {}).get("content") or ""
    assert done, "the stream ended without [DONE]"
    last = next(e for e in reversed(events) if e["choices"])
    assert "pdd" in last, "the last chunk with a choice carries the pdd object"
    assert last["choices"][0]["finish_reason"] in ("stop", "length"), last
    return text, last["pdd"], events


def fresh_prompt(words: int, tag: str = "") -> str:
    """A prompt no cache has seen: prefix caches would otherwise hide the WAN transfer."""
    nonce = uuid.uuid4().hex[:8]
    return f"[{tag}{nonce}] " + " ".join(f"item{i}" for i in range(words))


def completion(url: str, body: dict, timeout: float = 120) -> dict:
    r = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def in_flight(url: str, headers: dict[str, str] | None = None) -> int:
    """Requests admitted at the gateway at `url` and not finished (its pdd:num_requests_running)."""
    text = httpx.get(url + "/metrics", headers=headers).text
    return int(float(re.search(r"^pdd:num_requests_running\{[^}]*\} (\S+)$", text, re.M).group(1)))


class Operator:
    """Talks to the cluster's control plane directly, as an operator's tool would."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def run(self, coro_fn):
        async def main():
            bus = await Bus.connect(self.cluster.nats_url(), "test-operator", "operator", self.cluster.secrets)
            try:
                return await coro_fn(bus)
            finally:
                await bus.close()

        return asyncio.run(main())

    def inspect(self, instance_id: str) -> InstanceState:
        return self.run(lambda bus: bus.request(subjects.inspect(instance_id), Inspect(instance_id), InstanceState, 5))

    def flush(self, instance_id: str) -> InstanceState:
        """Drop the instance's cached prefixes that no request uses (`pdd.admin.<id>.flush`)."""
        subject = subjects.flush_cache(instance_id)
        return self.run(lambda bus: bus.request(subject, Inspect(instance_id), InstanceState, 10))

    def wan(self, **settings) -> WanState:
        """Change the emulated line (both directions unless `direction=`); its state after."""
        name = self.cluster.cfg.wan.name
        state = self.run(lambda bus: bus.request(subjects.wan_control(name), WanControl(**settings), WanState, 5))
        assert not state.error, state.error
        return state

    def failpoints(self, spec: str = "") -> None:
        """Arm faults in the services (shared/failpoints.py syntax); "" disarms them. Each service
        reads the file again before its next armed place is passed."""
        self.cluster.failpoints.write_text(spec)

    def line_bytes(self, forward: str, direction: str = "a-b") -> int:
        """Bytes the line carried in `direction` on `forward` (a decoder's KV port, `nats-B`) so far.
        The line sees only TLS records: a request's KV is the difference around it, plus overhead."""
        return self.wan().lines[direction].bytes_by_forward.get(forward, 0)

    def idle(self, timeout: float = 30.0) -> dict[str, InstanceState]:
        """Wait until no instance holds a request and every block is free or cached; give up after
        `timeout` and return the states as they are (the test's assertions say what was left). An
        abort that lands mid-step waits for the step, up to 512 tokens of prefill: seconds on a
        slow machine, and several of them on CI's (5 s was too short there). A poll: an idle
        cluster answers at once."""
        deadline = time.monotonic() + timeout
        while True:
            states = {i.id: self.inspect(i.id) for i in self.cluster.cfg.instances}
            if all(_idle(s) for s in states.values()) or time.monotonic() > deadline:
                return states
            time.sleep(0.1)

    def settled(self, timeout: float = 30.0) -> None:
        """`idle`, then a heartbeat of every instance heard since, with no prompt tokens queued: the
        scheduler plans from heartbeats, and one sent while an earlier test's work was queued would
        still count that work in a plan's estimates."""
        self.idle(timeout)
        since, r = time.time(), self.redis()
        try:
            deadline = time.monotonic() + timeout
            while True:
                rows = [r.hgetall(INSTANCE + i.id) for i in self.cluster.cfg.instances]
                fresh = [row for row in rows if row and float(row["updated_at"]) > since]
                if len(fresh) == len(rows) and all(int(row["queued_tokens"]) == 0 for row in fresh):
                    return
                assert time.monotonic() < deadline, f"no fresh idle heartbeat from every instance in {timeout} s"
                time.sleep(0.1)
        finally:
            r.close()

    def wait_indexed(self, instance_id: str, token_ids: list[int], timeout: float = 30.0) -> int:
        """Wait until the prefix index holds `instance_id`'s copy of the full blocks of `token_ids`
        (its report goes out before a turn's last token, but the registrar applies it on its own
        task: the next turn can be planned first); how many blocks it holds."""
        cfg, secrets = self.cluster.cfg, self.cluster.secrets
        key = secrets.index_key if secrets else b""
        hashes = block_hashes(token_ids, cfg.block_size, namespace_of(cfg.model), key=key)
        r = self.redis()
        try:
            deadline = time.monotonic() + timeout
            while True:
                held = r.smismember(KV + instance_id, hashes) if hashes else []
                if all(held):
                    return len(hashes)
                assert time.monotonic() < deadline, f"{instance_id} indexed {sum(held)} of {len(hashes)} blocks"
                time.sleep(0.05)
        finally:
            r.close()

    def redis(self):
        import redis

        return redis.Redis.from_url(
            self.cluster.cfg.redis_url, password=self.cluster.secrets.redis_password, decode_responses=True
        )

    def request_keys(self) -> list[str]:
        r = self.redis()
        try:
            return list(r.scan_iter("pdd:request:*"))
        finally:
            r.close()


@pytest.fixture(scope="session")
def operator(cluster) -> Operator:
    return Operator(cluster)


def _idle(state: InstanceState) -> bool:
    return not state.requests and state.free_blocks + state.figures.engine.cached_blocks == state.total_blocks


def tls_overhead(kv_bytes: int) -> int:
    """What TLS adds on the line to `kv_bytes` of KV frames: the handshake (certificates both
    ways, a few KiB) and 22 bytes per record of at most 16 KiB."""
    return 8192 + 32 * (kv_bytes // 16384 + 1)


@pytest.fixture(scope="session")
def mixed_reference(smol, smol_dir, smol_tokenizer):
    """The one-process reference of the heterogeneous fleet: the prompt prefilled in float32 (its
    KV and the first token), the KV converted to bfloat16, then greedy decoding in bfloat16, one
    token per step, alone. With the batch-invariant kernels (shared/runtime/rows.py) this is what
    every pipeline, handoff mode and load gives: an extend recomputes the relay's KV bit for bit,
    so where the handoff falls does not matter."""
    from shared.messages import Sampling
    from shared.runtime.engine import Engine
    from shared.runtime.kv_payload import export_kv, import_kv
    from shared.runtime.models import load_model
    from shared.runtime.sequence import Sequence

    bf16 = load_model(smol_dir, "bfloat16")
    eos = tuple(e if isinstance(e, list) else [e]) if (e := smol.generation_config.eos_token_id) is not None else ()

    def text_for(prompt: list[int], n: int, ignore_eos: bool = False, ids: bool = False) -> str | list[int]:
        p = Engine.for_model(smol, 512)
        p.add(Sequence("p", list(prompt), Sampling(max_tokens=1, ignore_eos=True), hold_kv=True, max_new=1))
        first = next(o.token_id for o in p.step() if o.token_id is not None)
        payload = export_kv(p.pool, p.held["p"].block_table, 0, len(prompt))
        e = Engine.for_model(bf16, 512, eos_token_ids=eos)
        seq = Sequence("d", [*prompt, first], Sampling(max_tokens=n, ignore_eos=ignore_eos), prompt_len=len(prompt))
        seq.block_table = e.allocate(e.pool.blocks_for(len(prompt) + n))
        import_kv(e.pool, seq.block_table, payload)
        seq.num_computed = len(prompt)
        e.add(seq)
        tokens = [first]
        while e.has_work:
            tokens += [o.token_id for o in e.step() if o.token_id is not None]
        return tokens if ids else smol_tokenizer.decode(tokens, skip_special_tokens=True)

    return text_for
