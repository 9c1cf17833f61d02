"""A small W3C WebDriver client for headless Chromium (Debian's `chromium` + `chromium-driver`).

Enough for the search-page test and the screenshot command: open a page, find elements, type,
click, run a script, take a screenshot. chromedriver listens on a free 127.0.0.1 port and is ended
by `quit()`; Chromium runs headless with a new, empty profile and no background networking (this
machine has no internet; its connections would only be refused).
"""

from __future__ import annotations

import base64
import json
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from harness import processes
from harness.processes import free_port

ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # the W3C key of an element reference
CHROMIUM_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
INSTALL_HINT = "apt-get install -y chromium chromium-driver (.ci/run does it in CI)"


# No network at all, for pages that must work offline: every host resolves to nothing and any
# connection would go to a proxy on a port that is never open (loopback stays direct).
OFFLINE_FLAGS = ["--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                 "--proxy-server=http://127.0.0.1:9", "--proxy-bypass-list=<-loopback>"]


class Browser:
    def __init__(self, window: tuple[int, int] = (1200, 900),
                 extra_args: tuple[str, ...] = ()) -> None:
        driver, chromium = shutil.which("chromedriver"), shutil.which("chromium")
        if not driver or not chromium:
            raise RuntimeError(f"headless Chromium is needed: {INSTALL_HINT}")
        self.port = free_port()
        self.profile = tempfile.mkdtemp(prefix="clipms-chromium-")
        self.proc = processes.spawn([driver, f"--port={self.port}", "--allowed-ips=127.0.0.1"],
                                    None)
        try:
            self._wait_driver()
            args = [*CHROMIUM_FLAGS, *extra_args, f"--user-data-dir={self.profile}",
                    f"--window-size={window[0]},{window[1]}"]
            caps = {"capabilities": {"alwaysMatch": {
                "browserName": "chrome",
                "goog:chromeOptions": {"binary": chromium, "args": args}}}}
            self.session = self._call("POST", "/session", caps)["sessionId"]
        except BaseException:
            self._end_driver()
            raise

    def _wait_driver(self, timeout: float = 30) -> None:
        def answers() -> bool:
            self._call("GET", "/status")
            return True

        processes.wait_until(answers, self.proc, "chromedriver", None, timeout, interval=0.2)

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body if body is not None else {}).encode() if method == "POST" else None
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                     method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as response:
                return json.loads(response.read()).get("value")
        except urllib.error.HTTPError as err:
            raise RuntimeError(f"webdriver {method} {path}: {err.read()[:500]!r}") from None

    def _session(self, method: str, path: str, body: Any = None) -> Any:
        return self._call(method, f"/session/{self.session}{path}", body)

    def get(self, url: str) -> None:
        self._session("POST", "/url", {"url": url})

    def find_all(self, css: str) -> list[str]:
        found = self._session("POST", "/elements", {"using": "css selector", "value": css})
        return [element[ELEMENT] for element in found]

    def find(self, css: str) -> str:
        found = self.find_all(css)
        if not found:
            raise LookupError(f"no element matches {css!r}")
        return found[0]

    def type(self, element: str, text: str) -> None:
        self._session("POST", f"/element/{element}/value", {"text": text})

    def click(self, element: str) -> None:
        self._session("POST", f"/element/{element}/click")

    def text(self, element: str) -> str:
        return self._session("GET", f"/element/{element}/text")

    def script(self, source: str, *args: Any) -> Any:
        return self._session("POST", "/execute/sync", {"script": source, "args": list(args)})

    def wait(self, predicate: Any, timeout: float = 30, what: str = "the page") -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}")

    def screenshot(self, path: Path | str) -> None:
        Path(path).write_bytes(base64.b64decode(self._session("GET", "/screenshot")))

    def _end_driver(self) -> None:
        processes.stop(self.proc, timeout=10, kill_timeout=10)
        shutil.rmtree(self.profile, ignore_errors=True)

    def quit(self) -> None:
        try:
            self._session("DELETE", "")
        except (OSError, RuntimeError):
            pass
        finally:
            self._end_driver()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.quit()
