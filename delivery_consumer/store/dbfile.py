"""A database file in an operator's hands: is it still the file we opened, who writes it.

* :class:`FileGuard` -- the file's identity (device, inode) when it was
  opened; :meth:`FileGuard.check` (one ``stat``) raises
  :class:`~delivery_consumer.model.errors.DatabaseLost` once the path names
  another file or none: a connection keeps writing into a deleted or
  replaced file without an error, and nothing may be acknowledged on that.
  For the writer that holds the file, it also watches the file's *content*:
  the tag the writer keeps in the header (:class:`ContentTags`) must never
  go back, which a copy written over the live file (``cp backup inbox.db``)
  makes it do.
* :class:`WriterLock` -- an exclusive lock on the database file itself (an
  open-file-description lock on a byte SQLite never locks), held for a
  writer's life: one ``run`` (or ``replay``) per file, by whatever path it is
  reached; the kernel releases it when the holder dies, however it dies.
  ``<db>.lock`` beside the real file is only a note: who holds it, and its
  heartbeat (the note's time).
* :class:`SerialLock` -- the same kind of lock, on another byte of the file,
  held around one protocol step that spans transactions (the fence's claim,
  call and completion).

Why an OFD lock and not ``flock`` or ``fcntl``, and what the operator sees:
docs/failures.md, "Operator mistakes".
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path

from ..model.errors import DatabaseError, DatabaseInUse, DatabaseLost, StoreUnavailable
from . import liveness

#: How often a waiting standby tries the lock again (and looks at its parent).
LOCK_POLL_S = 0.2
#: How often the holder of a database touches its note (``<db>.lock``): its heartbeat.
HEARTBEAT_S = 1.0
#: The bytes of the database file that the locks take. SQLite's own locks are
#: the bytes at 1 GiB (its pending, reserved and shared bytes); these are far
#: beyond any database and never touched by it. Writer generations take
#: ``WRITER_BYTE + g`` (a standby that takes over from a frozen holder takes
#: the next one: :meth:`WriterLock.take_over`).
WRITER_BYTE = 0x7FFF_FFFF_0000_0000
GENERATIONS = 8
SERIAL_BYTE = WRITER_BYTE - 1
#: The header field a writer keeps its content tag in (SQLite's ``application_id``, offset 68).
TAG_OFFSET = 68

_FLOCK = "hhqqi"  # struct flock: l_type, l_whence, l_start, l_len, l_pid (native alignment)


def _ofd(fd: int, kind: int, start: int, *, wait: bool = False) -> bool:
    """Set (or with F_UNLCK clear) an OFD lock on byte *start*; False when another holds it."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, struct.pack(_FLOCK, kind, 0, start, 1, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _ofd_held(fd: int, start: int) -> bool:
    """Whether another open file description holds a lock on byte *start* that a write lock would meet."""
    answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, 0, start, 1, 0))
    return bool(struct.unpack(_FLOCK, answer[:struct.calcsize(_FLOCK)])[0] != fcntl.F_UNLCK)


# -- descriptors of a database file --------------------------------------------
# A process that closes ANY descriptor of a file loses every POSIX (fcntl) lock
# it holds on that file -- SQLite's own included (https://sqlite.org/howtocorrupt.html,
# 2.2): SQLite would then let another connection delete the WAL under this one. So a
# descriptor of ours is closed only when no other descriptor of this process refers
# to the file (SQLite keeps its descriptor while it holds a lock); until then it is
# parked, unlocked, and closed by a later release.

_parked: list[tuple[int, tuple[int, int]]] = []
_parked_lock = threading.Lock()


def _descriptors_of(identity: tuple[int, int], but: set[int]) -> bool:
    """Whether a descriptor of this process other than *but* refers to the file *identity*."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return True  # cannot tell: keep the descriptor
    for name in names:
        if not name.isdigit() or int(name) in but:
            continue
        with suppress(OSError):
            st = os.stat(f"/proc/self/fd/{name}")
            if (st.st_dev, st.st_ino) == identity:
                return True
    return False


def release_fd(fd: int, identity: tuple[int, int]) -> None:
    """Close *fd* (a descriptor of the database file *identity*) once that cannot
    release SQLite's locks; park it meanwhile. Closes parked ones that can go now."""
    with _parked_lock:
        _parked.append((fd, identity))
        mine = {f for f, _ in _parked}
        keep = []
        for f, ident in _parked:
            if _descriptors_of(ident, mine):
                keep.append((f, ident))
            else:
                with suppress(OSError):
                    os.close(f)
        _parked[:] = keep


