"""One tenant against another, and anyone against the dashboard, on the keyed cluster (the shipped
config with API keys from a keys file, tests/cluster/conftest.py) and a second gateway process
beside its own, as the second gateway of an HA pair runs: the cluster's config and keys file,
plus an env key (`PDD_API_KEYS`) with no limit of its own, a default of one request at once
(`gateway.default_max_concurrent`) and `/metrics` open (`metrics_need_key: false`).

What stops each attempt: request ids namespaced by key (services/gateway/auth.py
`scoped_request_id`), the dashboard's access rule and user view (services/gateway/dashboard.py),
error bodies scrubbed whatever their status (services/gateway/errors.py), and the gateway's default
limits for every key source (`KeyRing.of`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from tests.cluster.conftest import KEYS, fresh_prompt, keyed  # noqa: F401
from tests.cluster.test_migration import until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ENV_KEY = "sk-env-" + uuid.uuid4().hex[:12]
TOKENS = 48


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def second(keyed, tmp_path_factory):  # noqa: F811
    """The second gateway's URL, once it reports every role alive."""
    run = tmp_path_factory.mktemp("gateway-2")
    cfg = yaml.safe_load(Path(keyed.config_path).read_text())
    cfg["port"] = _free_port()
    cfg["gateway"] = {**cfg["gateway"], "metrics_need_key": False, "default_max_concurrent": 1}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PDD_API_KEYS": ENV_KEY}
    with open(run / "gateway.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.gateway", "--config", str(run / "config.yaml")],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://{cfg['host']}:{cfg['port']}"

    def healthy() -> bool:
        assert proc.poll() is None, (run / "gateway.log").read_text()
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(url + "/health", timeout=2).status_code == 200
        return False

    try:
        until(healthy, 120, "the second gateway to report every role alive", every=0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _stream(client: httpx.Client, url: str, body: dict, headers: dict):
    """A streamed completion held open: (response, its lines, the first text chunk's text)."""
    r = client.send(client.build_request("POST", url + "/v1/completions", json=body, headers=headers), stream=True)
    assert r.status_code == 200, r.read()
    lines = r.iter_lines()
    first = next(line for line in lines if line.startswith('data: {"id"'))
    return r, lines, json.loads(first[len("data: ") :])["choices"][0]["text"]


def _rest_of(lines) -> str:
    text = ""
    for line in lines:
        if line.startswith('data: {"id"'):
            text += json.loads(line[len("data: ") :])["choices"][0]["text"]
    return text


def test_another_tenant_reusing_a_request_id_gets_its_own_answer(keyed, second):  # noqa: F811
    """While tenant A's request streams on the cluster's gateway, tenant B sends its own prompt to
    the second gateway with A's `X-Request-Id` (as a client retrying on another gateway would).
    Before, the schedulers answered the id with A's plan and B's gateway listened on A's stream:
    B got A's answer, token for token. Now B's request is planned apart and B gets exactly the
    answer its own prompt gets, under the id it sent."""
    rid = f"shared-{uuid.uuid4().hex[:8]}"
    body = {"max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    a_body = {**body, "prompt": fresh_prompt(30, "tenant-a"), "stream": True}
    b_body = {**body, "prompt": "The capital of France is Paris. The capital of Italy is"}
    with httpx.Client(timeout=180) as client:
        r, lines, a_text = _stream(client, keyed.url, a_body, {**auth("calm"), "X-Request-Id": rid})
        try:
            b = httpx.post(
                second + "/v1/completions", json=b_body, headers={**auth("deaf"), "X-Request-Id": rid}, timeout=180
            )
            a_text += _rest_of(lines)
        finally:
            r.close()
    assert b.status_code == 200, b.text
    assert b.headers["x-request-id"] == rid and b.json()["id"] == rid
    b_text = b.json()["choices"][0]["text"]
    assert b_text != a_text, "tenant B was handed tenant A's answer"
    fresh = httpx.post(keyed.url + "/v1/completions", json=b_body, headers=auth("deaf"), timeout=180)
    assert b_text == fresh.json()["choices"][0]["text"]


def test_no_anonymous_visitor_sees_the_dashboard_even_with_open_metrics(second):
    """`metrics_need_key: false` gave anonymous visitors the dashboard's admin view (every instance,
    process and request); now it opens `/metrics` alone."""
    assert httpx.get(second + "/metrics", timeout=10).status_code == 200
    for path in ("/dashboard", "/dashboard/api/state", "/dashboard/api/requests/anything"):
        r = httpx.get(second + path, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
    assert httpx.get(second + "/dashboard/api/state", headers=auth("calm"), timeout=10).status_code == 200


def _internal_names(cluster) -> list[str]:
    """What no tenant is told: the instances' ids, and where the cluster's servers listen."""
    cfg = cluster.cfg
    ports = {cluster.nats_url(dc.name).rsplit(":", 1)[1] for dc in cfg.datacenters}
    ports.add(cfg.redis_url.rsplit(":", 1)[1].split("/")[0])
    return [i.id for i in cfg.instances] + [f"{cfg.host}:{p}" for p in ports]


def test_a_user_keys_dashboard_names_no_instance_and_no_other_tenants_request(keyed):  # noqa: F811
    mine, theirs = f"mine-{uuid.uuid4().hex[:8]}", f"theirs-{uuid.uuid4().hex[:8]}"
    body = {"prompt": fresh_prompt(8, "dash"), "max_tokens": 4, "temperature": 0}
    for key, rid in (("calm", mine), ("tenant-a", theirs)):
        r = httpx.post(
            keyed.url + "/v1/completions", json=body, headers={**auth(key), "X-Request-Id": rid}, timeout=120
        )
        assert r.status_code == 200, r.text
    state = httpx.get(keyed.url + "/dashboard/api/state", headers=auth("calm"), timeout=10)
    waterfall = httpx.get(keyed.url + f"/dashboard/api/requests/{mine}", headers=auth("calm"), timeout=10)
    assert state.status_code == waterfall.status_code == 200
    assert mine in [row["id"] for row in state.json()["requests"]] and waterfall.json()["request"]["id"] == mine
    for text in (state.text, waterfall.text):
        assert theirs not in text
        assert not [n for n in _internal_names(keyed) if n in text], text
    admin = httpx.get(keyed.url + "/dashboard/api/state", headers=auth("tenant-a"), timeout=10).text
    assert "md-0" in admin  # the admin view still names them: the check above would see them


def test_an_error_body_names_no_instance_host_or_port(keyed):  # noqa: F811
    """4xx answers, as 5xx ones, say nothing of the cluster's insides, even when the client's own
    words would echo them back (a model or request id shaped like an instance or an address)."""
    names = _internal_names(keyed)
    answers = [
        httpx.post(
            keyed.url + "/v1/completions", json={"prompt": "hi", "model": name}, headers=auth("calm"), timeout=30
        )
        for name in names
    ]
    answers += [
        httpx.get(keyed.url + f"/dashboard/api/requests/{name}", headers=auth("calm"), timeout=30) for name in names
    ]
    answers.append(
        httpx.post(keyed.url + "/v1/completions", json={"prompt": [10**9]}, headers=auth("calm"), timeout=30)
    )
    assert sorted({a.status_code for a in answers}) == [400, 404]
    for a in answers:
        assert not [n for n in names if n in a.text], a.text


def test_an_env_key_with_no_limit_of_its_own_is_limited_by_default(second):
    """`PDD_API_KEYS` keys had no per-key limit at all; now they get `gateway.default_*` (here one
    request at once): a second request while the first streams is 429 for that key."""
    env = {"Authorization": f"Bearer {ENV_KEY}"}
    held = {"prompt": fresh_prompt(8, "env"), "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as client:
        r, lines, _ = _stream(client, second, held, env)  # dropping `lines` would close the stream
        try:
            again = httpx.post(
                second + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=env, timeout=60
            )
        finally:
            lines.close()
            r.close()
    assert again.status_code == 429, again.text
    assert again.json()["error"]["code"] == "concurrency_limit" and again.headers["retry-after"]
