"""Bad input on the loading side, each example of issues 16 and 25 through ``build_loader``: shards that shrink
or are rewritten in place under a running loader (never SIGBUS, never silent wrong data), loader states that
belong to other data, runs or layouts (each refused naming the field), mixed audio codecs, odd ``.npy`` token
members. The preparation side is test_bad_input_prepare.py."""

from __future__ import annotations

import copy
import io
import json
import os
import shutil

import numpy as np
import pytest
import soundfile
import webdataset as wds

from tests import loader_util
from headrace.dataio import build_loader
from headrace.dataio.loader_state import StateError
from headrace.dataio.usererror import SampleDecodeError
from tests.hostile import flac_bytes


# --- silent wrong data: a shard rewritten in place ---------------------------------------------------


def _rewrite_in_place(tmp_path, sizes: list[int], shard: str = "doc-000000.tar") -> None:
    """Overwrite ``shard`` in place (same inode, same size) with a shard of other keys and tokens."""
    loader_util.make_text_dataset(tmp_path / "other", sizes, prefix="dod", seed=1)
    new = (tmp_path / "other" / shard.replace("doc", "dod")).read_bytes()
    path = tmp_path / "d" / shard
    assert len(new) == path.stat().st_size
    with open(path, "r+b") as f:
        f.write(new)


@pytest.mark.parametrize("workers, packed", [(0, False), (2, False), (2, True)])
def test_shard_rewritten_in_place_at_the_same_size_is_an_error(tmp_path, workers, packed):
    """Used to serve the new bytes under the old keys (100 of 800 samples wrong): the token fast path
    checked each block once per loader. Now every read compares the file's (inode, mtime) with the
    version first mapped, in every worker."""
    sizes = [3000, 100] if packed else [400, 400]  # packing reads 256 samples a chunk, workers 2 chunks ahead
    loader_util.make_text_dataset(tmp_path / "d", sizes, seed=0)
    cfg = {
        "datasets": [{"path": str(tmp_path / "d")}],
        "batch_size": 8,
        "epochs": 1,
        "num_workers": workers,
        "shuffle": False,
        "max_bad_samples": 0,
        "prefetch": 1,
    }
    if packed:
        cfg.update(seq_len=64, packing="greedy")
    loader = build_loader(cfg)
    it = iter(loader)
    next(it)
    _rewrite_in_place(tmp_path, sizes)
    with pytest.raises(SampleDecodeError, match=r"doc-000000\.tar'?: shard changed since"):
        for batch in it:
            keys = batch.get("__key__", [])
            assert not any(k.startswith("dod") for k in keys), "new bytes served under the old index"


def test_shard_rewritten_before_a_worker_maps_it_is_an_error(tmp_path):
    """A worker that maps the shard only after the rewrite must not read the new version under checks
    the main process made on the old one: the first version's stamp is shared with the workers."""
    loader_util.make_text_dataset(tmp_path / "d", [400, 400], seed=0)
    cfg = {
        "datasets": [{"path": str(tmp_path / "d")}],
        "batch_size": 8,
        "epochs": 1,
        "num_workers": 0,
        "shuffle": False,
        "max_bad_samples": 0,
    }
    loader = build_loader(cfg)
    source = loader.stream.sources[0]
    source.array(0)  # the main process maps shard 0: its stamp is now the loader's
    os.utime(tmp_path / "d" / "doc-000000.tar", ns=(1, 1))  # another version (mtime) before anyone reads on
    source.open_shards._pid = -1  # as a freshly forked worker: the parent's maps forgotten
    with pytest.raises(SampleDecodeError, match="shard changed since the loader first read it"):
        list(loader)


# --- loader states -----------------------------------------------------------------------------------


def _state_cfg(root, **kw):
    return {"datasets": [{"path": str(root)}], "batch_size": 2, "epochs": 1, "num_workers": 0, "shuffle": False, **kw}


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s.update(consumed=50), r"'consumed' 50 .*reaches position 50, past the end of this data's 20"),
        (lambda s: s["layout"].update(start=50), r"'consumed' 0 \(with 'layout' start 50\) reaches position 50, past"),
        (lambda s: s.update(consumed=10**30), r"'consumed' must be a non-negative integer below 2\*\*62"),
        (lambda s: s.update(seed=2**64), r"'seed' must be a non-negative integer below 2\*\*62"),
        (lambda s: s["layout"].update(start=10**30), r"'layout' must be a mapping"),
        (lambda s: s.update(reseeds=[[1, [10**30]]]), r"'reseeds' must be a list of \[seed, "),  # was accepted
        (lambda s: s.update(reseeds="zz"), r"'reseeds' must be a list of \[seed, "),  # was a bare ValueError
    ],
)
def test_loader_state_past_the_end_or_huge_is_refused_naming_the_field(tmp_path, edit, message):
    """Used to be accepted and yield 0 samples (past the end), or OverflowError (huge integers)."""
    loader_util.make_text_dataset(tmp_path, [10, 10])
    state = build_loader(_state_cfg(tmp_path)).state_dict()
    edit(state)
    with pytest.raises(StateError, match=rf"loader state 0: {message}"):
        build_loader(_state_cfg(tmp_path)).load_state_dict(state)


