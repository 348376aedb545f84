"""A Hugging Face tokenizer directory's chat template: conversations rendered to text, and which tokens are trained.

``--tokenizer`` is a ``tokenizer.json`` or a directory holding one beside ``tokenizer_config.json`` (its
``chat_template``, a string or transformers' list of named templates, "default" taken) or ``chat_template.jinja``
(which wins, as in transformers). Rendering reuses transformers' own jinja machinery
(``transformers.utils.chat_template_utils.render_jinja_template``: the same sandboxed environment, filters and
``{% generation %}`` tracking ``apply_chat_template`` uses), with the config's special tokens (``bos_token`` ...)
as template variables, exactly as ``apply_chat_template`` passes them.

Trained tokens (the assistant's turns) come as character spans of the rendered text:

- a template with ``{% generation %}`` markers: the spans the markers enclose (one render);
- a template without: turn by turn. For every assistant message *i*, the text of ``messages[:i]`` with the
  generation prompt and the text of ``messages[:i+1]`` are rendered; the assistant's span is what the second
  adds to the first. This needs a template that renders each conversation as its prefixes' extension (every
  common one does); one that does not is refused with the turn named. Cost: 2 renders per assistant turn.

``trained_mask`` turns spans into a per-token mask from the fast tokenizer's offsets with the rule of
``apply_chat_template(..., return_assistant_tokens_mask=True)`` (a token is trained when its characters overlap
a span): one ``searchsorted`` per conversation, no per-token Python. The rendered text is tokenized as
``apply_chat_template(tokenize=True)`` does (no special tokens added; ``sanitize_control_tokens`` off, its
default), so the ids equal transformers'.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
# what transformers' special_tokens_map hands a template
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def tokenizer_json(path: str) -> str:
    """The ``tokenizer.json`` of ``--tokenizer`` (the file itself, or the one in the directory)."""
    if os.path.isdir(path):
        inner = os.path.join(path, TOKENIZER_JSON)
        if not os.path.isfile(inner):
            raise ValueError(f"tokenizer directory {path} has no {TOKENIZER_JSON} (a fast tokenizer is needed)")
        return inner
    if not os.path.isfile(path):
        raise ValueError(f"tokenizer not found: {path}")
    return path


def tokenizer_fingerprint(path: str) -> dict:
    """Path and content hash of the tokenizer's files (the directory's template and config included)."""
    files = [tokenizer_json(path)]
    if os.path.isdir(path):
        files += [
            os.path.join(path, n) for n in (TOKENIZER_CONFIG, TEMPLATE_FILE) if os.path.isfile(os.path.join(path, n))
        ]
    digest = hashlib.sha256()
    for name in files:
        digest.update(Path(name).read_bytes())
    return {"path": os.path.abspath(path), "sha256": digest.hexdigest()}


def _token_text(value) -> str | None:
    """A special token of tokenizer_config.json: a string, or a serialised AddedToken (``{"content": ...}``)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass(kw_only=True)
class ChatTemplate:
    """A chat template and the variables ``apply_chat_template`` renders it with."""

    template: str
    variables: dict[str, object] = field(default_factory=dict)

    @property
    def has_generation_markers(self) -> bool:
        return _GENERATION.search(self.template) is not None

    def render(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """``(text, trained character spans)`` of one conversation (module docstring). Any exception the template
        raises (``raise_exception``, an undefined variable) propagates; the reader names the line."""
        if self.has_generation_markers:
            texts, spans = self._render(messages, with_spans=True)
            return texts, [tuple(s) for s in spans]
        full = self._render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self._render(messages[:i], add_generation_prompt=True) if i else ""
            upto = self._render(messages[: i + 1])
            if not (upto.startswith(prompt) and full.startswith(upto)):
                raise ValueError(
                    f"the chat template does not render message {i + 1} (assistant) as an extension of the "
                    "conversation before it; mark the assistant's text with {% generation %} ... "
                    "{% endgeneration %} in the template"
                )
            if len(upto) > len(prompt):
                spans.append((len(prompt), len(upto)))
        return full, spans

    def _render(self, messages: list[dict], add_generation_prompt: bool = False, with_spans: bool = False):
        from transformers.utils.chat_template_utils import render_jinja_template

        texts, spans = render_jinja_template(
            conversations=[messages],
            chat_template=self.template,
            return_assistant_tokens_mask=with_spans,
            add_generation_prompt=add_generation_prompt,
            **self.variables,
        )
        return (texts[0], spans[0]) if with_spans else texts[0]


def load_chat_template(path: str) -> ChatTemplate:
    """The chat template of tokenizer directory ``path``; ValueError saying what is missing."""
    if not os.path.isdir(path):
        raise ValueError(
            f"chat data needs --tokenizer to be a Hugging Face tokenizer directory with a chat template "
            f"({TOKENIZER_JSON} + {TOKENIZER_CONFIG} or {TEMPLATE_FILE}); {path} is a file"
        )
    config: dict = {}
    config_path = os.path.join(path, TOKENIZER_CONFIG)
    if os.path.isfile(config_path):
        try:
            config = json.loads(Path(config_path).read_text())
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{config_path}: not valid JSON ({e})") from None
        if not isinstance(config, dict):
            raise ValueError(f"{config_path}: expected a JSON object")
    template = config.get("chat_template")
    if isinstance(template, list):  # transformers' named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja_path = os.path.join(path, TEMPLATE_FILE)
    if os.path.isfile(jinja_path):
        template = Path(jinja_path).read_text()
    if not isinstance(template, str) or not template.strip():
        raise ValueError(
            f"tokenizer directory {path} has no chat template ({TEMPLATE_FILE}, or 'chat_template' in "
            f"{TOKENIZER_CONFIG})"
        )
    variables = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        variables["additional_special_tokens"] = [t for t in map(_token_text, extra) if t is not None]
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        _compile_jinja_template(template)
    except Exception as e:  # jinja2's TemplateSyntaxError and friends
        raise ValueError(f"{path}: the chat template does not compile ({type(e).__name__}: {e})") from None
    return ChatTemplate(template=template, variables=variables)


def trained_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """uint8 per token: 1 where the token's characters ``offsets[t] = (start, end)`` overlap a span (sorted,
    disjoint). The first span ending after a token's start is the only one it can overlap (transformers' rule)."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    if not spans or not len(offsets):
        return mask
    span = np.asarray(spans, dtype=np.int64)
    j = np.searchsorted(span[:, 1], offsets[:, 0], side="right")
    inside = j < len(span)
    mask[inside] = offsets[inside, 1] > span[j[inside], 0]
    return mask


def encode_conversations(
    tokenizer, texts: list[str], spans: list[list[tuple[int, int]]], dtype: np.dtype, limit: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(token ids as dtype, trained mask)`` of each rendered conversation, one ``encode_batch`` per ``limit``
    characters (the readers refuse a conversation longer than ``limit``, so memory stays bounded)."""
    out: list[tuple[np.ndarray, np.ndarray]] = []
    start = 0
    while start < len(texts):
        end, chars = start, 0
        while end < len(texts) and (end == start or chars + len(texts[end]) <= limit):
            chars += len(texts[end])
            end += 1
        for enc, s in zip(tokenizer.encode_batch(texts[start:end], add_special_tokens=False), spans[start:end]):
            offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
            out.append((np.asarray(enc.ids, dtype=dtype), trained_mask(offsets, s)))
        start = end
    return out


__all__ = [
    "ChatTemplate",
    "encode_conversations",
    "load_chat_template",
    "tokenizer_fingerprint",
    "tokenizer_json",
    "trained_mask",
]
