"""nginx running the project's serving/nginx.conf on free loopback ports, in front of a recording
HTTP server: what reaches the server behind the proxy, and what the proxy answers itself.

The recording server stands in for `mlflow models serve` (or the service): the proxy's limits act
on the request before any upstream is involved, so the upstream only has to show what got
through. nginx is Debian's (`apt-get install nginx-light`); it runs in the foreground with every
file it writes under the test's folder.
"""

from __future__ import annotations

import getpass
import json
import re
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from harness import processes
from harness.processes import free_port

PROJECT_ROOT = Path(__file__).resolve().parents[1]
CONFIG = PROJECT_ROOT / "serving" / "nginx.conf"
INSTALL_HINT = "apt-get install -y nginx-light (.ci/run does it in CI)"


class RecordingUpstream:
    """A loopback HTTP server answering 200 `{}` to anything; `requests` lists (method, path,
    body bytes) of what it received."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, int]] = []
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                upstream.requests.append((self.command, self.path, len(self.rfile.read(length))))
                body = json.dumps({}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = answer  # noqa: N815 (http.server's naming)

            def log_message(self, *_args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> RecordingUpstream:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


class Nginx:
    """`with Nginx(folder, upstream_port) as proxy:` serving/nginx.conf with both upstreams at
    `upstream_port` and its two servers on `proxy.search_port` and `proxy.pyfunc_port`."""

    def __init__(self, folder: Path, upstream_port: int) -> None:
        self.folder = Path(folder)
        self.search_port, self.pyfunc_port = free_port(), free_port()
        self.upstream_port = upstream_port
        self.log = self.folder / "nginx.log"
        self.proc = None

    def render(self) -> Path:
        text = CONFIG.read_text()
        text = re.sub(r"server 127\.0\.0\.1:\d+;", f"server 127.0.0.1:{self.upstream_port};",
                      text)
        text = text.replace("listen 127.0.0.1:8080;", f"listen 127.0.0.1:{self.search_port};")
        text = text.replace("listen 127.0.0.1:8081;", f"listen 127.0.0.1:{self.pyfunc_port};")
        (self.folder / "clipms.conf").write_text(text)
        temp = {name: self.folder / name for name in ("body", "proxy", "fastcgi", "uwsgi",
                                                      "scgi")}
        main = (f"daemon off;\nworker_processes 1;\nuser {getpass.getuser()};\n"
                f"pid {self.folder / 'nginx.pid'};\nerror_log {self.log} warn;\n"
                "events { worker_connections 256; }\n"
                "http {\n  access_log off;\n"
                + "".join(f"  {name}_temp_path {path};\n" if name != "body" else
                          f"  client_body_temp_path {path};\n" for name, path in temp.items())
                + f"  include {self.folder / 'clipms.conf'};\n}}\n")
        (self.folder / "nginx.conf").write_text(main)
        return self.folder / "nginx.conf"

    def __enter__(self) -> Nginx:
        binary = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
        if binary is None:
            raise RuntimeError(f"nginx is needed: {INSTALL_HINT}")
        config = self.render()
        self.proc = processes.spawn([binary, "-p", str(self.folder), "-e", str(self.log),
                                     "-c", str(config)], self.folder / "nginx.out")
        try:
            processes.wait_until(processes.port_open(self.pyfunc_port), self.proc, "nginx",
                                 self.log, timeout=30, interval=0.1)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        processes.stop(self.proc)
        self.proc = None
