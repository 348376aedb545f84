"""Which checkpoints a job trusts: a seal over every file's size and SHA-256, keyed outside the run.

Loading a checkpoint never unpickles (``headrace.training.checkpoint.restore``: safetensors + JSON), so the
seal is not what stops code execution; it vouches that the bytes loaded are the ones this user's saves wrote.

- Hashes are computed while the files are written (``HashingFileSystem`` wraps DCP's writer streams), not by
  re-reading them; rank 0 then records in ``trainer_state.json`` each file's size and SHA-256 and an
  HMAC-SHA256 of the whole state.
- The key is the *user's*, never the run's: ``$HEADRACE_SEAL_KEY`` or ``$XDG_CONFIG_HOME/headrace/seal-key``
  (``~/.config/headrace/seal-key``), 32 random bytes made by the first save, mode 0600 in a 0700 folder. A
  checkpoint folder cannot ship its own key (nothing is read from it but the checkpoint), and a key that
  someone else could have written (not ours, group/world-accessible, a symlink, a writable folder above it)
  is refused, never adopted.
- ``check`` (rank 0, before any tensor is read): the state parses and its HMAC holds; the folder holds exactly
  the sealed files (a file added would be read by the safetensors reader) at their sealed sizes.
  ``verify_hashes``: a share of the files re-hashed on each rank at load.

Verdicts: a file missing, of another size or hash, a state that does not parse: *incomplete* (a crash, a
full disk, a copy cut short): the trainer falls back to the previous checkpoint. A seal that does not match,
no seal, an extra file, another layout: *refused*, one line.

Cost: at save, SHA-256 over the bytes written (~1-2 GB/s per writer thread, in the background with async
saves); at load, one read of every file spread over the ranks.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import stat
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystem

KEY_ENV = "HEADRACE_SEAL_KEY"
KEY_BYTES = 32
FORMAT = "headrace-safetensors-1"  # the layout a state file names; older checkpoints name none


class Incomplete(Exception):
    """The checkpoint was cut short or damaged (a file missing, truncated, of another hash; a state that does not
    parse)."""


class NotSealed(Exception):
    """The checkpoint was not written by this user's saves (no seal, a seal that does not match, a foreign file)."""


class OldLayout(NotSealed):
    """A checkpoint of headrace's pickled DCP layout (``.metadata`` + ``.distcp``)."""


class UntrustedKey(Exception):
    """The seal key exists but someone other than this user could have written or read it."""


def key_path() -> Path:
    """Where this user's key lives: ``$HEADRACE_SEAL_KEY``, else ``$XDG_CONFIG_HOME/headrace/seal-key``."""
    if os.environ.get(KEY_ENV):
        return Path(os.environ[KEY_ENV])
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "headrace" / "seal-key"


def _refuse_unless_private(path: Path, st: os.stat_result, what: str) -> None:
    if st.st_uid != os.getuid():
        raise UntrustedKey(
            f"seal key {path}: its {what} belongs to uid {st.st_uid}, not to this user "
            f"({os.getuid()}); remove it or set {KEY_ENV} to a key of your own"
        )
    if what == "file" and st.st_mode & 0o077:
        raise UntrustedKey(
            f"seal key {path}: mode {stat.S_IMODE(st.st_mode):o} lets others read or replace it "
            f"(planted?); remove it (the next save makes a new one) or chmod 600 it if you made it"
        )
    if what == "folder" and st.st_mode & 0o022:
        raise UntrustedKey(
            f"seal key {path}: its folder {path.parent} is writable by others "
            f"(mode {stat.S_IMODE(st.st_mode):o}); chmod go-w it or set {KEY_ENV}"
        )


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "a device")


def seal_key(*, create: bool) -> bytes | None:
    """This user's key (``key_path``), made once when ``create``; None when absent and not ``create``.
    ``UntrustedKey`` when the file or its folder is not this user's alone."""
    path = key_path()
    if create:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass  # made earlier (or by another job of this user at once): read below, checked like any
        else:
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(KEY_BYTES))
                f.flush()
                os.fsync(f.fileno())
    try:
        # O_NONBLOCK: a FIFO planted at the path must not block the open (regular files ignore the flag)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a symlink
        raise UntrustedKey(
            f"seal key {path}: does not open without following a link ({e.strerror}); remove it"
        ) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UntrustedKey(f"seal key {path}: not a regular file ({_kind(st.st_mode)}); remove it")
    with os.fdopen(fd, "rb") as f:
        _refuse_unless_private(path, st, "file")
        _refuse_unless_private(path, os.stat(path.parent), "folder")
        key = f.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise UntrustedKey(f"seal key {path}: holds {len(key)} bytes, not {KEY_BYTES}; remove it")
    return key


