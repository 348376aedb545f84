"""Index a tar shard someone else wrote: parse its headers, group members into samples, read lengths.

Algorithm: walk the 512-byte header blocks of a memory-mapped tar, jumping over each payload (only the
header pages are touched, plus the ``.npy`` token members and the audio members whose duration
is wanted). GNU longname/longlink (``L``/``K``) and PAX (``x``/``g``) headers are folded into the member
that follows them, the way ``tarfile`` does, so ``header_offset`` is where a member's *first* header
starts (what ``tarfile.TarInfo.offset`` and Megatron-Energon's ``.tar.idx`` record). Every header's
checksum is checked and a payload running past the end of the file is an error, so a truncated or
damaged tar is reported at its byte offset instead of being indexed short.

Members become samples the way webdataset's ``base_plus_ext`` and energon's ``split_name_re`` split a
name: key = path up to the first dot of the basename, extension = the rest; consecutive members with
the same key form one sample; ``__*__`` metadata entries, names without a dot and non-regular entries
are skipped (they still count toward the byte span of the sample before them, as in energon).

Cost: a Python loop per header (~2 us) -- ~0.5 s for 100k members -- versus ``tarfile``'s ~15 us per
member; lengths read the ``.npy`` token members (header regex, then one numpy ``max`` for the shard's
largest token id, which the trainer checks against the model's vocabulary) and the header of audio
members (``headrace.dataio.shards.audioheader.probe``: FLAC/WAV parsed directly, libsndfile for the rest).
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import stat
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from headrace.dataio.shards.audioheader import probe
from headrace.dataio.shards.formats import is_audio_member, is_token_member, npy_header
from headrace.dataio.shards.index import MEMBER_DTYPE, SAMPLE_DTYPE, ShardInfo, ShardPart
from headrace.dataio.shards.tarwriter import BLOCK
from headrace.dataio.usererror import UserError

ZERO_BLOCK = bytes(BLOCK)
MAX_MEMBERS = int(np.iinfo(SAMPLE_DTYPE["member_count"]).max)  # members of one sample the index can hold
MAX_EXTENSIONS = int(np.iinfo(MEMBER_DTYPE["ext"]).max) + 1  # distinct extensions of one shard
REGULAR_TYPES = (b"0", b"\0", b"7")  # regular, old-style regular, contiguous (tarfile.REGULAR_TYPES)
NO_PAYLOAD_TYPES = (b"1", b"2", b"3", b"4", b"5", b"6")  # link/symlink/char/block/dir/fifo: size not skipped

# webdataset.tariterators.base_plus_ext == megatron.energon...config.split_name_re
SPLIT_NAME = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
SKIP_META = re.compile(r"__[^/]*__($|/)")  # energon skips these (e.g. __meta__/...)


class TarFormatError(ValueError, UserError):
    """A tar that cannot be indexed: names the file and the byte offset of the broken header."""

    def __init__(self, path: str | os.PathLike, offset: int, reason: str):
        super().__init__(f"{path}: byte {offset}: {reason}")
        self.path, self.offset, self.reason = str(path), offset, reason

    def __reduce__(self):  # crosses process boundaries (parallel `dataio index`)
        return type(self), (self.path, self.offset, self.reason)


@dataclass(frozen=True, slots=True)
class TarMember:
    name: str
    header_offset: int  # first header block of this member (longname / PAX headers included)
    offset: int  # payload
    size: int


def _number(field: bytes, what: str) -> int:
    """A numeric header field: octal text, or GNU base-256 when the top bit is set (tarfile.nti).
    ValueError (naming ``what``) for text that is not octal and for a negative value."""
    if field[0] & 0x80:
        value = int.from_bytes(field[1:], "big")
        value = -value if field[0] == 0xFF else value
    else:
        text = field.split(b"\0", 1)[0].strip()
        if text and not text.isdigit() or b"8" in text or b"9" in text:
            raise ValueError(f"{what} field {bytes(text)[:12]!r} is not an octal number")
        value = int(text, 8) if text else 0
    if value < 0:
        raise ValueError(f"{what} is negative ({value})")
    return value


def _text(field: bytes, what: str) -> str:
    """A NUL-terminated text field; names must be UTF-8 (what webdataset, energon and JSON need)."""
    raw = field.split(b"\0", 1)[0]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{what} {raw[:60]!r} is not UTF-8") from None


def _pax_records(data: bytes) -> dict[str, str]:
    """``key=value`` records of a PAX header: ``"<length> <key>=<value>\\n"`` each, lengths checked."""
    records, pos = {}, 0
    while pos < len(data) and data[pos] != 0:
        space = data.find(b" ", pos, pos + 21)
        length = int(data[pos:space]) if space > pos and data[pos:space].isdigit() else 0
        if length <= space - pos + 1 or pos + length > len(data) or data[pos + length - 1] != 0x0A:
            raise ValueError(f"malformed PAX header record at byte {pos} of the extended header")
        key, eq, value = data[space + 1 : pos + length - 1].partition(b"=")
        if not eq:
            raise ValueError(f"PAX header record at byte {pos} has no '='")
        records[_text(key, "PAX record key")] = _text(value, f"PAX {key[:20]!r} value")
        pos += length
    return records


def _pax_size(fields: dict[str, str]) -> int:
    text = fields["size"]
    if not text.isdigit():  # no sign, no spaces: a PAX size is a plain decimal count
        raise ValueError(f"PAX size {text[:20]!r} is not a non-negative decimal number")
    return int(text)


def scan_members(buf, *, path: str | os.PathLike = "<tar>") -> tuple[list[TarMember], int]:
    """Regular-file members of the tar in ``buf`` (bytes / mmap), and the end-of-data offset.

    The end offset is where the end-of-archive zero blocks start (the file size when they are
    missing, which ``tarfile`` also accepts). Every size is checked (non-negative, within the file)
    before it moves the position, so the walk always advances and ends; any header that does not
    parse (bad checksum, non-octal or negative size, malformed PAX record, a name that is not UTF-8,
    a sparse member, a payload past the end of the file) raises ``TarFormatError`` naming the file,
    the header's byte offset and, when known, the member.
    """
    members: list[TarMember] = []
    size_total = len(buf)
    pos = 0
    first_header: int | None = None  # start of pending longname / PAX headers
    pending: dict[str, str] = {}  # path / size overrides for the next member
    global_pax: dict[str, str] = {}
    while pos + BLOCK <= size_total:
        block = bytes(buf[pos : pos + BLOCK])
        if block == ZERO_BLOCK:
            return members, pos
        name = None
        try:
            checksum = _number(block[148:156], "checksum")
            unsigned = sum(block) - sum(block[148:156]) + 256
            if checksum != unsigned:
                raise ValueError(f"bad tar header checksum ({checksum} != {unsigned})")
            kind = block[156:157]
            size = _number(block[124:136], "size")
            data = pos + BLOCK
            if kind in (b"L", b"K", b"x", b"X", b"g"):
                if data + size > size_total:
                    raise ValueError("extended header runs past the end of the file (truncated tar)")
                payload = bytes(buf[data : data + size])
                if kind == b"L":
                    pending["path"] = _text(payload, "GNU long name")
                elif kind == b"g":
                    global_pax.update(_pax_records(payload))
                elif kind != b"K":
                    pending.update(_pax_records(payload))
                first_header = pos if first_header is None else first_header
                pos = data + -(-size // BLOCK) * BLOCK
                continue
            fields = {**global_pax, **pending}
            name = fields.get("path")
            if name is None:
                name = _text(block[0:100], "member name")
                prefix = _text(block[345:500], "name prefix") if block[257:263] == b"ustar\0" else ""
                name = f"{prefix}/{name}" if prefix else name
            if "size" in fields:
                size = _pax_size(fields)
            if kind == b"S" or any(k.startswith("GNU.sparse") for k in fields):
                raise ValueError("a sparse file (not supported in shards)")
            header_offset = pos if first_header is None else first_header
            if kind not in NO_PAYLOAD_TYPES and data + size > size_total:
                pos = header_offset
                raise ValueError(f"needs bytes {data}..{data + size} but the file has {size_total} (truncated tar)")
        except ValueError as e:
            member = f"member {name!r}: " if name else ""
            raise TarFormatError(path, pos, f"{member}{e}") from None
        first_header, pending = None, {}
        if kind in NO_PAYLOAD_TYPES:
            pos = data
            continue
        if kind in REGULAR_TYPES and not (kind == b"\0" and name.endswith("/")):
            members.append(TarMember(name=name, header_offset=header_offset, offset=data, size=size))
        pos = data + -(-size // BLOCK) * BLOCK
    if pos > size_total:  # found by tests/fuzz.py: the offset used to point past the end of the file
        raise TarFormatError(path, size_total, "tar ends inside the last member's padding (truncated tar)")
    if pos != size_total or first_header is not None:
        raise TarFormatError(path, pos, "tar ends inside a header block (truncated tar)")
    return members, pos


def split_name(name: str) -> tuple[str, str] | None:
    """``(key, extension)`` of a member name as webdataset/energon group it, or None when skipped."""
    if SKIP_META.match(name):
        return None
    m = SPLIT_NAME.match(name)
    return (m.group(1), m.group(2)) if m else None


def _token_count_and_max(payload) -> tuple[int, int]:
    """Token count from an ``.npy`` member's header, and its largest id (-1 for a float or empty array)."""
    shape, _, dtype, offset = npy_header(payload)
    count = math.prod(shape)
    if dtype.kind not in "iu" or count == 0:
        return count, -1
    return count, int(np.frombuffer(payload, dtype=dtype, count=count, offset=offset).max())