def test_loader_states_of_mixed_dp_sizes_are_refused(tmp_path):
    """Rank 0 of a dp_size-2 run beside rank 1 of a dp_size-3 run used to be accepted (a mix of both)."""
    loader_util.make_text_dataset(tmp_path, [10, 10])
    cfg = _state_cfg(tmp_path)
    a, b = build_loader(cfg, 0, 2).state_dict(), build_loader(cfg, 1, 3).state_dict()
    with pytest.raises(StateError, match=r"loader state 1: 'dp_size' 3 differs from loader state 0's 2"):
        build_loader(cfg, 0, 2).load_state_dict([a, b])
    with pytest.raises(StateError, match=r"loader state 1: 'dp_rank' 0 appears twice"):
        build_loader(cfg, 0, 1).load_state_dict([a, copy.deepcopy(a)])


def test_packing_and_bucketing_sub_states_name_their_field(tmp_path):
    loader_util.make_text_dataset(tmp_path, [10, 10])
    cfg = _state_cfg(tmp_path, seq_len=16, packing="greedy")
    loader = build_loader(cfg)
    next(iter(loader))
    state = loader.state_dict()
    for value in (10**30, 5000):  # IndexError / OverflowError deep in the read before
        bad = copy.deepcopy(state)
        bad["packing"]["open"][0][0][0] = value
        with pytest.raises(StateError, match=rf"packing state: document {value} is not a sample of this data"):
            build_loader(cfg).load_state_dict(bad)
    bad = copy.deepcopy(state)
    bad["packed_batches"] = 10**30
    with pytest.raises(StateError, match="'packed_batches' must be a non-negative integer below 2"):
        build_loader(cfg).load_state_dict(bad)

    audio = tmp_path / "audio"
    _mixed_codec_dataset(audio)
    bucketed = {
        "datasets": [{"path": str(audio)}],
        "batch_size": 2,
        "epochs": 1,
        "num_workers": 0,
        "bucketing": {"max_duration": 1.0, "num_buckets": 2},
    }
    state = build_loader(bucketed).state_dict()
    for field, value in (("step", -3), ("epoch", 10**30), ("history", [[10**30, 5]])):  # IndexError, 0 samples
        bad = copy.deepcopy(state)
        bad["bucketing"][field] = value
        with pytest.raises(StateError, match="'bucketing' must be a mapping of epoch"):
            build_loader(bucketed).load_state_dict(bad)
    bad = copy.deepcopy(state)
    bad["bucketing"]["step"] = 1000
    loader = build_loader(bucketed)
    loader.load_state_dict(bad)
    with pytest.raises(StateError, match="bucketing 'step' 1000 is past the"):
        list(loader)


# --- mixed codecs ------------------------------------------------------------------------------------


def _wav_bytes(frames: int, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, np.sin(np.arange(frames) / 5.0).astype(np.float32) * 0.2, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def _mixed_codec_dataset(root, n: int = 8) -> None:
    root.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(root / "d-000000.tar")) as w:
        for i in range(n):
            audio = {"flac": flac_bytes(1600 + 10 * i)} if i % 2 else {"wav": _wav_bytes(1600 + 10 * i)}
            w.write({"__key__": f"k{i}", **audio, "json": json.dumps({"text": f"t{i}"}).encode()})
    loader_util.index_dir(root)


@pytest.mark.parametrize("workers", [0, 2])
def test_mixed_flac_and_wav_members_are_served(tmp_path, workers):
    """Used to die of AttributeError ('NoneType' ... 'sample_rate') in collate; with bucketing KeyError 'flac'."""
    _mixed_codec_dataset(tmp_path)
    cfg = {
        "datasets": [{"path": str(tmp_path)}],
        "batch_size": 4,
        "epochs": 1,
        "num_workers": workers,
        "shuffle": False,
        "decode": {"sample_rate": None},
    }
    batches = list(build_loader(cfg))
    frames = {}
    for b in batches:
        for ext in ("flac", "wav"):
            for key, wave, rate in zip(b["__key__"], b[ext], b["__sample_rate__"][ext]):
                if wave is not None:
                    frames[key] = (ext, wave.shape[0], rate)
    assert frames == {f"k{i}": ("flac" if i % 2 else "wav", 1600 + 10 * i, 16000) for i in range(8)}
    bucketed = {**cfg, "bucketing": {"max_duration": 1.0, "num_buckets": 2}}
    lengths = sorted(n for b in build_loader(bucketed) for n in b["audio_lens"].tolist())
    assert lengths == sorted(1600 + 10 * i for i in range(8))