class _HashingStream(io.RawIOBase):
    """A write stream that hashes what passes through it on the way to ``raw``."""

    def __init__(self, raw):
        self.raw, self.sha, self.size = raw, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += memoryview(data).nbytes
        return self.raw.write(data)

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()


class HashingFileSystem(FileSystem):
    """DCP's local file system whose write streams record ``digests[name] = (size, sha256)`` of each file."""

    def __init__(self):
        self.digests: dict[str, tuple[int, str]] = {}

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = _HashingStream(raw)
            yield stream
        self.digests[Path(path).name] = (stream.size, stream.sha.hexdigest())


def _mac(key: bytes, state: dict) -> str:
    body = json.dumps({k: v for k, v in state.items() if k != "seal"}, sort_keys=True).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def seal(state: dict, digests: dict[str, tuple[int, str]], key: bytes) -> dict:
    """``state`` with its layout, ``files`` ({name: [size, sha256]}, from the writers) and ``seal`` (HMAC)."""
    state = {**state, "format": FORMAT, "files": {n: list(digests[n]) for n in sorted(digests)}}
    return {**state, "seal": _mac(key, state)}


def sealed_by(step_dir: Path, key: bytes, state_file: str) -> bool:
    """Whether ``step_dir`` holds a state file of this layout whose seal holds under ``key`` (its files unchecked:
    what ``keep_last`` may prune)."""
    try:
        with open(step_dir / state_file, "rb") as f:
            state = json.loads(f.read())
    except (OSError, ValueError, RecursionError):
        return False
    return (
        isinstance(state, dict)
        and state.get("format") == FORMAT
        and isinstance(state.get("seal"), str)
        and hmac.compare_digest(_mac(key, state), state["seal"])
    )


def check(step_dir: Path, key: bytes | None, state_file: str) -> dict:
    """The trainer state of ``step_dir`` once its seal holds and the folder holds exactly its files at their
    sizes; ``Incomplete`` / ``NotSealed`` / ``OldLayout`` (module docstring). Hashes: ``verify_hashes``."""
    try:
        state = json.loads((step_dir / state_file).read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise Incomplete(f"{state_file} does not read ({type(e).__name__})") from None
    if not isinstance(state, dict):
        raise NotSealed(f"{state_file} is not a sealed state")
    if state.get("format") != FORMAT:
        raise OldLayout(
            f"{state_file} names no checkpoint format: written in headrace's former pickled DCP layout "
            "(.metadata + .distcp), which cannot be loaded without unpickling it; load it with the "
            "headrace that wrote it and export hf/ (then model.pretrained_path=.../hf), or move it away "
            "to start afresh"
        )
    if key is None:
        raise NotSealed(f"this user has no seal key ({key_path()}): it was written by someone else's saves")
    if not isinstance(state.get("seal"), str) or not hmac.compare_digest(_mac(key, state), state["seal"]):
        raise NotSealed(
            f"its seal does not match this user's key {key_path()} ({state_file} changed since the "
            "save, or another user's run wrote it)"
        )
    files = state["files"]
    present = {p.name for p in step_dir.iterdir()} - {state_file}
    if extra := sorted(present - files.keys()):
        raise NotSealed(f"holds files its save did not write: {', '.join(extra[:3])}")
    for name, (size, _) in files.items():
        path = step_dir / name
        if not path.is_file():
            raise Incomplete(f"{name} is missing")
        if path.stat().st_size != size:
            raise Incomplete(f"{name} has {path.stat().st_size} bytes, {size} were written")
    return state


def file_sha256(path: Path, block: int = 8 << 20) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            sha.update(chunk)
    return sha.hexdigest()


def verify_hashes(step_dir: Path, state: dict, rank: int, world: int) -> str | None:
    """This rank's share of ``state``'s files (every ``world``-th, from ``rank``) re-hashed: the first mismatch
    as a line, or None."""
    for name, (_, digest) in sorted(state["files"].items())[rank::world]:
        if file_sha256(step_dir / name) != digest:
            return f"{name} does not hash to what was written"
    return None


__all__ = [
    "FORMAT",
    "HashingFileSystem",
    "Incomplete",
    "KEY_ENV",
    "NotSealed",
    "OldLayout",
    "UntrustedKey",
    "check",
    "key_path",
    "seal",
    "seal_key",
    "sealed_by",
    "verify_hashes",
]
