"""A WebDataset tar writer that records every member's offset as it writes.

Each member is one 512-byte POSIX ustar header, the payload, and zero padding to a 512-byte block,
so member ``i``'s payload offset is known before its bytes hit the disk and the shard index needs no
second read of the tar. Headers are filled into a prebuilt template (fixed mode 0644, uid/gid 0,
mtime 0, empty user/group names), so the same samples always give the same bytes: a resumed job is
byte-identical to an uninterrupted one. ``tarfile`` and ``webdataset.ShardWriter`` instead build
headers through ``TarInfo`` (pax/gnu logic, several encodes per member) and stamp the wall clock; this
writer costs one template copy and one checksum per member and writes payloads without copying them.

A payload may also be a ``FilePayload`` (a file on disk, e.g. audio kept as given): its bytes go from
the source file to the tar inside the kernel (``os.copy_file_range``, else ``os.sendfile``, else a
read/write loop), so they never enter Python. That is the difference between copying a corpus at a
fraction of the disk's speed and at the disk's speed; with ``sha256=True`` the bytes must be hashed,
so they are read into memory instead.

Limits (checked, never silently broken): a member name of at most 100 bytes, or 255 split at a ``/``
into ustar's prefix and name fields; a member of less than 8 GiB (11 octal digits).
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import queue
import socket
import threading
from dataclasses import dataclass
from typing import BinaryIO

from headrace.dataio.shards.writes import writing

BLOCK = 512
MAX_MEMBER_SIZE = 8**11 - 1

_CHECKSUM_BLANK = b" " * 8
_EOF = b"\0" * (2 * BLOCK)


def _template() -> bytes:
    h = bytearray(BLOCK)
    h[100:108] = b"0000644\0"  # mode
    h[108:116] = b"0000000\0"  # uid
    h[116:124] = b"0000000\0"  # gid
    h[136:148] = b"00000000000\0"  # mtime: fixed, so reruns are byte-identical
    h[148:156] = _CHECKSUM_BLANK
    h[156:157] = b"0"  # regular file
    h[257:263] = b"ustar\0"
    h[263:265] = b"00"
    return bytes(h)


_TEMPLATE = _template()


def _split_name(name: bytes) -> tuple[bytes, bytes]:
    """ustar ``(prefix, name)`` fields for a member name, or ValueError when it does not fit."""
    if len(name) <= 100:
        return b"", name
    # The prefix holds the leading directories (<= 155 bytes), the name field the rest (<= 100).
    cut = name.rfind(b"/", 0, 156)  # the last '/' that leaves a prefix of <= 155 bytes
    if cut <= 0 or len(name) - cut - 1 > 100:
        raise ValueError(f"tar member name too long for one ustar header ({len(name)} bytes): {name[:60]!r}...")
    return name[:cut], name[cut + 1 :]


def tar_header(name: str, size: int) -> bytes:
    """The 512-byte ustar header of a regular file ``name`` of ``size`` bytes."""
    if not 0 <= size <= MAX_MEMBER_SIZE:
        raise ValueError(f"tar member {name!r}: size {size} exceeds the ustar limit of {MAX_MEMBER_SIZE} bytes")
    prefix, short = _split_name(name.encode())
    h = bytearray(_TEMPLATE)
    h[0 : len(short)] = short
    h[124:136] = b"%011o\0" % size
    if prefix:
        h[345 : 345 + len(prefix)] = prefix
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


@dataclass(frozen=True, slots=True)
class FilePayload:
    """A member payload that is the first ``size`` bytes of the file at ``path``."""

    path: str
    size: int


@dataclass(kw_only=True)
class MemberSpan:
    """Where a member's payload landed: absolute byte offset in the tar and payload size."""

    offset: int
    size: int


class BackgroundSha256:
    """sha256 computed on another thread: hashlib releases the GIL on large buffers, so hashing
    overlaps the writer's I/O and Python work instead of adding to it (payloads must not mutate)."""

    def __init__(self):
        self._hash = hashlib.sha256()
        self._queue: queue.Queue = queue.Queue(maxsize=256)  # backpressure bounds the memory held
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            self._hash.update(data)

    def update(self, data) -> None:
        self._queue.put(data)

    def hexdigest(self) -> str:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        return self._hash.hexdigest()


# Errors that mean "this kernel / file system cannot copy between these files": fall back, don't fail.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.ETXTBSY}
COPY_CHUNK = 8 << 20  # bytes per pread when a payload goes through Python


def _copy_all(src: int, dst: int, size: int, copy) -> int:
    """Copy ``size`` bytes from offset 0 of ``src`` to ``dst``'s position with ``copy(src, dst, n, offset)``;
    returns the bytes copied (fewer when ``src`` is shorter)."""
    done = 0
    while done < size:
        n = copy(src, dst, size - done, done)
        if n == 0:
            break
        done += n
    return done


