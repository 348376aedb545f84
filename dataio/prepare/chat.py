"""Chat inputs of ``dataio shard``: conversations in, rendered and masked token documents out.

A JSONL or Parquet input is chat data when its first record (or its schema) has one of:

- ``messages``: OpenAI-style ``[{"role": ..., "content": ...}, ...]`` (roles system, user, assistant, tool;
  other message keys, e.g. ``name`` or ``tool_calls``, go to the template as given);
- ``conversations``: ShareGPT ``[{"from": ..., "value": ...}, ...]`` (``human`` -> user, ``gpt`` -> assistant,
  ``system``, ``tool``/``function``/``observation`` -> tool);
- ``prompt`` and ``completion``: strings (a user turn and the assistant's answer) or message lists (TRL's
  conversational prompt-completion form).

Every record of the file must be of the file's form. The scan checks each conversation (the one place a bad
record is named with its line before anything is written): a message that is not an object, an unknown role,
a missing or non-string content, an empty conversation, or one without an assistant message (nothing to train
on) is a ``BadRecord``. ``load`` renders the conversation with the tokenizer directory's chat template
(``headrace.dataio.prepare.chat_template``) in the writer process; a template that raises, or a rendering
longer than ``MAX_PIECE_CHARS`` characters (longer than any context, and the bound on the tokenizer's memory),
is a ``SampleError`` naming file and line. The writer tokenizes the rendered texts in batches and stores
``npy`` (token ids) and ``trained.npy`` (uint8, 1 on the assistant's tokens) beside the ``json`` metadata
(the normalised ``messages``, the record's other fields, source and line).

Key: the record's ``id`` (Parquet: an ``id``/``key`` column) when present, else ``<file stem>-<line>``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from headrace.dataio.prepare.chat_template import ChatTemplate, load_chat_template
from headrace.dataio.prepare.readers import (
    BadRecord,
    Entry,
    Input,
    ReadOptions,
    Sample,
    SampleError,
    _dumps,
    _first_record,
    _LineInput,
    _stem,
    make_key,
)
from headrace.dataio.prepare.tokenize import MAX_PIECE_CHARS

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
FORMATS = {"messages": ("messages",), "conversations": ("conversations",), "prompt": ("prompt", "completion")}


def chat_format(names) -> str | None:
    """The chat form of a record's (or a schema's) field names: "messages", "conversations", "prompt", or None."""
    return next((form for form, fields in FORMATS.items() if all(f in names for f in fields)), None)


def _messages(value, where: str) -> list[dict]:
    if not isinstance(value, list):
        raise ValueError(f"field {where!r} must be a list of messages, got {type(value).__name__}")
    out = []
    for i, m in enumerate(value, 1):
        if not isinstance(m, dict):
            raise ValueError(f"{where} message {i} must be an object, got {type(m).__name__}")
        m = {k: v for k, v in m.items() if v is not None}  # Parquet structs fill absent keys with null
        if m.get("role") not in ROLES:
            raise ValueError(
                f"{where} message {i}: unknown role {m.get('role')!r} (expected one of {', '.join(ROLES)})"
            )
        if "content" not in m:
            raise ValueError(f"{where} message {i} ({m['role']}): missing 'content'")
        if not isinstance(m["content"], str):
            raise ValueError(
                f"{where} message {i} ({m['role']}): 'content' must be a string, got {type(m['content']).__name__}"
            )
        out.append(m)
    return out


def _sharegpt(value) -> list[dict]:
    if not isinstance(value, list):
        raise ValueError(f"field 'conversations' must be a list of turns, got {type(value).__name__}")
    out = []
    for i, turn in enumerate(value, 1):
        if not isinstance(turn, dict):
            raise ValueError(f"conversations turn {i} must be an object, got {type(turn).__name__}")
        role = SHAREGPT_ROLES.get(turn.get("from"))
        if role is None:
            raise ValueError(
                f"conversations turn {i}: unknown role {turn.get('from')!r} "
                f"(expected one of {', '.join(SHAREGPT_ROLES)})"
            )
        if not isinstance(turn.get("value"), str):
            raise ValueError(f"conversations turn {i} ({turn.get('from')}): missing or non-string 'value'")
        out.append({"role": role, "content": turn["value"]})
    return out


def conversation(rec: dict, form: str) -> list[dict]:
    """The record's conversation as messages (module docstring); ValueError naming the broken rule."""
    missing = [f for f in FORMATS[form] if f not in rec]
    if missing:
        raise ValueError(f"missing required field {missing[0]!r} (this file's records are {form!r} conversations)")
    if form == "messages":
        messages = _messages(rec["messages"], "messages")
    elif form == "conversations":
        messages = _sharegpt(rec["conversations"])
    else:
        parts = []
        for name, role in (("prompt", "user"), ("completion", "assistant")):
            value = rec[name]
            if isinstance(value, str):
                parts.append({"role": role, "content": value})
            else:
                parts.extend(_messages(value, name))
        messages = parts
    if not messages:
        raise ValueError("empty conversation (no messages)")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant message (nothing to train on)")
    return messages


