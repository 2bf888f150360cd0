"""run's /metrics under scrapers that give up: a client that closes before its answer is written
(its timeout passed while the queue depths were asked of a slow broker) leaves no traceback."""

from __future__ import annotations

import socket
import struct
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from support import wait_until
from webhook_server import free_port

from delivery_consumer.observability import metrics
from delivery_consumer.observability.metrics import RunExposition


class _Slow:
    """A collector that takes its time, as the queue depths do when the broker is slow."""

    def __init__(self) -> None:
        self.calls = 0

    def collect(self) -> Iterator[Any]:
        time.sleep(0.3)
        self.calls += 1
        return iter(())


def test_a_scraper_that_gives_up_leaves_no_traceback(capfd: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Five scrapes whose clients reset the connection before the answer: nothing on stderr (no
    BrokenPipeError or ConnectionResetError traceback), and the next scrape answers."""
    failed = []
    quiet = metrics._QuietServer.handle_error

    def counted(self: Any, request: Any, address: Any) -> None:
        failed.append(address)
        quiet(self, request, address)

    monkeypatch.setattr(metrics._QuietServer, "handle_error", counted)
    slow = _Slow()
    exposition = RunExposition("catalog", None, [slow])  # type: ignore[list-item]
    port = free_port()
    exposition.serve(port)
    try:
        for _ in range(5):
            client = socket.create_connection(("127.0.0.1", port))
            client.sendall(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()  # a reset, as a scraper's timeout does
        wait_until("the five failed scrapes", lambda: len(failed) == 5, 30)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            assert b"delivery_active" in answer.read()
    finally:
        exposition.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "BrokenPipe" not in err and "ConnectionReset" not in err, err