# --- .npy token members ------------------------------------------------------------------------------


def _npy_dataset(root, odd: np.ndarray, n: int = 8, at: int = 3) -> None:
    root.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(root / "d-000000.tar")) as w:
        for i in range(n):
            tokens = odd if i == at else np.arange(1, 6, dtype=np.uint16)
            w.write({"__key__": f"k{i}", "tokens.npy": loader_util.npy_bytes(tokens)})
    loader_util.index_dir(root)


ODD_NPY = {
    "fortran": (np.asfortranarray(np.arange(6, dtype=np.uint16).reshape(2, 3)), "1-D integer array"),
    "2d": (np.arange(6, dtype=np.uint16).reshape(2, 3), "1-D integer array"),
    "float": (np.arange(3, dtype=np.float32), "token ids must be integers"),
    "negative": (np.array([1, -5, 3], dtype=np.int32), "negative token id -5"),
}


@pytest.mark.parametrize("name", sorted(ODD_NPY))
def test_odd_npy_token_members_are_counted_bad_samples_when_packing(tmp_path, name):
    """Used to be AttributeError ('list' ... 'clone') or a torch promotion error, uncounted, unnamed."""
    array, message = ODD_NPY[name]
    _npy_dataset(tmp_path, array)
    cfg = {
        "datasets": [{"path": str(tmp_path)}],
        "batch_size": 4,
        "epochs": 1,
        "num_workers": 0,
        "shuffle": False,
        "seq_len": 16,
        "packing": "greedy",
        "max_bad_samples": 0,
    }
    with pytest.raises(SampleDecodeError, match=rf"d-000000\.tar', key 'k3', member 'tokens\.npy': .*{message}"):
        list(build_loader(cfg))
    batches = list(build_loader({**cfg, "max_bad_samples": 1}))
    assert sum(b["num_docs"] for b in batches) == 7  # the other seven documents, packed


def test_int32_token_members_among_uint16_collate_as_int64(tmp_path):
    """int32 among uint16 used to be torch's "Promotion for uint16 ... not supported"; the ids are kept."""
    _npy_dataset(tmp_path, np.array([70000, 2, 3], dtype=np.int32))
    plain = {"datasets": [{"path": str(tmp_path)}], "batch_size": 4, "epochs": 1, "num_workers": 0, "shuffle": False}
    first = next(iter(build_loader(plain)))
    assert first["tokens.npy"].dtype.is_signed and first["tokens.npy"].tolist()[15:18] == [70000, 2, 3]
    packed = list(build_loader({**plain, "seq_len": 16, "packing": "greedy"}))
    assert any(70000 in b["input_ids"].flatten().tolist() for b in packed)


def test_sample_without_the_token_member_is_a_counted_bad_sample_when_packing(tmp_path):
    """Found by tests/fuzz.py ("mixed"): a sample without the dataset's .npy member was a KeyError (or
    'list' ... 'clone') inside the packer."""
    tmp_path.mkdir(exist_ok=True)
    with wds.TarWriter(str(tmp_path / "d-000000.tar")) as w:
        for i in range(6):
            member = (
                {"flac": flac_bytes(800, 8000)}
                if i == 2
                else {"tokens.npy": loader_util.npy_bytes(np.arange(1, 5, dtype=np.uint16))}
            )
            w.write({"__key__": f"k{i}", **member})
    loader_util.index_dir(tmp_path)
    cfg = {
        "datasets": [{"path": str(tmp_path)}],
        "batch_size": 2,
        "epochs": 1,
        "num_workers": 0,
        "shuffle": False,
        "seq_len": 8,
        "packing": "greedy",
        "max_bad_samples": 0,
    }
    with pytest.raises(SampleDecodeError, match=r"key 'k2', member 'tokens\.npy': no tokens\.npy member"):
        list(build_loader(cfg))
    assert sum(b["num_docs"] for b in build_loader({**cfg, "max_bad_samples": 1})) == 5


# --- issue 16: shards that shrink under a running loader, loader states for other data --------------------


def _loader_cfg(root, **kw):
    return {
        "datasets": [{"path": str(root)}],
        "batch_size": 4,
        "epochs": 1,
        "num_workers": 0,
        "shuffle": False,
        "max_bad_samples": 0,
        **kw,
    }