@dataclass(kw_only=True)
class ChatSample(Sample):
    """A rendered conversation: ``text`` is the rendering, ``spans`` its trained character spans."""

    spans: list[tuple[int, int]] = field(default_factory=list)


def _render(template: ChatTemplate, path: str, line: int, key: str, messages: list[dict], meta: dict) -> ChatSample:
    try:
        text, spans = template.render(messages)
    except Exception as e:  # jinja raises TemplateError, a template's raise_exception anything
        raise SampleError(f"{path}:{line}: the chat template raised {type(e).__name__}: {e}") from None
    if len(text) > MAX_PIECE_CHARS:
        raise SampleError(
            f"{path}:{line}: the conversation renders to {len(text):,} characters (limit {MAX_PIECE_CHARS:,})"
        )
    return ChatSample(key=key, members={"json": _dumps({"messages": messages, **meta})}, text=text, spans=spans)


@dataclass(kw_only=True)
class ChatJsonlInput(_LineInput):
    form: str
    template: ChatTemplate
    kind: str = "text"

    def _key(self, rec: dict, number: int) -> str:
        return make_key(str(rec["id"]) if "id" in rec else f"{_stem(self.path)}-{number:09d}")

    def _plan(self, rec: dict, number: int, raw: bytes) -> tuple[str, int]:
        conversation(rec, self.form)
        return self._key(rec, number), 2 * len(raw)  # json + ids + mask: about twice the line

    def load(self, entry: Entry) -> ChatSample:
        rec = json.loads(self._lines.read(entry.locator))
        messages = conversation(rec, self.form)
        meta = {k: v for k, v in rec.items() if k not in FORMATS[self.form]}
        return _render(
            self.template, self.path, entry.line, entry.key, messages, {**meta, "source": self.path, "line": entry.line}
        )


@dataclass(kw_only=True)
class ChatParquetInput:
    path: str
    options: ReadOptions
    form: str
    template: ChatTemplate
    key_column: str | None = None
    kind: str = "text"

    def __post_init__(self):
        self._cache: tuple[int, list[dict]] | None = None

    def _rows(self, group: int, columns=None) -> list[dict]:
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(self.path).read_row_group(group, columns=columns).to_pylist()
        except Exception as e:  # a damaged row group: pyarrow names neither the file nor the group
            raise SampleError(f"{self.path}: row group {group} unreadable ({type(e).__name__}: {e})") from None

    def scan(self):
        import pyarrow.parquet as pq

        columns = [*FORMATS[self.form], *([self.key_column] if self.key_column else [])]
        row_number = 0
        for group in range(pq.ParquetFile(self.path).num_row_groups):
            for index, row in enumerate(self._rows(group, columns)):
                row_number += 1
                try:
                    conversation(row, self.form)
                    name = str(row[self.key_column]) if self.key_column else f"{_stem(self.path)}-{row_number:09d}"
                    key = make_key(name)
                except ValueError as e:
                    yield BadRecord(path=self.path, line=row_number, reason=str(e))
                    continue
                est = 2 * len(json.dumps([row[f] for f in FORMATS[self.form]], default=str))
                yield Entry(key=key, est_bytes=est, line=row_number, locator=(group, index))

    def load(self, entry: Entry) -> ChatSample:
        group, index = entry.locator
        if self._cache is None or self._cache[0] != group:  # shards are contiguous: one read per group
            self._cache = (group, self._rows(group))
        row = dict(self._cache[1][index])
        messages = conversation(row, self.form)
        meta = {k: v for k, v in row.items() if k not in FORMATS[self.form]}
        return _render(
            self.template, self.path, entry.line, entry.key, messages, {**meta, "source": self.path, "line": entry.line}
        )


def open_chat_input(path: str, options: ReadOptions, tokenizer: str | None) -> Input | None:
    """The chat reader of ``path`` when it holds conversations (module docstring), else None; ValueError when it
    does and ``tokenizer`` is not a directory with a chat template (chat data is stored rendered)."""
    name = Path(path).name.lower()
    if options.kind == "audio" or not Path(path).is_file():
        return None
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            names = set(pq.ParquetFile(path).schema_arrow.names)
        except Exception:  # not readable: the plain reader says so with its own message
            return None
        form = chat_format(names)
        key_column = next((c for c in ("id", "key") if c in names), None)
    elif name.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz")):
        form, key_column = chat_format(_first_record(path) or {}), None
    else:
        return None
    if form is None:
        return None
    if tokenizer is None:
        raise ValueError(
            f"{path}: chat data ({form!r}) needs --tokenizer DIR, a Hugging Face tokenizer directory with a chat template"
        )
    template = load_chat_template(tokenizer)
    if name.endswith(".parquet"):
        return ChatParquetInput(path=path, options=options, form=form, template=template, key_column=key_column)
    return ChatJsonlInput(path=path, options=options, form=form, template=template)


__all__ = ["ChatJsonlInput", "ChatParquetInput", "ChatSample", "chat_format", "conversation", "open_chat_input"]
