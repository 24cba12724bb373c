"""The gateway's state: tokenizer, NATS and Redis clients, admission, metrics.

Owned by the gateway process's event loop; the HTTP handlers and `RequestFlow` use it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections import deque

import llguidance

from services.gateway.auth import OPEN, Key, KeyRing, scoped_request_id
from services.gateway.errors import APIError
from services.gateway.flow import RequestFlow
from services.gateway.metrics import GatewayMetrics
from services.gateway.openai_api import ParsedRequest
from services.gateway.responses import pdd_for
from services.gateway.structured import Tools, native_history, render_history
from services.gateway.tokenizer import TextTokenizer
from shared.bus import Bus
from shared.config import ClusterConfig, ConfigError
from shared.model_info import load_model_info
from shared.registry import Registry
from shared.security import Secrets

log = logging.getLogger(__name__)


class Gateway:
    def __init__(self, cfg: ClusterConfig, name: str = "gateway") -> None:
        self.cfg = cfg
        self.name = name  # one of control_plane.gateway_names: its NATS client and its presence in Redis
        self.model = load_model_info(cfg.model)
        self.tokenizer = TextTokenizer(self.model.path)
        # checks request grammars against the model's vocabulary (built once, ~0.4 s)
        self.grammar_vocab = llguidance.LLTokenizer(
            str(self.model.path / "tokenizer.json"), n_vocab=self.model.vocab_size
        )
        self.context_len = self.model.context_len
        self.vocab_size = self.model.vocab_size
        self.served_model = self.model.name
        self.bus: Bus | None = None
        self.registry: Registry | None = None
        self._presence: asyncio.Task | None = None
        self.metrics = GatewayMetrics(self.served_model)
        self.inflight: dict[str, RequestFlow] = {}  # by scoped id (auth.scoped_request_id): each key's own
        self.recent: deque[RequestFlow] = deque(maxlen=100)  # finished requests, oldest first: the dashboard's list
        self.keys = KeyRing.of(cfg.gateway)
        self.started = int(time.time())
        if self.keys.open:
            if not cfg.gateway.allow_open and not _loopback(cfg.host):
                raise ConfigError(
                    f"gateway: no API keys configured and listening on {cfg.host}: set PDD_API_KEYS "
                    "(and PDD_ADMIN_KEYS) or gateway.keys_file, or gateway.allow_open: true to serve "
                    "anyone who can reach it"
                )
            log.warning(
                "gateway: no API keys configured (PDD_API_KEYS, PDD_ADMIN_KEYS, gateway.keys_file): "
                "serving OPEN, every client may force plans and see the whole pdd object"
            )
        else:
            log.info("gateway: %d API key(s), %d admin", len(self.keys.keys), sum(k.admin for k in self.keys.keys))

    async def start(self) -> None:
        secrets = Secrets.of(self.cfg)
        self.bus = await Bus.connect(self.cfg.nats_url_for(self.cfg.control_dc), self.name, "gateway", secrets)
        self.registry = Registry.of(self.cfg)
        url = f"http://{self.cfg.host}:{self.cfg.gateway_port(self.name)}"
        self._presence = asyncio.create_task(
            self.registry.announce("gateway", self.name, self.cfg.control_dc, self.cfg.heartbeat_s, url=url)
        )

    async def stop(self) -> None:
        if self._presence is not None:
            self._presence.cancel()
        for flow in list(self.inflight.values()):
            await flow.close()
        await self.bus.close()
        await self.registry.r.aclose()

    # -- tokenizing -------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def apply_chat_template(self, messages: list[dict], tools: Tools | None = None) -> list[int]:
        """The prompt of a chat: the model's template renders tools when it knows them; else
        they and the history's calls are written in the fallback format (structured.py)."""
        if tools is not None and self.tokenizer.knows_tools:
            specs = [{"type": "function", "function": f} for f in tools.functions]
            return self.tokenizer.encode(self.tokenizer.render_chat(native_history(messages), tools=specs))
        if tools is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            messages = render_history(messages, tools)
        return self.tokenizer.encode(self.tokenizer.render_chat(messages))

    # -- admission --------------------------------------------------------------------------
    def check_capacity(self) -> None:
        if len(self.inflight) >= self.cfg.max_queue:
            raise APIError(
                429,
                f"{len(self.inflight)} requests in flight; try again shortly",
                type="rate_limit_error",
                code="overloaded",
            )

    def admit(self, parsed: ParsedRequest, key: Key = OPEN, request_id: str = "") -> RequestFlow:
        self.check_capacity()
        self.keys.admit(key, len(parsed.prompt_ids))
        # a client's own id, unless a request of its key with it came in while this one was read
        taken = scoped_request_id(key, request_id) in self.inflight
        flow = RequestFlow(self, parsed, key, "" if taken else request_id)
        self.inflight[flow.scoped_id] = flow
        self.metrics.running.set(len(self.inflight))
        return flow

    async def release(self, flow: RequestFlow) -> None:
        """Book-keeping first, then the (shielded) cleanup: a cancelled caller skips nothing."""
        if self.inflight.pop(flow.scoped_id, None) is None:
            return
        self.keys.release(flow.key)
        self.keys.count_tokens(flow.key, flow.stats.completion_tokens)
        self.metrics.running.set(len(self.inflight))
        self.metrics.observe(flow)
        _log_request(flow)
        self.recent.append(flow)
        await flow.close()

    def cache_salt(self, key: Key) -> str:
        """The tenant's prefix-cache salt: its own unless the keys file gives several keys one."""
        return "" if self.keys.open else key.cache_salt or key.name

    def pdd_view(self, flow: RequestFlow, pdd: dict) -> dict | None:
        return pdd_for(flow.key, pdd, self.cfg.gateway.pdd_object)

    def model_card(self) -> dict:
        return {
            "id": self.served_model,
            "object": "model",
            "created": self.started,
            "owned_by": "pdd",
            "max_model_len": self.context_len,
        }

    async def forget_request(self, request_id: str) -> None:
        try:
            await self.registry.delete_request(request_id)
        except Exception as e:
            log.warning("could not delete request state %s: %s", request_id, e)

    async def alive_ids(self) -> set[str]:
        """Instances whose heartbeat is current. On a Redis hiccup, and for a heartbeat TTL after
        Redis restarted empty (every instance reports again within a heartbeat), assume nobody
        died: a missing key then means only that its heartbeat has not come yet."""
        try:
            alive = {i.id for i in await self.registry.alive()}
            age = await self.registry.epoch_age()
        except Exception:
            return {i.id for i in self.cfg.instances}
        if age is None or age < self.cfg.heartbeat_ttl_s:
            return alive | {i.id for i in self.cfg.instances}
        return alive

    async def missing_roles(self) -> list[str]:
        try:
            alive = {i.role for i in await self.registry.alive()}
        except Exception:
            return ["redis"]
        if not self.bus.nc.is_connected:
            return ["nats"]
        wanted = {i.role for i in self.cfg.instances}
        return sorted(role for role in wanted if role not in alive)


