"""Headless Chromium over its DevTools protocol, for rendering tests.

``render(url)`` starts Debian's ``chromium`` (tools/setup-system.sh) with a
throw-away profile, loads ``url`` in a fresh tab and returns what a test
needs to judge the page: its DOM after load, a PNG screenshot, every console
message and uncaught exception, every network request the page made, and
the answer of any JavaScript expressions asked for (``evaluate``). Chromium
is killed and its profile removed afterwards, whatever happened.

Only loopback traffic: the browser's own background services (updates,
safe browsing, DNS prefetch...) are switched off, and every host name but
127.0.0.1/localhost resolves to nothing, so a page that tried to reach out
would show it as a failed request rather than send anything.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import websocket

CHROMIUM = "chromium"
START_TIMEOUT_S = 30.0
LOAD_TIMEOUT_S = 30.0

FLAGS = (
    "--headless",
    "--no-sandbox",  # tests run as root, where the sandbox refuses to start
    "--disable-gpu",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-domain-reliability",
    "--disable-client-side-phishing-detection",
    "--disable-features=Translate,OptimizationHints,MediaRouter,DialMediaRouteProvider",
    "--dns-prefetch-disable",
    "--no-pings",
    "--metrics-recording-only",
    "--mute-audio",
    "--hide-scrollbars",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1",
    "--remote-debugging-port=0",
    "--remote-allow-origins=*",
)


def available() -> bool:
    return shutil.which(CHROMIUM) is not None


@dataclass
class Rendered:
    url: str
    dom: str
    screenshot: bytes  # PNG
    console: list[dict[str, Any]] = field(default_factory=list)  # {"level", "text", "source"}
    exceptions: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)  # every URL the page asked for
    failed: list[dict[str, Any]] = field(default_factory=list)  # {"url", "error"}
    values: dict[str, Any] = field(default_factory=dict)  # evaluate's answers

    @property
    def errors(self) -> list[str]:
        """Console errors and warnings, uncaught exceptions and failed loads."""
        out = [
            f"{m['level']}: {m['text']}" for m in self.console if m["level"] in ("error", "warning")
        ]
        out += [f"exception: {e}" for e in self.exceptions]
        out += [f"failed: {f['url']} ({f['error']})" for f in self.failed]
        return out


class _DevTools:
    """One websocket to the browser; commands to a page go to its session."""

    def __init__(self, ws_url: str) -> None:
        self.ws = websocket.create_connection(ws_url, timeout=LOAD_TIMEOUT_S, suppress_origin=True)
        self._id = 0
        self.events: list[dict[str, Any]] = []

    def close(self) -> None:
        self.ws.close()

    def send(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None
    ) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self.ws.send(json.dumps(msg))
        self.ws.settimeout(LOAD_TIMEOUT_S)  # drain() leaves a short one
        while True:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result
            self.events.append(reply)

    def wait_for(self, method: str, deadline: float) -> dict[str, Any]:
        for i, ev in enumerate(self.events):
            if ev.get("method") == method:
                return self.events.pop(i)
        while time.monotonic() < deadline:
            self.ws.settimeout(max(0.1, deadline - time.monotonic()))
            ev = json.loads(self.ws.recv())
            if ev.get("method") == method:
                return ev
            self.events.append(ev)
        raise TimeoutError(f"no {method} within the deadline")

    def drain(self, quiet_s: float = 0.3) -> None:
        """Read the events still arriving (late console messages) until quiet."""
        self.ws.settimeout(quiet_s)
        try:
            while True:
                self.events.append(json.loads(self.ws.recv()))
        except websocket.WebSocketTimeoutException:
            pass


def _start(profile: Path) -> tuple[subprocess.Popen[bytes], str]:
    # Chromium puts its singleton socket in TMPDIR (org.chromium.Chromium.*)
    # and, killed, leaves it there: inside the profile it goes with it.
    tmp = profile / "tmp"
    tmp.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "TMPDIR": str(tmp)},
        start_new_session=True,  # the launcher script and every child: one group to kill
    )
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited {proc.returncode} at start")
        try:
            lines = port_file.read_text().split()
        except FileNotFoundError:
            lines = []
        if len(lines) >= 2:
            return proc, f"ws://127.0.0.1:{lines[0]}{lines[1]}"
        time.sleep(0.1)
    raise RuntimeError("chromium did not open its DevTools port in time")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
    # The renderer and GPU helpers are in the same group: make sure none stays.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def render(
    url: str,
    *,
    width: int = 1200,
    height: int = 900,
    evaluate: dict[str, str] | None = None,
) -> Rendered:
    """Load ``url`` in a fresh headless Chromium and report on it (module docstring).

    ``evaluate``: name -> JavaScript expression, run after load; its JSON
    value is in ``values[name]``.
    """
    profile = Path(tempfile.mkdtemp(prefix="kickass-chromium-"))
    proc: subprocess.Popen[bytes] | None = None
    dt: _DevTools | None = None
    try:
        proc, ws_url = _start(profile)
        dt = _DevTools(ws_url)
        target = dt.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = dt.send("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"
        ]
        for domain in ("Page", "Runtime", "Log", "Network"):
            dt.send(f"{domain}.enable", session=session)
        dt.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            session=session,
        )
        dt.events.clear()  # about:blank's own events
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        nav = dt.send("Page.navigate", {"url": url}, session=session)
        if nav.get("errorText"):
            raise RuntimeError(f"cannot load {url}: {nav['errorText']}")
        dt.wait_for("Page.loadEventFired", deadline)
        dt.drain()
        values: dict[str, Any] = {}
        for name, expr in (evaluate or {}).items():
            res = dt.send(
                "Runtime.evaluate",
                {"expression": f"JSON.stringify({expr})", "returnByValue": True},
                session=session,
            )
            if "exceptionDetails" in res:
                raise RuntimeError(f"evaluate {name}: {res['exceptionDetails']}")
            values[name] = json.loads(res["result"]["value"])
        dom = dt.send(
            "Runtime.evaluate",
            {"expression": "document.documentElement.outerHTML", "returnByValue": True},
            session=session,
        )["result"]["value"]
        # The whole page, not just the first screen.
        size = dt.send(
            "Runtime.evaluate",
            {
                "expression": "JSON.stringify([document.documentElement.scrollWidth,"
                " document.documentElement.scrollHeight])",
                "returnByValue": True,
            },
            session=session,
        )
        w, h = json.loads(size["result"]["value"])
        shot = dt.send(
            "Page.captureScreenshot",
            {
                "format": "png",
                "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": max(w, 1), "height": max(h, 1), "scale": 1},
            },
            session=session,
        )
        dt.drain()
        out = Rendered(url, dom, base64.b64decode(shot["data"]), values=values)
        urls: dict[str, str] = {}
        for ev in dt.events:
            method, p = ev.get("method"), ev.get("params", {})
            if method == "Runtime.consoleAPICalled":
                text = " ".join(
                    str(a.get("value", a.get("description", ""))) for a in p.get("args", [])
                )
                out.console.append(
                    {"level": _level(p.get("type", "")), "text": text, "source": "console"}
                )
            elif method == "Log.entryAdded":
                e = p.get("entry", {})
                out.console.append(
                    {"level": e.get("level"), "text": e.get("text"), "source": e.get("source")}
                )
            elif method == "Runtime.exceptionThrown":
                out.exceptions.append(json.dumps(p.get("exceptionDetails", {}))[:500])
            elif method == "Network.requestWillBeSent":
                urls[p.get("requestId", "")] = p.get("request", {}).get("url", "")
                out.requests.append(urls[p.get("requestId", "")])
            elif method == "Network.loadingFailed":
                url = urls.get(p.get("requestId", ""), p.get("requestId"))
                out.failed.append({"url": url, "error": p.get("errorText")})
        return out
    finally:
        if dt is not None:
            with contextlib.suppress(Exception):  # the browser is going away anyway
                dt.close()
        if proc is not None:
            _stop(proc)
        shutil.rmtree(profile, ignore_errors=True)


def _level(kind: str) -> str:
    return {"error": "error", "assert": "error", "warning": "warning", "warn": "warning"}.get(
        kind, "info"
    )


def png_size(png: bytes) -> tuple[int, int]:
    """Width and height from a PNG's header."""
    if png[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")


def png_colours(png: bytes, sample: int = 20000) -> int:
    """How many distinct colours a screenshot has (a blank page has one)."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(png)) as img:
        rgb = img.convert("RGB")
        w, h = rgb.size
        step = max(1, (w * h) // sample)
        data = rgb.tobytes()
        return len({data[i : i + 3] for i in range(0, len(data), 3 * step)})


# Marks of the figures (kickass_analysis.figures): per figure and series, a
# point is a <use> inside its tagged group, a bar is one tagged group.
COUNT_MARKS = """(() => {
  const out = {};
  for (const svg of document.querySelectorAll('svg.ka-figure')) {
    const fig = {};
    for (const el of svg.querySelectorAll('.ka-mark')) {
      const uses = el.querySelectorAll('use').length;
      const s = el.getAttribute('data-series');
      fig[s] = (fig[s] || 0) + (uses || 1);
    }
    out[svg.getAttribute('data-figure')] = fig;
  }
  return out;
})()"""
