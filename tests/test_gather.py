"""The batch-level token path (``headrace.dataio.stream.reading.gather``) yields exactly the batch of the general
per-sample path, and hands anything it does not fully check back to that path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from headrace.dataio.stagetimes import TIMES
import webdataset as wds

from headrace.dataio.config import DataConfig
from headrace.config import from_dict
from headrace.dataio.stream.reading.batches import SampleReader
from headrace.dataio.stream.ordering.refs import make_ref
from headrace.dataio.stream.reading.collate import collate, plain_memory
from headrace.dataio.stream.reading.gather import gather_tokens, tokens_only
from headrace.dataio.stream.sources.shard_source import ShardSource

from tests.loader_util import index_dir, npy_bytes


def token_tars(root: Path, lengths: list[list[int]], dtype=np.int32, prefix="t") -> None:
    """One tar per entry of ``lengths``, one ``tokens.npy`` member a sample (first token = sample number)."""
    root.mkdir(parents=True, exist_ok=True)
    n = 0
    for shard, sizes in enumerate(lengths):
        with wds.TarWriter(str(root / f"{prefix}-{shard:06d}.tar")) as w:
            for size in sizes:
                w.write({"__key__": f"{prefix}{n:05d}", "tokens.npy": npy_bytes(np.arange(size, dtype=dtype) + n)})
                n += 1
    index_dir(root)


def general(sources, refs):
    """The per-sample path's batch of ``refs`` (what BatchMaker made before the batch-level path)."""
    cfg = from_dict(DataConfig, {"datasets": [{"path": s.path} for s in sources]}, "data")
    samples, keys, kept, bad = SampleReader(cfg, sources, bad_so_far=0).read(refs, defer_npy=True)
    assert bad == 0 and len(kept) == len(refs)
    return collate(
        samples, keys, torch.from_numpy(refs), torch.ones(len(refs), dtype=torch.bool), end=7, alloc=plain_memory
    )


def assert_same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        if k == TIMES:  # the stages' seconds: a measurement of this run, not the batch's content
            continue
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        elif isinstance(a[k], dict):
            assert_same(a[k], b[k])
        else:
            assert a[k] == b[k], k


def test_same_batch_as_the_general_path(tmp_path):
    rng = np.random.default_rng(0)
    token_tars(tmp_path / "a", [rng.integers(0, 300, 40).tolist(), rng.integers(0, 300, 25).tolist()])
    token_tars(tmp_path / "b", [[5] * 30], prefix="u")  # equal lengths: a (B, L) batch
    token_tars(tmp_path / "c", [[4, 9, 1000000]], dtype=np.int64, prefix="w")  # 7-digit count, other dtype
    a, b, c = (ShardSource(str(tmp_path / n)) for n in "abc")
    assert tokens_only([a, b])
    cases = [
        ([a], make_ref(0, np.arange(65))),  # across both shards
        ([a], make_ref(0, rng.permutation(65)[:32])),  # shuffled
        ([a, b], make_ref(rng.integers(0, 2, 40), rng.integers(0, 25, 40))),  # blended, interleaved
        ([b], make_ref(0, np.arange(8))),
        ([c], make_ref(0, np.arange(3))),
    ]
    for sources, refs in cases:
        batch = gather_tokens(sources, refs, 7, plain_memory)
        assert batch is not None
        assert_same(batch, general(sources, refs))
    assert gather_tokens([b], make_ref(0, np.arange(8)), 7, plain_memory)["tokens.npy"].shape == (8, 5)
    # mixed dtypes across datasets: the general path's business
    assert gather_tokens([a, c], make_ref(np.array([0, 1]), np.array([0, 0])), 7, plain_memory) is None