def identity_of(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def check_one_name(path: Path | str, st: os.stat_result | None = None) -> None:
    """Refuse a database file with more than one name (hard links): SQLite keeps
    its journal (``-wal``, ``-shm``) per name, so two names are two databases to it."""
    st = st or os.stat(path)
    if st.st_nlink > 1:
        raise DatabaseError(
            f"{path}: this database file has {st.st_nlink} names (hard links); SQLite keeps its journal per "
            f"name, so writers through two names write two different databases into one file: remove the other "
            f"names first (find them: find / -xdev -samefile {path})")


def note_path(db_path: Path | str) -> Path:
    """The note of a database's writer: ``<real path of the db>.lock`` (every path to
    the file -- symlink, relative, bind mount -- finds the same note)."""
    return Path(f"{os.path.realpath(db_path)}.lock")


lock_path = note_path


class ContentTags:
    """The tags a writer put in its file's header (``application_id``), in order.

    The writer sets a new tag when it starts and again at most every second it
    commits (:meth:`next`). A checkpoint copies into the main file a header
    the writer wrote, so the main file's tag moves forward through the list;
    one that is not in the list, or is older than one seen before, is a file
    whose content someone else wrote: a copy over the live file.
    """

    __slots__ = ("_seen", "tags")

    def __init__(self, first: int) -> None:
        self.tags = [first]
        self._seen = 0

    def next(self) -> int:
        tag = int.from_bytes(os.urandom(4), "big") & 0x7FFF_FFFF or 1
        self.tags.append(tag)
        return tag

    def judge(self, tag: int) -> bool:
        """Whether *tag*, read from the main file, is one of ours and not older than the last seen."""
        try:
            at = len(self.tags) - 1 - self.tags[::-1].index(tag)
        except ValueError:
            return False
        if at < self._seen:
            return False
        self._seen = at
        if at > 64:  # older tags can never be seen again
            del self.tags[:at]
            self._seen = 0
        return True


def read_tag(fd: int) -> int | None:
    """The tag in the main file's header (None: no header, an empty file)."""
    raw = os.pread(fd, 4, TAG_OFFSET)
    return int.from_bytes(raw, "big") & 0x7FFF_FFFF if len(raw) == 4 else None


class FileGuard:
    """The identity of a database file as it was opened; :meth:`check` says whether the path still names it,
    and (once :meth:`watch` is called, by the file's one writer) whether its content is still its own."""

    __slots__ = ("_fd", "_written", "identity", "path", "tags")

    def __init__(self, path: Path | str) -> None:
        self.path = os.path.abspath(path)
        st = os.stat(self.path)
        self.identity = identity_of(st)
        self._fd: int | None = None
        self.tags: ContentTags | None = None
        self._written = (st.st_mtime_ns, st.st_size)

    def watch(self, tags: ContentTags | None = None) -> ContentTags:
        """Watch the content from now on (the writer's); the tags it sets go in the returned
        list -- *tags*, when given (the writer's before), which the file must still carry."""
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        if identity_of(os.fstat(fd)) != self.identity:
            os.close(fd)  # never opened by SQLite: nothing of it can be lost
            self.check()
        self._fd = fd
        self.tags = tags or ContentTags(read_tag(fd) or 0)
        if tags is not None:
            self._check_content()
        return self.tags

    def check(self) -> None:
        """One ``stat`` of the path: DatabaseLost when the file is gone or another
        one, or its content was written by someone else; StoreUnavailable when the
        path cannot be looked at now."""
        try:
            st = os.stat(self.path)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                raise DatabaseLost(f"{self.path}: the database file was deleted while in use; stopped: nothing "
                                   f"written since is acknowledged or published (restore a backup; see "
                                   f"docs/failures.md)") from None
            raise StoreUnavailable(f"{self.path}: cannot look at the database file: {exc.strerror}",
                                   code="io-error") from None
        if (st.st_dev, st.st_ino) != self.identity:
            raise DatabaseLost(f"{self.path}: the database file was replaced while in use; stopped: nothing "
                               f"written since is acknowledged or published (start again if the new file is meant; "
                               f"see docs/failures.md)")
        if self.tags is not None and (st.st_mtime_ns, st.st_size) != self._written:
            self._check_content()
            self._written = (st.st_mtime_ns, st.st_size)

    def _check_content(self) -> None:
        assert self._fd is not None and self.tags is not None
        try:
            tag = read_tag(self._fd)
        except OSError as exc:
            raise StoreUnavailable(f"{self.path}: cannot read the database file: {exc.strerror}",
                                   code="io-error") from None
        if tag is None or not self.tags.judge(tag):
            raise DatabaseLost(
                f"{self.path}: the database file's content was replaced while in use (a copy written over it, "
                f"e.g. a backup restored with cp); stopped: nothing written since is acknowledged or published. "
                f"The file now mixes the copy with this run's journal: do not start on it; restore the backup "
                f"while no run is up (see docs/failures.md, \"Restores\")")

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            release_fd(fd, self.identity)


class _FileLock:
    """An OFD lock on one byte of a database file, through a descriptor of its own."""

    def __init__(self, db_path: Path | str, byte: int) -> None:
        self.db_path = Path(db_path)
        self.byte = byte
        self._fd: int | None = None
        self.identity: tuple[int, int] | None = None
        #: Whether this lock made the file (it did not exist): an empty database of ours.
        self.created = False
        self._held: list[int] = []

    def _open(self, create: bool = True) -> int:
        if self._fd is None:
            path = str(self.db_path)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                if not create:
                    raise DatabaseError(f"{path}: no such database") from None
                fd = self._create(path)
            except OSError as exc:
                if exc.errno not in (errno.EACCES, errno.EROFS, errno.EPERM, errno.EISDIR):
                    raise StoreUnavailable(f"{path}: cannot open the database file now: {exc.strerror}",
                                           code="io-error") from None
                try:  # a read-only file or disk: a read lock needs no write access
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    raise DatabaseError(f"{path}: cannot open the database file: {exc.strerror}") from None
            self._fd = fd
            self.identity = identity_of(os.fstat(fd))
        return self._fd

    def _create(self, path: str) -> int:
        """Make the file, already locked before its name appears (a second run never
        finds it empty and unlocked): a new file under a temporary name, locked, then
        linked to *path*."""
        temp = f"{path}.new-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StoreUnavailable(f"{path}: cannot create the database file: {exc.strerror}",
                                   code="cannot-open") from None
        try:
            _ofd(fd, fcntl.F_WRLCK, self.byte)
            os.link(temp, path)
        except FileExistsError:
            os.close(fd)  # someone else made it meanwhile: open theirs
            return os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                os.close(fd)  # a filesystem without hard links: made under its name, locked just after
                with suppress(OSError):
                    os.unlink(temp)
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                except FileExistsError:
                    return os.open(path, os.O_RDWR | os.O_CLOEXEC)
                self.created = True
                return fd
            os.close(fd)
            raise StoreUnavailable(f"{path}: cannot create the database file: {exc.strerror}",
                                   code="cannot-open") from None
        finally:
            with suppress(OSError):
                os.unlink(temp)
        self.created = True
        return fd

    def _lock(self, fd: int, byte: int, kind: int, blocking: bool) -> bool:
        if not _ofd(fd, kind, byte, wait=blocking):
            return False
        self._held.append(byte)
        return True

    def _still_the_file(self) -> bool:
        """Whether the path names the file locked (someone may have replaced it meanwhile)."""
        try:
            return identity_of(os.stat(self.db_path)) == self.identity
        except FileNotFoundError:
            return False

    def unlock(self) -> None:
        if self._fd is not None:
            for byte in self._held:
                with suppress(OSError):
                    _ofd(self._fd, fcntl.F_UNLCK, byte)
            self._held = []

    def close(self) -> None:
        """Release the lock and let the descriptor go (:func:`release_fd`)."""
        if self._fd is not None:
            self.unlock()
            fd, self._fd = self._fd, None
            assert self.identity is not None
            release_fd(fd, self.identity)


