"""`dataio bench` end to end on tiny data: every installed peer reads the same samples as headrace, the
JSON has every field, the table and plot are written, the trainer path reports its data wait."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import soundfile
import webdataset as wds

from headrace.dataio.bench.peers import PEERS, skip_reason
from headrace.dataio.bench.report import RUN_FIELDS
from headrace.dataio.usererror import CommandError

REPO = Path(__file__).resolve().parents[1]


def _index(root: Path) -> None:
    from headrace.dataio.prepare.indexing import build_index

    build_index(root, workers=1)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Tiny text (tokens + txt + json) and audio (FLAC + json) shard dirs, written by ShardWriter, indexed."""
    base = tmp_path_factory.mktemp("bench")
    rng = np.random.default_rng(0)
    text, audio = base / "text", base / "audio"
    text.mkdir()
    audio.mkdir()
    with wds.ShardWriter(str(text / "train-%06d.tar"), maxcount=23, verbose=0) as w:
        for i in range(61):
            buf = io.BytesIO()
            np.save(buf, rng.integers(0, 4000, int(rng.integers(5, 300)), dtype=np.uint16))
            w.write(
                {
                    "__key__": f"doc{i:04d}",
                    "npy": buf.getvalue(),
                    "txt": f"document {i}".encode(),
                    "json": json.dumps({"i": i}).encode(),
                }
            )
    with wds.ShardWriter(str(audio / "train-%06d.tar"), maxcount=7, verbose=0) as w:
        for i in range(17):
            buf = io.BytesIO()
            soundfile.write(
                buf,
                0.1 * rng.standard_normal(int(rng.integers(1600, 8000))).astype(np.float32),
                16000,
                format="FLAC",
                subtype="PCM_16",
            )
            w.write({"__key__": f"utt{i:04d}", "flac": buf.getvalue(), "json": json.dumps({"i": i}).encode()})
    _index(text)
    _index(audio)
    return base


def bench(tmp_path: Path, data: dict, *argv: str) -> dict:
    from headrace.dataio.commands import bench as command

    config = tmp_path / "data.yaml"
    config.write_text(json.dumps({"data": data}))  # JSON is YAML
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    out = tmp_path / "out"
    assert command.run(parser.parse_args(["--config", str(config), "--out", str(out), *argv])) == 0
    for name in ("results.json", "results.md", "throughput.png"):
        assert (out / name).stat().st_size > 0, name
    return json.loads((out / "results.json").read_text())


def test_text_every_peer_reads_the_same_samples(shards, tmp_path):
    result = bench(
        tmp_path,
        {"datasets": [{"path": str(shards / "text")}], "batch_size": 8, "shuffle": False, "seq_len": 64},
        "--num-workers",
        "0,1",
        "--trainer",
        "--step-time",
        "5",
        "--batches",
        "4",
    )
    # --batches caps every run at 4 batches of 8; a one-epoch run is the next test
    assert result["data"]["samples"] == 61 and result["data"]["kind"] == "text"
    ran = {r["loader"] for r in result["runs"]}
    skipped = {s["loader"]: s["reason"] for s in result["skipped"]}
    assert "lhotse" in skipped and "text" in skipped["lhotse"]  # not silently dropped
    for name in ("webdataset", "energon", "litdata", "torch"):
        assert name in ran or name in skipped, name
    for run in result["runs"]:
        assert set(RUN_FIELDS) <= set(run), set(RUN_FIELDS) - set(run)
        assert run["batches"] == 4 and run["samples"] == 32, run
        assert run["samples_per_s"] > 0 and run["peak_rss_mb"] > 0
        assert run["cpu_util"] >= 0  # CPU time has 10 ms ticks: a tiny run may show none
        assert 0 <= run["data_wait_fraction"] <= 1
        assert run["latency_p99_ms"] >= run["latency_p50_ms"] > 0
    headrace = [r for r in result["runs"] if r["loader"] == "headrace"]
    assert [r["vs_headrace"] for r in headrace] == [1.0, 1.0]
    for run in headrace:  # its loader stages (headrace.dataio.stagetimes), read by a worker or here
        stages = run["stage_fractions"]
        assert set(stages) == {"read", "decode", "pack", "collate", "h2d"} and stages["h2d"] == 0.0  # CPU: no copy
        assert stages["read"] > 0 and all(v >= 0 for v in stages.values()), stages
    assert all(r["stage_fractions"] is None for r in result["runs"] if not r["loader"].startswith("headrace"))
    assert result["page_cache"]["bytes"] > 0 and result["page_cache"]["samples_per_s"] > 0
    assert [t["workers"] for t in result["trainer"]] == [0, 1]
    for t in result["trainer"]:
        assert t["packing"] == "best_fit" and t["batches"] == 4 and 0 <= t["data_wait_fraction"] <= 1
        assert t["tokens_per_s"] > 0