def audio_duration(payload) -> float:
    """Duration in seconds of an audio member, from its header (``headrace.dataio.shards.audioheader.probe``)."""
    sample_rate, frames = probe(payload)
    return frames / sample_rate


def open_tar(path: str | os.PathLike):
    """A read-only memory map of a tar file (``b""`` for an empty file); a FIFO, device or directory
    named like a shard is a ``TarFormatError`` (opened without blocking, never read)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TarFormatError(
                os.fspath(path), 0, "not a regular file (a FIFO, device or directory named like a shard)"
            )
        if st.st_size == 0:
            return b""
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)


def scan_shard(
    root: str | os.PathLike, name: str, *, split: str = "train", lengths: bool = True, checksum: bool = False
) -> ShardPart:
    """The index part of shard ``root/name``: samples, members, keys and (``lengths``) per-sample
    token counts from ``.npy`` headers and audio durations from audio headers."""
    path = Path(root) / name
    buf = open_tar(path)
    try:
        return scan_buffer(buf, name, path=path, split=split, lengths=lengths, checksum=checksum)
    finally:
        if isinstance(buf, mmap.mmap):
            buf.close()


def scan_buffer(
    buf, name: str, *, path: str | os.PathLike, split: str = "train", lengths: bool = True, checksum: bool = False
) -> ShardPart:
    """``scan_shard`` of a tar already in memory or mapped (``path`` labels errors)."""
    members, end = scan_members(buf, path=path)
    exts: dict[str, int] = {}
    keys: list[str] = []
    starts: list[int] = []
    member_rows: list[tuple[int, int, int]] = []
    member_starts: list[int] = []
    tokens: list[int] = []
    durations: list[float] = []
    max_token = -1
    for m in members:
        split_ = split_name(m.name)
        if split_ is None:
            continue
        key, ext = split_
        if keys and keys[-1] == key and len(member_rows) - member_starts[-1] >= MAX_MEMBERS:
            raise TarFormatError(path, m.header_offset, f"sample {key!r} has more than {MAX_MEMBERS} members")
        if ext not in exts and len(exts) >= MAX_EXTENSIONS:
            raise TarFormatError(
                path, m.header_offset, f"member {m.name!r}: more than {MAX_EXTENSIONS} distinct extensions in one shard"
            )
        if not keys or keys[-1] != key:
            keys.append(key)
            starts.append(m.header_offset)
            member_starts.append(len(member_rows))
            tokens.append(-1)
            durations.append(float("nan"))
        member_rows.append((exts.setdefault(ext, len(exts)), m.offset, m.size))
        if not lengths:
            continue
        payload = buf[m.offset : m.offset + m.size]
        try:
            if is_token_member(ext) and tokens[-1] < 0:
                tokens[-1], top = _token_count_and_max(payload)
                max_token = max(max_token, top)
            elif is_audio_member(ext) and durations[-1] != durations[-1]:
                durations[-1] = audio_duration(payload)
        except (ValueError, RuntimeError, OSError, TypeError):
            pass  # an undecodable member is `dataio verify`'s business; the index records "unknown"
    samples = np.zeros(len(keys), SAMPLE_DTYPE)
    samples["offset"] = starts
    samples["size"] = np.diff(np.asarray(starts + [end], dtype=np.uint64))
    samples["member_start"] = member_starts
    samples["member_count"] = np.diff(np.asarray(member_starts + [len(member_rows)]))
    samples["tokens"] = tokens
    samples["duration"] = durations
    sha = None
    if checksum:
        sha = hashlib.sha256(buf).hexdigest()
    info = ShardInfo(
        name=str(name),
        split=split,
        bytes=len(buf),
        samples=len(keys),
        sha256=sha,
        max_token=max_token if max_token >= 0 else None,
    )
    return ShardPart(
        info=info,
        extensions=list(exts),
        samples=samples,
        members=np.array(member_rows, dtype=MEMBER_DTYPE) if member_rows else np.zeros(0, MEMBER_DTYPE),
        keys=np.array([k.encode("utf-8", "surrogateescape") for k in keys], dtype=np.bytes_)
        if keys
        else np.zeros(0, "S1"),
    )
