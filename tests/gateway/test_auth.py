"""API keys at the front door, without a cluster: the KeyRing (env keys, a keys file of hashed
keys, plain keys never kept, per-key concurrency and tokens-per-minute limits on an injected
clock, a token window of a minute at most) and the gateway's routes around it (401 in OpenAI's
shape, /health open, /metrics as configured, 403 for a user key forcing a plan)."""

from __future__ import annotations

import dataclasses
from collections import deque
from types import SimpleNamespace

import pytest
import yaml
from fastapi.testclient import TestClient

from services.gateway.app import create_app
from services.gateway.auth import OPEN, WINDOW_S, KeyRing, digest
from services.gateway.errors import APIError
from services.gateway.metrics import GatewayMetrics
from shared.config import ConfigError, load_config

USER, USER2, ADMIN = "sk-user-4c1f0e9b7a2d", "sk-user-second-93ab", "sk-admin-d08e51c6"


def ring(**env: str) -> KeyRing:
    return KeyRing.from_settings("", env)


def keys_file(tmp_path, entries) -> str:
    path = tmp_path / "keys.yaml"
    path.write_text(entries if isinstance(entries, str) else yaml.safe_dump(entries))
    return str(path)


def limited(tmp_path, **limits) -> KeyRing:
    """Two user keys from a keys file, both with `limits`."""
    entries = [{"name": n, "sha256": digest(k), **limits} for n, k in (("alice", USER), ("bob", USER2))]
    return KeyRing.from_settings(keys_file(tmp_path, entries), {})


def refused(call) -> APIError:
    with pytest.raises(APIError) as e:
        call()
    return e.value


# --- who may call --------------------------------------------------------------------------


def test_with_no_key_configured_the_gateway_is_open():
    r = ring()
    assert r.open and r.keys == []
    for header in (None, "", "Bearer anything", "Basic xyz"):
        assert r.authenticate(header) is OPEN
    assert OPEN.admin
    for _ in range(100):  # the open key has no limits and keeps no usage
        r.admit(OPEN, 10**6)
    r.count_tokens(OPEN, 10**6)
    r.release(OPEN)
    assert r._usage == {}
    assert ring(PDD_API_KEYS=" , ,", PDD_ADMIN_KEYS="").open  # only separators: still no key


def test_env_keys_authenticate_as_user_or_admin():
    r = ring(PDD_API_KEYS=f" {USER} ,{USER2},", PDD_ADMIN_KEYS=ADMIN)
    assert not r.open and len(r.keys) == 3
    user = r.authenticate(f"Bearer {USER}")
    assert (user.name, user.admin) == ("key-0", False)
    assert r.authenticate(f"Bearer {USER2}").name == "key-1"
    admin = r.authenticate(f"Bearer {ADMIN}")
    assert (admin.name, admin.admin) == ("admin-0", True)
    assert r.authenticate(f"bearer {USER}") is user  # the scheme is case-insensitive
    assert r.authenticate(f"Bearer  {USER} ") is user  # and spaces around the key do not matter


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        "Bearer    ",
        USER,
        f"Basic {USER}",
        f"Token {USER}",
        f"Bearer{USER}",
        "Bearer sk-unknown",
        f"Bearer {USER}x",
        f"Bearer {USER[:-1]}",
        f"Bearer {digest(USER)}",
        f"Bearer {USER},{ADMIN}",
    ],
)
def test_a_missing_malformed_or_unknown_key_is_401_in_openais_shape(header):
    e = refused(lambda: ring(PDD_API_KEYS=USER, PDD_ADMIN_KEYS=ADMIN).authenticate(header))
    assert e.status == 401 and e.retry_after is None
    body = e.to_json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "invalid_api_key" and body["error"]["type"] == "invalid_request_error"
    assert "Authorization: Bearer" in body["error"]["message"]
    assert USER not in body["error"]["message"] and ADMIN not in body["error"]["message"]


