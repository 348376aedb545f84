"""Input readers for ``dataio shard``: manifests and corpora in, samples (tar members) out.

Every reader has two halves so a job can be planned once and written by many processes:

- ``scan()`` walks the input cheaply (manifest lines, file sizes; never audio payloads) and yields
  one small ``Entry`` per sample (key, estimated bytes, line, a locator) or a ``BadRecord`` naming the
  file, line and broken rule. Planning, splits and shard boundaries are computed from entries alone.
- ``load(entry)`` builds the sample's members (audio, ``.json`` metadata, ``.txt``) in a worker; audio
  kept as given is only header-probed and handed on as a ``FilePayload`` for the tar writer to copy
  file to file. It raises ``SampleError`` (file:line: reason) for input that only shows up when read
  (corrupt audio).

Supported inputs (``open_input`` picks one from the suffix and the first record):

- NeMo-style audio manifests (JSONL: ``audio_filepath``, ``duration``, ``text``, optional ``offset``; other
  fields kept; relative paths resolved against the manifest's folder). Key: the ``id`` field when present, else
  the audio path relative to the manifest's folder without extension, plus ``_<offset ms>`` for segments (an
  absolute path outside that folder: its last folder and file name); see ``nemo_key_name``.
- Text JSONL (``--text-field``, default ``text``); key: the ``id`` field when present, else
  ``<file stem>-<line>``. Plain ``.txt``: one document per non-empty line.
- Lhotse CutSet manifests (``.jsonl``/``.jsonl.gz`` of cuts); key: the cut id.
- Parquet with a text column and/or an ``audio`` column (binary, or a struct with ``bytes`` and ``path``
  as Hugging Face ``datasets`` writes it); key: an ``id``/``key`` column when present, else ``<stem>-<row>``.

JSONL locators are ``(byte offset, length)`` read back with ``os.pread`` (gzip files keep the raw line),
so planning holds about 100 bytes per sample, not the corpus.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import stat
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Iterator, Protocol

from headrace.dataio.prepare.audio import cut_and_encode, encode, sniff_ext
from headrace.dataio.shards.audioheader import probe, probe_file
from headrace.dataio.shards.formats import SHARD_AUDIO_EXTENSIONS
from headrace.dataio.shards.tarwriter import FilePayload
from headrace.dataio.usererror import UserError

# Planning estimate for audio that is cut or decoded at shard time (16 kHz 16-bit FLAC is ~30 kB/s).
SEGMENT_BYTES_PER_SECOND = 32_000
_KEY_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
MAX_KEY_BYTES = 200  # leaves room for ".flac" etc. in one ustar header
MAX_SECONDS = 1e7  # ~116 days: no recording is longer; larger times overflow the planning arithmetic
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # where a JSON string may hold a lone surrogate


class SampleError(ValueError, UserError):
    """A sample that cannot be written; the message names file, line and the broken rule."""


def skip_budget_error(reason: str, count: int, budget: int, where: str = "") -> str | None:
    """The one-line error once ``count`` bad samples (the last one's ``reason``) exceed the ``--skip-errors``
    ``budget``, None within it: planning, each shard's writer and the whole job check the budget through it."""
    if count <= budget:
        return None
    if budget == 0:
        return f"{reason}; --skip-errors N skips up to N bad samples"
    return f"{reason} ({count} bad samples{where} exceed --skip-errors {budget})"


@dataclass(kw_only=True, slots=True)
class Entry:
    """A planned sample: enough to place it in a shard and to load it later."""

    key: str
    est_bytes: int
    line: int  # 1-based manifest line or parquet row
    locator: object = None
    input_id: int = 0  # set by the planner: position of the input on the command line


@dataclass(kw_only=True, slots=True)
class BadRecord:
    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass(kw_only=True)
class Sample:
    """One sample as it goes into a tar: members in write order plus what the index records."""

    key: str
    members: dict[str, bytes | FilePayload]  # ext -> payload (a FilePayload is copied file to file)
    text: str | None = None  # what ``--tokenizer`` encodes
    duration: float | None = None


@dataclass(kw_only=True)
class ReadOptions:
    kind: str = "auto"  # auto | text | audio
    text_field: str = "text"
    audio_format: str | None = None  # re-encode audio to this codec; None keeps it as given


class Input(Protocol):
    path: str
    kind: str  # "text" or "audio"

    def scan(self) -> Iterator[Entry | BadRecord]: ...

    def load(self, entry: Entry) -> Sample: ...


def make_key(name: str) -> str:
    """A WebDataset-safe key: no dots (webdataset splits key and extension at the first dot), no ``..`` or leading
    ``/`` (members never escape a directory), at most MAX_KEY_BYTES. Escaped, never collapsed, so distinct names
    stay distinct keys: every UTF-8 byte outside ``[A-Za-z0-9_-]`` becomes ``%XX`` (``a.b`` -> ``a%2Eb``, ``a_b``
    stays; '文档' and '资料' differ), except ``/`` between two non-empty parts (``dir/name``, as a relative path
    has it); a name with a leading, trailing or doubled ``/`` has every ``/`` escaped."""
    if not name:
        raise ValueError(f"empty sample key from {name!r}")
    keep_slash = all(name.split("/"))
    key = "".join(
        chr(b) if b in _KEY_SAFE or (b == 0x2F and keep_slash) else f"%{b:02X}"
        for b in name.encode("utf-8", "surrogatepass")
    )
    if len(key.encode()) > MAX_KEY_BYTES:
        raise ValueError(f"sample key longer than {MAX_KEY_BYTES} bytes: {key[:60]}...")
    return key


def nemo_key_name(rec: dict, folders: tuple[str, ...]) -> str:
    """The name a NeMo manifest line without ``id`` is keyed by (before ``make_key``), the same for the same corpus on
    any machine: the audio path relative to the manifest's folder (``folders``: that folder as written and with its
    links resolved), normalised as pathlib does, without extension, and ``_<offset ms>`` for a segment. An absolute
    path outside the folder keeps its last folder and file name (``/data/asr/spk1/u1.flac`` -> ``spk1/u1``): never
    the machine's folders; two files that still collide are the planner's duplicate keys (give each line an ``id``).
    String operations only (one call per sample)."""
    path = PurePosixPath(rec["audio_filepath"])
    if path.is_absolute():
        inside = [path.relative_to(f) for f in folders if path.is_relative_to(f)]
        path = inside[0] if inside else PurePosixPath(*path.parts[1:][-2:])  # parts[0] is the root, '/'
    name = str(path.with_suffix(""))
    if "offset" in rec:
        name += f"_{round(rec['offset'] * 1000)}"
    return name


def _audio_ext(path: str) -> str:
    """``"flac"`` for ``"a/b.FLAC"`` (what ``Path(path).suffix`` gives, lower-cased, without the dot)."""
    return os.path.splitext(path)[1].lstrip(".").lower()


def _dumps(meta: dict) -> bytes:
    return json.dumps(meta, ensure_ascii=False, separators=(",", ":"), default=str).encode()


def _is_gzip(path: str) -> bool:
    return path.endswith(".gz")


def regular_file_size(path: str) -> int:
    """The size of ``path``; ValueError unless it is a regular file (a FIFO or device would block the
    reader that opens it, or never end)."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path}: not a regular file (a FIFO, device or directory cannot be an input)")
    return st.st_size


def _jsonl_lines(path: str) -> Iterator[tuple[int, int, bytes]]:
    """``(line number, byte offset, raw line)`` for every non-blank line (offset -1 for gzip); a gzip
    file that is truncated or not gzip is a ``SampleError`` naming it and the line it broke at."""
    opener = gzip.open if _is_gzip(path) else open
    number = 0
    try:
        with opener(path, "rb") as f:
            offset = 0
            for number, raw in enumerate(f, 1):
                start, offset = offset, offset + len(raw)
                if raw.strip():
                    yield number, (-1 if _is_gzip(path) else start), raw
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise SampleError(f"{path}:{number + 1}: broken gzip stream ({type(e).__name__}: {e})") from None


def _parse_line(path: str, number: int, raw: bytes) -> dict | BadRecord:
    try:
        rec = json.loads(raw)
    except ValueError as e:
        return BadRecord(path=path, line=number, reason=f"not valid JSON ({e})")
    except RecursionError:
        return BadRecord(path=path, line=number, reason="JSON nested too deeply")
    if not isinstance(rec, dict):
        return BadRecord(path=path, line=number, reason=f"expected a JSON object, got {type(rec).__name__}")
    if _SURROGATE_ESCAPE.search(raw):  # rare: only then the record is re-encoded to find a lone one
        try:
            json.dumps(rec, ensure_ascii=False).encode()
        except UnicodeEncodeError as e:
            return BadRecord(
                path=path,
                line=number,
                reason=f"a string holds a lone surrogate {e.object[e.start]!r} "
                "(\\ud800-\\udfff without its pair: not Unicode text)",
            )
    return rec


def _scan_jsonl(path: str, entry) -> Iterator[Entry | BadRecord]:
    """``entry(record, line, byte offset, raw line)`` for every JSON-object line of ``path``; a line
    that does not parse, or whose ``entry`` raises ValueError, becomes a BadRecord naming the rule."""
    for number, offset, raw in _jsonl_lines(path):
        rec = _parse_line(path, number, raw)
        if isinstance(rec, BadRecord):
            yield rec
            continue
        try:
            yield entry(rec, number, offset, raw)
        except ValueError as e:
            yield BadRecord(path=path, line=number, reason=str(e))


class _LineReader:
    """Reads a planned JSONL line back by ``(offset, length)`` with pread (safe across forked workers)."""

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None
        self._pid = -1

    def read(self, locator) -> bytes:
        if isinstance(locator, bytes):  # gzip input: the planner kept the line
            return locator
        if self._pid != os.getpid():  # a descriptor opened before fork is shared; open our own
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        offset, length = locator
        return os.pread(self._fd, length, offset)

    def locator(self, offset: int, raw: bytes):
        return raw if offset < 0 else (offset, len(raw))


def _required_text(rec: dict, field_name: str) -> str:
    if field_name not in rec:
        raise ValueError(f"missing required field {field_name!r}")
    text = rec[field_name]
    if not isinstance(text, str):
        raise ValueError(f"field {field_name!r} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"empty text in field {field_name!r}")
    return text


# --- text JSONL and .txt ------------------------------------------------------------------------


@dataclass(kw_only=True)
class _LineInput:
    """A line-oriented input file (JSONL, .txt) read by offset: scan records offsets, load re-reads."""

    path: str
    options: ReadOptions
    _lines: _LineReader = field(init=False)

    def __post_init__(self):
        self._lines = _LineReader(self.path)

    def _plan(self, rec: dict, number: int, raw: bytes) -> tuple[str, int]:
        """``(key, estimated bytes)`` for a parsed JSONL record; a ValueError names the broken rule."""
        raise NotImplementedError

    def scan(self):
        def entry(rec: dict, number: int, offset: int, raw: bytes) -> Entry:
            key, est = self._plan(rec, number, raw)
            return Entry(key=key, est_bytes=est, line=number, locator=self._lines.locator(offset, raw))

        return _scan_jsonl(self.path, entry)


def _text_sample(key: str, text: str, meta: dict) -> Sample:
    return Sample(key=key, members={"txt": text.encode(), "json": _dumps(meta)}, text=text)


@dataclass(kw_only=True)
class TextJsonlInput(_LineInput):
    kind: str = "text"

    def _key(self, rec: dict, number: int) -> str:
        if "id" in rec:
            return make_key(str(rec["id"]))
        return make_key(f"{_stem(self.path)}-{number:09d}")

    def _plan(self, rec: dict, number: int, raw: bytes) -> tuple[str, int]:
        _required_text(rec, self.options.text_field)
        return self._key(rec, number), len(raw)

    def load(self, entry: Entry) -> Sample:
        rec = json.loads(self._lines.read(entry.locator))
        text = rec.pop(self.options.text_field)
        return _text_sample(entry.key, text, {"source": self.path, "line": entry.line, **rec})


@dataclass(kw_only=True)
class TxtInput(_LineInput):
    """A plain text file, one document per non-empty line."""

    kind: str = "text"

    def scan(self):
        for number, offset, raw in _jsonl_lines(self.path):
            try:
                raw.decode()
            except UnicodeDecodeError as e:
                yield BadRecord(path=self.path, line=number, reason=f"not UTF-8 ({e})")
                continue
            yield Entry(
                key=make_key(f"{_stem(self.path)}-{number:09d}"),
                est_bytes=len(raw),
                line=number,
                locator=self._lines.locator(offset, raw),
            )

    def load(self, entry: Entry) -> Sample:
        text = self._lines.read(entry.locator).decode().rstrip("\r\n")
        return _text_sample(entry.key, text, {"source": self.path, "line": entry.line})


# --- NeMo audio manifests -----------------------------------------------------------------------


@dataclass(kw_only=True)
class NemoManifestInput(_LineInput):
    kind: str = "audio"

    def __post_init__(self):
        super().__post_init__()
        self._root = os.path.dirname(os.path.realpath(self.path))
        self._folders = (os.path.dirname(os.path.abspath(self.path)), self._root)

    def _audio_path(self, rec: dict) -> str:
        """The file to open: relative paths resolve against the manifest's folder (string ops: per sample)."""
        return os.path.join(self._root, rec["audio_filepath"])

    def _validate(self, rec: dict) -> None:
        for name in ("audio_filepath", "duration"):
            if name not in rec:
                raise ValueError(f"missing required field {name!r}")
        if not isinstance(rec["audio_filepath"], str) or not rec["audio_filepath"]:  # found by tests/fuzz.py
            raise ValueError(f"field 'audio_filepath' must be a non-empty string, got {rec['audio_filepath']!r}")
        _required_text(rec, self.options.text_field)
        for name in ("duration", "offset"):  # JSON allows NaN and Infinity; neither is a time
            if name in rec and (
                isinstance(rec[name], bool)
                or not isinstance(rec[name], (int, float))
                or not math.isfinite(rec[name])
                or rec[name] < 0
            ):
                raise ValueError(f"field {name!r} must be a finite non-negative number, got {rec[name]!r}")
            if name in rec and rec[name] > MAX_SECONDS:
                raise ValueError(f"field {name!r} must be at most {MAX_SECONDS:.0e} seconds, got {rec[name]!r}")
        if "offset" in rec and rec["duration"] <= 0:
            raise ValueError(
                f"field 'duration' must be positive for a segment (offset {rec['offset']}), got {rec['duration']!r}"
            )
        ext = _audio_ext(rec["audio_filepath"])
        if ext not in SHARD_AUDIO_EXTENSIONS:
            raise ValueError(
                f"unsupported audio extension {ext!r} (expected one of {', '.join(SHARD_AUDIO_EXTENSIONS)})"
            )

    def _key(self, rec: dict) -> str:
        """The record's ``id`` when it has one (as for text JSONL), else ``nemo_key_name``, escaped by ``make_key``."""
        if "id" in rec:
            return make_key(str(rec["id"]))
        return make_key(nemo_key_name(rec, self._folders))

    def _plan(self, rec: dict, number: int, raw: bytes) -> tuple[str, int]:
        self._validate(rec)
        audio = self._audio_path(rec)
        try:
            size = regular_file_size(audio)
        except FileNotFoundError:
            raise ValueError(f"audio file not found: {audio}") from None
        est = round(rec["duration"] * SEGMENT_BYTES_PER_SECOND) if "offset" in rec else size
        return self._key(rec), est

    def load(self, entry: Entry) -> Sample:
        rec = json.loads(self._lines.read(entry.locator))
        audio = self._audio_path(rec)
        source_ext = _audio_ext(audio)
        try:
            if "offset" in rec:
                fmt = self.options.audio_format or (source_ext if source_ext in ("flac", "wav") else "flac")
                data, sample_rate, frames = cut_and_encode(audio, fmt, offset=rec["offset"], duration=rec["duration"])
                rec["source_offset"] = rec.pop("offset")
            elif self.options.audio_format and self.options.audio_format != source_ext:
                fmt = self.options.audio_format
                data, sample_rate, frames = cut_and_encode(audio, fmt)
            else:  # kept as given: only the header is read here; the tar writer copies the file
                sample_rate, frames, size = probe_file(audio)
                data, fmt = FilePayload(path=audio, size=size), source_ext
        except (OSError, ValueError) as e:
            raise SampleError(f"{self.path}:{entry.line}: {audio}: {e}") from None
        duration = frames / sample_rate
        text = rec.pop(self.options.text_field)
        meta = {
            "text": text,
            **rec,
            "duration": duration,
            "sample_rate": sample_rate,
            "source": self.path,
            "line": entry.line,
        }
        return Sample(key=entry.key, members={fmt: data, "json": _dumps(meta)}, text=text, duration=duration)


# --- Lhotse CutSet manifests --------------------------------------------------------------------


@dataclass(kw_only=True)
class LhotseCutsInput:
    """Cuts are deserialised during the scan and kept (they are small metadata objects)."""

    path: str
    options: ReadOptions
    kind: str = "audio"

    def scan(self):
        from lhotse.serialization import deserialize_item

        def entry(rec: dict, number: int, offset: int, raw: bytes) -> Entry:
            try:
                cut = deserialize_item(rec)
                if not (math.isfinite(cut.duration) and cut.duration > 0):
                    raise ValueError(f"cut duration must be a finite positive number, got {cut.duration!r}")
                if not _cut_text(cut):
                    raise ValueError("empty text (no supervision with text)")
                file_source = _whole_file_source(cut)
                if file_source is not None and not os.path.exists(file_source):
                    raise ValueError(f"audio file not found: {file_source}")
                est = regular_file_size(file_source) if file_source else round(cut.duration * SEGMENT_BYTES_PER_SECOND)
                key = make_key(cut.id)
            except (KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"not a valid lhotse cut ({e})") from None
            return Entry(key=key, est_bytes=est, line=number, locator=cut)

        return _scan_jsonl(self.path, entry)

    def load(self, entry: Entry) -> Sample:
        cut = entry.locator
        if not cut.has_recording:
            raise SampleError(f"{self.path}:{entry.line}: cut {cut.id} has no recording (nothing to shard)")
        file_source = _whole_file_source(cut)
        try:
            ext = _audio_ext(file_source) if file_source else None
            if file_source and (self.options.audio_format in (None, ext)):
                sample_rate, frames, size = probe_file(file_source)
                data = FilePayload(path=file_source, size=size)
            else:
                ext = self.options.audio_format or "flac"
                samples = cut.load_audio()  # (channels, frames) float32
                data, sample_rate, frames = (
                    encode(samples.T, cut.sampling_rate, ext),
                    cut.sampling_rate,
                    samples.shape[-1],
                )
        except Exception as e:  # lhotse and libsndfile raise many types for unreadable audio
            raise SampleError(f"{self.path}:{entry.line}: cut {cut.id}: {e}") from None
        text = _cut_text(cut)
        duration = frames / sample_rate
        meta = {
            "text": text,
            "id": cut.id,
            "duration": duration,
            "sample_rate": sample_rate,
            "supervisions": [s.to_dict() for s in cut.supervisions],
            "source": self.path,
            "line": entry.line,
        }
        return Sample(key=entry.key, members={ext: data, "json": _dumps(meta)}, text=text, duration=duration)


def _cut_text(cut) -> str:
    return " ".join(s.text for s in cut.supervisions if s.text and s.text.strip())


def _whole_file_source(cut) -> str | None:
    """The audio file path when the cut is exactly one whole, untransformed single-file recording."""
    from lhotse import MonoCut

    rec = cut.recording if isinstance(cut, MonoCut) else None  # mixed and padding cuts have no one recording
    if rec is None or len(rec.sources) != 1 or rec.sources[0].type != "file" or rec.transforms:
        return None
    if cut.start != 0 or abs(cut.duration - rec.duration) > 1e-3:
        return None
    path = rec.sources[0].source
    return path if _audio_ext(path) in SHARD_AUDIO_EXTENSIONS else None


# --- Parquet ------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class ParquetInput:
    path: str
    options: ReadOptions
    kind: str = "text"
    audio_column: str | None = None
    key_column: str | None = None

    def __post_init__(self):
        import pyarrow.parquet as pq

        try:
            schema = pq.ParquetFile(self.path).schema_arrow
        except Exception as e:  # pyarrow raises ArrowInvalid/OSError without the file's name
            raise ValueError(f"{self.path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
        names = self._columns = set(schema.names)
        if "audio" in names:
            self.audio_column, self.kind = "audio", "audio"
        self.key_column = next((c for c in ("id", "key") if c in names), None)
        self._cache: tuple[int, list[dict]] | None = None

    def _audio_bytes(self, row: dict) -> tuple[bytes, str | None]:
        value = row[self.audio_column]
        if isinstance(value, dict):
            data, name = value.get("bytes"), value.get("path")
        else:
            data, name = value, None
        if not data:
            raise ValueError(f"empty audio bytes in column {self.audio_column!r}")
        ext = _audio_ext(name) if name else ""
        return data, ext if ext in SHARD_AUDIO_EXTENSIONS else sniff_ext(data)

    def scan(self):
        columns = [c for c in (self.audio_column, self.key_column, self.options.text_field) if c]
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(self.path)
        row_number = 0
        for group in range(pf.num_row_groups):
            try:
                rows = pf.read_row_group(group, columns=[c for c in columns if c in self._columns]).to_pylist()
            except Exception as e:  # a damaged row group: pyarrow names neither the file nor the group
                raise SampleError(f"{self.path}: row group {group} unreadable ({type(e).__name__}: {e})") from None
            for index, row in enumerate(rows):
                row_number += 1
                try:
                    est = 0
                    if self.audio_column:
                        data, ext = self._audio_bytes(row)
                        if ext is None:
                            raise ValueError("audio bytes in an unrecognised format")
                        est += len(data)
                    if self.kind == "text" or self.options.text_field in row:
                        est += len(_required_text(row, self.options.text_field).encode())
                    name = str(row[self.key_column]) if self.key_column else f"{_stem(self.path)}-{row_number:09d}"
                    key = make_key(name)
                except ValueError as e:
                    yield BadRecord(path=self.path, line=row_number, reason=str(e))
                    continue
                yield Entry(key=key, est_bytes=est, line=row_number, locator=(group, index))

    def load(self, entry: Entry) -> Sample:
        import pyarrow.parquet as pq

        group, index = entry.locator
        if self._cache is None or self._cache[0] != group:  # shards are contiguous: one read per group
            self._cache = (group, pq.ParquetFile(self.path).read_row_group(group).to_pylist())
        row = dict(self._cache[1][index])
        text = row.pop(self.options.text_field, None)
        meta = {"source": self.path, "line": entry.line}
        if not self.audio_column:
            meta.update(row)
            return Sample(key=entry.key, members={"txt": text.encode(), "json": _dumps(meta)}, text=text)
        try:
            data, ext = self._audio_bytes(row)
            sample_rate, frames = probe(data)
            if self.options.audio_format and self.options.audio_format != ext:
                ext = self.options.audio_format
                data, sample_rate, frames = cut_and_encode(data, ext)
        except ValueError as e:
            raise SampleError(f"{self.path}:{entry.line}: {e}") from None
        row.pop(self.audio_column)
        duration = frames / sample_rate
        meta = {
            **({"text": text} if text is not None else {}),
            **row,
            "duration": duration,
            "sample_rate": sample_rate,
            **meta,
        }
        return Sample(key=entry.key, members={ext: data, "json": _dumps(meta)}, text=text, duration=duration)


# --- choosing a reader --------------------------------------------------------------------------


def _stem(path: str) -> str:
    name = Path(path).name
    for suffix in (".gz", ".jsonl", ".json", ".txt", ".parquet"):
        name = name.removesuffix(suffix)
    return name


def _first_record(path: str) -> dict | None:
    for number, _, raw in _jsonl_lines(path):
        rec = _parse_line(path, number, raw)
        return rec if isinstance(rec, dict) else None
    return None


def open_input(path: str, options: ReadOptions) -> Input:
    """The reader for ``path``: by suffix, then (for JSONL) by the first record's fields."""
    name = Path(path).name.lower()
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: input file not found")
    regular_file_size(path)
    if name.endswith(".txt"):
        reader: Input = TxtInput(path=path, options=options)
    elif name.endswith(".parquet"):
        reader = ParquetInput(path=path, options=options)
        if options.kind == "text" and reader.audio_column:
            reader.audio_column, reader.kind = None, "text"
    elif name.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz")):
        first = _first_record(path) or {}
        if options.kind != "text" and "audio_filepath" in first:
            reader = NemoManifestInput(path=path, options=options)
        elif options.kind != "text" and ("recording" in first or str(first.get("type", "")).endswith("Cut")):
            reader = LhotseCutsInput(path=path, options=options)
        else:
            reader = TextJsonlInput(path=path, options=options)
    else:
        raise ValueError(f"{path}: unsupported input type (expected .jsonl[.gz], .txt or .parquet)")
    if options.kind == "audio" and reader.kind != "audio":
        raise ValueError(
            f"{path}: --kind audio, but this input has no audio "
            "(NeMo manifest with audio_filepath, lhotse cuts, or parquet with an 'audio' column)"
        )
    return reader
