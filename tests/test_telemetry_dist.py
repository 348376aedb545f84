"""Compute stragglers show in the per-rank telemetry: 2 gloo ranks, one made slower in its forward, named by
every rank's record (tests/dist/straggler.py)."""

from __future__ import annotations

from tests.helpers import torchrun


def test_slow_rank_is_named_the_compute_straggler(tmp_path):
    slow_rank = 1  # not rank 0, which writes the logs
    out = torchrun(2, "tests.dist.straggler", tmp_path, slow_rank, timeout=300).stdout
    assert out.count("OK straggler named") == 2, out[-3000:]
