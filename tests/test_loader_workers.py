"""Worker processes: batches come back in order for any worker count; a dead or hung worker, or an
exception in one, is an error in the main process."""

import faulthandler
import os
import signal
import time

import pytest
import torch

from headrace.dataio.stream.reading.workers import RankBatches, SharedRing, iterate


def make_batch(b, alloc):
    return {"b": b, "x": torch.full((3,), b)}


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_batches_in_order_whatever_the_worker_count(workers):
    batches = RankBatches(make_batch, first=0, last=10, seed=0, dp_rank=0, epoch=0)
    out = list(iterate(batches, num_workers=workers, prefetch=2, pin_memory=False, timeout=30 if workers else 0))
    assert [b["b"] for b in out] == list(range(10))
    assert all(torch.equal(b["x"], torch.full((3,), i)) for i, b in enumerate(out))


def die_at_3(b, alloc):
    if b == 3:
        os._exit(1)
    return make_batch(b, alloc)


def hang_at_2(b, alloc):
    if b == 2:
        time.sleep(60)
    return make_batch(b, alloc)


def test_crashed_worker_is_an_error_in_the_main_process():
    batches = RankBatches(die_at_3, first=0, last=None, seed=0, dp_rank=0, epoch=0)
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        for _ in iterate(batches, num_workers=2, prefetch=1, pin_memory=False, timeout=30):
            pass