def _log_request(flow: RequestFlow) -> None:
    """One line per request when it ends, with the figures an operator greps for."""
    s, plan, d = flow.stats, flow.plan, flow.stats.decoder_stats
    fields = {
        "request_id": flow.request_id,
        "attempt": flow.attempt_id,  # the id the other services' logs have (its key's namespace, moves)
        "pipeline": plan.pipeline if plan else "",
        "instances": ",".join(i for i in (plan.prefill, plan.rld, plan.md) if i) if plan else "",
        "prompt_tokens": len(flow.parsed.prompt_ids),
        "output_tokens": s.completion_tokens,
        "ttft_ms": round((s.first_token_at - s.arrived) * 1000, 1) if s.first_token_at else None,
        "e2e_ms": round((time.perf_counter() - s.arrived) * 1000, 1),
        "wan_kv_bytes": d.wan_kv_bytes,
        "finish_reason": flow.finish_reason,
        "outcome": flow.outcome,
        "migrations": s.migrations,
        "key": flow.key.name,
        **({"error": repr(flow.error)} if flow.error else {}),  # in full: the client saw it without hosts
    }
    log.info("request %s", " ".join(f"{k}={v}" for k, v in fields.items()), extra=fields)


def _loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine alone (the one-host demo's front door)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
