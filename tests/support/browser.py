"""A real headless Chromium for tests, driven over the DevTools protocol (CDP) on a websocket.

    with Browser(profile_dir) as b:
        page = b.open("http://127.0.0.1:9003/dashboard?token=...")
        page.wait_for("document.body.dataset.refreshes >= 1", timeout=20)
        page.screenshot("dash.png")

Uses the system ``chromium`` (Debian's package) and the ``websocket-client`` package (the dev
extra); :func:`find_chromium` returns None when there is no browser. Every call takes a
timeout; a browser that stops answering is an error, never a hang.
"""

from __future__ import annotations

import base64
import itertools
import json
import re
import shutil
import subprocess
import time
from typing import Any

from kvplane.common.errors import Timeout
from kvplane.common.procs import wait_for_line

_LISTENING = re.compile(r"DevTools listening on (ws://\S+)")


def find_chromium() -> str | None:
    """Path of a Chromium/Chrome binary, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Page:
    """One tab, attached with a flat CDP session."""

    def __init__(self, browser: Browser, session: str) -> None:
        self.browser, self.session = browser, session

    def call(self, method: str, params: dict[str, Any] | None = None, timeout: float = 20.0) -> Any:
        return self.browser.call(method, params, self.session, timeout)

    def navigate(self, url: str, timeout: float = 30.0) -> None:
        """Load ``url`` and wait for its load event."""
        self.browser.events.clear()
        self.call("Page.navigate", {"url": url}, timeout)
        self.browser.wait_event("Page.loadEventFired", self.session, timeout)

    def evaluate(self, expression: str, timeout: float = 20.0) -> Any:
        """The JSON value of ``expression`` in the page (awaits promises).

        Raises:
            RuntimeError: the expression threw.
        """
        got = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                             "awaitPromise": True}, timeout)
        if "exceptionDetails" in got:
            raise RuntimeError(f"{expression!r} threw: {got['exceptionDetails']}")
        return got["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0) -> Any:
        """Poll ``expression`` until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise Timeout(f"{expression!r} still falsy after {timeout}s")
            time.sleep(0.1)

    def screenshot(self, path: str, timeout: float = 30.0) -> int:
        """Write a PNG of the page to ``path``; returns its size in bytes."""
        data = base64.b64decode(self.call("Page.captureScreenshot",
                                          {"format": "png", "captureBeyondViewport": True}, timeout)["data"])
        with open(path, "wb") as f:
            f.write(data)
        return len(data)


class Browser:
    """A headless Chromium process with its own profile in ``profile_dir``.

    Raises:
        FileNotFoundError: no Chromium installed. Timeout: it did not start in time.
    """

    def __init__(self, profile_dir: str, timeout: float = 60.0, width: int = 1280,
                 height: int = 900) -> None:
        import websocket  # the dev extra's websocket-client

        exe = find_chromium()
        if exe is None:
            raise FileNotFoundError("no chromium (apt-get install chromium)")
        self.proc = subprocess.Popen(
            [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-extensions", "--disable-background-networking", "--remote-debugging-port=0",
             "--remote-allow-origins=*", "--no-proxy-server", f"--user-data-dir={profile_dir}",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []
        try:
            url = self._endpoint(timeout)
            self.ws = websocket.create_connection(url, timeout=timeout, suppress_origin=True)
        except BaseException:
            self.close()
            raise

    def _endpoint(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        assert self.proc.stderr is not None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"chromium did not print its DevTools endpoint within {timeout}s")
            found = _LISTENING.search(wait_for_line(self.proc.stderr, left))
            if found:
                return found.group(1)

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout: float = 20.0) -> Any:
        """Send one CDP command and return its result (events that arrive meanwhile are kept).

        Raises:
            RuntimeError: the browser answered with an error. Timeout: no answer in time.
        """
        msg_id = next(self._ids)
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self.ws.send(json.dumps(msg))
        reply = self._receive(lambda m: m.get("id") == msg_id, timeout, method)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def wait_event(self, method: str, session: str | None, timeout: float) -> dict[str, Any]:
        """The first ``method`` event of ``session`` (already received or still to come)."""
        for i, ev in enumerate(self.events):
            if ev.get("method") == method and ev.get("sessionId") == session:
                return self.events.pop(i)
        return self._receive(lambda m: m.get("method") == method and m.get("sessionId") == session,
                             timeout, method, keep=False)

    def _receive(self, match: Any, timeout: float, what: str, keep: bool = True) -> dict[str, Any]:
        import websocket

        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"no answer to {what} within {timeout}s")
            self.ws.settimeout(left)
            try:
                msg = json.loads(self.ws.recv())
            except websocket.WebSocketTimeoutException as exc:
                raise Timeout(f"no answer to {what} within {timeout}s") from exc
            if match(msg):
                return msg  # type: ignore[no-any-return]
            if keep and "method" in msg:
                self.events.append(msg)
                del self.events[:-1000]

    def open(self, url: str, timeout: float = 30.0) -> Page:
        """A new tab showing ``url`` (loaded)."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        page.call("Page.enable")
        page.call("Runtime.enable")
        page.navigate(url, timeout)
        return page

    def close(self) -> None:
        """Close the connection and end the browser (idempotent)."""
        ws = getattr(self, "ws", None)
        if ws is not None:
            try:
                ws.close()
            except OSError:
                pass
            self.ws = None
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        if self.proc.stderr:
            self.proc.stderr.close()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