@pytest.mark.parametrize("damage", ["pickle dtype", "shape", "magic", "key", "padding"])
def test_anything_not_checked_goes_the_general_way(tmp_path, damage):
    token_tars(tmp_path, [[3, 4, 5]])
    tar = tmp_path / "t-000000.tar"
    data = bytearray(tar.read_bytes())
    at = data.index(b"\x93NUMPY", data.index(b"t00001."))  # the second sample's member
    if damage == "pickle dtype":
        data[at : at + 30] = data[at : at + 30].replace(b"'<i4'", b"'|O4'")
    elif damage == "shape":
        data[at : at + 90] = data[at : at + 90].replace(b"(4,)", b"(2,)")
    elif damage == "magic":
        data[at + 1] = ord("X")
    elif damage == "padding":  # the header's last padding byte (before its newline): the end of a word compare
        data[data.index(b"\n", at) - 1] = ord("x")
    else:
        k = data.index(b"t00001.")
        data[k + 5] = ord("9")
    tar.write_bytes(bytes(data))
    source = ShardSource(str(tmp_path))
    assert gather_tokens([source], make_ref(0, np.arange(3)), 3, plain_memory) is None
    intact = make_ref(0, np.array([0, 2]))  # only the damaged sample is left to the general path
    assert_same(gather_tokens([source], intact, 7, plain_memory), general([source], intact))
    # every damage, a shape shorter than the payload included (bytes beyond the shape are refused as in
    # `dataio verify`), is an error of the general path naming the sample
    with pytest.raises(Exception, match="t00001"):  # and the general path names the sample
        general([source], make_ref(0, np.arange(3)))


def test_expected_headers_are_the_canonical_bytes():
    """The column-wise headers equal ``prefix + count + ",), }"`` padded, for counts of every digit count."""
    from headrace.dataio.stream.reading.gather import _expected_headers

    prefix, data = b"\x93NUMPY\x01\x00v\x00{'descr': '<i4', 'fortran_order': False, 'shape': (", 80
    rng = np.random.default_rng(0)
    counts = np.concatenate([rng.integers(0, 10**k, 50) for k in range(1, 19)] + [10 ** np.arange(19), [-3]])
    headers, fits = _expected_headers(prefix, counts, data)
    for c, row, fit in zip(counts.tolist(), headers, fits.tolist()):
        want = (b"%s%d,), }" % (prefix, c)).ljust(data - 1) + b"\n"
        assert fit == (len(want) == data and c >= 0), c
        if fit:
            assert row.tobytes() == want, c
    room = data - 1 - len(prefix) - len(b",), }")  # digits that fit
    assert (fits == ((counts >= 0) & (counts < 10**room))).all() and 0 < room < 18


def test_forked_processes_share_the_checks(tmp_path):
    """A sample checked in a forked process (a loader worker) is checked for its parent and siblings too:
    the table lives in shared memory, so each sample is checked once per loader, not once per process;
    a batch checks only its own samples (lazy: not the blocks around them)."""
    import os

    from headrace.dataio.stream.reading.gather import BLOCK, UNCHECKED, checked

    token_tars(tmp_path / "a", [[3] * (BLOCK + 50)])
    source = ShardSource(str(tmp_path / "a"))
    table = checked(source)  # made before the fork, as the loader's first batch makes it
    pid = os.fork()
    if pid == 0:  # checks the three samples asked for, nothing else
        refs = make_ref(0, np.array([5, BLOCK + 7, BLOCK + 9]))
        os._exit(0 if gather_tokens([source], refs, end=3, alloc=plain_memory) is not None else 1)
    assert os.waitpid(pid, 0)[1] == 0
    assert np.flatnonzero(table.code != UNCHECKED).tolist() == [5, BLOCK + 7, BLOCK + 9]  # the child's, seen here
    refs = make_ref(0, np.arange(BLOCK - 4, BLOCK + 50))
    assert_same(gather_tokens([source], refs, end=7, alloc=plain_memory), general([source], refs))


