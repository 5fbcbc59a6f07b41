"""The dashboard page in a real browser: headless Chromium (Debian's ``chromium`` package;
``make test`` installs it where missing) renders a page built from a small two-commit history
(tests/dashboard_fixture.py).  Checked through the DevTools protocol, spoken with the standard
library: no console message at level error, no uncaught exception, no failed or attempted
network load; the key figures are in the rendered DOM; the screenshot is not blank (its pixels
decoded here, PNG by hand).

Set ``UNIRADIX_DASHBOARD_SHOT=FILE.png`` to keep a full-page screenshot for a human to look at.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import urllib.request
import zlib

import pytest

import dashboard_fixture as fx
from uniradix.conformance.bench import dashboard as D
from uniradix.conformance.bench import results as R

BROWSERS = ("chromium", "chromium-browser")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1")
TIMEOUT = 60.0


def find_browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


# ---- a minimal WebSocket client (RFC 6455): text frames out, text frames in ------------------


class WebSocket:
    def __init__(self, url: str, timeout: float = TIMEOUT) -> None:
        m = re.match(r"ws://([^/:]+):(\d+)(/.*)", url)
        assert m, url
        host, port, path = m.group(1), int(m.group(2)), m.group(3)
        self.sock = socket.create_connection((host, port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                           f"Sec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("DevTools closed the connection during the handshake")
            head += chunk
        head, self.buf = head.split(b"\r\n\r\n", 1)
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise ConnectionError(f"DevTools refused the WebSocket: {head[:200]!r}")

    def _read(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("DevTools closed the connection")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def send(self, text: str) -> None:
        data = text.encode()
        n = len(data)
        head = bytes([0x81])
        if n < 126:
            head += bytes([0x80 | n])
        elif n < 1 << 16:
            head += bytes([0x80 | 126]) + struct.pack(">H", n)
        else:
            head += bytes([0x80 | 127]) + struct.pack(">Q", n)
        mask = os.urandom(4)
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    def recv(self) -> str:
        parts = []
        while True:
            b0, b1 = self._read(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._read(8))[0]
            mask = self._read(4) if b1 & 0x80 else None
            data = self._read(n)
            if mask:
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
            op = b0 & 0x0F
            if op == 0x8:
                raise ConnectionError("DevTools closed the WebSocket")
            if op == 0x9:  # ping: answer, keep reading
                self.sock.sendall(bytes([0x8A, 0x80 | len(data)]) + b"\0\0\0\0" + data)
                continue
            if op in (0x1, 0x0):
                parts.append(data)
                if b0 & 0x80:
                    return b"".join(parts).decode()

    def close(self) -> None:
        self.sock.close()


class DevTools:
    """Commands to one page target; every event seen on the way is kept in ``events``."""

    def __init__(self, ws_url: str) -> None:
        self.ws = WebSocket(ws_url)
        self.next_id = 0
        self.events: list[dict] = []

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        my_id = self.next_id
        self.ws.send(json.dumps({"id": my_id, "method": method, "params": params}))
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == my_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            if "method" in msg:
                self.events.append(msg)
        raise TimeoutError(method)

    def wait_for(self, event: str, since: int = 0) -> dict:
        """The first ``event`` at or after ``events[since]``, waiting for it if need be."""
        deadline = time.monotonic() + TIMEOUT
        for e in self.events[since:]:
            if e["method"] == event:
                return e
        while time.monotonic() < deadline:
            msg = json.loads(self.ws.recv())
            if "method" in msg:
                self.events.append(msg)
                if msg["method"] == event:
                    return msg
        raise TimeoutError(event)

    def evaluate(self, expression: str):
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")


# ---- PNG decoding (8-bit RGB or RGBA, non-interlaced: what Chromium writes) -----------------


def decode_png(data: bytes) -> tuple[int, int, int, bytes]:
    """(width, height, channels, raw pixel rows without filter bytes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, [], 0
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and ctype in (2, 6) and interlace == 0, (depth, ctype, interlace)
            channels = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + n
    raw = zlib.decompress(b"".join(idat))
    stride = width * channels
    out = bytearray()
    prev = bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        if f == 1:
            for i in range(channels, stride):
                line[i] = (line[i] + line[i - channels]) & 0xFF
        elif f == 2:
            line = bytearray((a + b) & 0xFF for a, b in zip(line, prev, strict=True))
        elif f == 3:
            for i in range(stride):
                left = line[i - channels] if i >= channels else 0
                line[i] = (line[i] + ((left + prev[i]) >> 1)) & 0xFF
        elif f == 4:
            for i in range(stride):
                a = line[i - channels] if i >= channels else 0
                b = prev[i]
                c = prev[i - channels] if i >= channels else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        out += line
        prev = line
    return width, height, channels, bytes(out)


# ---- the test --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser_page(tmp_path_factory):
    exe = find_browser()
    if exe is None:
        pytest.skip("no headless Chromium here (`make test` installs Debian's `chromium`; "
                    "or apt-get install chromium)")
    root = tmp_path_factory.mktemp("dashboard")
    history = R.load_history(fx.make_history(str(root)))
    page = D.write_page(history, str(root / "dashboard.html"))
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        ws_url, seen = None, []
        deadline = time.monotonic() + TIMEOUT
        while ws_url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            seen.append(line)
            m = re.search(r"DevTools listening on (ws://\S+)", line)
            if m:
                ws_url = m.group(1)
        assert ws_url, "Chromium did not start its DevTools endpoint:\n" + "".join(seen[-20:])
        port = int(re.match(r"ws://[^:]+:(\d+)/", ws_url).group(1))
        no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        targets = json.load(no_proxy.open(f"http://127.0.0.1:{port}/json/list", timeout=TIMEOUT))
        target = next(t for t in targets if t.get("type") == "page")
        dt = DevTools(target["webSocketDebuggerUrl"])
        for domain in ("Page", "Runtime", "Log", "Network"):
            dt.call(f"{domain}.enable")
        dt.call("Emulation.setDeviceMetricsOverride", width=1400, height=900, deviceScaleFactor=1,
                mobile=False)
        dt.call("Page.navigate", url="file://" + os.path.abspath(page))
        dt.wait_for("Page.loadEventFired")
        yield dt, page
        dt.ws.close()
    finally:
        proc.kill()
        proc.wait(timeout=30)
        if proc.stderr:
            proc.stderr.close()
        shutil.rmtree(profile, ignore_errors=True)


def page_problems(dt: DevTools) -> tuple[list, list]:
    """(errors: console errors, uncaught exceptions, failed loads; URLs fetched other than
    file://) among the events so far."""
    dt.evaluate("1")  # a round trip: the events queued before it are in
    errors = [e for e in dt.events
              if e["method"] == "Runtime.exceptionThrown"
              or (e["method"] == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "assert"))
              or (e["method"] == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")
              or e["method"] == "Network.loadingFailed"]
    fetched = [e["params"]["request"]["url"] for e in dt.events
               if e["method"] == "Network.requestWillBeSent"
               and not e["params"]["request"]["url"].startswith("file://")]
    return errors, fetched


def test_no_console_errors_exceptions_or_network(browser_page):
    dt, page = browser_page
    errors, fetched = page_problems(dt)
    assert errors == [], json.dumps(errors, indent=1)[:3000]
    assert fetched == []


def test_the_checks_see_a_planted_fault(browser_page, tmp_path):
    """The same checks on a copy of the page with a script error and a remote image planted
    (the page's Content-Security-Policy blocks both, and says so on the console)."""
    dt, page = browser_page
    with open(page, encoding="utf-8") as f:
        html = f.read()
    bad = tmp_path / "planted.html"
    bad.write_text(html.replace("</main>", '<img src="http://192.0.2.1/x.png">'
                                '<script>undefinedFunction()</script></main>'), encoding="utf-8")
    dt.events.clear()
    dt.call("Page.navigate", url="file://" + str(bad))
    dt.wait_for("Page.loadEventFired")
    errors, _ = page_problems(dt)
    texts = " | ".join(json.dumps(e["params"])[:300] for e in errors)
    assert "Content Security Policy" in texts, texts or "a planted fault went unseen"
    # back to the real page for the tests after this one
    dt.events.clear()
    dt.call("Page.navigate", url="file://" + os.path.abspath(page))
    dt.wait_for("Page.loadEventFired")


def test_the_key_figures_are_in_the_rendered_page(browser_page):
    dt, _ = browser_page
    info = dt.evaluate("""JSON.stringify({
        figures: [...document.querySelectorAll('[data-figure]')].map(e => e.dataset.figure),
        history: [...document.querySelectorAll('[data-history]')].map(e => e.dataset.history),
        svgs: document.querySelectorAll('svg').length,
        points: document.querySelectorAll('[data-history] circle').length,
        pills: [...document.querySelectorAll('.pill')].map(e => e.textContent),
        sections: [...document.querySelectorAll('h2')].map(e => e.id),
        text: document.body.innerText,
        width: document.documentElement.scrollWidth,
    })""")
    info = json.loads(info)
    assert sorted(info["figures"]) == ["shared-prefix/full/p1/60req", "shared-prefix/full/p16/60req"]
    assert "shared-prefix/full/p1/60req|fast/spec" in info["history"]
    assert info["points"] >= 2 * len(info["history"])  # both commits on every ratio's line
    assert info["svgs"] >= 7  # 2 bar charts, 2 ratio and 2 req/s histories, memory
    assert any("conformance: 29,000 steps, 0 divergences" in p for p in info["pills"])
    assert any("2 commits of history" in p for p in info["pills"])
    sections = {"ratios", "history", "latency", "outcomes", "memory", "kernels", "conformance"}
    assert sections <= set(info["sections"])
    for text in ("fast/spec", "identical outcomes", "B/token", "a1a1a1a1", "b2b2b2b2", "load 0.50/0.40/0.30"):
        assert text in info["text"], text
    assert info["width"] <= 1400, "the page scrolls sideways at 1400 px"


def test_the_screenshot_is_not_blank(browser_page):
    dt, _ = browser_page
    shot = base64.b64decode(dt.call("Page.captureScreenshot", format="png",
                                    clip={"x": 0, "y": 0, "width": 1400, "height": 900,
                                          "scale": 0.5})["data"])
    w, h, ch, px = decode_png(shot)
    assert (w, h) == (700, 450)
    pixels = [px[i:i + 3] for i in range(0, len(px), ch)]
    colours = set(pixels)
    background = max(colours, key=pixels.count) if len(colours) < 50 else None
    assert len(colours) > 50, f"only {len(colours)} colours: a blank page?"
    if background is not None:
        assert sum(p != background for p in pixels) > 0.2 * len(pixels)
    # the header band is dark, the body light, and fast's teal bars are drawn
    assert sum(px[(10 * w + x) * ch:(10 * w + x) * ch + 3] < b"\x40\x40\x40"[:3] for x in range(0, w, 7)) > 0
    teal = sum(1 for p in pixels if abs(p[0] - 0x0F) < 24 and abs(p[1] - 0x76) < 24 and abs(p[2] - 0x6E) < 24)
    assert teal > 200, f"{teal} teal pixels: fast's bars not drawn?"
    keep = os.environ.get("UNIRADIX_DASHBOARD_SHOT")
    if keep:
        full = dt.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        with open(keep, "wb") as f:
            f.write(base64.b64decode(full))