def _copy_file_range(src: int, dst: int, n: int, offset: int) -> int:
    return os.copy_file_range(src, dst, n, offset)


def _sendfile(src: int, dst: int, n: int, offset: int) -> int:
    return os.sendfile(dst, src, offset, n)


def _read_write(src: int, dst: int, n: int, offset: int) -> int:
    chunk = memoryview(os.pread(src, min(n, COPY_CHUNK), offset))
    done = len(chunk)
    while chunk:
        chunk = chunk[os.write(dst, chunk) :]
    return done


class TarWriter:
    """Append regular-file members to a binary stream, tracking absolute offsets.

    ``add(name, payload)`` returns the payload's span; ``close()`` writes the end-of-archive blocks
    and returns the total size. With ``sha256=True`` every byte written is also hashed on a
    background thread (roughly 1 s of one core per 0.5-2 GB, overlapped with the writing).
    """

    def __init__(self, stream: BinaryIO, *, sha256: bool = False):
        self._stream = stream
        self._hash = BackgroundSha256() if sha256 else None
        self.position = 0
        try:  # file payloads are copied by the kernel into a real, seekable file only
            self._fd = stream.fileno() if stream.seekable() and not sha256 else None
        except (OSError, io.UnsupportedOperation):
            self._fd = None
        self._copiers = [_copy_file_range, _sendfile, _read_write]  # preferred first; unsupported ones dropped

    def _write(self, data: bytes | memoryview) -> None:
        self._stream.write(data)
        if self._hash is not None:
            self._hash.update(data)
        self.position += len(data)

    def add(self, name: str, payload: bytes | bytearray | memoryview | FilePayload) -> MemberSpan:
        size = payload.size if isinstance(payload, FilePayload) else len(payload)
        self._write(tar_header(name, size))
        span = MemberSpan(offset=self.position, size=size)
        if isinstance(payload, FilePayload):
            self._copy_file(payload)
        else:
            self._write(payload)
        pad = -size % BLOCK
        if pad:
            self._write(_EOF[:pad])
        return span

    def _copy_file(self, payload: FilePayload) -> None:
        """The payload's bytes, file to file in the kernel when it can (see the module docstring)."""
        fd = os.open(payload.path, os.O_RDONLY)
        try:
            if self._fd is None:  # hashing, or a stream without a descriptor: through Python, in chunks
                copied = 0
                while copied < payload.size and (chunk := os.pread(fd, min(COPY_CHUNK, payload.size - copied), copied)):
                    self._write(chunk)
                    copied += len(chunk)
            else:
                self._stream.flush()
                copied = self._copy_in_kernel(fd, payload.size)
                self._stream.seek(os.lseek(self._fd, 0, os.SEEK_CUR))  # resynchronise the stream with the descriptor
                self.position += copied
        finally:
            os.close(fd)
        if copied != payload.size:
            raise OSError(
                errno.EIO,
                f"{payload.path} has {copied} bytes, expected {payload.size} "
                "(changed while being written into the shard)",
            )

    def _copy_in_kernel(self, fd: int, size: int) -> int:
        while True:
            try:
                return _copy_all(fd, self._fd, size, self._copiers[0])
            except OSError as e:
                unsupported = e.errno in _NO_KERNEL_COPY and len(self._copiers) > 1
                if not unsupported or os.lseek(self._fd, 0, os.SEEK_CUR) != self.position:
                    raise  # a real I/O error, or a copier that failed half-way: not safe to retry
                self._copiers.pop(0)

    def close(self) -> int:
        """Write the two zero blocks that end a tar; returns the archive's size in bytes."""
        self._write(_EOF)
        return self.position

    def hexdigest(self) -> str | None:
        return self._hash.hexdigest() if self._hash is not None else None


def write_atomically(path: str | os.PathLike, content, *, what: str) -> object:
    """Write ``content`` (bytes, or a function ``write(stream)``) to ``path.tmp-HOST-PID``, fsync, then
    rename onto ``path``; returns what ``write`` returned. An ``OSError`` names ``path`` and ``what``
    (``headrace.dataio.shards.writes``: a full disk is a one-line error, not a traceback).

    The file becomes visible under its final name only once complete; on any exception the temporary
    file is removed and the exception propagates. Host and pid in the temporary name keep writers on
    different machines sharing one directory apart.
    """
    path = os.fspath(path)
    tmp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"
    write = content if callable(content) else lambda f: f.write(content)
    try:
        with writing(path, what), open(tmp, "wb", buffering=1 << 20) as f:
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return result
