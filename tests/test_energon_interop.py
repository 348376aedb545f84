"""`dataio index` metadata against Megatron-Energon: energon's own `prepare` is the oracle, and energon
opens the directory we indexed (no `energon prepare`) through a CrudeWebdataset task encoder with a
cooker, its sqlite random access, and the webdataset library reads the shards as they are."""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile
import webdataset as wds

REPO = Path(__file__).resolve().parents[1]


def run_verb(verb: str, *argv: str) -> int:
    """Run one `dataio` subcommand in-process through its own argument parser."""
    import importlib

    from headrace.dataio.usererror import CommandError

    module = importlib.import_module(f"headrace.dataio.commands.{verb}")
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    try:
        return module.run(parser.parse_args(list(argv)))
    except CommandError as e:
        print(f"dataio {verb}: error: {e}", file=sys.stderr)
        return e.exit_code


def make_samples(n: int = 11, seed: int = 0) -> list[dict]:
    """Text + token ids + WAV audio + JSON samples, one key long enough to need a PAX header."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        tokens = rng.integers(0, 5000, size=int(rng.integers(1, 40)), dtype=np.uint16)
        npy = io.BytesIO()
        np.save(npy, tokens)
        frames = int(rng.integers(800, 4000))
        wav = io.BytesIO()
        soundfile.write(wav, rng.standard_normal(frames).astype(np.float32) * 0.1, 8000, format="WAV", subtype="PCM_16")
        key = f"utt{i:05d}" + ("-" + "x" * 120 if i == 3 else "")
        samples.append(
            {
                "__key__": key,
                "txt": f"sentence number {i} " * int(rng.integers(1, 5)),
                "tokens.npy": npy.getvalue(),
                "wav": wav.getvalue(),
                "json": json.dumps({"i": i, "duration": frames / 8000}).encode(),
                "_tokens": len(tokens),
                "_duration": frames / 8000,
            }
        )
    return samples


def write_shards(root: Path, samples: list[dict], *, per_shard: int = 4) -> None:
    root.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(root / "shard-%06d.tar"), maxcount=per_shard, verbose=0) as w:
        for s in samples:
            w.write({k: v for k, v in s.items() if k == "__key__" or not k.startswith("_")})


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """(ours, energon's): the same ShardWriter tars indexed by `dataio index` and by `energon prepare`."""
    base = tmp_path_factory.mktemp("energon")
    samples = make_samples()
    ours, oracle = base / "ours", base / "oracle"
    write_shards(ours, samples)
    shutil.copytree(ours, oracle)
    assert run_verb("index", str(ours), "--workers", "2", "--quiet") == 0
    energon = Path(sys.executable).with_name("energon")
    subprocess.run(
        [
            str(energon),
            "prepare",
            "--non-interactive",
            "--sample-type",
            "CrudeWebdataset",
            "--split-ratio",
            "1,0,0",
            "--num-workers",
            "1",
            "--no-progress",
            str(oracle),
        ],
        check=True,
        capture_output=True,
    )
    return ours, oracle, samples


def _sqlite_dump(path: Path):
    db = sqlite3.connect(path)
    try:
        return (
            sorted(db.execute("SELECT type, name, tbl_name, sql FROM sqlite_master")),
            list(db.execute("SELECT * FROM samples ORDER BY tar_file_id, sample_index")),
            list(db.execute("SELECT * FROM sample_parts ORDER BY tar_file_id, sample_index, content_byte_offset")),
        )
    finally:
        db.close()


def test_metadata_matches_energon_prepare(datasets):
    ours, oracle, samples = datasets
    for name in ("dataset.yaml", "split.yaml", ".info.json"):
        assert (ours / ".nv-meta" / name).read_bytes() == (oracle / ".nv-meta" / name).read_bytes(), name
    idx_files = sorted(p.name for p in oracle.glob("*.tar.idx"))
    assert idx_files == sorted(p.name for p in ours.glob("*.tar.idx")) and len(idx_files) == 3
    for name in idx_files:
        assert (ours / name).read_bytes() == (oracle / name).read_bytes(), name
    schema, rows, parts = _sqlite_dump(ours / ".nv-meta" / "index.sqlite")
    assert (schema, rows, parts) == _sqlite_dump(oracle / ".nv-meta" / "index.sqlite")
    assert len(rows) == len(samples) and len(parts) == 4 * len(samples)
    uuid_text = (ours / ".nv-meta" / "index.uuid").read_text()
    assert len(uuid_text) == 36 and uuid_text.count("-") == 4


def _encoder():
    from megatron.energon import Cooker, DefaultTaskEncoder, Sample, stateless
    from megatron.energon.edataclass import edataclass

    @edataclass
    class Utterance(Sample):
        text: bytes
        tokens: bytes
        audio: bytes

    @stateless
    def cook(crude: dict) -> Utterance:
        return Utterance(
            __key__=crude["__key__"],
            __restore_key__=crude["__restore_key__"],
            __subflavors__=crude.get("__subflavors__"),
            __sources__=crude.get("__sources__"),
            text=crude["txt"],
            tokens=crude["tokens.npy"],
            audio=crude["wav"],
        )

    class Encoder(DefaultTaskEncoder):
        decoder = None  # raw bytes: compare exactly what the shards hold
        cookers = [Cooker(cook)]

        def batch(self, batch):
            return batch

    return Encoder()


def _expected(samples):
    return [(s["__key__"], s["txt"].encode(), s["tokens.npy"], s["wav"]) for s in samples]


def test_energon_reads_our_metadata_in_order(datasets):
    from megatron.energon import WorkerConfig, get_loader, get_val_dataset

    ours, _, samples = datasets
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    ds = get_val_dataset(ours, split_part="train", worker_config=wc, batch_size=1, task_encoder=_encoder())
    got = [(u.__key__, u.text, u.tokens, u.audio) for batch in get_loader(ds) for u in batch]
    assert got == _expected(samples)


def test_energon_train_loader_one_epoch(datasets):
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    ours, _, samples = datasets
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    ds = get_train_dataset(
        ours,
        worker_config=wc,
        batch_size=1,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        repeat=False,
        task_encoder=_encoder(),
    )
    got = [(u.__key__, u.text, u.tokens, u.audio) for batch in get_loader(ds) for u in batch]
    assert sorted(got) == sorted(_expected(samples))


def test_energon_random_access_by_key_uses_our_sqlite(datasets):
    from megatron.energon.cache.file_store import WebdatasetFileStore
    from megatron.energon.epathlib import EPath

    ours, _, samples = datasets
    store = WebdatasetFileStore(EPath(ours))
    assert len(store) == len(samples)
    for s in (samples[0], samples[3], samples[-1]):
        data, _ = store[f"{s['__key__']}.wav"]
        assert data == s["wav"]
        data, _ = store[f"{s['__key__']}.tokens.npy"]
        assert data == s["tokens.npy"]
    with pytest.raises(KeyError):
        store["no-such-key.wav"]


def test_webdataset_reads_indexed_shards_unchanged(datasets):
    ours, _, samples = datasets
    urls = [str(p) for p in sorted(ours.glob("*.tar"))]
    got = [(s["__key__"], s["txt"], s["tokens.npy"], s["wav"]) for s in wds.WebDataset(urls, shardshuffle=False)]
    assert got == _expected(samples)


def test_sharding_without_energon_installed_writes_metadata_energon_reads(tmp_path, monkeypatch):
    """energon is the `bench` extra, not a dependency of sharding: where its distribution is absent, `dataio index`
    (the metadata writer `dataio shard` shares) still writes `.info.json`, without `energon_version`, and energon
    reads the directory."""
    from importlib.metadata import PackageNotFoundError, version

    from megatron.energon import WorkerConfig, get_loader, get_val_dataset

    from headrace.dataio.cli import main
    from headrace.dataio.shards import metadata

    def without_energon(name: str) -> str:
        if name == "megatron-energon":
            raise PackageNotFoundError(name)
        return version(name)

    monkeypatch.setattr(metadata, "version", without_energon)
    samples = make_samples(n=6, seed=5)
    write_shards(tmp_path, samples, per_shard=3)
    assert main(["index", str(tmp_path), "--quiet"]) == 0
    info = json.loads((tmp_path / ".nv-meta" / ".info.json").read_text())
    assert "energon_version" not in info and sum(info["shard_counts"].values()) == 6
    ds = get_val_dataset(
        tmp_path,
        split_part="train",
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
        batch_size=1,
        task_encoder=_encoder(),
    )
    assert [(u.__key__, u.text, u.tokens, u.audio) for b in get_loader(ds) for u in b] == _expected(samples)