def _strings(obj, seen: set[int]):
    """Every string and bytes reachable from `obj` through attributes and containers."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, str | bytes):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _strings(k, seen)
            yield from _strings(v, seen)
    elif isinstance(obj, list | tuple | set | frozenset | deque):
        for v in obj:
            yield from _strings(v, seen)
    elif hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
        attrs = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
        for name in getattr(type(obj), "__slots__", ()):
            if hasattr(obj, name):
                attrs[name] = getattr(obj, name)
        yield from _strings(attrs, seen)


def test_plain_keys_are_never_stored(tmp_path):
    path = keys_file(tmp_path, [{"name": "filed", "sha256": digest(USER2), "tokens_per_minute": 100}])
    r = KeyRing.from_settings(path, {"PDD_API_KEYS": USER, "PDD_ADMIN_KEYS": ADMIN})
    for plain in (USER, USER2, ADMIN):  # used: authenticated, admitted, counted, released
        key = r.authenticate(f"Bearer {plain}")
        r.admit(key, 5, now=1.0)
        r.count_tokens(key, 3, now=2.0)
        r.release(key)
    found = list(_strings(r, set()))
    assert digest(USER) in found and digest(ADMIN) in found  # the walk does reach the keys
    for plain in (USER, USER2, ADMIN):
        assert not [s for s in found if (plain in s if isinstance(s, str) else plain.encode() in s)], plain


# --- the keys file -------------------------------------------------------------------------


def test_a_keys_file_gives_hashed_keys_their_scope_limits_and_salt(tmp_path):
    entries = [
        {
            "name": "alice",
            "sha256": digest(USER).upper(),
            "max_concurrent": 2,
            "tokens_per_minute": 1000,
            "cache_salt": "team-a",
        },
        {"name": "ops", "sha256": digest(ADMIN), "scope": "admin"},
        {"name": "bob", "sha256": digest(USER2), "scope": "user", "cache_salt": "team-a"},
    ]
    r = KeyRing.from_settings(keys_file(tmp_path, entries), {"PDD_API_KEYS": "sk-env"})
    assert [k.name for k in r.keys] == ["key-0", "alice", "ops", "bob"]  # env keys and the file's together
    alice = r.authenticate(f"Bearer {USER}")  # an upper-case digest in the file still matches
    assert (alice.name, alice.admin, alice.max_concurrent, alice.tokens_per_minute, alice.cache_salt) == (
        "alice",
        False,
        2,
        1000,
        "team-a",
    )
    ops = r.authenticate(f"Bearer {ADMIN}")
    assert (ops.name, ops.admin, ops.max_concurrent, ops.tokens_per_minute, ops.cache_salt) == ("ops", True, 0, 0, "")
    assert r.authenticate(f"Bearer {USER2}").admin is False
    assert r.authenticate("Bearer sk-env").name == "key-0"
    assert refused(lambda: r.authenticate(f"Bearer {digest(USER)}")).status == 401  # the digest is no key


@pytest.mark.parametrize(
    ("entries", "named"),
    [
        ([{"sha256": digest(USER)}], "name, sha256"),  # no name
        ([{"name": "a"}], "name, sha256"),  # no digest
        ([{"name": "a", "sha256": digest(USER), "rate": 5}], r"got fields \['name', 'rate', 'sha256'\]"),
        ([{"name": "a", "sha256": digest(USER), "scope": "root"}], "scope must be user or admin"),
        ([USER], "each key is a map .*; got str$"),  # plain keys listed: named by type, not echoed
        ({"name": "a", "sha256": digest(USER)}, "a YAML list of keys; got dict"),  # a map where a list is due
        ("5\n", "a YAML list of keys; got int"),
        (f"- name: a\n  sha256: {USER}: x\n", "not valid YAML at line 2"),  # the line may hold a key: not quoted
        ([{"name": "a", "sha256": USER}], "sha256 must be the 64 hex digits"),  # the plain key, not its digest
        ([{"name": "a", "sha256": digest(USER)[:-1]}], "sha256 must be the 64 hex digits"),
        ([{"name": "a", "sha256": digest(USER), "max_concurrent": "lots"}], "max_concurrent must be an integer"),
        ([{"name": "a", "sha256": digest(USER), "max_concurrent": -1}], "max_concurrent must be an integer >= 0"),
        ([{"name": "a", "sha256": digest(USER), "tokens_per_minute": 1.5}], "tokens_per_minute must be an integer"),
        ([{"name": "a", "sha256": digest(USER), "tokens_per_minute": True}], "tokens_per_minute must be an integer"),
    ],
)
def test_a_bad_keys_file_is_a_clear_error_naming_the_file_and_no_key(tmp_path, entries, named):
    path = keys_file(tmp_path, entries)
    with pytest.raises(ValueError, match=named) as e:
        KeyRing.from_settings(path, {"PDD_API_KEYS": USER2})
    assert str(e.value).startswith(f"{path}: ") and USER not in str(e.value)


def test_an_empty_keys_file_adds_no_key(tmp_path):
    assert KeyRing.from_settings(keys_file(tmp_path, ""), {}).open  # (and the gateway warns it serves open)
    assert [k.name for k in KeyRing.from_settings(keys_file(tmp_path, []), {"PDD_ADMIN_KEYS": ADMIN}).keys] == [
        "admin-0"
    ]


# --- per-key limits ------------------------------------------------------------------------


def test_every_key_source_gets_the_gateways_default_limits_unless_it_names_its_own(tmp_path):
    """An env key has no field to name a limit: it had none at all (a leaked one could take the
    whole gateway). Now every key without a limit of its own gets `gateway.default_*`; a file key's
    own value wins, 0 included (no limit, said explicitly)."""
    shipped = load_config(None).gateway
    assert shipped.default_max_concurrent > 0 and shipped.default_tokens_per_minute > 0
    cfg = dataclasses.replace(shipped, default_max_concurrent=3, default_tokens_per_minute=500)
    entries = [
        {"name": "plain", "sha256": digest(USER)},
        {"name": "own", "sha256": digest(USER2), "max_concurrent": 7, "tokens_per_minute": 0},
    ]
    cfg = dataclasses.replace(cfg, keys_file=keys_file(tmp_path, entries))
    r = KeyRing.of(cfg, {"PDD_API_KEYS": "sk-env", "PDD_ADMIN_KEYS": "sk-env-admin"})
    limits = {k.name: (k.max_concurrent, k.tokens_per_minute) for k in r.keys}
    assert limits == {"key-0": (3, 500), "admin-0": (3, 500), "plain": (3, 500), "own": (7, 0)}
    env_key = r.authenticate("Bearer sk-env")
    for _ in range(3):
        r.admit(env_key, 1)
    assert refused(lambda: r.admit(env_key, 1)).code == "concurrency_limit"
    unlimited = KeyRing.of(dataclasses.replace(cfg, default_max_concurrent=0, default_tokens_per_minute=0), {})
    assert [(k.max_concurrent, k.tokens_per_minute) for k in unlimited.keys] == [(0, 0), (7, 0)]


@pytest.mark.parametrize("field", ["default_max_concurrent", "default_tokens_per_minute"])
def test_a_negative_default_limit_is_a_config_error_naming_it(field):
    with pytest.raises(ConfigError, match=f"gateway.{field} must be >= 0"):
        dataclasses.replace(load_config(None).gateway, **{field: -1})


def test_a_key_past_its_concurrency_limit_gets_429_while_other_keys_go_on(tmp_path):
    r = limited(tmp_path, max_concurrent=2)
    alice, bob = r.authenticate(f"Bearer {USER}"), r.authenticate(f"Bearer {USER2}")
    r.admit(alice, 10)
    r.admit(alice, 10)
    for _ in range(3):  # a refusal takes no slot
        e = refused(lambda: r.admit(alice, 10))
        assert (e.status, e.code, e.type) == (429, "concurrency_limit", "rate_limit_error")
        assert e.retry_after is not None and e.retry_after >= 1
    r.admit(bob, 10)
    r.admit(bob, 10)  # bob has slots of his own
    r.release(alice)
    r.admit(alice, 10)  # a release frees one slot, and only one
    assert refused(lambda: r.admit(alice, 10)).status == 429
    r.release(alice)
    r.release(alice)
    r.admit(alice, 10)
    r.admit(alice, 10)
    assert refused(lambda: r.admit(bob, 10)).code == "concurrency_limit"


def test_a_key_past_its_tokens_per_minute_gets_429_until_its_tokens_age_out(tmp_path):
    r = limited(tmp_path, tokens_per_minute=100)
    alice, bob = r.authenticate(f"Bearer {USER}"), r.authenticate(f"Bearer {USER2}")
    r.admit(alice, 60, now=1000.0)
    r.release(alice)
    r.count_tokens(alice, 30, now=1020.0)  # completion tokens count too
    r.admit(alice, 10, now=1030.0)  # 100: exactly the limit
    r.release(alice)
    e = refused(lambda: r.admit(alice, 1, now=1030.0))
    assert (e.status, e.code, e.type) == (429, "tokens_per_minute", "rate_limit_error")
    assert "100 tokens in the last minute" in e.message
    assert e.retry_after == 30  # the oldest 60 tokens leave the window at 1060
    assert refused(lambda: r.admit(alice, 70, now=1030.0)).retry_after == 50  # needs the 30 of 1020 gone too
    assert refused(lambda: r.admit(alice, 1, now=1059.5)).retry_after == 1  # never less than a second
    r.admit(bob, 100, now=1030.0)  # bob's window is his own
    r.release(bob)
    r.admit(alice, 60, now=1060.0)  # the first 60 aged out
    r.release(alice)
    assert refused(lambda: r.admit(alice, 1, now=1060.0)).retry_after == 20
    assert refused(lambda: r.admit(alice, 101, now=5000.0)).retry_after == int(WINDOW_S)  # more than a minute's
    r.admit(alice, 100, now=5000.0)


def test_the_token_window_holds_a_minute_at_most(tmp_path):
    r = limited(tmp_path, tokens_per_minute=10**9)
    alice = r.authenticate(f"Bearer {USER}")
    window = r._usage[alice.sha256].tokens
    for i in range(3600):  # an hour of one completion every second, counted at release only
        r.count_tokens(alice, 7, now=float(i))
        assert len(window) <= WINDOW_S + 1
    assert window[0][0] > 3599 - WINDOW_S and len(window) == WINDOW_S
    r.admit(alice, 1, now=10**6)  # an admission alone, long after, drops the old entries too
    assert list(window) == [(10**6, 1)]
    unlimited = KeyRing.from_settings("", {"PDD_API_KEYS": USER})
    key = unlimited.authenticate(f"Bearer {USER}")
    for i in range(100):  # a key without a token limit keeps no window at all
        unlimited.admit(key, 50, now=float(i))
        unlimited.count_tokens(key, 50, now=float(i))
        unlimited.release(key)
    assert not unlimited._usage[key.sha256].tokens and unlimited._usage[key.sha256].in_flight == 0


# --- the gateway's routes around the ring ----------------------------------------------------


def fake_gateway(keys: KeyRing, need_key: bool = True) -> SimpleNamespace:
    """What the routes use of a Gateway; `admit` takes the key's slot and stops there (no cluster)."""
    cfg = load_config(None)
    cfg = dataclasses.replace(cfg, gateway=dataclasses.replace(cfg.gateway, metrics_need_key=need_key))
    gw = SimpleNamespace(
        cfg=cfg,
        keys=keys,
        metrics=GatewayMetrics("smol"),
        inflight={},
        recent=deque(),
        served_model="smol",
        context_len=2048,
        vocab_size=1000,
        admitted=[],
    )

    async def missing_roles() -> list[str]:
        return []

    def admit(parsed, key, request_id):
        keys.admit(key, len(parsed.prompt_ids))
        gw.admitted.append((key.name, parsed.pipeline))
        raise APIError(503, "admitted; no cluster behind this test", code="test_admitted")

    gw.missing_roles, gw.admit, gw.check_capacity = missing_roles, admit, lambda: None
    gw.encode = lambda text: [1] * len(text.split())
    gw.apply_chat_template = lambda messages, tools=None: [1] * len(messages)
    gw.grammar_vocab = None
    gw.model_card = lambda: {"id": "smol", "object": "model"}
    return gw


