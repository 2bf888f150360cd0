"""Where envelopes come from on the command line: files, directories, stdin.

A SOURCE is a ``.json`` file holding one envelope, a ``.ndjson`` / ``.jsonl``
file with one envelope per line, a directory (its such files, in name order,
not recursive), or ``-`` for NDJSON on standard input. Each item keeps its
location (``file:line``) so that a rejection can point at it.

A UTF-8 byte order mark at the start of a file or of standard input (some
Windows editors and PowerShell write one) is skipped; on the wire a body has
none (see :mod:`delivery_consumer.model.envelope`).

Nothing here trusts the input's size: a line or file longer than the body
limit is cut at ``limit + 1`` bytes (enough for the envelope check to reject
it as too large) and the rest is skipped without being held in memory.
"""

from __future__ import annotations

import codecs
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, NamedTuple

from ..model.cloudevents import parse_body
from ..model.envelope import MAX_BODY_BYTES, Envelope, too_large
from ..model.errors import ConfigError
from ..model.event_types import EventTypes

SINGLE_SUFFIXES = (".json",)
LINE_SUFFIXES = (".ndjson", ".jsonl")
SUFFIXES = SINGLE_SUFFIXES + LINE_SUFFIXES
_CHUNK = 1 << 16
_BOM = codecs.BOM_UTF8


class Item(NamedTuple):
    """One body read from a source, with where it came from (immutable; a
    NamedTuple because one is made per event, see envelope.Envelope)."""

    location: str
    body: bytes
    #: The size of the body as the source held it, when it was cut at the
    #: limit (``limit + 1`` bytes kept); 0 when ``body`` is all of it.
    cut_from: int = 0

    def parse(self, max_bytes: int, types: EventTypes | None = None) -> Envelope:
        """The Envelope of the body (:func:`~delivery_consumer.model.cloudevents.parse_body`), or
        raise Rejection; a body that was cut is refused with the size it had."""
        if self.cut_from:
            raise too_large(self.cut_from, max_bytes)
        return parse_body(self.body, max_bytes, types)


def expand(sources: Sequence[str]) -> list[str]:
    """Resolve SOURCE arguments to files (or ``-``), checking they exist.

    Raises ConfigError naming the first source that cannot be read, before
    anything is applied.
    """
    files: list[str] = []
    for source in sources:
        if source == "-":
            files.append(source)
            continue
        path = Path(source)
        if path.is_dir():
            found = sorted(
                p for p in path.iterdir() if p.is_file() and p.suffix.lower() in SUFFIXES
            )
            files.extend(str(p) for p in found)
        elif path.is_file():
            if path.suffix.lower() not in SUFFIXES:
                raise ConfigError(f"{source}: unsupported file type (use .json, .ndjson or .jsonl)")
            if not os.access(path, os.R_OK):
                raise ConfigError(f"{source}: not readable")
            files.append(str(path))
        else:
            raise ConfigError(f"{source}: no such file or directory")
    return files


def total_size(files: Sequence[str]) -> int:
    """Bytes in the listed files (stdin counts as 0)."""
    return sum(os.path.getsize(f) for f in files if f != "-")


def read(files: Sequence[str], *, limit: int = MAX_BODY_BYTES, stdin: BinaryIO | None = None) -> Iterator[Item]:
    """Every envelope body in *files* (as returned by :func:`expand`), in order."""
    for name in files:
        if name == "-":
            stream = stdin if stdin is not None else sys.stdin.buffer
            _skip_bom(stream)
            yield from _lines("-", stream, limit)
            continue
        with open(name, "rb") as handle:
            _skip_bom(handle)
            if name.lower().endswith(SINGLE_SUFFIXES):
                body = handle.read(limit + 1)
                size = len(body) + max(0, os.fstat(handle.fileno()).st_size - handle.tell())  # what is left unread
                yield Item(name, body, size if size > len(body) else 0)
            else:
                yield from _lines(name, handle, limit)


def _skip_bom(stream: BinaryIO) -> None:
    """Move past a UTF-8 byte order mark at the start of *stream*, if any."""
    peek = getattr(stream, "peek", None)
    if peek is not None:  # a buffered file or pipe: look without consuming
        if peek(len(_BOM))[: len(_BOM)] == _BOM:
            stream.read(len(_BOM))
    elif stream.seekable() and stream.read(len(_BOM)) != _BOM:
        stream.seek(0)


def _lines(name: str, stream: BinaryIO, limit: int) -> Iterator[Item]:
    """The non-blank lines of *stream* without their end, each cut at
    ``limit + 1`` bytes. One generator, not a chain: it runs once per event."""
    readline = stream.readline
    number = 0
    while True:
        line = readline(limit + 2)
        if not line:
            return
        number += 1
        if len(line) > limit + 1 and not line.endswith(b"\n"):
            # Too long: keep limit + 1 bytes, drop the rest of the line (counted, not held).
            size = len(line)
            rest = line
            while rest and not rest.endswith(b"\n"):
                rest = readline(_CHUNK)
                size += len(rest)
            if rest.endswith(b"\n"):
                size -= 2 if rest.endswith(b"\r\n") else 1
            yield Item(f"{name}:{number}", line[: limit + 1], size)
            continue
        line = line.rstrip(b"\r\n")
        # Blank lines are skipped (isspace() of b"" is False: checked first).
        if line and not line.isspace():
            yield Item(f"{name}:{number}", line)