def test_one_epoch_like_for_like(shards, tmp_path):
    """In one process every loader serves exactly the epoch: the same samples and the same tokens."""
    result = bench(tmp_path, {"datasets": [{"path": str(shards / "text")}], "batch_size": 8}, "--num-workers", "0")
    runs = {r["loader"]: r for r in result["runs"]}
    assert "headrace" in runs and len(runs) >= 4  # webdataset, energon, torch are dependencies
    for name, run in runs.items():
        assert run["samples"] == 61 and run["units"] == runs["headrace"]["units"], name


def test_audio_peers_decode_the_same_seconds(shards, tmp_path):
    result = bench(
        tmp_path,
        {"datasets": [{"path": str(shards / "audio")}], "batch_size": 4, "shuffle": False},
        "--num-workers",
        "0",
        "--compare",
        "webdataset,energon,lhotse,torch,dali",
    )
    runs = {r["loader"]: r for r in result["runs"]}
    skipped = {s["loader"]: s["reason"] for s in result["skipped"]}
    dali = {"dali", "headrace-dali"}  # DALI's reader, and headrace with decode.audio: dali beside it
    assert set(runs) | dali == {"headrace", "headrace-full", "webdataset", "energon", "lhotse", "torch", *dali}, skipped
    for name in dali:
        assert name in runs or "not installed" in skipped[name]  # the `dali` extra is optional
    seconds = runs["headrace"]["units"]
    assert seconds > 1.0
    for name, run in runs.items():
        assert run["samples"] == 17, name
        assert run["units"] == pytest.approx(seconds, rel=1e-3), name  # lhotse re-encodes: same frames
    assert "audio s/s" in (tmp_path / "out" / "results.md").read_text()


def _audio_bytes(root: Path) -> int:
    from headrace.dataio.bench.peers import tar_samples

    return sum(len(m["flac"]) for shard in sorted(root.glob("*.tar")) for _, m in tar_samples(shard))


@pytest.mark.parametrize("workers", ["0", "1"])
def test_audio_bytes_every_loader_hands_over_the_same_bytes(shards, tmp_path, workers):
    """--audio-bytes: no loader decodes; each hands over exactly the source's encoded audio bytes."""
    result = bench(
        tmp_path,
        {"datasets": [{"path": str(shards / "audio")}], "batch_size": 4, "shuffle": False},
        "--num-workers",
        workers,
        "--audio-bytes",
        "--compare",
        "webdataset,energon,lhotse,torch,dali",
    )
    assert result["data"]["audio"] == "bytes"
    runs = {r["loader"]: r for r in result["runs"]}
    skipped = {s["loader"]: s["reason"] for s in result["skipped"]}
    assert "re-encodes" in skipped["lhotse"] and "headrace-dali" not in runs  # nothing decoded here
    assert set(runs) | {"dali"} == {"headrace", "headrace-full", "webdataset", "energon", "torch", "dali"}, skipped
    megabytes = _audio_bytes(shards / "audio") / 1e6
    for name, run in runs.items():
        assert run["samples"] == 17, name
        assert run["units"] == pytest.approx(megabytes, rel=1e-9), name
    assert "audio MB/s" in (tmp_path / "out" / "results.md").read_text()


def test_audio_bytes_needs_audio(shards, tmp_path):
    with pytest.raises(CommandError, match="no audio member"):
        bench(tmp_path, {"datasets": [{"path": str(shards / "text")}]}, "--audio-bytes", "--compare", "")