def test_known_blocks_are_read_without_the_lock(tmp_path, monkeypatch):
    """Once this process has seen (under the lock) every block of a batch finished, the batch takes no
    lock; once every block is, and all samples hold one dtype, no per-sample dtype test either
    (``uniform``). The batches stay the general path's."""
    import fcntl

    from headrace.dataio.stream.reading.gather import BLOCK, FIRST_DTYPE_CODE, TOKEN_DTYPES, checked

    token_tars(tmp_path / "a", [[3, 5, 7] * ((BLOCK + 100) // 3)])
    source = ShardSource(str(tmp_path / "a"))
    locks = []
    real = fcntl.lockf
    monkeypatch.setattr(fcntl, "lockf", lambda fd, op: (locks.append(op), real(fd, op))[1])
    gather_tokens([source], make_ref(0, np.arange(BLOCK)), 3, plain_memory)  # checks block 0
    table, taken = checked(source), len(locks)
    assert taken > 0 and table.uniform is None
    refs = make_ref(0, np.arange(BLOCK - 9, BLOCK - 1))
    assert_same(gather_tokens([source], refs, 7, plain_memory), general([source], refs))
    assert len(locks) == taken  # block 0 known here: read without the lock
    refs = make_ref(0, np.array([BLOCK + 3, 4, BLOCK + 50]))  # block 1: these two samples checked, not the block
    assert_same(gather_tokens([source], refs, 7, plain_memory), general([source], refs))
    assert len(locks) > taken and table.uniform is None and (table.code[BLOCK:] != 0).sum() == 2
    refs = make_ref(0, np.arange(BLOCK, len(source))[::-1].copy())  # the rest of block 1: everything known
    assert_same(gather_tokens([source], refs, 7, plain_memory), general([source], refs))
    assert TOKEN_DTYPES[table.uniform - FIRST_DTYPE_CODE] == np.dtype("<i4")
    taken = len(locks)
    refs = make_ref(0, np.array([BLOCK + 60, 2, BLOCK + 1]))
    assert_same(gather_tokens([source], refs, 7, plain_memory), general([source], refs))
    assert len(locks) == taken


def test_a_task_made_at_once_is_batch_by_batch_what_make_batch_gives(tmp_path):
    """``BatchMaker.task`` (a worker's task of token batches from one gather) gives each batch as
    ``BatchMaker.__call__`` makes it -- (B, L) where a batch's lengths agree, flat + lengths where not,
    blended datasets, the short last batch -- and None where a batch must go the general way (a bad
    sample); through 2 workers the loader's batches and state are those of one process."""
    from headrace.dataio.loader import build_loader
    from headrace.dataio.stream.reading.batches import BatchMaker

    rng = np.random.default_rng(1)
    token_tars(tmp_path / "a", [rng.integers(1, 60, 70).tolist()])
    token_tars(tmp_path / "b", [[6] * 50], prefix="u")  # batches drawn only from here are (B, 6)
    cfg = {
        "datasets": [{"path": str(tmp_path / "a")}, {"path": str(tmp_path / "b"), "weight": 4.0}],
        "batch_size": 3,
        "epochs": 1,
        "shuffle": True,
        "shuffle_window": 16,
        "num_workers": 0,
    }
    stream = build_loader(cfg, dp_rank=0, dp_size=1).stream
    maker = BatchMaker(
        reader=stream.reader(),
        blend=stream.blend,
        seed=stream.seeds,
        layout=stream.layout,
        dp_rank=0,
        first_local=0,
        batch_size=3,
    )
    last = stream.num_batches(3)
    shapes = set()
    for first in range(0, last, 3):
        count = min(4, last - first)
        task = maker.task(first, count, plain_memory)
        assert task is not None and len(task) == count
        for b, batch in enumerate(task, first):
            assert_same(batch, maker(b, plain_memory))
            shapes.add(batch["tokens.npy"].ndim)
    assert shapes == {1, 2} and len(maker(last - 1, plain_memory)["__key__"]) < 3  # both layouts, a short tail

    one, two = (build_loader({**cfg, "num_workers": n}) for n in (0, 2))
    for x, y in zip(one, two, strict=True):
        assert_same({k: v for k, v in x.items()}, {k: y[k] for k in x})
    assert one.state_dict() == two.state_dict()

    tar = tmp_path / "a" / "t-000000.tar"
    data = bytearray(tar.read_bytes())
    data[data.index(b"\x93NUMPY", data.index(b"t00005.")) + 1] = ord("X")  # sample 5's magic
    tar.write_bytes(bytes(data))
    stream = build_loader({**cfg, "datasets": cfg["datasets"][:1], "shuffle": False}, dp_rank=0, dp_size=1).stream
    maker = BatchMaker(
        reader=stream.reader(),
        blend=stream.blend,
        seed=stream.seeds,
        layout=stream.layout,
        dp_rank=0,
        first_local=0,
        batch_size=3,
    )
    assert maker.task(0, 2, plain_memory) is None  # batch 1 holds sample 5: the general path names it
    assert maker.task(2, 2, plain_memory) is not None