@pytest.mark.parametrize("workers", [0, 2])
def test_shard_truncated_under_the_loader_is_its_error_not_sigbus(tmp_path, workers):
    """Used to die of SIGBUS with no message (num_workers 0) or report "workers are out of shared memory"."""
    import itertools
    import os

    from tests import loader_util
    from headrace.dataio import build_loader

    # shard 0 long enough (500 batches) that workers reading a task of several batches ahead are still in it
    loader_util.make_text_dataset(tmp_path, [2000, 40])
    loader = build_loader(_loader_cfg(tmp_path, num_workers=workers, prefetch=1))
    it = iter(loader)
    next(it)
    os.truncate(tmp_path / "doc-000000.tar", 4096)  # the shard being read (mapped in this process or a worker)
    # a worker may not have mapped it yet: then the open-time size check names it
    shrank = r"shard shrank to 4096 bytes while mapped" + ("" if workers == 0 else r"|truncated shard: 4096 bytes")
    with pytest.raises(SampleDecodeError, match=rf"doc-000000\.tar'?: ({shrank})"):
        list(itertools.islice(it, 600))


def test_state_of_a_dataset_rebuilt_in_place_with_the_same_count_is_refused(tmp_path):
    from tests import loader_util
    from headrace.dataio import build_loader
    from headrace.dataio.loader_state import StateError

    loader_util.make_text_dataset(tmp_path / "d", [10, 10], seed=0)
    loader = build_loader(_loader_cfg(tmp_path / "d"))
    next(iter(loader))
    state = loader.state_dict()
    copy = tmp_path / "copy"

    shutil.copytree(tmp_path / "d", copy)  # the same data elsewhere: still this state's data
    build_loader(_loader_cfg(copy)).load_state_dict(state)
    loader_util.make_text_dataset(tmp_path / "d", [10, 10], seed=1)  # rebuilt in place: 20 other samples
    with pytest.raises(StateError, match="comes from other data"):
        build_loader(_loader_cfg(tmp_path / "d")).load_state_dict(state)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("consumed", -50, "'consumed' must be a non-negative integer, got -50"),  # was numpy's message
        ("consumed", "12", "'consumed' must be a non-negative integer, got '12'"),
        ("bad_samples", 1.5, "'bad_samples' must be a non-negative integer"),
        ("dp_size", 0, "'dp_size' must be an integer above dp_rank 0, got 0"),
        ("layout", None, "'layout' must be a mapping"),
        ("seed", -1, "'seed' must be a non-negative integer, got -1"),  # found by the fuzzer: numpy's message
        ("bad_samples", 1, "already counts 1 bad samples, over max_bad_samples=0"),  # fuzzer: "see the warnings"
        (
            "layout",
            {"start": 0, "dp_size": 1, "skips": [{"start": 0, "dp_size": 2, "consumed": [1]}]},
            "'layout' must be a mapping of start",
        ),
    ],
)
def test_hand_edited_loader_state_names_the_field(tmp_path, field, value, message):
    from tests import loader_util
    from headrace.dataio import build_loader
    from headrace.dataio.loader_state import StateError

    loader_util.make_text_dataset(tmp_path, [8])
    state = build_loader(_loader_cfg(tmp_path)).state_dict()
    state[field] = value
    with pytest.raises(StateError, match=rf"loader state 0: {message}"):
        build_loader(_loader_cfg(tmp_path)).load_state_dict(state)


def test_worker_killed_by_sigbus_is_the_shrunk_shards_error(tmp_path, monkeypatch):
    """A worker that dies of SIGBUS (the shard shrank between the size check and the copy) is reported
    as the shard's error, not as the signal: the main process stats the shards once a worker dies so."""
    import faulthandler
    import os
    import signal

    from tests import loader_util
    from headrace.dataio import build_loader
    from headrace.dataio.stream.reading.batches import BatchMaker
    from headrace.dataio.stream.sources.storage import ShardFormatError

    loader_util.make_text_dataset(tmp_path, [40, 40])
    made = BatchMaker.__call__

    def truncate_then_die(self, b, alloc):  # forked workers inherit the patch
        if b == 3:
            os.truncate(tmp_path / "doc-000001.tar", 4096)
            faulthandler.disable()  # pytest's handler, inherited by the fork, would print every module's name
            os.kill(os.getpid(), signal.SIGBUS)
        return made(self, b, alloc)

    monkeypatch.setattr(BatchMaker, "__call__", truncate_then_die)
    loader = build_loader(_loader_cfg(tmp_path, num_workers=2, prefetch=1))
    with pytest.raises(ShardFormatError, match=r"doc-000001\.tar.*truncated shard: 4096 bytes"):
        list(loader)
