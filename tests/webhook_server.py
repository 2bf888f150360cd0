"""A local HTTP endpoint for the webhook tests and benchmark: it records every
request and honours ``Idempotency-Key`` like a careful provider.

* idempotent (the default): the first request with a key is the effect and
  gets a new response id; a later request with the same key gets the same
  id and is no new effect;
* ``idempotent=False``: every request is an effect with a new id.

What it answers depends on the notification's title:

* ``reject`` -- 400 (no effect);
* ``slow:S`` -- the effect happens, then the answer waits S seconds (a
  client with a shorter read timeout cannot know the outcome);
* ``busy:N`` -- 503 for the first N requests with that key (no effect);
* ``throttle:N`` -- 429 with ``Retry-After: 1`` for the first N requests;
* anything else -- 200 ``{"id": ...}``.

``healed = True`` answers every title as "anything else" (the fix after
which a dead letter is requeued). ``hold_at = N`` holds the answer of the
N-th request (its effect made) until ``release`` is set: ``holding`` is set
once it arrived and ``held`` is its key -- a caller killed meanwhile dies
between its call and its commit.

The ledger counts effects per key, never throughput: ``effects()``.
Run it alone for the benchmark: ``python tests/webhook_server.py [PORT [DELAY_S]]``
prints the port and serves until killed (every answer DELAY_S late).
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

import orjson


@dataclass(frozen=True)
class Request:
    """One request as the endpoint saw it, with its answer."""

    key: str | None
    body: dict[str, Any]
    status: int
    response_id: str | None
    effect: bool


def free_port() -> int:
    """A TCP port nobody listens on now (for an endpoint that starts later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _QuietServer(ThreadingHTTPServer):
    """A client killed mid-request (what the chaos and kill tests do) is expected, not a traceback."""

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


class WebhookServer:
    """The endpoint, served from a thread of the test process."""

    def __init__(self, port: int = 0, *, idempotent: bool = True, record: bool = True, delay_s: float = 0.0) -> None:
        self.port = port
        self.idempotent = idempotent
        self.record = record
        #: Every answer waits this long (a slow endpoint), after the effect.
        self.delay_s = delay_s
        self.lock = threading.Lock()
        self.requests: list[Request] = []
        self.ids: dict[str, str] = {}
        self.tries: Counter[str] = Counter()
        self.served = 0
        self.healed = False
        #: The number of the request whose answer waits for ``release`` (None: none).
        self.hold_at: int | None = None
        self.holding = threading.Event()
        self.release = threading.Event()
        self.held: str | None = None
        #: The client's port of the held request (which process made it).
        self.held_port: int | None = None
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/notify"

    def start(self) -> WebhookServer:
        server = _QuietServer(("127.0.0.1", self.port), _handler(self))
        server.daemon_threads = True
        self.port = int(server.server_address[1])
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> WebhookServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the ledger --
    def effects(self) -> Counter[str]:
        """Effects per idempotency key."""
        with self.lock:
            return Counter(r.key or "-" for r in self.requests if r.effect)

    def calls(self) -> Counter[str]:
        """Requests per idempotency key (effects or not)."""
        with self.lock:
            return Counter(r.key or "-" for r in self.requests)

    def first_id(self, key: str) -> str | None:
        """The response id of the effect of *key*."""
        with self.lock:
            return next((r.response_id for r in self.requests if r.key == key and r.effect), None)

    # -- one request --
    def answer(self, key: str | None, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes, float]:
        """Status, headers, body and delay of the answer; records the request."""
        title = str(body.get("title", ""))
        with self.lock:
            self.served += 1
            self.tries[key or "-"] += 1
            tries = self.tries[key or "-"]
            status, headers, delay, effect, rid = 200, {}, self.delay_s, False, None
            kind, _, arg = ("", "", "") if self.healed else title.partition(":")
            if kind == "reject":
                status = 400
            elif kind == "busy" and tries <= int(arg):
                status = 503
            elif kind == "throttle" and tries <= int(arg):
                status, headers = 429, {"Retry-After": "1"}
            else:
                if self.idempotent and key is not None and key in self.ids:
                    rid = self.ids[key]
                else:
                    rid, effect = f"ntf-{self.served:06d}", True
                    if key is not None:
                        self.ids.setdefault(key, rid)
                if kind == "slow":
                    delay = float(arg)
            if self.record:
                self.requests.append(Request(key, body, status, rid, effect))
            if self.served == self.hold_at:
                self.held, delay = key, -1.0
        payload = orjson.dumps({"id": rid}) if rid else orjson.dumps({"error": status})
        return status, headers, payload, delay


def _handler(server: WebhookServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as a real endpoint
        # Headers and body are two writes: with Nagle's algorithm the body waits
        # for the client's delayed ACK (~40 ms a request).
        disable_nagle_algorithm = True

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            key = self.headers.get("Idempotency-Key")
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                body = {}
            status, headers, payload, delay = server.answer(unquote(key) if key else None, body)
            if delay < 0:  # held: the effect is made, the answer waits
                server.held_port = int(self.client_address[1])
                server.holding.set()
                server.release.wait(60)
            elif delay:
                time.sleep(delay)  # a deliberately slow endpoint: the slowness is what the caller tests
            try:
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
            except OSError:  # the client gave up waiting
                self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


if __name__ == "__main__":
    endpoint = WebhookServer(int(sys.argv[1]) if len(sys.argv) > 1 else 0, record=False,
                             delay_s=float(sys.argv[2]) if len(sys.argv) > 2 else 0.0).start()
    print(endpoint.port, flush=True)
    try:
        while True:
            time.sleep(3600)  # serves from its threads until interrupted
    except KeyboardInterrupt:
        endpoint.stop()