def test_bad_configs_are_one_line_errors(shards, tmp_path):
    two = {"datasets": [{"path": str(shards / "text")}, {"path": str(shards / "audio")}]}
    with pytest.raises(CommandError, match="one dataset"):
        bench(tmp_path, two)
    with pytest.raises(CommandError, match="unknown loader"):
        bench(tmp_path, {"datasets": [{"path": str(shards / "text")}]}, "--compare", "mosaic")


def test_skip_reason_names_the_missing_package(shards, tmp_path):
    from dataclasses import replace

    from headrace.dataio.bench.data import describe
    from headrace.dataio.config import DataConfig
    from headrace.config import from_dict

    data = describe(from_dict(DataConfig, {"datasets": [{"path": str(shards / "text")}]}), tmp_path)
    missing = replace(PEERS["litdata"], module="surely_not_installed_pkg")
    assert "not installed" in skip_reason(missing, data) and "--no-deps" in skip_reason(missing, data)


def test_page_cache_limit_reads_every_byte(tmp_path):
    from headrace.dataio.bench.pagecache import read_limit

    files = [tmp_path / f"f{i}" for i in range(3)]
    for i, f in enumerate(files):
        f.write_bytes(bytes(1000 * (i + 1)))
    limit = read_limit(files, repeats=2)
    assert limit["bytes"] == 6000 and limit["bytes_per_s"] > 0