def client(gw) -> TestClient:
    return TestClient(create_app(gw))  # not entered: no lifespan, no NATS or Redis


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_the_routes_answer_401_in_openais_shape_and_keep_health_open():
    gw = fake_gateway(ring(PDD_API_KEYS=USER, PDD_ADMIN_KEYS=ADMIN))
    c = client(gw)
    for response in (
        c.get("/v1/models"),
        c.get("/v1/models", headers=bearer("sk-wrong")),
        c.post("/v1/completions", json={"prompt": "hi"}),
        c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": USER},
        ),
    ):
        assert response.status_code == 401
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert set(error) == {"message", "type", "param", "code"}
    assert gw.admitted == []  # nothing was parsed or admitted for them
    assert c.get("/v1/models", headers=bearer(USER)).json()["data"][0]["id"] == "smol"
    health = c.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


@pytest.mark.parametrize("need_key", [True, False])
def test_metrics_need_a_key_as_configured(need_key):
    c = client(fake_gateway(ring(PDD_API_KEYS=USER), need_key=need_key))
    assert c.get("/metrics").status_code == (401 if need_key else 200)
    assert c.get("/metrics", headers=bearer("sk-wrong")).status_code == (401 if need_key else 200)
    ok = c.get("/metrics", headers=bearer(USER))
    assert ok.status_code == 200 and "pdd:num_requests_running" in ok.text
    assert client(fake_gateway(ring(), need_key=True)).get("/metrics").status_code == 200  # open: no key to ask


