"""Fuzz targets of issue 46 (``tests/fuzz.py`` runs them with the others): the checkpoint reader, the LoRA adapter
loader, the index files and the speech recipe's manifest. The property is fuzz.py's: a correct result, or the
input's own one-line error (a ``JobInputError``, exit 2 with one line, a ``RecipeInputError``), never another
exception, a traceback printed, a hang or a runaway allocation.

- ``ckptreader``: a sealed checkpoint of a tiny model, its safetensors bytes (headers most) and its state's fields
  mutated, then *resealed* with the user's key (so the seal holds and the reader itself must cope), loaded by
  ``checkpoint.load_newest`` in a one-rank process group: it loads, falls back to the previous checkpoint, or
  refuses in one ``JobInputError``; nothing is printed but its own lines.
- ``adapter``: a peft adapter folder with its config (JSON texts, mutated bytes) and safetensors (header bytes)
  mutated, a file linked from outside, loaded by ``lora.load_adapter`` into a tiny LoRA Llama: loads, or one
  ``JobInputError``; a link out is always refused.
- ``indexfiles``: a dataset's ``.nv-meta/headrace`` files mutated (bytes, array fields, the manifest), then
  ``dataio verify`` and ``dataio get``: exit 0, verify's FAILED report (1), or one line (2).
- ``recipemanifest``: manifest and text lines of any JSON (and not JSON) and any ``--minutes``: the recipe's
  ``check_inputs`` refuses in one ``RecipeInputError``, or what it accepts is read by the recipe's own split and
  text gathering without error.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
from pathlib import Path

from hypothesis import strategies as st

SAFETENSORS_HEAD = [(0, 256)]
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6,
)


@contextlib.contextmanager
def one_rank_group():
    """A one-process gloo group on an in-memory store (no port), destroyed after."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _captured(fn) -> tuple[object, str]:
    """``fn()``'s result (or the exception it raised) and everything it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            result = fn()
        except Exception as e:  # judged by the caller
            result = e
    return result, out.getvalue()


# --- the checkpoint reader ----------------------------------------------------------------------------------------


def tiny_model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def make_checkpoints(root: Path) -> Path:
    """``root/checkpoints/step-0000000{1,2}`` of ``tiny_model`` (sealed with the user's key)."""
    from headrace.training.checkpoint.saver import Saver

    with one_rank_group():
        model, optimizer = tiny_model()
        for step in (1, 2):
            Saver().save(
                root / "checkpoints",
                step,
                model,
                optimizer,
                [{"consumed": step}],
                extra={"model_config": {"kind": "tiny"}, "first_loss": 1.0},
            )
    return root / "checkpoints"


def reseal(step_dir: Path, fields: dict) -> None:
    from headrace.training.checkpoint.seal import file_sha256, seal, seal_key

    state = json.loads((step_dir / "trainer_state.json").read_text())
    files = {p.name: (p.stat().st_size, file_sha256(p)) for p in step_dir.iterdir() if p.name != "trainer_state.json"}
    plain = {k: v for k, v in state.items() if k not in ("seal", "files", "format")}
    (step_dir / "trainer_state.json").write_text(json.dumps(seal({**plain, **fields}, files, seal_key(create=False))))


def check_checkpoint_reader(tmp: Path, base: Path, weights: bytes | None, fields: dict) -> None:
    from headrace.training.checkpoint.restore import load_newest
    from headrace.training.errors import JobInputError

    case = tmp / "cases" / "ckptreader"
    shutil.rmtree(case, ignore_errors=True)
    shutil.copytree(base, case)
    newest = case / "step-00000002"
    if weights is not None:
        next(newest.glob("*.safetensors")).write_bytes(weights)
    reseal(newest, fields)
    with one_rank_group():
        model, optimizer = tiny_model()
        result, printed = _captured(lambda: load_newest(case, model, optimizer, {"kind": "tiny"}))
    if isinstance(result, JobInputError):
        assert "\n" not in str(result).strip(), str(result)
    elif isinstance(result, Exception):
        raise AssertionError(f"load_newest raised {type(result).__name__}: {result}") from result
    else:
        path, state = result
        assert path.name in ("step-00000001", "step-00000002") and isinstance(state["step"], int), result
    assert "Traceback" not in printed, printed[-3000:]


# --- the adapter loader -------------------------------------------------------------------------------------------

ADAPTER_TARGETS = ["q_proj", "v_proj", "down_proj"]


def make_adapter(root: Path) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.dist.train_common import TINY_LLAMA, save_pretrained_tiny

    save_pretrained_tiny(root / "base", TINY_LLAMA)
    base = AutoModelForCausalLM.from_pretrained(root / "base")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=ADAPTER_TARGETS, init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(root / "adapter")
    return root / "adapter"


def check_adapter(tmp: Path, base: Path, config: bytes | None, weights: bytes | None, link: str | None) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from headrace.training.config.peft import PeftConfig
    from headrace.training.errors import JobInputError
    from headrace.training.models.lora import apply_lora, load_adapter

    case = tmp / "cases" / "adapter"
    shutil.rmtree(case, ignore_errors=True)
    shutil.copytree(base, case / "a")
    if config is not None:
        (case / "a" / "adapter_config.json").write_bytes(config)
    if weights is not None:
        (case / "a" / "adapter_model.safetensors").write_bytes(weights)
    if link is not None:
        (case / "outside").write_bytes((case / "a" / link).read_bytes())
        (case / "a" / link).unlink()
        (case / "a" / link).symlink_to(case / "outside")
    cfg = PeftConfig(dim=4, alpha=8, target_modules=ADAPTER_TARGETS, pretrained_path=str(case / "a"))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base.parent / "base"))
    apply_lora(model, cfg)
    with one_rank_group():
        result, printed = _captured(lambda: load_adapter(model, cfg, case / "a"))
    if isinstance(result, JobInputError):
        assert "\n" not in str(result).strip(), str(result)
    elif isinstance(result, Exception):
        raise AssertionError(f"load_adapter raised {type(result).__name__}: {result}") from result
    else:
        assert link is None, "a file linked from outside the adapter folder was read"
    assert "Traceback" not in printed, printed[-3000:]


