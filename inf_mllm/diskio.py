"""Every write a session folder sees goes through here: files replaced atomically, records appended,
one writer's lock.

Why one module: a crash or a full disk can strike at any write, and the only way to know a session
survives all of them is to try each one. `hook`, when set, is called before every write primitive
(`hook(op, path, fd, data)`); the fault-injection test (tests/test_session_faults.py) counts the calls
of a clean run, then makes the N-th one crash or fail with ENOSPC. Code that writes into a session
folder (span store, index, transcript, settings, lock) must use these functions, or it goes untested.

Nothing here buffers: each record is one `os.write` (retried until whole) followed by `fsync`, so what
a caller was told is written survives a crash of the process, and a failed append is cut back off the
file instead of leaving half a record for the next writer to append onto.
"""

import contextlib
import errno
import fcntl
import os
from pathlib import Path

hook = None  # tests: called as hook(op, path, fd, data) before each write primitive; may raise
DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


def _before(op: str, path, fd: int | None = None, data: bytes | None = None) -> None:
    if hook is not None:
        hook(op, str(path), fd, data)


def why(err: OSError) -> str:
    """A disk error in the words a user needs: what is wrong with the disk, not which call failed."""
    if err.errno in DISK_FULL:
        return "the disk is full"
    if err.errno == errno.EROFS:
        return "the disk is read-only"
    if err.errno in (errno.EACCES, errno.EPERM):
        return "no permission to write there"
    return err.strerror or str(err)


def _write_all(fd: int, data: bytes, path) -> None:
    view = memoryview(data)
    while view:
        _before("write", path, fd, bytes(view))
        view = view[os.write(fd, view):]


def write_atomic(path: Path, data: bytes) -> None:
    """`path` holds either its old content or all of `data`, whatever happens: write a temporary file,
    fsync it, rename it over. On an error the temporary file is removed and the error raised."""
    tmp = path.with_name(path.name + ".tmp")
    _before("create", tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, data, tmp)
        _before("fsync", tmp, fd)
        os.fsync(fd)
    except OSError:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    try:
        _before("rename", path)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def make_folder(path: Path) -> None:
    """Create a folder and its parents (existing is fine)."""
    _before("mkdir", path)
    Path(path).mkdir(parents=True, exist_ok=True)


def remove(path: Path) -> None:
    """Delete a file (missing is fine)."""
    _before("unlink", path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def truncate(path: Path, size: int) -> None:
    """Cut a file back to `size` bytes (a torn last record)."""
    _before("truncate", path)
    os.truncate(path, size)


class AppendLog:
    """An append-only file of whole records: each `append` writes one record and fsyncs it, or, on an
    error, cuts the file back to where it was and raises. Opened on the first append."""

    def __init__(self, path: Path):
        self.path, self.fd = Path(path), None

    def append(self, record: bytes) -> None:
        if self.fd is None:
            _before("open", self.path)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        size = os.fstat(self.fd).st_size
        try:
            _write_all(self.fd, record, self.path)
            _before("fsync", self.path, self.fd)
            os.fsync(self.fd)
        except OSError:
            with contextlib.suppress(OSError):  # no half record left for the next append to land on
                os.ftruncate(self.fd, size)
            raise

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self):  # a log dropped without close() (an error on the way) does not keep its descriptor
        with contextlib.suppress(Exception):
            self.close()


class FolderBusy(RuntimeError):
    """Another live process holds the folder's lock (`pid`: its process id, None if unknown)."""

    def __init__(self, folder, pid: int | None):
        self.folder, self.pid = folder, pid
        holder = f"process {pid}" if pid else "another process"
        super().__init__(f"{folder} is in use by {holder}, which is still running; one writer at a time: "
                         f"wait for it to end or stop it")


class FolderLock:
    """One writer per folder: an exclusive `flock` on FOLDER/NAME, which holds the holder's pid.

    The kernel drops a flock when its holder dies, however it dies (kill -9 included), so a lock file
    left by a dead process is simply taken over: there is no stale lock to clean up. `acquire` returns
    False when the folder cannot be written (read-only disk, no permission): the caller runs read-only."""

    def __init__(self, folder: Path, name: str = "lock"):
        self.path, self.fd = Path(folder) / name, None
        self.why = ""  # why the folder cannot be written, when `acquire` says so

    def acquire(self) -> bool:
        try:
            _before("lock", self.path)
            fd, writable = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644), True
        except OSError as err:
            if err.errno not in READ_ONLY + DISK_FULL:
                raise
            self.why = why(err)
            try:  # a read-only folder: a lock file already there still keeps writers and readers apart
                fd, writable = os.open(self.path, os.O_RDONLY), False
            except OSError:
                return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read_pid(fd)
            os.close(fd)
            raise FolderBusy(self.path.parent, pid) from None
        self.fd = fd
        if writable:
            try:
                _before("write", self.path, fd, b"")
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError:
                pass  # the lock holds all the same; a refused writer just cannot name us
        return writable

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the flock; the file stays (removing it would race a new holder)
            self.fd = None

    def __del__(self):  # a holder dropped without release() (an error on the way) frees the folder
        with contextlib.suppress(Exception):
            self.release()


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text.isdigit() else None
    except (OSError, UnicodeDecodeError):
        return None