def test_only_admin_keys_may_force_a_plan():
    gw = fake_gateway(ring(PDD_API_KEYS=USER, PDD_ADMIN_KEYS=ADMIN))
    c = client(gw)
    forced = {"prompt": "hello there", "pdd": {"pipeline": "p-md"}}
    for body in (
        forced,
        {"prompt": "hi", "pdd": {"handoff": "oneshot"}},
        {"prompt": "hi", "pdd": {"ttft_slo_ms": 300}},
    ):
        r = c.post("/v1/completions", json=body, headers=bearer(USER))
        assert r.status_code == 403
        assert r.json()["error"] == {
            "message": r.json()["error"]["message"],
            "type": "permission_error",
            "param": "pdd",
            "code": "admin_only",
        }
    chat = {"messages": [{"role": "user", "content": "hi"}], "pdd": {"pipeline": "p-md"}}
    assert c.post("/v1/chat/completions", json=chat, headers=bearer(USER)).status_code == 403
    assert gw.admitted == []  # refused before admission: no slot, no tokens
    assert c.post("/v1/completions", json=forced, headers=bearer(ADMIN)).json()["error"]["code"] == "test_admitted"
    assert c.post("/v1/completions", json={"prompt": "hi"}, headers=bearer(USER)).json()["error"]["code"] == (
        "test_admitted"
    )
    assert gw.admitted == [("admin-0", "p-md"), ("key-0", None)]