# --- the index files ----------------------------------------------------------------------------------------------

INDEX_NAMES = [
    "manifest.json",
    "samples.npy",
    "members.npy",
    "keys.npy",
    "key_order.npy",
    "shard_names.npy",
    "shards.npy",
]
ARRAY_FIELDS = {
    "samples.npy": ["shard", "offset", "size", "member_start", "member_count", "tokens"],
    "members.npy": ["ext", "offset", "size"],
    "shards.npy": ["split", "bytes", "samples", "max_token"],
}


def index_edit():
    """One edit of an index file: its bytes (the ``.npy`` header most), a value of a structured array's field, a
    plain array's value, or the manifest's JSON."""
    field_edit = st.sampled_from(sorted(ARRAY_FIELDS)).flatmap(
        lambda name: st.tuples(
            st.just(name), st.just("field"), st.sampled_from(ARRAY_FIELDS[name]), st.integers(-1, 2**40)
        )
    )
    value_edit = st.tuples(
        st.sampled_from(["key_order.npy", "keys.npy", "shard_names.npy"]),
        st.just("value"),
        st.integers(0, 60),
        st.integers(-(2**33), 2**33),
    )
    byte_edit = st.tuples(
        st.sampled_from(INDEX_NAMES), st.just("bytes"), st.binary(min_size=1, max_size=8), st.integers(0, 200)
    )
    manifest_edit = st.tuples(
        st.just("manifest.json"),
        st.just("json"),
        st.sampled_from(["extensions", "splits", "version", "format", "shards"]),
        JSON_VALUES,
    )
    return st.one_of(field_edit, value_edit, byte_edit, manifest_edit)


def apply_index_edit(folder: Path, edit: tuple) -> None:
    import numpy as np

    name, kind, what, value = edit
    path = folder / name
    if kind == "bytes":
        data = bytearray(path.read_bytes())
        at = min(value, len(data))
        data[at : at + len(what)] = what
        path.write_bytes(bytes(data))
    elif kind == "json":
        try:
            manifest = json.loads(path.read_text())
        except ValueError:  # an earlier edit of this case broke the file
            return
        if not isinstance(manifest, dict):
            return
        manifest[what] = value
        path.write_text(json.dumps(manifest))
    else:
        try:
            array = np.load(path)
        except Exception:  # an earlier edit of this case broke the file: that edit is the case
            return
        if not len(array) or array.ndim != 1 or (array.dtype.names is None) == (kind == "field"):
            return  # an earlier edit changed its type: nothing of that kind to edit
        if kind == "field" and what not in array.dtype.names:
            return
        if kind == "field":
            info = np.iinfo(array.dtype[what]) if array.dtype[what].kind in "iu" else None
            array[what][-1] = value if info is None else min(max(value, info.min), info.max)
        else:
            i = what % len(array)
            if array.dtype.kind in "iu":
                info = np.iinfo(array.dtype)
                array[i] = min(max(value, info.min), info.max)
            else:
                array[i] = str(value).encode()[: array.dtype.itemsize]
        np.save(path, array)


