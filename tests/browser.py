"""A headless Chromium driven over the DevTools protocol, for the chat page's tests.

The protocol runs over a pipe (`--remote-debugging-pipe`: the browser reads commands from its
fd 3 and writes answers and events to its fd 4, each message JSON ended by a NUL byte), so no
port is opened and no websocket client is needed. `Browser.open(url)` gives a `Page` whose
`eval` runs JavaScript in it and `wait` polls an expression until it is truthy.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         "--no-default-browser-check", "--remote-debugging-pipe")


def find_chromium(given: str | None) -> str | None:
    """The browser to use: `--chromium PATH` if given, else chromium or chromium-browser."""
    if given:
        return given if Path(given).is_file() else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _above_4(fd: int) -> int:
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 5)
    os.close(fd)
    return high


class PageError(AssertionError):
    """A script threw in the page, or the browser answered a command with an error."""


class Browser:
    def __init__(self, executable: str):
        self._profile = tempfile.TemporaryDirectory(prefix="jengine-chromium-")
        to_browser, self._out = os.pipe()  # commands: we write, the browser reads its fd 3
        self._in, from_browser = os.pipe()  # answers: the browser writes its fd 4, we read
        # bash moves the two ends onto 3 and 4 (a preexec_fn would fork a threaded JAX process;
        # dash reads only one-digit fds), from numbers above 4, so neither move hits the other.
        to_browser, from_browser = (_above_4(fd) for fd in (to_browser, from_browser))
        redirect = (f'exec "$0" "$@" 3<&{to_browser} 4>&{from_browser} '
                    f'{to_browser}<&- {from_browser}>&-')
        self.proc = subprocess.Popen(
            ["bash", "-c", redirect, executable, *FLAGS,
             f"--user-data-dir={self._profile.name}", "about:blank"],
            pass_fds=(to_browser, from_browser), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser)
        os.close(from_browser)
        self._buffer = b""
        self._next_id = 0

    def call(self, method: str, session: str | None = None, timeout: float = 30,
             **params) -> dict:
        """Sends one command and returns its result (events in between are dropped)."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            answer = self._read(deadline)
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise PageError(f"{method}: {answer['error']}")
                return answer["result"]

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise TimeoutError("the browser did not answer in time")
            chunk = os.read(self._in, 1 << 16)
            if not chunk:
                raise PageError(f"the browser exited ({self.proc.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def open(self, url: str) -> Page:
        """A new tab showing `url`, loaded (its scripts run)."""
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        page = Page(self, session, target)
        self.call("Page.navigate", session, url=url)
        page.wait("document.readyState === 'complete' && location.href !== 'about:blank'")
        return page

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._out)
        os.close(self._in)
        self._profile.cleanup()


class Page:
    def __init__(self, browser: Browser, session: str, target: str):
        self.browser, self.session, self.target = browser, session, target

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited if it is a promise)."""
        result = self.browser.call("Runtime.evaluate", self.session, expression=expression,
                                   awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise PageError(details.get("exception", {}).get("description") or details["text"])
        return result["result"].get("value")

    def wait(self, expression: str, timeout: float = 30) -> Any:
        """Polls `expression` until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"still false after {timeout}s: {expression}")
            time.sleep(0.05)

    def type(self, selector: str, text: str) -> None:
        """Focuses the element and types `text` into it as keyboard input would."""
        self.eval(f"document.querySelector({json.dumps(selector)}).focus()")
        self.browser.call("Input.insertText", self.session, text=text)

    def click(self, selector: str) -> None:
        """A real mouse click at the element's centre."""
        box = self.eval(f"(r => [r.x + r.width / 2, r.y + r.height / 2])("
                        f"document.querySelector({json.dumps(selector)}).getBoundingClientRect())")
        for kind in ("mousePressed", "mouseReleased"):
            self.browser.call("Input.dispatchMouseEvent", self.session, type=kind, x=box[0],
                              y=box[1], button="left", clickCount=1)
