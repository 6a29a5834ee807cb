"""An HTTP relay in front of the moto server, on 127.0.0.1, that answers chosen requests with a
fault a real S3 endpoint shows: a 503 SlowDown after reading the body, or a connection closed
after the request landed (the answer lost). Tests point ``endpoint_url`` at it."""

from __future__ import annotations

import http.client
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
CONFLICT = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>ConditionalRequestConflict</Code>'
    b"<Message>A conflicting operation occurred.</Message></Error>"
)


@dataclass
class Fault:
    method: str
    key_part: str  # the fault hits requests whose path contains this
    action: str  # "slowdown": 503 before forwarding ("conflict": 409); "drop_after": forwarded, then no answer;
    # "hang": no answer until the relay ends (the connection held open, as a hung server's);
    # "late": held ``delay_s`` (the client gives up), then forwarded: applied after all
    times: int = 1
    delay_s: float = 0.0


@dataclass
class Relay:
    endpoint: str
    faults: list[Fault] = field(default_factory=list)
    seen: list[tuple[str, str, int, int]] = field(default_factory=list)
    """(method, path, Content-Length declared, body bytes received) of every request."""
    access_keys: list[str] = field(default_factory=list)
    """The access key each signed request names (its Authorization header's Credential)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    ended: threading.Event = field(default_factory=threading.Event)

    def fault_for(self, method: str, path: str) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.times and fault.method == method and fault.key_part in path:
                    fault.times -= 1
                    return fault
        return None


def _handler(relay: Relay, upstream: tuple[str, int]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _relay(self) -> None:
            declared = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(declared) if declared else b""
            signed = (self.headers.get("Authorization") or "").partition("Credential=")[2]
            with relay.lock:
                relay.seen.append((self.command, self.path, declared, len(body)))
                if signed:
                    relay.access_keys.append(signed.split("/", 1)[0])
            fault = relay.fault_for(self.command, self.path)
            action = fault.action if fault else None
            if action == "late":
                relay.ended.wait(fault.delay_s)
            if action in ("slowdown", "conflict"):
                status, error = (503, SLOWDOWN) if action == "slowdown" else (409, CONFLICT)
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(error)))
                self.end_headers()
                self.wfile.write(error)
                return
            if action == "hang":
                relay.ended.wait(60)
                self.close_connection = True
                return
            conn = http.client.HTTPConnection(*upstream, timeout=30)
            headers = {k: v for k, v in self.headers.items() if k.lower() != "expect"}
            conn.request(self.command, self.path, body=body, headers=headers)
            answer = conn.getresponse()
            data = answer.read()
            conn.close()
            if action == "drop_after":
                self.close_connection = True
                return  # landed upstream; the client hears nothing
            self.send_response(answer.status)
            for name, value in answer.getheaders():
                if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(name, value)
            length = answer.getheader("Content-Length") if self.command == "HEAD" else None
            self.send_header("Content-Length", length or str(len(data)))  # HEAD: the object's
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

    return Handler


@contextmanager
def s3_relay(upstream_endpoint: str) -> Iterator[Relay]:
    """A relay to ``upstream_endpoint`` (moto's ``http://127.0.0.1:PORT``) for the block."""
    parts = urlsplit(upstream_endpoint)
    relay = Relay(endpoint="")
    server = ThreadingHTTPServer(
        ("127.0.0.1", 0), _handler(relay, (parts.hostname, parts.port or 80))
    )
    server.daemon_threads = True
    relay.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield relay
    finally:
        relay.ended.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
