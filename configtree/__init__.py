"""Typed config trees: ``@dataclass(kw_only=True)`` classes built from YAML dicts.

One small function does the checking for every config in the project (the loader's ``data:`` section,
the trainer's whole file): unknown keys and wrong types fail at load time with the key's full dotted
path, e.g. ``data.datasets[1].weight: expected float, got 'heavy'``. Dotted CLI overrides
(``optim.lr=3e-4``) are applied to the raw dict before checking, so they get the same errors.
A package of its own so that `training` and `dataio` share it without either importing the other for it.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value or key is wrong; the message starts with the dotted path."""


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass ``cls`` from ``data`` (a dict, or already a ``cls``), checking keys and types."""
    return _convert(cls, data, path or cls.__name__)


def to_dict(obj: Any) -> Any:
    """Plain dict/list/scalars of a config tree (what ``yaml.safe_dump`` writes)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads ``1e-3`` / ``2E5`` as floats: YAML 1.1 (PyYAML) wants a dot
    (``1.0e-3``), so the number as people write it would arrive as the string ``'1e-3'`` (YAML 1.2 and
    Python read it as a float). Nothing else changes: no tags beyond the safe ones."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


MAX_VALUES = 1_000_000  # values a config may expand to, aliases counted at every use (as to_dict writes them)


def _parse_yaml(text, where: str):
    """``yaml.safe_load`` (plus ``1e-3`` as a float, ``_Loader``) whose syntax errors are one ConfigError
    line: place and problem. A document whose aliases expand past ``MAX_VALUES`` values (an alias bomb: ten
    levels of ten aliases are 10**10 values in a few hundred bytes), refers to itself, or nests past Python's
    recursion limit is a ConfigError too: saving or checking it would never end."""
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader)
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply to read") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        said = " ".join(str(getattr(e, "problem", None) or e).split())  # a ReaderError's text has several lines
        raise ConfigError(f"{where}: not valid YAML{at}: {said}") from None
    _check_expansion(data, where)
    return data


def _check_expansion(data: Any, where: str) -> None:
    """ConfigError unless ``data`` expands to at most ``MAX_VALUES`` values and holds no container inside itself.
    One depth-first walk over the distinct containers (an alias is one object however often it is used), each
    container's expanded size the sum of its children's: O(distinct values), however large the expansion."""
    if not isinstance(data, (dict, list)):
        _check_text(data, where)
        return
    sizes: dict[int, int] = {}
    stack, on_path = [(data, iter(_children(data)))], {id(data)}
    while stack:
        node, children = stack[-1]
        for child in children:
            _check_text(child, where)
            if isinstance(child, (dict, list)) and id(child) not in sizes:
                if id(child) in on_path:
                    raise ConfigError(f"{where}: a YAML alias inside itself (its value would be infinite)")
                on_path.add(id(child))
                stack.append((child, iter(_children(child))))
                break
        else:
            stack.pop()
            on_path.discard(id(node))
            size = sizes[id(node)] = 1 + sum(sizes.get(id(c), 1) for c in _children(node))
            if size > MAX_VALUES:
                raise ConfigError(
                    f"{where}: expands to more than {MAX_VALUES:,} values (YAML aliases repeated in "
                    "aliases); write the values out"
                )


def _check_text(value: Any, where: str) -> None:
    """ConfigError for a string that is not text: YAML's ``"\\ud800"`` escapes give lone surrogates, which no file
    name, script or log line can hold (writing one would be a UnicodeEncodeError traceback)."""
    if isinstance(value, str) and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(
                f"{where}: a string holds an unpaired surrogate ({value!r:.60}); write the character "
                "itself, not its \\u escapes"
            ) from None


def _children(value: dict | list) -> list:
    return [*value.keys(), *value.values()] if isinstance(value, dict) else value


def load_yaml(path: str) -> dict:
    with open(path) as f:
        data = _parse_yaml(f, path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides in place; values are parsed as YAML scalars/lists."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected KEY.PATH=VALUE")
        node = data
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = _parse_yaml(raw, f"override {item!r}")
    return data


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:  # its values, as written in YAML: `int | 'auto'`
        return " | ".join(repr(v) for v in get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        # NeMo Automodel's YAML writes ``dp_size: none``: the string means null where no str is accepted
        if type(None) in options and str not in options and isinstance(value, str) and value.lower() == "none":
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, path)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) == 1:  # one real option (X | None): its own message names the broken rule
            raise ConfigError(errors[0])
        raise ConfigError(f"{path}: expected {' | '.join(_type_name(o) for o in options)}, got {value!r}")
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{path}: expected one of {list(get_args(tp))}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping for {tp.__name__}, got {value!r}")
        hints = get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp) if f.init}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise ConfigError(f"{path}.{unknown[0]}: unknown key (valid: {', '.join(sorted(fields))})")
        kwargs = {k: _convert(hints[k], v, f"{path}.{k}") for k, v in value.items()}
        missing = [
            n
            for n, f in fields.items()
            if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise ConfigError(f"{path}.{missing[0]}: required key is missing")
        try:
            return tp(**kwargs)
        except (TypeError, ValueError) as e:  # __post_init__ validation
            raise ConfigError(f"{path}: {e}") from e
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        (item_tp, *_) = get_args(tp) or (Any,)
        return [_convert(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        _, val_tp = get_args(tp) or (Any, Any)
        return {k: _convert(val_tp, v, f"{path}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 (PyYAML) reads `1e-3` (no dot) as a string; accept what float() accepts.
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{path}: expected float, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected float, got {value!r}")
        if not math.isfinite(value):  # no setting means inf or NaN; `null` is how "no limit" is written
            raise ConfigError(f"{path}: expected a finite number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected int, got {value!r}")
        return value
    if tp in (str, bool):
        if not isinstance(value, tp):
            raise ConfigError(f"{path}: expected {tp.__name__}, got {value!r}")
        return value
    if isinstance(tp, type):
        if not isinstance(value, tp):
            raise ConfigError(f"{path}: expected {tp.__name__}, got {value!r}")
        return value
    raise TypeError(f"{path}: unsupported config type {tp!r}")


__all__ = ["ConfigError", "apply_overrides", "from_dict", "load_yaml", "to_dict"]
