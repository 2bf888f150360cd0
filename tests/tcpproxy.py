"""A TCP proxy in front of the broker that fails on command, for tests.

Run as a process (``python tcpproxy.py HOST PORT``): it prints
``listening <port>`` and then obeys one command per line on stdin, answering
``ok <command>`` on stdout once it is in force:

* ``forward`` -- new connections go to the broker (connections frozen before stay frozen);
* ``refuse`` -- nothing listens: a connect is refused;
* ``close`` -- a connection is accepted and closed at once, before a byte is said;
* ``blackhole`` -- a connection is accepted and nothing is ever answered; the
  established ones go silent too (what they are sent is dropped);
* ``halfopen`` -- the established connections go silent (sockets open, nothing
  forwarded either way, as after a lost NAT entry); new ones are forwarded;
* ``slow`` -- every chunk is forwarded after a delay (``slow 0.2``: seconds, the default);
* ``noconfirm`` -- new connections are forwarded, but the broker's publisher confirms
  (``basic.ack`` / ``basic.nack`` frames) never reach the client: the messages are
  stored, the confirms never come;
* ``reset`` -- every established connection is closed now (the mode stays);
* ``count`` -- answers ``ok count <accepted connections>``.

:class:`Proxy` starts it as a child process and talks to it; its
:meth:`Proxy.close` kills it (and with it every connection it holds).
"""

from __future__ import annotations

import contextlib
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO
from urllib.parse import urlparse, urlunparse


class _Pair:
    """One client connection and its broker connection."""

    def __init__(self, client: socket.socket, upstream: socket.socket | None) -> None:
        self.client = client
        self.upstream = upstream
        self.frozen = upstream is None
        self.noconfirm = False  # drop the broker's basic.ack / basic.nack frames

    def close(self) -> None:
        for sock in (self.client, self.upstream):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    sock.close()


class _Server:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.mode = "forward"
        self.delay = 0.2
        self.accepted = 0
        self.pairs: list[_Pair] = []
        self.lock = threading.Lock()
        self.listener: socket.socket | None = None
        self.port = 0
        self._listen()

    def _listen(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(64)
        self.port = sock.getsockname()[1]
        self.listener = sock

    def command(self, line: str) -> str:
        words = line.split()
        if not words:
            return ""
        name = words[0]
        with self.lock:
            if name == "count":
                return f"count {self.accepted}"
            if name == "reset":
                pairs, self.pairs = self.pairs, []
                for pair in pairs:
                    pair.close()
                return "reset"
            if name not in ("forward", "refuse", "close", "blackhole", "halfopen", "slow", "noconfirm"):
                return f"unknown {name}"
            if name == "slow" and len(words) > 1:
                self.delay = float(words[1])
            if name in ("blackhole", "halfopen"):
                for pair in self.pairs:
                    pair.frozen = True
            if name == "refuse" and self.listener is not None:
                self.listener.close()
                self.listener = None
            elif name != "refuse" and self.listener is None:
                self._listen()
            self.mode = name
            return name

    def serve(self) -> None:
        while True:
            with self.lock:
                listener = self.listener
            if listener is None:
                time.sleep(0.02)
                continue
            try:
                ready, _, _ = select.select([listener], [], [], 0.05)
                if not ready:
                    continue
                client, _ = listener.accept()
            except (OSError, ValueError):  # closed by a refuse meanwhile
                continue
            with self.lock:
                self.accepted += 1
                mode = self.mode
            if mode == "close":
                client.close()
                continue
            upstream = None
            if mode != "blackhole":
                try:
                    upstream = socket.create_connection(self.upstream, timeout=5)
                    upstream.settimeout(None)
                except OSError:
                    client.close()
                    continue
            pair = _Pair(client, upstream)
            pair.noconfirm = mode == "noconfirm"
            with self.lock:
                self.pairs.append(pair)
            threading.Thread(target=self._pump, args=(pair, client, upstream), daemon=True).start()
            if upstream is not None:
                threading.Thread(target=self._pump, args=(pair, upstream, client), daemon=True).start()

    def _pump(self, pair: _Pair, src: socket.socket, dst: socket.socket | None) -> None:
        frames = _ConfirmFilter() if pair.noconfirm and src is pair.upstream else None
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if pair.frozen or dst is None:
                    continue  # silent: taken and dropped
                if self.mode == "slow":
                    time.sleep(self.delay)
                if frames is not None:
                    data = frames.feed(data)
                dst.sendall(data)
        except OSError:
            pass
        if not pair.frozen:
            pair.close()


class _ConfirmFilter:
    """The broker's side of an AMQP 0-9-1 connection, frame by frame (type, channel, size, payload, 0xCE),
    without its publisher confirms: method frames of class 60 (basic), method 80 (ack) or 120 (nack)."""

    def __init__(self) -> None:
        self.buffer = b""

    def feed(self, data: bytes) -> bytes:
        self.buffer += data
        out = []
        while len(self.buffer) >= 7:
            size = int.from_bytes(self.buffer[3:7], "big")
            if len(self.buffer) < size + 8:
                break
            frame, self.buffer = self.buffer[:size + 8], self.buffer[size + 8:]
            if frame[0] == 1 and frame[7:11] in (b"\x00\x3c\x00\x50", b"\x00\x3c\x00\x78"):
                continue
            out.append(frame)
        return b"".join(out)


def main() -> None:
    server = _Server((sys.argv[1], int(sys.argv[2])))
    print(f"listening {server.port}", flush=True)
    threading.Thread(target=server.serve, daemon=True).start()
    for line in sys.stdin:
        answer = server.command(line)
        if answer:
            print(f"ok {answer}", flush=True)


class Proxy:
    """The proxy as a child process, in front of the broker of *url*."""

    def __init__(self, url: str) -> None:
        self.target = urlparse(url)
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__)), self.target.hostname or "127.0.0.1", str(self.target.port or 5672)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        first = self._stdout().readline().split()
        assert first[:1] == ["listening"], first
        self.port = int(first[1])

    def _stdout(self) -> IO[str]:
        assert self.proc.stdout is not None
        return self.proc.stdout

    @property
    def url(self) -> str:
        """The broker's URL with the proxy's port."""
        netloc = self.target.netloc.rsplit(":", 1)[0] if self.target.port else self.target.netloc
        return urlunparse(self.target._replace(netloc=f"{netloc}:{self.port}"))

    def __call__(self, command: str) -> str:
        """Send one command; its answer once it is in force."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        answer = self._stdout().readline().strip()
        assert answer.startswith("ok "), answer
        return answer[3:]

    def accepted(self) -> int:
        return int(self("count").split()[1])

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


if __name__ == "__main__":
    main()