def check_index_files(tmp: Path, base: Path, key: str, edits: list[tuple]) -> None:
    from headrace.dataio.cli import main
    from headrace.dataio.shards.index import INDEX_DIR

    case = tmp / "cases" / "index"
    shutil.rmtree(case, ignore_errors=True)
    shutil.copytree(base, case)
    for edit in edits:
        apply_index_edit(case / INDEX_DIR, edit)
    for argv, allowed in (
        (["verify", str(case), "--quiet", "--workers", "1"], (0, 1, 2)),
        (["get", str(case), key], (0, 2)),
        (["get", str(case), key, "--member", "tokens.npy", "--out", str(tmp / "cases" / "member.npy")], (0, 2)),
    ):
        code, printed = _captured(lambda: main(argv))
        assert code in allowed, (argv[0], code, printed[-3000:])
        assert "Traceback" not in printed, printed[-3000:]
        if code == 2:
            assert printed.strip().count("\n") == 0, printed[-3000:]


# --- the recipe's manifest ----------------------------------------------------------------------------------------


def recipe_line():
    audio = st.sampled_from(["audio/a.flac", "audio/b.flac", "audio/c.flac", "x", 7, None, ""])
    obj = st.fixed_dictionaries(
        {},
        optional={
            "audio_filepath": audio,
            "text": st.one_of(st.text(max_size=8), JSON_VALUES),
            "duration": JSON_VALUES,
        },
    )
    return st.one_of(obj.map(json.dumps), JSON_VALUES.map(json.dumps), st.text(max_size=20), st.just(""))


def check_recipe_manifest(tmp: Path, lines: list[str], text_lines: list[str] | None, minutes: float) -> None:
    import argparse

    from tools.speech_recipe import VAL_PERCENT, is_val, read_jsonl, split_manifest
    from tools.speech_recipe_inputs import RecipeInputError, check_inputs

    case = tmp / "cases" / "recipe"
    shutil.rmtree(case, ignore_errors=True)
    case.mkdir(parents=True)
    manifest = case / "m.jsonl"
    manifest.write_text("".join(line + "\n" for line in lines))
    text = None
    if text_lines is not None:
        text = case / "t.jsonl"
        text.write_text("".join(line + "\n" for line in text_lines))
    args = argparse.Namespace(
        manifest=manifest, text=text, out=case / "run", minutes=minutes, max_steps=None, eval_every=None
    )
    try:
        check_inputs(args, is_val, VAL_PERCENT)
    except RecipeInputError as e:
        assert "\n" not in str(e), str(e)
        return
    assert math.isfinite(minutes) and minutes > 0
    (case / "work").mkdir()
    parts = split_manifest(manifest, case / "work")  # what the recipe does next: must not fail on accepted input
    texts = [r["text"] for r in parts["train"]] + ([r["text"] for r in read_jsonl(text)] if text else [])
    assert all(isinstance(t, str) for t in texts)


# --- the targets ----------------------------------------------------------------------------------------------


def issue46_targets(tmp: Path, guarded, guarded_run) -> dict:
    """name -> (strategy, check), their bases made once here."""
    from tests.fuzz import mutated
    from tests.loader_util import make_text_dataset

    checkpoints = make_checkpoints(tmp / "ckptreader")
    weights = next((checkpoints / "step-00000002").glob("*.safetensors")).read_bytes()
    adapter = make_adapter(tmp / "adapter46")
    adapter_config = (adapter / "adapter_config.json").read_bytes()
    adapter_weights = (adapter / "adapter_model.safetensors").read_bytes()
    keys = make_text_dataset(tmp / "index46", [12, 9])
    json_texts = st.one_of(JSON_VALUES.map(lambda v: json.dumps(v).encode()), st.just(b"[" * 100_000 + b"]" * 100_000))
    state_fields = st.dictionaries(
        st.sampled_from(["step", "loader", "rng", "optim_plain", "model_config", "first_loss", "files"]),
        JSON_VALUES,
        max_size=2,
    )
    return {
        "ckptreader": (
            st.tuples(st.one_of(st.none(), mutated(weights, hot=SAFETENSORS_HEAD)), state_fields),
            guarded_run(lambda c: check_checkpoint_reader(tmp, checkpoints, *c)),
        ),
        "adapter": (
            st.tuples(
                st.one_of(st.none(), json_texts, mutated(adapter_config)),
                st.one_of(st.none(), mutated(adapter_weights, hot=SAFETENSORS_HEAD)),
                st.one_of(st.none(), st.sampled_from(["adapter_config.json", "adapter_model.safetensors"])),
            ),
            guarded_run(lambda c: check_adapter(tmp, adapter, *c)),
        ),
        "indexfiles": (
            st.lists(index_edit(), min_size=1, max_size=3),
            guarded(lambda edits: check_index_files(tmp, tmp / "index46", keys[4], edits)),
        ),
        "recipemanifest": (
            st.tuples(
                st.lists(recipe_line(), min_size=0, max_size=30),
                st.one_of(st.none(), st.lists(recipe_line(), max_size=3)),
                st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -5.0, 1.0])),
            ),
            guarded(lambda c: check_recipe_manifest(tmp, *c)),
        ),
    }


__all__ = ["issue46_targets"]
