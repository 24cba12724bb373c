"""API keys at the front door: who may call, how much, and what they may see.

Keys come from `PDD_API_KEYS` and `PDD_ADMIN_KEYS` (comma-separated plain keys, as vLLM's
`--api-key` takes them) and/or a keys file (`gateway.keys_file`: YAML, hashed keys with scope,
limits and cache salt each). Only SHA-256 digests are kept in memory; a presented key is
compared by digest in constant time. With no key configured the gateway is open (the demo), and
says so at start.

Per key: at most `max_concurrent` requests in flight and `tokens_per_minute` tokens (prompt and
completion) in any 60 s; past either, that key gets 429 with Retry-After while other keys go on.
A key that names no limit of its own (every env key; a file key without the field) gets the
gateway's defaults (`gateway.default_max_concurrent`, `gateway.default_tokens_per_minute`); 0,
given explicitly, is no limit.
Admin keys may force `pdd` overrides and see the whole `pdd` object; user keys may not, and see
it without instance ids, cache-hit counts and estimates (or not at all: `gateway.pdd_object`).
Each key names its tenant's cache salt: tenants never share cached KV unless given one salt.
Each key is its own namespace of request ids (`scoped_request_id`): a client's `X-Request-Id`
names only its own key's requests.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import re
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from services.gateway.errors import APIError
from shared.config import GatewayConfig

WINDOW_S = 60.0
_SHA256 = re.compile(r"[0-9a-f]{64}")
TAG_CHARS = 12  # of a key's request-id tag: 48 bits, no two keys of one gateway share one


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Key:
    name: str
    sha256: str
    admin: bool = False
    max_concurrent: int = 0  # 0 = no limit
    tokens_per_minute: int = 0  # 0 = no limit
    cache_salt: str = ""  # "" = the key's own name: its tenant's cached KV is its own


OPEN = Key("open", "", admin=True)  # no keys configured: everyone is admin of the demo


def scoped_request_id(key: Key, request_id: str) -> str:
    """The id the schedulers and stages know a client's request by: `<request_id>@<tag>`, the tag
    a digest of the key's hash (the same on every gateway: a client that retries elsewhere with
    its id finds its request again). The tag has a fixed length, so two keys' ids never meet:
    another key's `X-Request-Id` cannot name this key's request, its plan (the schedulers' memory
    of ids) or its stream, nor a moved attempt (`<id>.m1`: client ids have no `.`). The open
    gateway has one tenant: its ids are used as given."""
    if key is OPEN:
        return request_id
    tag = hashlib.sha256(f"pdd request ids {key.sha256}".encode()).hexdigest()[:TAG_CHARS]
    return f"{request_id}@{tag}"


@dataclass
class _Usage:
    in_flight: int = 0
    tokens: deque = field(default_factory=deque)  # (time, tokens) within the window

    def tokens_in_window(self, now: float) -> int:
        while self.tokens and now - self.tokens[0][0] >= WINDOW_S:
            self.tokens.popleft()
        return sum(n for _, n in self.tokens)


class KeyRing:
    def __init__(self, keys: list[Key]) -> None:
        self.keys = keys
        self._usage: dict[str, _Usage] = {k.sha256: _Usage() for k in keys}

    @classmethod
    def of(cls, cfg: GatewayConfig, env: dict[str, str] | None = None) -> KeyRing:
        """The gateway's keys, from every source, each limited by `cfg`'s defaults where it names
        no limit of its own."""
        return cls.from_settings(cfg.keys_file, env, (cfg.default_max_concurrent, cfg.default_tokens_per_minute))

    @classmethod
    def from_settings(
        cls, keys_file: str = "", env: dict[str, str] | None = None, defaults: tuple[int, int] = (0, 0)
    ) -> KeyRing:
        """Env keys (limited by `defaults`: max_concurrent, tokens_per_minute) and a keys file's
        (each limit it leaves out is the default's)."""
        env = os.environ if env is None else env
        users, admins = _split(env.get("PDD_API_KEYS")), _split(env.get("PDD_ADMIN_KEYS"))
        keys = [Key(f"key-{i}", digest(k), False, *defaults) for i, k in enumerate(users)]
        keys += [Key(f"admin-{i}", digest(k), True, *defaults) for i, k in enumerate(admins)]
        if keys_file:
            keys += _load_keys_file(keys_file, defaults)
        return cls(keys)

    @property
    def open(self) -> bool:
        return not self.keys

    def authenticate(self, authorization: str | None) -> Key:
        """The key of an `Authorization: Bearer <key>` header, or 401 in OpenAI's shape."""
        if self.open:
            return OPEN
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() == "bearer" and presented.strip():
            d = digest(presented.strip())
            for key in self.keys:
                if hmac.compare_digest(d, key.sha256):
                    return key
        raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`", code="invalid_api_key")

    def admit(self, key: Key, prompt_tokens: int, now: float | None = None) -> None:
        """Count a request in (or 429 with Retry-After, this key only). Pair with `release`."""
        if key is OPEN:
            return
        now = time.monotonic() if now is None else now
        self.check(key, prompt_tokens, now)
        self._usage[key.sha256].in_flight += 1
        self.count_tokens(key, prompt_tokens, now)

    def check(self, key: Key, prompt_tokens: int = 0, now: float | None = None) -> None:
        """429 with Retry-After when the key has no room for a request of `prompt_tokens`; counts
        nothing. The front door asks with 0 before it reads or tokenizes a body: a key at its
        limit costs the gateway no parsing."""
        if key is OPEN:
            return
        now = time.monotonic() if now is None else now
        use = self._usage[key.sha256]
        if key.max_concurrent and use.in_flight >= key.max_concurrent:
            raise APIError(
                429,
                f"{key.max_concurrent} requests in flight for this key",
                type="rate_limit_error",
                code="concurrency_limit",
                retry_after=1,
            )
        if key.tokens_per_minute:
            used = use.tokens_in_window(now)
            if used + prompt_tokens > key.tokens_per_minute:
                raise APIError(
                    429,
                    f"{used} tokens in the last minute; the limit is {key.tokens_per_minute}",
                    type="rate_limit_error",
                    code="tokens_per_minute",
                    retry_after=_retry_after(use, now, used + prompt_tokens - key.tokens_per_minute),
                )

    def count_tokens(self, key: Key, n: int, now: float | None = None) -> None:
        """Tokens into the key's window (kept only for keys with a token limit, and only a minute)."""
        if key is not OPEN and n and key.tokens_per_minute:
            now = time.monotonic() if now is None else now
            use = self._usage[key.sha256]
            use.tokens.append((now, n))
            use.tokens_in_window(now)  # drops what aged out: the window stays a minute long

    def release(self, key: Key) -> None:
        if key is not OPEN:
            self._usage[key.sha256].in_flight -= 1


def _retry_after(use: _Usage, now: float, excess: int) -> int:
    """Seconds until enough of the window's tokens have aged out."""
    freed = 0
    for t, n in use.tokens:
        freed += n
        if freed >= excess:
            return max(1, math.ceil(t + WINDOW_S - now))
    return int(WINDOW_S)


def _split(value: str | None) -> list[str]:
    return [k.strip() for k in (value or "").split(",") if k.strip()]


def _load_keys_file(path: str, defaults: tuple[int, int] = (0, 0)) -> list[Key]:
    """The keys of a keys file; anything malformed is a ValueError naming the file."""
    try:
        entries = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:  # where and what only: the line itself might hold a key
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"{path}: not valid YAML{at}: {getattr(e, 'problem', None) or type(e).__name__}") from None
    if entries is not None and not isinstance(entries, list):
        raise ValueError(f"{path}: a keys file is a YAML list of keys; got {type(entries).__name__}")
    return [_from_file_entry(e, path, defaults) for e in entries or []]


def _from_file_entry(entry: dict, where: str, defaults: tuple[int, int] = (0, 0)) -> Key:
    """`{name, sha256, scope: user|admin, max_concurrent, tokens_per_minute, cache_salt}`."""
    known = {"name", "sha256", "scope", "max_concurrent", "tokens_per_minute", "cache_salt"}
    if not isinstance(entry, dict) or set(entry) - known or "sha256" not in entry or "name" not in entry:
        got = f"fields {sorted(map(str, entry))}" if isinstance(entry, dict) else type(entry).__name__
        raise ValueError(f"{where}: each key is a map with name, sha256 and optionally {sorted(known)}; got {got}")
    if entry.get("scope", "user") not in ("user", "admin"):
        raise ValueError(f"{where}: key {entry['name']!r}: scope must be user or admin")
    sha256 = str(entry["sha256"]).lower()
    if not _SHA256.fullmatch(sha256):  # a plain key (or a typo) here would be a key nobody could ever use
        raise ValueError(
            f"{where}: key {entry['name']!r}: sha256 must be the 64 hex digits of the key's SHA-256 "
            "(`printf %s KEY | sha256sum`), not the key itself"
        )
    return Key(
        str(entry["name"]),
        sha256,
        entry.get("scope") == "admin",
        _limit(entry, "max_concurrent", where, defaults[0]),
        _limit(entry, "tokens_per_minute", where, defaults[1]),
        str(entry.get("cache_salt", "")),
    )


def _limit(entry: dict, name: str, where: str, default: int) -> int:
    value = entry.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: key {entry['name']!r}: {name} must be an integer >= 0 (0: no limit); got {value!r}")
    return value
