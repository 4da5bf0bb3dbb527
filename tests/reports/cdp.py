"""A minimal Chrome DevTools Protocol driver over ``--remote-debugging-pipe`` (stdlib only, no websockets).

Chromium reads NUL-terminated JSON commands from fd 3 and writes replies / events to fd 4. Enough of CDP for the
report tests: open a page, collect console errors / exceptions / failed loads, evaluate JavaScript, screenshot.

    python tests/reports/cdp.py reports/out/latest/index.html shot.png   # look at a report
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-pipe")


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


class CdpError(RuntimeError):
    pass


class Browser:
    """One headless Chromium with one page. Use as a context manager; the process is ended on exit."""

    def __init__(self, binary: str | None = None, timeout: float = 30.0, width: int = 1400, height: int = 900):
        self.binary = binary or find_chromium()
        if not self.binary:
            raise CdpError("no chromium found")
        self.timeout = timeout
        self.size = (width, height)
        self.events: list[dict[str, Any]] = []
        self._buffer = b""
        self._next_id = 0
        self._proc: subprocess.Popen | None = None
        self._profile = tempfile.mkdtemp(prefix="dsv4-chromium-")
        self.session: str | None = None

    # ---- process ------------------------------------------------------------------------------------------------
    def __enter__(self) -> "Browser":
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def wire_fds() -> None:  # in the child: fd 3 = commands in, fd 4 = replies out
            a, b = os.dup(to_chrome_r), os.dup(from_chrome_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self._proc = subprocess.Popen([self.binary, *FLAGS, f"--user-data-dir={self._profile}", "about:blank"],
                                      preexec_fn=wire_fds, close_fds=False, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        target = self.call("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 session=False)["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            self.call(f"{domain}.enable")
        self.call("Emulation.setDeviceMetricsOverride", {"width": self.size[0], "height": self.size[1],
                                                         "deviceScaleFactor": 1, "mobile": False})
        return self

    def __exit__(self, *exc: object) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                self.call("Browser.close", session=False, timeout=5)
            except (CdpError, OSError):
                pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        for fd in (self._to_chrome, self._from_chrome):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self._profile, ignore_errors=True)

    # ---- protocol -----------------------------------------------------------------------------------------------
    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CdpError("timed out waiting for chromium")
            ready, _, _ = select.select([self._from_chrome], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(self._from_chrome, 1 << 20)
                if not chunk:
                    raise CdpError("chromium closed the pipe")
                self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, params: dict[str, Any] | None = None, *, session: bool = True,
             timeout: float | None = None) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session and self.session:
            message["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise CdpError(f"{method}: {reply['error'].get('message')}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, timeout: float | None = None) -> dict[str, Any]:
        for event in self.events:
            if event.get("method") == method:
                return event
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            event = self._read(deadline)
            self.events.append(event)
            if event.get("method") == method:
                return event

    # ---- page helpers -------------------------------------------------------------------------------------------
    def open(self, path: Path | str) -> None:
        """Navigate to a local file and wait for its load event."""
        self.events.clear()
        url = path if str(path).startswith(("file:", "about:", "data:")) else Path(path).resolve().as_uri()
        self.call("Page.navigate", {"url": url})
        self.wait_event("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True})
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise CdpError(f"JS exception: {details.get('exception', {}).get('description') or details.get('text')}")
        return result["result"].get("value")

    def console_errors(self) -> list[str]:
        """Uncaught exceptions, console.error/assert calls and browser-logged errors (CSP, failed loads)."""
        found = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                found.append("exception: " + str(details.get("exception", {}).get("description") or
                                                 details.get("text")))
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                found.append("console." + params["type"] + ": " +
                             " ".join(str(a.get("value", a.get("description"))) for a in params.get("args", [])))
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                found.append("log: " + str(params["entry"].get("text")))
        return found

    def screenshot(self, path: Path | str, full_page: bool = True) -> Path:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            metrics = self.call("Page.getLayoutMetrics")
            size = metrics.get("cssContentSize") or metrics["contentSize"]
            params.update(captureBeyondViewport=True, clip={"x": 0, "y": 0, "width": self.size[0],
                                                            "height": min(size["height"], 16000), "scale": 1})
        data = self.call("Page.captureScreenshot", params, timeout=60)["data"]
        path = Path(path)
        path.write_bytes(base64.b64decode(data))
        return path


if __name__ == "__main__":
    page, out = sys.argv[1], sys.argv[2]
    with Browser() as browser:
        browser.open(page)
        for script in sys.argv[3:]:
            print(browser.evaluate(script))
        browser.screenshot(out, full_page="--viewport" not in os.environ.get("CDP_SHOT", ""))
        print("\n".join(browser.console_errors()) or "no console errors")
