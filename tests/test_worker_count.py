"""``num_workers: auto`` (headrace.dataio.worker_count): it resolves to the count a short measurement finds
faster (the timing source replaced, so the decision is asserted, never a timing), and the loader is then
exactly the loader of that count (batches, state, resume); one usable core means 0 without a worker; a bad
value is a one-line config error through build_loader, the trainer and ``dataio bench``."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from headrace.config import ConfigError
from headrace.dataio import build_loader, worker_count
from headrace.dataio.stream.reading import workers

from tests.loader_util import make_text_dataset
from tests.test_loader import cfg, keys_of


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    return root, make_text_dataset(root, [7, 5, 3, 1, 6])


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    """Each test measures afresh (the choice is otherwise kept per process and config)."""
    monkeypatch.setattr(worker_count, "_chosen", {})
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


class StepClock:
    """A ``perf_counter`` that moves ``slow`` seconds per reading while the slower setting runs (worker
    processes alive or not), ``fast`` otherwise: samples/s then follow from batches per reading."""

    def __init__(self, slow_with_workers: bool, fast: float = 0.01, slow: float = 0.03):
        self.slow_with_workers, self.fast, self.slow, self.now = slow_with_workers, fast, slow, 0.0
        self.before = set(multiprocessing.active_children())  # an earlier test's child still exiting is not ours

    def __call__(self) -> float:
        with_workers = bool(set(multiprocessing.active_children()) - self.before)
        self.now += self.slow if with_workers == self.slow_with_workers else self.fast
        return self.now


@pytest.mark.parametrize("slower, chosen", [("workers", 0), ("one process", worker_count.WORKERS)])
def test_auto_picks_the_faster_count_then_is_that_count(text, monkeypatch, slower, chosen):
    root, _ = text
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(worker_count, "perf_counter", StepClock(slow_with_workers=slower == "workers"))
    config = cfg(root, epochs=2, num_workers="auto")
    auto = build_loader(config)
    choice = auto.worker_choice
    assert auto.cfg.num_workers == choice.num_workers == chosen
    assert set(choice.rates) == {0, worker_count.WORKERS} and min(choice.rates.values()) > 0
    assert f"auto -> {chosen} (one process" in choice.line()
    written = build_loader({**config, "num_workers": chosen})
    assert written.worker_choice is None
    first = keys_of(auto, limit=3)
    assert first == keys_of(written, limit=3) and auto.state_dict() == written.state_dict()
    # resume: the auto loader's state continues under the other count, and under auto again (kept: no measuring)
    other = build_loader({**config, "num_workers": worker_count.WORKERS - chosen})
    again = build_loader(config)
    assert again.worker_choice is choice
    for resumed in (other, again):
        resumed.load_state_dict(auto.state_dict())
        assert first + keys_of(resumed) == keys_of(build_loader({**config, "num_workers": 0}))


def test_ties_go_to_one_process():
    assert worker_count.pick({0: 100.0, 2: 104.0}) == 0
    assert worker_count.pick({0: 100.0, 2: 106.0}) == 2
    assert worker_count.pick({0: 100.0, 2: 60.0}) == 0


@pytest.mark.parametrize("cores, ranks", [(1, 1), (2, 2)])
def test_one_usable_core_is_one_process_without_measuring(text, monkeypatch, cores, ranks):
    root, all_keys = text
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))

    def no_worker(*args, **kwargs):
        raise AssertionError("a worker process was started")

    monkeypatch.setattr(workers, "WorkerPool", no_worker)
    loader = build_loader(cfg(root, num_workers="auto"))
    assert loader.cfg.num_workers == 0
    assert loader.worker_choice.rates == {} and loader.worker_choice.seconds == 0
    assert "1 usable core for this rank: no room for workers, not measured" in loader.worker_choice.line()
    assert sorted(k for b in keys_of(loader) for k in b) == sorted(all_keys)


@pytest.mark.parametrize(
    "value, message",
    [
        ("two", r"data\.num_workers: expected int \| 'auto', got 'two'"),
        (-1, r"num_workers must be an integer >= 0 or 'auto', got -1"),
        (1.5, r"data\.num_workers: expected int \| 'auto', got 1\.5"),
        (True, r"data\.num_workers: expected int \| 'auto', got True"),
    ],
)
def test_bad_num_workers_is_a_config_error(text, value, message):
    root, _ = text
    with pytest.raises(ConfigError, match=message):
        build_loader(cfg(root, num_workers=value))


def test_bad_num_workers_is_one_line_from_the_trainer_and_the_bench(tmp_path, capsys, monkeypatch):
    from headrace.dataio.commands import bench
    from headrace.dataio.usererror import CommandError
    from headrace.training.__main__ import main

    for key in ("RANK", "HEADRACE_DEBUG"):
        monkeypatch.delenv(key, raising=False)
    assert main(["--config", "configs/debug_llama.yaml", "data.num_workers=several"]) == 2
    assert capsys.readouterr().err == "error: JobConfig.data.num_workers: expected int | 'auto', got 'several'\n"
    config = tmp_path / "data.yaml"
    config.write_text("data: {datasets: [{path: x}], num_workers: -2}\n")
    with pytest.raises(CommandError, match=r"num_workers must be an integer >= 0 or 'auto', got -2"):
        bench._load_config(config)