def _descriptors_elsewhere(identity: tuple[int, int]) -> Iterator[tuple[int, str]]:
    """(pid, descriptor) of every process of this pid namespace but this one that has the file
    *identity* open, read from ``/proc``."""
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
    except OSError:
        return
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for name in fds:
            with suppress(OSError):
                if identity_of(os.stat(f"/proc/{pid}/fd/{name}")) == identity:
                    yield pid, name


def _holders(identity: tuple[int, int], bytes_: range) -> dict[int, int]:
    """The pids (in this pid namespace, this one's aside) whose descriptors hold a lock on one
    of *bytes_* of the file *identity*: byte -> pid. Read from ``/proc/<pid>/fdinfo``."""
    dev = f"{os.major(identity[0]):02x}:{os.minor(identity[0]):02x}:{identity[1]}"
    found: dict[int, int] = {}
    for pid, name in _descriptors_elsewhere(identity):
        try:
            with open(f"/proc/{pid}/fdinfo/{name}", encoding="ascii", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        for line in text.splitlines():
            words = line.split()
            if line.startswith("lock:") and "OFDLCK" in words and dev in words:
                start = int(words[words.index(dev) + 1])
                if start in bytes_:
                    found[start] = pid
    return found


def open_elsewhere(path: Path | str) -> bool:
    """Whether another process (of this pid namespace) has the file *path* open:
    an empty database file that another process has open is being made by it."""
    try:
        identity = identity_of(os.stat(path))
    except OSError:
        return False
    return next(_descriptors_elsewhere(identity), None) is not None


def _the_run_of(pid: int) -> tuple[int, str, None]:
    """The process to name for the holder *pid*: the run it is the worker of, when it is one."""
    with suppress(OSError, IndexError, ValueError):
        parent = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
        words = Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0")
        if any(w.endswith(b"delivery_consumer") or w.endswith(b"delivery-consumer") for w in words) \
                and b"run" in words:
            return parent, "run", None
    return pid, "", None


class Holder:
    """Who holds a database, as its note and ``/proc`` say."""

    def __init__(self, pid: int | None, what: str, silent_s: float | None, state: str) -> None:
        self.pid, self.what, self.silent_s, self.state = pid, what, silent_s, state

    def __str__(self) -> str:
        if self.pid is None:
            return "another process"
        text = f"pid {self.pid}" + (f" ({self.what})" if self.what else "")
        if self.state == liveness.STOPPED:
            text += " -- stopped (SIGSTOP or a debugger)"
        if self.silent_s is not None and self.silent_s >= 3 * HEARTBEAT_S:
            text += f", no heartbeat for {self.silent_s:.0f}s"
        return text


def read_note(db_path: Path | str) -> tuple[int | None, str, float | None]:
    """The note of a database's writer: (pid, what, seconds since its heartbeat); (None, "", None) when none."""
    note = note_path(db_path)
    try:
        text = note.read_text(errors="replace").split()
        silent = max(0.0, time.time() - note.stat().st_mtime)
    except OSError:
        return None, "", None
    if not text or not text[0].isdigit():
        return None, "", silent
    return int(text[0]), " ".join(text[1:2]), silent


class WriterLock(_FileLock):
    """One writer per database file: an exclusive OFD lock on a byte of the file, held
    until :meth:`release` or the process's end, whatever path the file was reached by.
    The holder writes ``<pid> <what>`` in the note ``<db>.lock`` (beside the real
    file) and touches it every :data:`HEARTBEAT_S` (:meth:`beat`), so that a refused
    or waiting process can name it and say how long it has been silent. The
    descriptor is not inherited by programs the holder executes (``O_CLOEXEC``);
    a ``fork`` shares it, so a forked child holds the lock with its parent
    (``run`` takes it in its worker process, which forks nothing)."""

    def __init__(self, db_path: Path | str) -> None:
        super().__init__(db_path, WRITER_BYTE)
        self._note: tuple[int, str] | None = None
        self._beating: threading.Event | None = None
        #: Set once another process took over this database (this one was frozen).
        self.superseded = threading.Event()

    @property
    def path(self) -> Path:
        """The note (kept for messages: ``... which holds <db>.lock``)."""
        return note_path(self.db_path)

    def _generations(self) -> range:
        return range(WRITER_BYTE, WRITER_BYTE + GENERATIONS)

    def try_acquire(self, pid: int, what: str, *, shared: bool = False) -> bool:
        """Take the lock if it is free (and note *pid* and *what*); False when another holds it.
        *shared*: writers that may share the database with each other, not with
        an exclusive holder (``replay``: its concurrent writers are safe)."""
        while True:
            fd = self._open()
            if shared:
                taken = all(self._lock(fd, b, fcntl.F_RDLCK, False) for b in self._generations())
            else:
                taken = self._lock(fd, WRITER_BYTE, fcntl.F_WRLCK, False) and not any(
                    _ofd_held(fd, b) for b in self._generations()[1:])
            if not taken:
                self.unlock()
                if not self._still_the_file():
                    self.close()
                    continue
                return False
            if self._still_the_file():
                break
            self.close()  # the path names another file now: lock that one
        self._after_taken(fd, pid, what)
        return True

    def _after_taken(self, fd: int, pid: int, what: str) -> None:
        try:
            check_one_name(self.db_path, os.fstat(fd))
        except DatabaseError:
            self.close()
            raise
        self._note = (pid, what)
        self._write_note()

    def _write_note(self) -> None:
        if self._note is None:
            return
        with suppress(OSError):  # who holds it is for messages only (a full or read-only disk)
            note = self.path
            temp = Path(f"{note}.{os.getpid()}")
            temp.write_text(f"{self._note[0]} {self._note[1]} {liveness.proc_start(os.getpid()) or ''}\n")
            os.replace(temp, note)

    def holder(self) -> Holder:
        """Who holds the database: the note, checked against ``/proc`` (the pids whose
        descriptors hold its lock) when it can be."""
        pid, what, silent = read_note(self.db_path)
        identity = self.identity
        if identity is None:
            with suppress(OSError):
                identity = identity_of(os.stat(self.db_path))
        state = liveness.process_state(pid, None)[0] if pid is not None else liveness.GONE
        if state == liveness.GONE and identity is not None:  # no note, or a stale one: ask /proc who holds it
            holders = _holders(identity, self._generations())
            if holders:
                pid, what, silent = _the_run_of(min(holders.values()))
                state = liveness.process_state(pid, None)[0]
        return Holder(pid, what, silent, state)

    def acquire(self, pid: int, what: str, *, shared: bool = False) -> None:
        """Take the lock or raise DatabaseInUse in one line naming the holder."""
        if not self.try_acquire(pid, what, shared=shared):
            holder = self.holder()
            self.close()
            raise DatabaseInUse(f"{self.db_path}: in use by {holder}, which holds this database file's writer "
                                f"lock; one writer per database: stop it first (a partition's standby waits instead)")

    def wait(self, pid: int, what: str, *, give_up: Callable[[], bool],
             on_wait: Callable[[Holder], None] = lambda _holder: None,
             take_over: Callable[[Holder], bool] = lambda _holder: False) -> bool:
        """Wait for the lock (a standby); *on_wait* is told the holder once.
        *take_over* is asked, while the lock stays taken, whether to take over
        from the holder (it was proven frozen: :meth:`take_over`). False when
        *give_up* said so before the lock was free."""
        told = False
        while not self.try_acquire(pid, what):
            holder = self.holder()
            if not told:
                on_wait(holder)
                told = True
            if take_over(holder) and self.take_over(pid, what):
                return True
            if give_up():
                self.close()
                return False
            time.sleep(LOCK_POLL_S)
        return True

    def take_over(self, pid: int, what: str) -> bool:
        """Become the writer beside a holder that cannot write (frozen): take the
        next free generation's byte. True when taken and no live process holds
        another generation. The frozen holder keeps its own byte until it dies."""
        fd = self._open()
        generations = self._generations()
        for byte in generations[1:]:
            if not _ofd_held(fd, byte) and self._lock(fd, byte, fcntl.F_WRLCK, False):
                assert self.identity is not None
                others = {b: p for b, p in _holders(self.identity, generations).items() if b != byte}
                if any(liveness.process_state(p, None)[0] != liveness.STOPPED for p in others.values()):
                    self.unlock()  # another live writer meanwhile: not ours to take
                    return False
                self._after_taken(fd, pid, what)
                return True
        return False

    def taken_over(self) -> bool:
        """Whether the note names another process than this holder: a standby took the
        database over while this one was frozen."""
        pid = read_note(self.db_path)[0]
        return self._note is not None and pid is not None and pid != self._note[0]

    def take_again(self, pid: int, what: str) -> None:
        """Take the lock again on the file the path names now (after a remount the
        old descriptor locks a file of a filesystem that is gone); DatabaseInUse when
        another process took it meanwhile."""
        self.close()
        if not self.try_acquire(pid, what):
            raise DatabaseInUse(f"{self.db_path}: in use by {self.holder()} since the disk came back; stopped")

    def beat(self, alive: Callable[[], bool] = lambda: True) -> None:
        """Start the heartbeat: a thread touches the note every HEARTBEAT_S while
        *alive* says so (and writes it again if someone deleted it); a note naming
        another process means this one was taken over from: :attr:`superseded` is set."""
        if self._beating is not None:
            return
        stop = self._beating = threading.Event()

        def loop() -> None:
            while not stop.wait(HEARTBEAT_S):
                if not alive():
                    continue
                note = self.path
                try:
                    os.utime(note)
                except FileNotFoundError:
                    self._write_note()
                    continue
                except OSError:
                    continue
                if self.taken_over():
                    self.superseded.set()

        threading.Thread(target=loop, name="delivery-heartbeat", daemon=True).start()

    def release(self) -> None:
        if self._beating is not None:
            self._beating.set()
            self._beating = None
        self.close()


def holder_states(lock: WriterLock, holder: Holder) -> list[liveness.State]:
    """The states of the processes that hold *lock*'s database: the one its note names
    and those whose descriptors hold a writer byte (a run's worker)."""
    pids = {holder.pid} if holder.pid is not None else set()
    if lock.identity is not None:
        pids.update(_holders(lock.identity, range(WRITER_BYTE, WRITER_BYTE + GENERATIONS)).values())
    return [liveness.process_state(pid, None)[0] for pid in pids]


#: The WAL-index byte SQLite's writer locks in ``<db>-shm`` (https://sqlite.org/walformat.html).
_WAL_WRITE_LOCK = 120


def frozen_inside(lock: WriterLock) -> str:
    """Why a frozen holder of *lock*'s database would still write when continued, or "":
    it holds SQLite's write lock (inside a transaction) or the fence's serial lock (a
    call under way). Read by a process with no connection to the database (closing
    the ``-shm`` descriptor here releases no lock of its own)."""
    fd = lock._open(create=False)
    if _ofd_held(fd, SERIAL_BYTE):
        return "it is inside the fence's claim-call-complete step (it holds the serial lock)"
    try:
        shm = os.open(f"{lock.db_path}-shm", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        answer = fcntl.fcntl(shm, fcntl.F_GETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, 0, _WAL_WRITE_LOCK, 1, 0))
    finally:
        os.close(shm)
    if struct.unpack(_FLOCK, answer[:struct.calcsize(_FLOCK)])[0] != fcntl.F_UNLCK:
        return "it is inside a write transaction (it holds SQLite's write lock)"
    return ""


class SerialLock(_FileLock):
    """``with lock:`` -- one process at a time in the block, whichever connection
    it uses (the fence's claim, call and completion: docs/fence.md). Blocks.
    An OFD lock on a byte of the database file itself (not of a file beside it),
    opened through the file the guard checks, so every name of the file meets it."""

    def __init__(self, db_path: Path | str, identity: tuple[int, int] | None = None) -> None:
        super().__init__(db_path, SERIAL_BYTE)
        self._expected = identity
        self._threads = threading.Lock()

    def __enter__(self) -> SerialLock:
        self._threads.acquire()  # the OFD lock does not exclude this process's own threads using one descriptor
        try:
            fd = self._open(create=False)
            if self._expected is not None and self.identity != self._expected:
                raise DatabaseLost(f"{self.db_path}: the database file was replaced while in use; stopped")
            self._lock(fd, SERIAL_BYTE, fcntl.F_WRLCK, True)
        except BaseException:
            self._threads.release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.unlock()
        self._threads.release()


__all__ = [
    "GENERATIONS", "HEARTBEAT_S", "LOCK_POLL_S", "SERIAL_BYTE", "WRITER_BYTE", "ContentTags", "FileGuard", "Holder",
    "SerialLock", "WriterLock", "check_one_name", "frozen_inside", "holder_states", "identity_of", "lock_path",
    "note_path", "open_elsewhere", "read_note", "read_tag", "release_fd",
]