@pytest.mark.parametrize("given", ["job.m1", "job@0123456789ab", "has space", "x" * 129])
def test_an_x_request_id_that_could_forge_another_id_is_400_before_the_body(given):
    """A `.` could name a moved attempt (`<id>.m1`), an `@` another key's namespace: refused,
    before the body is read (it is not even valid JSON here)."""
    gw = fake_gateway(ring(PDD_API_KEYS=USER))
    headers = {**bearer(USER), "content-type": "application/json", "X-Request-Id": given}
    r = client(gw).post("/v1/completions", content=b'{"prompt": ', headers=headers)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request_id" and gw.admitted == []


def test_a_usable_x_request_id_reaches_admission_as_the_client_sent_it():
    gw = fake_gateway(ring(PDD_API_KEYS=USER))
    seen = []

    def admit(parsed, key, request_id):
        seen.append(request_id)
        raise APIError(503, "admitted; no cluster behind this test")

    gw.admit = admit
    r = client(gw).post("/v1/completions", json={"prompt": "hi"}, headers={**bearer(USER), "X-Request-Id": "a:b_c-9"})
    assert seen == ["a:b_c-9"] and r.headers["x-request-id"] == "a:b_c-9"


def test_a_key_past_its_limit_gets_429_with_retry_after_from_the_routes(tmp_path):
    keys = limited(tmp_path, max_concurrent=1)
    c = client(fake_gateway(keys))
    assert c.post("/v1/completions", json={"prompt": "hi"}, headers=bearer(USER)).status_code == 503  # holds the slot
    r = c.post("/v1/completions", json={"prompt": "hi"}, headers=bearer(USER))
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "concurrency_limit" and r.json()["error"]["type"] == "rate_limit_error"
    assert c.post("/v1/completions", json={"prompt": "hi"}, headers=bearer(USER2)).status_code == 503  # bob goes on
    # the key's limit is checked before its body is read or tokenized: a body that would be a 400
    # (or cost a 4 MB tokenization) is a 429 while the key is full (it was a 400: parsed first)
    bad = {"content": b'{"prompt": ', "headers": {**bearer(USER), "content-type": "application/json"}}
    assert c.post("/v1/completions", **bad).json()["error"]["code"] == "concurrency_limit"