def test_help_does_not_import_torch():
    code = (
        "import sys, headrace.dataio.commands.bench as b, argparse; b.add_arguments(argparse.ArgumentParser()); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, env={"PYTHONPATH": str(REPO)})


def test_cold_cache_refused_without_root_says_so(shards, tmp_path, monkeypatch):
    """Without root the page cache cannot be dropped: the run says so and is labelled warm."""
    from headrace.dataio.bench import pagecache

    monkeypatch.setattr(pagecache.os, "geteuid", lambda: 1000)
    assert "not root" in pagecache.drop_page_cache()
    result = bench(
        tmp_path,
        {"datasets": [{"path": str(shards / "text")}], "batch_size": 8},
        "--compare",
        "",
        "--num-workers",
        "0",
        "--cache",
        "cold",
        "--batches",
        "2",
    )
    assert result["cache"].startswith("warm (cold refused: not root")
    assert [r["loader"] for r in result["runs"]] == ["headrace", "headrace-full"]


def test_fixed_cost_fit_recovers_the_line():
    from headrace.dataio.bench.fixedcost import fit

    got = fit([(b, 50e-6 + 2e-6 * b) for b in (1, 8, 32)])
    assert got["fixed_us"] == pytest.approx(50) and got["per_sample_us"] == pytest.approx(2)
    assert fit([(8, 1e-4), (8, 2e-4)]) is None  # one batch size: nothing to fit


def test_batch_sizes_report_the_fixed_cost_per_batch(shards, tmp_path):
    """``--batch-sizes`` runs every loader at each size and reports, per loader and worker count, the time
    per batch at each size and the fitted fixed cost per batch and cost per sample (shape, not timing)."""
    result = bench(
        tmp_path,
        {"datasets": [{"path": str(shards / "text")}], "batch_size": 8},
        "--num-workers",
        "0",
        "--compare",
        "torch",
        "--batch-sizes",
        "1,4,16",
    )
    assert {(r["loader"], r["batch_size"]) for r in result["runs"]} == {
        (name, b) for name in ("headrace", "headrace-full", "torch") for b in (1, 4, 16)
    }
    assert all(r["samples"] == 61 for r in result["runs"])  # each size: the whole epoch
    costs = {c["loader"]: c for c in result["fixed_cost"]}
    assert set(costs) == {"headrace", "headrace-full", "torch"}
    for c in costs.values():
        assert c["workers"] == 0 and set(c["us_per_batch"]) == {"1", "4", "16"}
        assert all(v > 0 for v in c["us_per_batch"].values())
        assert isinstance(c["fixed_us"], float) and isinstance(c["per_sample_us"], float)
    table = (tmp_path / "out" / "results.md").read_text()
    assert "fixed us/batch" in table and "us/batch at 16" in table
    with pytest.raises(CommandError, match="--batch-sizes"):
        bench(tmp_path, {"datasets": [{"path": str(shards / "text")}]}, "--batch-sizes", "0,8", "--compare", "")


def test_auto_workers_runs_headrace_with_its_choice_beside_the_counts(shards, tmp_path):
    """``--num-workers 0,auto``: headrace also runs with the count ``num_workers: auto`` chose, its measurement
    (a real one: this machine's rates) in the row and the table; the peers have no ``auto`` and run their counts."""
    from headrace.dataio.worker_count import pick

    result = bench(
        tmp_path,
        {"datasets": [{"path": str(shards / "text")}], "batch_size": 8},
        "--num-workers",
        "0,auto",
        "--compare",
        "torch",
        "--batches",
        "4",
    )
    assert sorted((r["loader"], str(r["workers"])) for r in result["runs"]) == [
        ("headrace", "0"),
        ("headrace", "auto"),
        ("headrace-full", "0"),
        ("headrace-full", "auto"),
        ("torch", "0"),
    ]
    auto = next(r for r in result["runs"] if r["workers"] == "auto" and r["loader"] == "headrace")
    assert auto["samples"] == 32
    choice = auto["auto"]
    rates = {int(n): r for n, r in choice["rates"].items()}
    assert choice["num_workers"] == (pick(rates) if rates else 0)
    assert all(r > 0 for r in rates.values()) and (rates or choice["cores"] < 2)
    table = (tmp_path / "out" / "results.md").read_text()
    assert f"| auto ({choice['num_workers']}) |" in table and choice["line"] in table


def test_every_loader_returns_exactly_the_contract(shards, tmp_path):
    """Each loader's batches hold the output contract and nothing else: for text, one flat token tensor in the
    stored dtype + int64 lengths; every loader yields the same documents (order aside), headrace's contract
    row the same tokens as its full layout."""
    from headrace.dataio.bench.data import describe
    from headrace.dataio.config import DataConfig
    from headrace.config import from_dict
    from headrace.dataio.bench.peers import prepare
    from headrace.dataio.stagetimes import TIMES

    data = describe(from_dict(DataConfig, {"datasets": [{"path": str(shards / "text")}], "batch_size": 8}), tmp_path)
    documents = {}
    for name in ("headrace", "webdataset", "energon", "litdata", "torch"):
        peer = PEERS[name]
        if skip_reason(peer, data):
            continue
        state, _ = prepare(peer, data)
        docs = []
        for batch in peer.open(data, 0, False, state):
            # the contract's fields; headrace's batches also carry its stages' seconds (the run's stage fractions)
            assert set(batch) - {TIMES} == {"tokens", "lengths"}, name
            tokens, lengths = batch["tokens"], batch["lengths"]
            assert tokens.ndim == 1 and tokens.dtype == torch.uint16 and lengths.dtype == torch.int64, name
            assert int(lengths.sum()) == tokens.numel() and len(lengths) <= 8, name
            docs += [tuple(d.tolist()) for d in torch.split(tokens, lengths.tolist())]
        documents[name] = sorted(docs)
    assert {"headrace", "webdataset", "energon", "torch"} <= set(documents)
    for name, docs in documents.items():
        assert len(docs) == 61 and docs == documents["headrace"], name
    full = [
        tuple(d.tolist())
        for b in PEERS["headrace-full"].open(data, 0, False, None)
        for d in torch.split(b["npy"], b["__lengths__"]["npy"].tolist())
    ]
    assert sorted(full) == documents["headrace"]


def test_contract_pieces():
    """Stacked headrace batches (equal lengths) and flat audio become the contract; audio is zero-padded."""
    from headrace.dataio.bench.contract import audio_batch, count, from_headrace

    stacked = {"npy": torch.arange(6, dtype=torch.int32).view(2, 3), "__lengths__": {}}
    out = from_headrace(stacked, "npy", "text", None)
    assert out["tokens"].tolist() == list(range(6)) and out["lengths"].tolist() == [3, 3]
    assert count(out, "text") == (2, 6.0)
    flat = {"flac": torch.ones(5), "__lengths__": {"flac": torch.tensor([2, 3])}, "__sample_rate__": {"flac": [10]}}
    audio = from_headrace(flat, "flac", "audio", None)
    assert audio["audio"].tolist() == [[1, 1, 0], [1, 1, 1]] and audio["sample_rate"] == 10
    assert count(audio, "audio") == (2, 0.5)
    assert audio_batch([np.ones(1, np.float32)], 16000)["audio"].shape == (1, 1)