def test_hung_worker_is_an_error_within_the_timeout():
    batches = RankBatches(hang_at_2, first=0, last=None, seed=0, dp_rank=0, epoch=0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        for _ in iterate(batches, num_workers=2, prefetch=1, pin_memory=False, timeout=2):
            pass
    assert time.monotonic() - start < 30


def ring_batch(b, alloc):
    x = alloc((1000 + 300 * (b % 4),), torch.int64)  # b % 4 == 3: 1.9x the nominal 8 KB, still in the ring
    x.fill_(b)
    y = alloc((4, 3), torch.int32)
    y.copy_(torch.arange(12, dtype=torch.int32).view(4, 3) + b)
    return {"b": b, "x": x, "lengths": {"x": torch.tensor([b])}, "strided": y.t()}


@pytest.mark.parametrize("prefetch,last", [(1, 40), (3, 37)])
def test_ring_bytes_are_reused_without_overwriting_unread_batches(prefetch, last):
    batches = RankBatches(ring_batch, first=0, last=last, seed=0, dp_rank=0, epoch=0)
    out = list(iterate(batches, num_workers=2, prefetch=prefetch, pin_memory=False, timeout=30, batch_bytes=8_000))
    assert batches.ring.per_task == 8  # tasks of 8 batches (the last one short with last=37), in order
    assert [b["b"] for b in out] == list(range(last))
    for b in out:  # checked after all were made, so the ring's bytes were reused many times meanwhile
        assert b["x"].shape == (1000 + 300 * (b["b"] % 4),) and bool((b["x"] == b["b"]).all())
        assert b["lengths"]["x"].tolist() == [b["b"]]  # a nested small tensor, by value
        assert torch.equal(b["strided"], (torch.arange(12, dtype=torch.int32).view(4, 3) + b["b"]).t())


def test_ring_batches_are_views_whose_bytes_come_back_once_dropped():
    """Batches the consumer drops give their bytes back (the same memory serves later batches, with no
    copy in the main process), batches up to twice the nominal size included; batches it keeps are
    never overwritten."""
    batches = RankBatches(ring_batch, first=0, last=60, seed=0, dp_rank=0, epoch=0)
    kept, in_ring = [], 0
    for batch in iterate(batches, num_workers=2, prefetch=2, pin_memory=False, timeout=30, batch_bytes=8_000):
        ring = batches.ring
        in_ring += ring.base <= batch["x"].data_ptr() < ring.base + len(ring.array)
        if batch["b"] % 7 == 0:
            kept.append(batch)
        del batch
    # the first batch is made in this process; every later one, big or not, finds room in a ring
    assert in_ring == 59
    assert [b["b"] for b in kept] == list(range(0, 60, 7))
    assert all(bool((b["x"] == b["b"]).all()) for b in kept)


def test_ring_takes_the_lowest_free_bytes_and_gives_them_back_in_any_order():
    n = 4 << 20  # the nominal batch: one batch a task, so the ring holds (prefetch + 3) of them
    ring = SharedRing(num_workers=1, prefetch=1, batch_bytes=n)
    assert ring.per_task == 1 and ring.region == 4 * n

    def batch(nbytes):
        ring.begin_batch(0)
        ring.alloc((nbytes,), torch.uint8)
        return ring.finish_batch()

    a, b, c = batch(n), batch(2 * n), batch(n)  # twice the nominal size: still a batch of the ring
    assert [h[1:] for h in (a, b, c)] == [(0, n), (n, 3 * n), (3 * n, 4 * n)]
    assert batch(64) is None  # full: the caller's allocator falls back to shared memory
    ring.released[b[0]] = 1  # the consumer dropped the middle batch first
    d = batch(n // 2)
    assert d[1:] == (n, n + n // 2)  # the lowest gap that holds it
    ring.released[a[0]] = 1
    assert batch(n)[1:] == (n + n // 2, 2 * n + n // 2)  # the first gap, exactly n, leaves no slack
    assert batch(n // 2)[1:] == (0, n // 2)
    assert batch(4 * n + 1) is None  # more than the whole ring
    assert ring.tickets == 16 and ring.released.sum() == 16 - 4  # c, d and the last two are out


def test_a_cancelled_piece_gives_its_bytes_back():
    """A task the worker abandons after carving bytes (``make_task`` found a batch for the general path)
    leaves no bytes out: the next piece takes the same ones."""
    ring = SharedRing(num_workers=1, prefetch=1, batch_bytes=1 << 20)
    ring.begin_batch(0)
    ring.alloc((1000,), torch.int64)
    ring.cancel_batch()
    ring.begin_batch(0)
    ring.alloc((1000,), torch.int64)
    assert ring.finish_batch()[1:] == (0, 8000)
    assert ring.released.sum() == ring.tickets - 1  # only the piece just made is out


def pid_batch(b, alloc):
    import numpy as np

    return {"b": b, "pid": os.getpid(), "keys": [f"k{b}"], "array": np.arange(4)}


@pytest.mark.parametrize("first_here", [True, False])
def test_first_batch_is_made_before_the_fork_unless_told_not_to(first_here):
    batches = RankBatches(pid_batch, first=5, last=12, seed=0, dp_rank=0, epoch=0)
    out = list(iterate(batches, num_workers=2, prefetch=2, pin_memory=False, timeout=30, first_here=first_here))
    assert [b["b"] for b in out] == list(range(5, 12))
    assert (out[0]["pid"] == os.getpid()) is first_here
    assert all(b["pid"] != os.getpid() for b in out[1:])


def test_a_one_batch_stream_starts_no_worker():
    batches = RankBatches(pid_batch, first=3, last=4, seed=0, dp_rank=0, epoch=0)
    out = list(iterate(batches, num_workers=2, prefetch=2, pin_memory=False, timeout=30))
    assert [(b["b"], b["pid"]) for b in out] == [(3, os.getpid())]


def test_workers_hand_back_the_batch_as_made():
    """No conversion on the way (torch's default ``collate_fn`` would turn the numpy array into a
    tensor and walk every key): a worker's batch is what ``make_batch`` returned, as without workers."""
    batches = RankBatches(pid_batch, first=0, last=6, seed=0, dp_rank=0, epoch=0)
    for b in iterate(batches, num_workers=2, prefetch=2, pin_memory=False, timeout=30):
        assert b["keys"] == [f"k{b['b']}"]
        assert type(b["array"]).__name__ == "ndarray" and b["array"].tolist() == [0, 1, 2, 3]


def bad_sample_at_4(b, alloc):
    from headrace.dataio.usererror import SampleDecodeError

    if b == 4:
        raise SampleDecodeError("bad header", shard="s-000001.tar", key="k42", member="tokens.npy")
    return make_batch(b, alloc)


def unpicklable_at_2(b, alloc):
    return {"b": b, "f": (lambda: b) if b == 2 else None}


def sigbus_at_3(b, alloc):
    if b == 3:
        faulthandler.disable()  # pytest's handler, inherited by the fork, would print every module's name
        os.kill(os.getpid(), signal.SIGBUS)
    return make_batch(b, alloc)


def test_a_worker_exception_is_re_raised_as_itself_and_a_signal_is_named():
    """The main process re-raises a worker's exception with its type and attributes (the sample named),
    the worker's traceback attached; a worker killed by a signal is reported with the signal's name
    (SIGBUS: "Bus error", which ``RankStream.explain_worker_crash`` turns into the shard's error)."""
    from headrace.dataio.usererror import SampleDecodeError

    batches = RankBatches(bad_sample_at_4, first=0, last=None, seed=0, dp_rank=0, epoch=0)
    with pytest.raises(SampleDecodeError, match="k42") as caught:
        for _ in iterate(batches, num_workers=2, prefetch=1, pin_memory=False, timeout=30):
            pass
    assert (caught.value.shard, caught.value.key, caught.value.member) == ("s-000001.tar", "k42", "tokens.npy")
    assert any("bad_sample_at_4" in note for note in caught.value.__notes__)
    batches = RankBatches(unpicklable_at_2, first=0, last=None, seed=0, dp_rank=0, epoch=0)
    with pytest.raises(Exception, match="lambda") as caught:  # a batch that cannot be sent: pickle's own error
        for _ in iterate(batches, num_workers=2, prefetch=1, pin_memory=False, timeout=30):
            pass
    assert any("raised in worker 1" in note for note in caught.value.__notes__)  # batch 2: task 1 (batch 0 made here)
    batches = RankBatches(sigbus_at_3, first=0, last=None, seed=0, dp_rank=0, epoch=0)
    with pytest.raises(RuntimeError, match=r"exited unexpectedly \(killed by signal SIGBUS: Bus error\)"):
        for _ in iterate(batches, num_workers=2, prefetch=1, pin_memory=False, timeout=30):
            pass


def test_stopping_early_ends_every_worker():
    """A consumer that stops (or breaks out with an error) leaves no worker behind, whatever it held."""
    import multiprocessing

    before = {p.pid for p in multiprocessing.active_children()}
    batches = RankBatches(ring_batch, first=0, last=None, seed=0, dp_rank=0, epoch=0)
    stream = iterate(batches, num_workers=2, prefetch=2, pin_memory=False, timeout=30, batch_bytes=8_000)
    held = [next(stream) for _ in range(30)]  # more than the ring holds: later ones by torch's handles
    assert [b["b"] for b in held] == list(range(30)) and all(bool((b["x"] == b["b"]).all()) for b in held)
    stream.close()
    assert {p.pid for p in multiprocessing.active_children()} == before
