"""The dashboard in a real browser, against the live cluster: headless Chromium driven over the
DevTools protocol (on a pipe, `--remote-debugging-pipe`: no websocket library needed). A relayed
catch-up request appears while it streams, its waterfall carries relay and main-decode token
marks and the `pdd` object's timings, the page logs no JavaScript error, and it fetches nothing
from any host but the gateway. Skipped, in one line, where no Chromium is installed (`.ci/run`
installs Debian's `chromium`)."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from pdd.servers import die_with_parent
from tests.cluster.conftest import fresh_prompt, stream_completion

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--hide-scrollbars",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--mute-audio",
    "--window-size=1400,1000",
    "--remote-debugging-pipe",
]


def chromium_binary() -> str | None:
    names = (os.environ.get("PDD_CHROMIUM", ""), "chromium", "chromium-browser", "google-chrome")
    return next((path for path in map(shutil.which, filter(None, names)) if path), None)


NO_BROWSER = "no Chromium (chromium, chromium-browser, google-chrome or PDD_CHROMIUM) to drive the dashboard"
# .ci/run installs Chromium and sets PDD_REQUIRE_BROWSER=1: in CI a missing browser fails, never skips
REQUIRED = os.environ.get("PDD_REQUIRE_BROWSER") == "1"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(chromium_binary() is None and not REQUIRED, reason=NO_BROWSER)]


class Browser:
    """One headless Chromium and one tab. DevTools messages are JSON, each ending in a NUL byte,
    on the child's descriptors 3 (commands in) and 4 (replies and events out)."""

    def __init__(self, binary: str, workdir: Path) -> None:
        commands_r, self._w = os.pipe()
        self._r, replies_w = os.pipe()
        # moved above 10 first: a dup2 onto a descriptor already numbered 3 or 4 is a no-op that
        # would leave it close-on-exec, and the browser would find no pipe
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (commands_r, replies_w)]
        os.close(commands_r)
        os.close(replies_w)

        def in_child() -> None:
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)
            die_with_parent()  # a killed test run leaves no browser behind

        self.log = open(workdir / "chromium.log", "wb")  # closed in close(): the browser writes to it until then
        self.proc = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={workdir / 'chromium-profile'}", "about:blank"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            close_fds=False,
            preexec_fn=in_child,
            start_new_session=True,
        )
        for fd in high:
            os.close(fd)
        self.events: list[dict] = []
        self._buf, self._id, self.session = b"", 0, None
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Network", "Log"):
            self.call(f"{domain}.enable")

    def call(self, method: str, timeout: float = 30.0, **params) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if self.session:  # the tab's session; the browser-level calls before it have none
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buf:
                ready, _, _ = select.select([self._r], [], [], max(0.0, deadline - time.monotonic()))
                chunk = os.read(self._r, 1 << 20) if ready else b""
                if not chunk:
                    raise TimeoutError(f"Chromium did not answer {method} (see chromium.log)")
                self._buf += chunk
            raw, _, self._buf = self._buf.partition(b"\0")
            reply = json.loads(raw)
            if reply.get("id") != self._id:
                self.events.append(reply)
            elif "error" in reply:
                raise RuntimeError(f"{method}: {reply['error']}")
            else:
                return reply["result"]

    def evaluate(self, expression: str):
        out = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in out:
            raise RuntimeError(f"{expression[:80]}: {out['exceptionDetails']}")
        return out["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 10.0):
        """The expression's value once truthy (polled every 0.1 s). A DOM node comes back as {}
        (falsy here): test it against null in the expression."""
        deadline = time.monotonic() + timeout
        while not (value := self.evaluate(expression)):
            if time.monotonic() > deadline:
                status = self.evaluate("document.getElementById('status')?.textContent")
                raise AssertionError(f"after {timeout:.0f}s still falsy: {expression[:160]} (page status: {status})")
            time.sleep(0.1)
        return value

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'")

    def screenshot(self, path: Path) -> Path:
        height = self.evaluate("document.documentElement.scrollHeight")
        self.call("Emulation.setDeviceMetricsOverride", width=1400, height=height, deviceScaleFactor=1, mobile=False)
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        return path

    def errors(self) -> list[str]:
        """JavaScript exceptions, console errors and the browser's own error entries (a CSP refusal, a failed load)."""
        self.call("Runtime.evaluate", expression="0")  # collect events that arrived meanwhile
        out = []
        for e in self.events:
            p = e.get("params", {})
            if e.get("method") == "Runtime.exceptionThrown":
                details = p["exceptionDetails"]
                out.append(details.get("exception", {}).get("description") or details.get("text", "exception"))
            elif e.get("method") == "Runtime.consoleAPICalled" and p.get("type") == "error":
                out.append(" ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
            elif e.get("method") == "Log.entryAdded" and p["entry"]["level"] == "error":
                out.append(f"{p['entry'].get('url', '')}: {p['entry']['text']}")
        return out

    def requested_urls(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]

    def close(self) -> None:
        self.session = None  # Browser.close is the browser's command, not the tab's
        try:
            self.call("Browser.close", timeout=5)
        except (OSError, TimeoutError, RuntimeError):
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the browser's own process group, started above
            self.proc.wait()
        for fd in (self._r, self._w):
            os.close(fd)
        self.log.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    binary = chromium_binary()
    assert binary, NO_BROWSER + " (PDD_REQUIRE_BROWSER=1)"
    b = Browser(binary, tmp_path_factory.mktemp("browser"))
    yield b
    b.close()


def _drawn(request_id: str, outcome: str = "finished") -> str:
    """JS: what the waterfall of `request_id` shows, read back from its SVG (null until it is drawn
    from the request in state `outcome`: a drawing made while it ran may still be on the page)."""
    return f"""(() => {{
      const svg = document.querySelector('#waterfall svg[data-request-id="{request_id}"][data-outcome="{outcome}"]');
      if (!svg) return null;
      const num = (el, a) => parseFloat(el.getAttribute(a));
      const bars = {{}};
      for (const r of svg.querySelectorAll('rect[data-stage]'))
        bars[r.dataset.stage] = {{start: num(r, 'data-start-ms'), dur: num(r, 'data-dur-ms')}};
      const gap = svg.querySelector('rect.gap');
      return {{bars, relay: svg.querySelectorAll('.tick-relay').length, main: svg.querySelectorAll('.tick-main').length,
               handoff: svg.querySelectorAll('.tick-handoff').length, ttft: num(svg.querySelector('.ttft'), 'data-ms'),
               end: num(svg.querySelector('.end-mark'), 'data-ms'), gap: gap ? num(gap, 'data-dur-ms') : null,
               figures: document.getElementById('wf-figures').textContent}};
    }})()"""


def test_a_relayed_catch_up_request_draws_its_waterfall(cluster, operator, model_id, browser, tmp_path):
    browser.open(cluster.url + "/dashboard")
    browser.wait_for("document.querySelector('[data-dc=B] [data-instance=\"md-0\"][data-state=up]') !== null")
    assert browser.evaluate("document.querySelector('[data-dc=A] [data-instance=\"rld-0\"]') !== null")
    body = {
        "model": model_id,
        "prompt": fresh_prompt(40, "dashboard"),
        "max_tokens": 240,
        "temperature": 0,
        "ignore_eos": True,
        "pdd": {"pipeline": "p-rld-md", "handoff": "catchup"},
    }
    events: list[dict] = []
    result: dict = {}
    worker = threading.Thread(
        target=lambda: result.update(
            out=stream_completion(cluster.url + "/v1/completions", body, timeout=240, events=events)
        )
    )
    # as test_relay's _with_backlog: main-decode's KV crawls at 1 Mbps while the relay streams 20
    # tokens, then the line opens. What is left then (a 64 KiB chunk reserved at 1 Mbps, ~0.5 s,
    # the rest of the KV, the extend, the catch-up) takes about a second whatever the machine: the
    # relay's 220 more tokens outlast it even at 5 ms a step
    try:
        operator.wan(bandwidth_mbps=1.0)
        worker.start()
        deadline = time.monotonic() + 120
        while not events and worker.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        rid = events[0]["id"]  # every chunk carries the request id
        # live, no reload: the row shows while it streams, and the line shows the KV crossing. Both
        # are states that pass (the request ends, the line opens), so a long wait on a busy machine
        # cannot let a page that never shows them pass; the line stays at 1 Mbps until it does
        browser.wait_for(f"document.querySelector('tr[data-request-id=\"{rid}\"][data-outcome=running]') !== null", 15)
        browser.wait_for("parseFloat(document.querySelector('[data-direction=a-b]')?.dataset.bytesPerS) > 10000", 15)
        while len(events) < 20 and worker.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(events) >= 20, f"the relay streamed {len(events)} tokens"
    finally:
        operator.wan(bandwidth_mbps=cluster.cfg.wan.bandwidth_mbps)
        worker.join(240)
    _, pdd, _ = result["out"]
    roles, t = pdd["tokens_by_role"], pdd["timings_ms"]
    assert pdd["handoff"] == "catchup" and roles["rld"] >= 20 and roles["md"] >= 1, pdd

    browser.wait_for(f"document.querySelector('tr[data-request-id=\"{rid}\"][data-outcome=finished]') !== null", 15)
    browser.evaluate(f"document.querySelector('tr[data-request-id=\"{rid}\"]').click()")
    drawn = browser.wait_for(_drawn(rid))
    bars = drawn["bars"]
    assert drawn["relay"] == roles["rld"] and drawn["main"] == roles["md"]  # a tick per token, by role
    assert drawn["handoff"] == pdd["handoff_chunks"] and drawn["gap"] == pytest.approx(pdd["handoff_gap_ms"])
    for stage in ("queue", "prefill", "kv_local", "kv_wan", "extend"):  # exactly the pdd object's figures
        assert bars[stage]["dur"] == pytest.approx(t[stage], abs=1e-6), (stage, bars[stage], t)
    assert bars["prefill"]["start"] == pytest.approx(t["queue"])
    assert bars["kv_local"]["start"] == bars["kv_wan"]["start"] == pytest.approx(t["queue"] + t["prefill"])
    assert drawn["ttft"] == pytest.approx(t["ttft"], abs=1e-6) and drawn["end"] == pytest.approx(t["e2e"], abs=50)
    shot = browser.screenshot(tmp_path / "dashboard.png")
    print(
        f"\nscreenshot {shot}\nwaterfall of {rid}: {drawn['figures']}\npdd timings_ms {t}, handoff_gap_ms "
        f"{pdd['handoff_gap_ms']:.1f}, handoff_chunks {pdd['handoff_chunks']}, tokens {roles}"
    )
    assert browser.errors() == []


def test_the_page_fetches_from_the_gateway_only(cluster, browser):
    browser.open(cluster.url + "/dashboard")
    polls = browser.wait_for("parseInt(document.body.dataset.polls)")
    browser.wait_for(f"parseInt(document.body.dataset.polls) >= {polls + 2}", 15)
    urls = browser.requested_urls()
    assert any(u.startswith(cluster.url + "/dashboard/api/state") for u in urls), urls
    strays = [u for u in urls if not u.startswith(cluster.url + "/") and u not in ("about:blank", "data:,")]
    assert strays == [], strays
    assert browser.errors() == []
