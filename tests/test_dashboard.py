"""GET /dashboard in a real headless Chromium (Debian's `chromium`) against `glm53 serve --demo`:
the page renders, its numbers move while a request runs, and it logs no console error. The page
is driven over Chromium's DevTools protocol (a websocket on 127.0.0.1)."""

import base64
import itertools
import json
import shutil
import subprocess
import threading
import time

import httpx
import openai
import pytest
from serving_kit import Server, free_port
from websockets.sync.client import connect

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (.ci/run installs Debian's chromium)"
)


class DevTools:
    """One page target of a headless Chromium, over the DevTools protocol. Console errors and
    uncaught exceptions are collected in `errors` as they arrive."""

    def __init__(self, ws):
        self.ws = ws
        self.ids = itertools.count(1)
        self.errors: list[str] = []

    def call(self, method: str, **params) -> dict:
        call_id = next(self.ids)
        self.ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
            self._event(message)

    def _event(self, message: dict) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            self.errors.append(f"console.{params['type']}: {params['args']}")
        elif method == "Runtime.exceptionThrown":
            self.errors.append(f"exception: {params['exceptionDetails']}")
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            self.errors.append(f"log: {params['entry']['text']}")

    def text(self, element_id: str) -> str:
        result = self.call(
            "Runtime.evaluate",
            expression=f"document.getElementById({element_id!r}).textContent",
            returnByValue=True,
        )
        return result["result"].get("value", "")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dashboard")
    server = Server(
        ["--demo", "--engine", "cpu", "--cache-dir", str(tmp / "cache"), "-cs", "2048"],
        log_path=tmp / "log",
    )
    server.wait_ready(timeout_s=900)
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture
def page(tmp_path):
    port = free_port()
    browser = subprocess.Popen(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",  # CI runs as root
            "--disable-gpu",
            "--no-first-run",
            "--remote-debugging-address=127.0.0.1",
            f"--remote-debugging-port={port}",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1200,900",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        targets = []
        while not targets and time.monotonic() < deadline:
            try:
                listed = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=2).json()
                targets = [t for t in listed if t["type"] == "page"]
            except httpx.HTTPError:
                time.sleep(0.2)
        assert targets, "chromium opened no page target"
        with connect(
            targets[0]["webSocketDebuggerUrl"], max_size=64 * 2**20, open_timeout=30
        ) as ws:
            devtools = DevTools(ws)
            devtools.call("Runtime.enable")
            devtools.call("Log.enable")
            devtools.call("Page.enable")
            yield devtools
    finally:
        browser.terminate()
        browser.wait(timeout=30)


def _wait_text(page: DevTools, element_id: str, predicate, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = page.text(element_id)
        if predicate(value):
            return value
        time.sleep(0.2)
    raise AssertionError(f"#{element_id} stayed {value!r}")


def test_dashboard_renders_and_its_numbers_move_while_a_request_runs(server, page, tmp_path):
    page.call("Page.navigate", url=server.url + "/dashboard")
    assert _wait_text(page, "status", lambda v: v == "ready") == "ready"
    assert page.text("tok_s") == "0.0"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
    done = threading.Event()

    def run():
        client.chat.completions.create(
            model="glm-5.3-flash",
            messages=[{"role": "user", "content": "Tell me a long story"}],
            max_tokens=60,
            temperature=0,
        )
        done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert _wait_text(page, "running", lambda v: v == "1") == "1"
    tok_s = float(_wait_text(page, "tok_s", lambda v: float(v) > 0))
    assert tok_s > 0
    layers = page.call(
        "Runtime.evaluate",
        expression="[...document.querySelectorAll('#layers tr')].map(r => r.cells[0].textContent)",
        returnByValue=True,
    )["result"]["value"]
    moe_layers = httpx.get(server.url + "/stats").json()["engine"]["tiers"]["layers"]
    assert layers == [f"layer {i}" for i in moe_layers]
    fill = page.call(
        "Runtime.evaluate",
        expression="document.getElementById('fill').textContent",
        returnByValue=True,
    )["result"]["value"]
    assert fill.startswith("RAM tier")
    thread.join(600)
    assert done.is_set()
    _wait_text(page, "running", lambda v: v == "0")
    cpu_lane = page.call(
        "Runtime.evaluate",
        expression="document.getElementById('lanes').rows[2].cells[2].textContent",
        returnByValue=True,
    )["result"]["value"]
    assert int(cpu_lane) > 0  # the finished request's lane picks, from /stats
    shot = page.call("Page.captureScreenshot", format="png")["data"]
    png = base64.b64decode(shot)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "dashboard.png").write_bytes(png)
    assert page.errors == []
