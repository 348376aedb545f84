"""headrace.dataio.feed.prefetch: same batches as the input, data-wait accounting, CUDA stream path on a GPU."""

import threading
import time

import pytest
import torch

from headrace.dataio.feed.prefetch import DevicePrefetcher, pin, tree_map

CUDA = torch.cuda.is_available()


def batches(n, sleep=0.0):
    for i in range(n):
        if sleep:
            time.sleep(sleep)
        yield {
            "input_ids": torch.arange(i, i + 64).view(2, 32),
            "cu_seqlens": torch.tensor([0, 32, 64], dtype=torch.int32),
            "meta": {"fill": 0.5 + i / 100, "__key__": [f"k{i}"]},
            "pair": (torch.full((3,), float(i)), i),
        }


def assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


class _GatedSource:
    """Batch 0 at once; batch i >= 1 only once ``gates[i]`` is set, and ``produced[i]`` set as it is handed out:
    the test, not the scheduler, decides when the loader is slow and observes when it ran ahead. Timing
    assertions on sleeps failed under load (the read-ahead thread scheduled late); these are orderings."""

    def __init__(self, n: int, *, gated: bool):
        self.gates = [threading.Event() for _ in range(n)]
        self.produced = [threading.Event() for _ in range(n)]
        for gate in self.gates[: 1 if gated else n]:
            gate.set()

    def __iter__(self):
        for i, (gate, produced) in enumerate(zip(self.gates, self.produced)):
            assert gate.wait(TIMEOUT_S), f"the test never opened gate {i}"
            produced.set()
            yield next(batches(1)) | {"i": i}


TIMEOUT_S = 30.0  # a bound on a hang, never reached when the code is right


def test_cpu_pass_through_yields_the_same_batches_and_measures_wait():
    got = list(DevicePrefetcher(batches(6), "cpu"))
    for a, b in zip(got, batches(6), strict=True):
        assert_same(a, b)
    # each wait is the time the consumer was blocked in next(): a batch gated for 200 ms after the call
    # began is waited for nearly that (100 ms allowed for the scheduler between the timer's start and
    # next() reading its clock), and never longer than the call itself
    source = _GatedSource(4, gated=True)
    prefetcher = DevicePrefetcher(source, "cpu")
    assert next(prefetcher)["i"] == 0
    for i in range(1, 4):
        opener = threading.Timer(0.2, source.gates[i].set)
        called = time.perf_counter()
        opener.start()
        assert next(prefetcher)["i"] == i
        returned = time.perf_counter()
        assert 0.1 <= prefetcher.waits[i] <= returned - called
    with pytest.raises(StopIteration):
        next(prefetcher)
    stats = prefetcher.stats()
    assert stats["batches"] == 4 and len(prefetcher.waits) == 4
    assert 3 * 0.1 <= stats["wait_s"] <= stats["elapsed_s"] and 0 < stats["wait_fraction"] <= 1.0


def test_wait_fraction_drops_when_the_consumer_is_the_bottleneck():
    """A step that lasts >= 20 ms and until the loader has read two batches ahead: the next batch is
    queued before it is asked for, so the consumer hardly waits."""
    source = _GatedSource(6, gated=False)
    prefetcher = DevicePrefetcher(source, "cpu")
    for batch in prefetcher:
        time.sleep(0.02)
        ahead = min(batch["i"] + 2, 5)
        assert source.produced[ahead].wait(TIMEOUT_S)
    assert prefetcher.stats()["wait_fraction"] < 0.5


def test_tree_map_and_pin_keep_structure():
    b = next(batches(1))
    assert_same(tree_map(lambda t: t.clone(), b), b)
    if CUDA:
        assert pin(b)["input_ids"].is_pinned()
    with pytest.raises(ValueError, match="depth"):
        DevicePrefetcher([], "cpu", depth=0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("depth", [1, 3])
def test_cuda_prefetch_same_batches_on_device(depth):
    prefetcher = DevicePrefetcher(batches(20), "cuda", depth=depth)
    got = []
    for batch in prefetcher:
        assert batch["input_ids"].is_cuda and batch["meta"]["__key__"][0].startswith("k")
        # use the batch on the consumer stream, as a training step would
        got.append(tree_map(lambda t: (t * 1).cpu(), batch))
    for a, b in zip(got, batches(20), strict=True):
        assert_same(a, b)
    assert prefetcher.stats()["batches"] == 20 and not prefetcher._thread.is_alive()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_prefetch_surfaces_loader_errors():
    def broken():
        yield from batches(2)
        raise OSError("shard-000003.tar: truncated")

    prefetcher = DevicePrefetcher(broken(), "cuda")
    with pytest.raises(OSError, match="truncated"):
        list(prefetcher)


class _CountingSource:
    """An iterable with a state_dict, like the loader: the state counts batches pulled."""

    def __init__(self, n: int):
        self.n, self.pulled = n, 0

    def __iter__(self):
        while self.pulled < self.n:
            self.pulled += 1
            yield {"x": torch.full((2,), self.pulled)}

    def state_dict(self):
        return {"pulled": self.pulled}


def test_state_is_that_of_the_last_delivered_batch():
    prefetcher = DevicePrefetcher(_CountingSource(4), "cpu")
    assert prefetcher.state_dict() == {"pulled": 0}
    for i, batch in enumerate(prefetcher, start=1):
        assert prefetcher.state_dict() == {"pulled": int(batch["x"][0])} == {"pulled": i}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_state_lags_read_ahead():
    source = _CountingSource(6)
    prefetcher = DevicePrefetcher(source, "cuda", depth=2)
    first = next(prefetcher)
    deadline = time.monotonic() + TIMEOUT_S
    while source.pulled < 2 and time.monotonic() < deadline:  # let the pinning thread read ahead
        time.sleep(0.01)
    assert source.pulled > 1
    assert prefetcher.state_dict() == {"pulled": int(first["x"][0].item())} == {"pulled": 1}


def test_cpu_read_ahead_overlaps_the_loader_with_the_step():
    """The loader's work runs in the read-ahead thread while the consumer computes: holding batch i, without
    asking for more, the consumer sees the source produce batch i + 1 (a pass-through never would)."""
    source = _GatedSource(5, gated=False)
    prefetcher = DevicePrefetcher(source, "cpu")
    for batch in prefetcher:
        if batch["i"] < 4:
            assert source.produced[batch["i"] + 1].wait(TIMEOUT_S), f"batch {batch['i'] + 1} was not read ahead"


def test_bookkeeping_entries_are_not_walked():
    docs = [[(1, 0, 5)], [(2, 0, 3)]]
    batch = {"input_ids": torch.zeros(2, 4), "__docs__": docs}
    seen = []
    out = tree_map(lambda t: seen.append(t) or t, batch)
    assert out["__docs__"] is docs and len(seen) == 1


def test_first_batch_is_pulled_in_the_callers_thread():
    """Loaders fork their workers on the first batch: that must happen in the constructing thread."""
    import threading

    pulled_in = []

    def source():
        for i in range(3):
            pulled_in.append(threading.current_thread())
            yield {"x": torch.tensor([i])}

    prefetcher = DevicePrefetcher(source(), "cpu")
    assert pulled_in[0] is threading.current_thread()
    assert [int(b["x"]) for b in prefetcher] == [0, 1, 2]
    assert all(t is not threading.current_thread() for t in pulled_in[1:])
