"""A fault-injecting S3 proxy on loopback, in front of the local S3 server.

Every request is forwarded to the real server except one in every `1 / fault_rate`
(counted in arrival order, so the share is exact however threads interleave), which
fails in turn as: 503 SlowDown, 500 InternalError (S3's XML error bodies), dropped by
closing the connection without an answer (a reset), or forwarded after a stall. Keys
under a denied prefix always get 403 AccessDenied (a persistent failure). Thread per
connection; binds 127.0.0.1 only; counts what it did.
"""

from __future__ import annotations

import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

ERROR_XML = ('<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
             '<Resource>{path}</Resource><RequestId>fault-proxy</RequestId></Error>')


class FaultyS3:
    KINDS = ("503", "500", "reset", "stall")

    def __init__(self, upstream_url: str, fault_rate: float = 0.1, stall_s: float = 1.5,
                 denied_prefixes: tuple[str, ...] = ()):
        up = urlsplit(upstream_url)
        self.upstream = (up.hostname, up.port)
        self.fault_rate, self.stall_s = fault_rate, stall_s
        self.denied_prefixes = denied_prefixes
        self.every = round(1 / fault_rate) if fault_rate > 0 else 0
        self.num_requests = 0
        self.lock = threading.Lock()
        self.counts = {"forwarded": 0, "503": 0, "500": 0, "reset": 0, "stall": 0, "denied": 0}
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _any(self):
                proxy.handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _draw(self) -> str | None:
        with self.lock:
            self.num_requests += 1
            if not self.every or self.num_requests % self.every:
                return None
            return self.KINDS[(self.num_requests // self.every - 1) % len(self.KINDS)]

    def _count(self, what: str) -> None:
        with self.lock:
            self.counts[what] += 1

    def handle(self, req: BaseHTTPRequestHandler) -> None:
        length = int(req.headers.get("content-length") or 0)
        body = req.rfile.read(length) if length else b""
        path = urlsplit(req.path).path
        if any(path.lstrip("/").startswith(p) for p in self.denied_prefixes):
            self._count("denied")
            return self._error(req, 403, "AccessDenied", "Access Denied", path)
        fault = self._draw()
        if fault in ("503", "500"):
            self._count(fault)
            code, msg = ("SlowDown", "Please reduce your request rate.") if fault == "503" else \
                        ("InternalError", "We encountered an internal error. Please try again.")
            return self._error(req, int(fault), code, msg, path)
        if fault == "reset":
            self._count("reset")
            req.close_connection = True
            req.connection.close()
            return
        if fault == "stall":
            self._count("stall")
            time.sleep(self.stall_s)
        self._count("forwarded")
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            headers = {k: v for k, v in req.headers.items() if k.lower() != "connection"}
            conn.request(req.command, req.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            req.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length", "date", "server"):
                    req.send_header(k, v)
            # HEAD: the object's size, as the server said; otherwise the body relayed.
            req.send_header("content-length", resp.getheader("content-length", "0") if req.command == "HEAD"
                            else str(len(data)))
            req.end_headers()
            if req.command != "HEAD":
                req.wfile.write(data)
        finally:
            conn.close()

    def _error(self, req, status: int, code: str, message: str, path: str) -> None:
        data = ERROR_XML.format(code=code, message=message, path=path).encode()
        req.send_response(status)
        req.send_header("content-type", "application/xml")
        req.send_header("content-length", str(len(data) if req.command != "HEAD" else 0))
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(data)

    @property
    def num_faults(self) -> int:
        return sum(v for k, v in self.counts.items() if k not in ("forwarded", "denied"))

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
