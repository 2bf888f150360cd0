"""Wake-ups: a producer's commit tells the dispatchers on its host that rows wait.

Each dispatcher binds a Linux *abstract* unix datagram socket named after
the database file (its device and inode, so every spelling of the path
agrees) and one of :data:`SLOTS` slots; after a commit that enqueued rows,
:func:`notify` sends one byte to every slot, non-blocking, ignoring every
error. A wake-up is only a hint: the dispatcher's timed poll still runs,
for a dispatcher on another host and for a wake-up that is lost.
Why this mechanism and not a socket file, ``PRAGMA data_version`` or
inotify: docs/outbox.md, "Waking the dispatcher".
"""

from __future__ import annotations

import os
import socket
import sqlite3
import threading
from contextlib import suppress
from typing import Final

#: Dispatchers of one outbox that can be woken at once (more only poll).
SLOTS: Final = 4
_PREFIX: Final = "\0delivery-consumer/outbox"

_sender: socket.socket | None = None
_sender_lock = threading.Lock()


def addresses(path: str | os.PathLike[str]) -> list[str]:
    """The abstract socket names of the wake-up slots of the database at
    *path* (OSError when it cannot be read: then nobody can be woken)."""
    st = os.stat(path)
    return [f"{_PREFIX}/{st.st_dev:x}:{st.st_ino:x}/{slot}" for slot in range(SLOTS)]


def _socket() -> socket.socket | None:
    global _sender
    if _sender is None:
        with _sender_lock:
            if _sender is None:
                try:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                except (OSError, AttributeError):  # no unix sockets here: the poll does the work
                    return None
                sock.setblocking(False)
                _sender = sock
    return _sender


def notify_path(path: str | os.PathLike[str]) -> int:
    """Wake the dispatchers of the database at *path* on this host; how many
    were told. Never blocks, never raises."""
    try:
        names = addresses(path)
    except (OSError, ValueError):
        return 0
    sock = _socket()
    if sock is None:
        return 0
    told = 0
    for name in names:
        try:
            sock.sendto(b"!", name)
        except BlockingIOError:  # its queue is full: it has wake-ups waiting already
            told += 1
        except OSError:  # nobody in this slot (ECONNREFUSED), or not Linux
            continue
        else:
            told += 1
    return told


def database_file(conn: sqlite3.Connection) -> str | None:
    """The file of *conn*'s main database (None: in memory, or unknown)."""
    with suppress(sqlite3.Error):
        row = conn.execute("PRAGMA database_list").fetchone()
        if row and row[2]:
            return str(row[2])
    return None


class Listener:
    """One dispatcher's wake-up socket (non-blocking); :meth:`fileno` is
    readable when a producer committed rows since the last :meth:`drain`."""

    #: A socket of this host does not break (PostgreSQL's LISTEN connection can).
    broken = False

    def __init__(self, sock: socket.socket, slot: int) -> None:
        self._sock = sock
        self.slot = slot

    @classmethod
    def bind(cls, path: str | os.PathLike[str]) -> Listener | None:
        """Take the first free slot of the database at *path*; None when
        every slot is taken (or the system has no abstract sockets)."""
        try:
            names = addresses(path)
        except (OSError, ValueError):
            return None
        for slot, name in enumerate(names):
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            except (OSError, AttributeError):
                return None
            try:
                sock.bind(name)
            except OSError:  # taken (EADDRINUSE), or no abstract namespace
                sock.close()
                continue
            sock.setblocking(False)
            return cls(sock, slot)
        return None

    def fileno(self) -> int:
        return self._sock.fileno()

    def drain(self) -> int:
        """Read every wake-up waiting; how many there were."""
        n = 0
        while True:
            try:
                self._sock.recv(64)
            except (BlockingIOError, InterruptedError):
                return n
            except OSError:
                return n
            n += 1

    def close(self) -> None:
        self._sock.close()


__all__ = ["SLOTS", "Listener", "addresses", "database_file", "notify_path"]
