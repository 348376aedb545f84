"""Issue 25, trainer side, one process through the real entry points (``python -m headrace.training``'s ``main`` and
``train``): user errors are one line, exit 2, printed once; checks that used to be skipped now run (the
vocabulary check on the loader's shards); resume refuses another model, a tampered checkpoint, and falls back
past an incomplete one; the run's first loss survives a resume; YAML reads ``1e-3`` as a number. The
multi-rank checks (uneven val, finite stream, output_dir lock, tp heads) are in test_validation_dist.py."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import webdataset as wds

from tests.helpers import DEBUG_LLAMA_CLI, REPO
from tests.loader_util import index_dir, make_text_dataset

from headrace.training.__main__ import main
from headrace.training.config.load import load_job_config

BASE = [*DEBUG_LLAMA_CLI, "trainer.max_steps=1"]


def run(tmp_path, capsys, *overrides) -> tuple[int, str]:
    code = main([*BASE, f"trainer.output_dir={tmp_path / 'out'}", *overrides])
    return code, capsys.readouterr().err


def datasets(path) -> str:
    return f"data.datasets=[{{path: {path}}}]"


def test_trainer_data_errors_are_one_line_exit_2(tmp_path, capsys, one_rank):
    make_text_dataset(tmp_path / "good", [20])
    (tmp_path / "empty").mkdir()
    (tmp_path / "no_tokens").mkdir()
    with wds.TarWriter(str(tmp_path / "no_tokens" / "a-000000.tar")) as w:
        for i in range(3):
            w.write({"__key__": f"k{i}", "txt": b"hello"})
    index_dir(tmp_path / "no_tokens")
    cases = {  # each was a traceback from every rank, exit 1
        datasets(tmp_path / "nope"): f"data.datasets[0].path: {tmp_path / 'nope'} does not exist",
        datasets(tmp_path / "empty"): f"data: {tmp_path / 'empty'}: no headrace index",
        f"data.datasets=[{{path: {tmp_path / 'good'}, split: val}}]": "data: ",  # only a train split there
        datasets(tmp_path / "no_tokens"): "data: packing: best_fit with seq_len: 64 needs token members (*.npy)",
        "model.config.num_attention_heads=3": "model.config: ",  # transformers: hidden 64 not a multiple of 3
    }
    for override, message in cases.items():  # "error: ", not "error (rank 0): ": the same on every rank, said once
        code, err = run(tmp_path, capsys, datasets(tmp_path / "good"), override)
        assert code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1, (override, err)
    code, err = run(tmp_path, capsys, f"data.datasets=[{{path: {tmp_path / 'good'}, split: val}}]")
    assert "no shards in split 'val'" in err


def test_vocab_check_runs_through_the_trainer(tmp_path, capsys, one_rank):
    """The loader's shards reach check_vocab (it used to receive none and the embedding raised IndexError)."""
    make_text_dataset(tmp_path / "d", [30])  # token ids up to ~1000
    code, err = run(tmp_path, capsys, datasets(tmp_path / "d"), "model.config.vocab_size=256")
    assert code == 2 and "holds token id" in err and "outside the model's vocab_size 256" in err, err


def test_damaged_or_pickle_only_pretrained_path_is_one_line(tmp_path, capsys, one_rank):
    from tests.dist.train_common import TINY_LLAMA, save_pretrained_tiny

    make_text_dataset(tmp_path / "d", [20])
    for name in ("damaged", "bin_only"):
        save_pretrained_tiny(tmp_path / name, dict(TINY_LLAMA, vocab_size=1024))
    (tmp_path / "damaged" / "model.safetensors").write_bytes(b"12")
    (tmp_path / "bin_only" / "model.safetensors").rename(tmp_path / "bin_only" / "pytorch_model.bin")
    capsys.readouterr()  # save_pretrained's progress bars
    for name, message in (
        ("damaged", f"{tmp_path / 'damaged' / 'model.safetensors'} is not a readable safetensors"),
        ("bin_only", f"{tmp_path / 'bin_only'} holds no *.safetensors file (only pytorch_model.bin"),
    ):
        code, err = run(
            tmp_path, capsys, datasets(tmp_path / "d"), "model.config=null", f"model.pretrained_path={tmp_path / name}"
        )
        assert code == 2 and err.startswith(f"error: model.pretrained_path: {message}"), err


def test_resume_refuses_another_model_falls_back_past_an_incomplete_checkpoint_and_refuses_a_tampered_one(
    tmp_path, capsys, one_rank
):
    make_text_dataset(tmp_path / "d", [60])
    steps = lambda n: (
        "trainer.log_every=1",
        f"trainer.max_steps={n}",
        "optim.decay_steps=6",  # noqa: E731
        "checkpoint.interval=2",
        datasets(tmp_path / "d"),
    )
    assert run(tmp_path, capsys, *steps(4))[0] == 0
    out = tmp_path / "out"
    first_loss = json.loads((out / "summary.json").read_text())["first_loss"]
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000002", "step-00000004"]  # the key is the user's

    # another model whose shapes may match: refused, naming every key that differs
    code, err = run(tmp_path, capsys, *steps(6), "model.config.tie_word_embeddings=true", "model.config.hidden_size=32")
    assert code == 2 and err.count("\n") == 1, err
    assert (
        "holds another model than this job's model config: head_dim 8 -> 4; hidden_size 64 -> 32; "
        "tie_word_embeddings False -> True" in err
    ), err

    # step 4 cut short (a safetensors file truncated): the run says so and resumes from step 2
    data_file = next((ckpts / "step-00000004").glob("*.safetensors"))
    data_file.write_bytes(data_file.read_bytes()[:100])
    capsys.readouterr()
    assert run(tmp_path, capsys, *steps(6))[0] == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records][-4:] == [3, 4, 5, 6]
    assert json.loads((out / "summary.json").read_text())["first_loss"] == first_loss  # the run's, not step 3's

    # a weight changed at the same size: its hash no longer matches, so step 6 is passed over for step 4
    data_file = next((ckpts / "step-00000006").glob("*.safetensors"))
    data = bytearray(data_file.read_bytes())
    data[-1] ^= 0xFF
    data_file.write_bytes(bytes(data))
    assert run(tmp_path, capsys, *steps(8))[0] == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records][-8:] == [3, 4, 5, 6, 5, 6, 7, 8]

    # the state changed (here its step), resealed with a key the checkpoint brings along: refused in one line
    state_file = ckpts / "step-00000008" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "step": 7}))
    (ckpts / ".seal-key").write_bytes(b"k" * 32)
    code, err = run(tmp_path, capsys, *steps(10))
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: checkpoint {ckpts / 'step-00000008'}: refused: its seal does not match"), err


def test_incomplete_checkpoint_fallback_is_said(tmp_path, capfd, one_rank):
    make_text_dataset(tmp_path / "d", [40])
    args = [
        *BASE,
        f"trainer.output_dir={tmp_path / 'out'}",
        datasets(tmp_path / "d"),
        "trainer.max_steps=2",
        "checkpoint.interval=1",
    ]
    assert main(args) == 0
    (tmp_path / "out" / "checkpoints" / "step-00000002" / "trainer_state.json").write_text('{"step": 2, "lo')
    assert main([*args[:-2], "trainer.max_steps=3", "checkpoint.interval=1"]) == 0
    out = capfd.readouterr().out
    assert (
        f"checkpoint {tmp_path / 'out' / 'checkpoints' / 'step-00000002'} is incomplete (trainer_state.json "
        "does not read"
        in out
        and "falling back to the previous one" in out
    ), out
    assert "resumed from" in out and "step-00000001 at step 1" in out, out


def test_yaml_reads_exponent_numbers_as_floats(tmp_path):
    """``1e-3`` was the string '1e-3' (YAML 1.1) and died in transformers' config validation on every rank."""
    (tmp_path / "job.yaml").write_text(
        "model: {config: {model_type: llama, rms_norm_eps: 1e-5}}\n"
        "data: {datasets: [{path: x}], seq_len: 8}\noptim: {lr: 3E-4}\n"
    )
    cfg = load_job_config(str(tmp_path / "job.yaml"), ["model.config.initializer_range=2e-2"])
    assert cfg.model.config["rms_norm_eps"] == 1e-5 and cfg.optim.lr == 3e-4
    assert cfg.model.config["initializer_range"] == 0.02


def test_demo_config_validates_and_eval_without_val_says_what_to_set_once(tmp_path, capsys, monkeypatch):
    from headrace.training.eval import main as eval_main
    from headrace.training.config.validate import check_validation

    demo = load_job_config(str(REPO / "configs" / "demo.yaml"))
    check_validation(demo)
    assert demo.data.val["datasets"] == [{"path": "demo/shards/text", "split": "val"}] and demo.trainer.eval_every
    monkeypatch.setenv("RANK", "0")
    assert eval_main(["--config", "configs/debug_llama.yaml", "--checkpoint", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    monkeypatch.setenv("RANK", "1")
    assert eval_main(["--config", "configs/debug_llama.yaml", "--checkpoint", str(tmp_path)]) == 2
    assert capsys.readouterr().err == ""


def test_rerun_of_a_finished_run_says_it_skips_the_current_export(tmp_path, capfd, one_rank):
    make_text_dataset(tmp_path / "d", [20])
    args = [*BASE, f"trainer.output_dir={tmp_path / 'out'}", datasets(tmp_path / "d"), "checkpoint.export_hf=true"]
    assert main(args) == 0
    assert f"exporting step 1 to {tmp_path / 'out' / 'hf'}" in capfd.readouterr().out
    assert main(args) == 0  # resumes at step 1 = max_steps: nothing to train, hf/ is current
    assert f"{tmp_path / 'out' / 'hf'} already holds step 1: export skipped" in capfd.readouterr().out


def _reseal(step_dir, **fields) -> None:
    """Re-seal ``step_dir``'s state with this user's key after setting ``fields`` and re-hashing every file (a
    state its owner edited: the seal holds, what it says is checked on its own)."""
    from headrace.training.checkpoint.seal import file_sha256, seal, seal_key

    state = json.loads((step_dir / "trainer_state.json").read_text())
    files = {n: (p.stat().st_size, file_sha256(p)) for n in state["files"] for p in [step_dir / n]}
    plain = {k: v for k, v in state.items() if k not in ("seal", "files", "format")}
    (step_dir / "trainer_state.json").write_text(json.dumps(seal({**plain, **fields}, files, seal_key(create=False))))


def test_keep_last_prunes_only_sealed_older_checkpoints_and_resealed_damage_is_one_line(tmp_path, capfd, one_rank):
    """Issue 46 items 1, 10, 12: ``keep_last`` never deletes the checkpoint just written nor anything it did not
    seal (a stray higher step-N folder, a file and a link of that name); a resealed state whose step is not a number
    is refused in one line; a resealed checkpoint whose safetensors header does not parse falls back to the
    previous one without torch's traceback."""
    make_text_dataset(tmp_path / "d", [60])
    out = tmp_path / "out"
    ckpts = out / "checkpoints"
    ckpts.mkdir(parents=True)
    (ckpts / "step-00000099").mkdir()  # a stray folder of a higher step (a copy cut short, another tool's)
    (ckpts / "step-00000099" / "trainer_state.json").write_text("{}")
    (ckpts / "step-00000098").write_text("a file")
    (ckpts / "step-00000097").symlink_to(ckpts / "step-00000099")
    args = [*BASE, f"trainer.output_dir={out}", datasets(tmp_path / "d"), "checkpoint.keep_last=1"]
    assert main([*args, "trainer.max_steps=4", "checkpoint.interval=1", "checkpoint.resume=false"]) == 0
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "step-00000004",
        "step-00000097",
        "step-00000098",
        "step-00000099",
    ]
    (ckpts / "step-00000097").unlink()
    (ckpts / "step-00000098").unlink()
    shutil.rmtree(ckpts / "step-00000099")
    assert main([*args, "trainer.max_steps=6", "checkpoint.interval=1", "checkpoint.keep_last=2"]) == 0
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000005", "step-00000006"]
    capfd.readouterr()

    step6 = ckpts / "step-00000006"
    saved = {p.name: p.read_bytes() for p in step6.iterdir()}
    _reseal(step6, step="6")
    assert main([*args, "trainer.max_steps=7"]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "refused: trainer_state.json: field step is not a whole number" in err, err

    for name, data in saved.items():
        (step6 / name).write_bytes(data)
    weights = next(step6.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[8:12] = b"\xff\xfe{{"  # the header's first bytes: no longer UTF-8 JSON
    weights.write_bytes(bytes(data))
    _reseal(step6)
    assert main([*args, "trainer.max_steps=7"]) == 0
    printed = capfd.readouterr()
    assert f"checkpoint {step6} does not load (" in printed.out and "falling back to the previous one" in printed.out
    assert "Traceback" not in printed.out + printed.err, printed.err[-2000:]
    assert "resumed from" in printed.out and "step-00000005 at step 5" in printed.out


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_seal_key_that_is_not_a_regular_file_is_named_without_blocking(tmp_path, capfd, one_rank, monkeypatch, kind):
    """Issue 46 item 9: a FIFO at the key's path used to block the first save forever; a directory gave an errno
    line naming nothing."""
    make_text_dataset(tmp_path / "d", [40])
    key = tmp_path / "keys" / "seal-key"
    key.parent.mkdir(mode=0o700)
    os.mkfifo(key) if kind == "fifo" else key.mkdir()
    monkeypatch.setenv("HEADRACE_SEAL_KEY", str(key))
    args = [*BASE, f"trainer.output_dir={tmp_path / 'out'}", datasets(tmp_path / "d"), "checkpoint.interval=1"]
    assert main(args) == 2
    err = capfd.readouterr().err
    what = "a FIFO" if kind == "fifo" else "a directory"
    assert err.strip().endswith(f"seal key {key}: not a regular file ({what}); remove it"), err
    assert err.count("\n") == 1


def test_a_killed_loader_worker_stops_the_trainer_in_one_line_naming_it(tmp_path, capfd, one_rank):
    """Issue 46 item 13: a loader worker killed while the trainer runs (the OOM killer, a kill -9) stops the job at
    its next batch with one line naming the worker and the signal; it used to train on without a word on what the
    other worker and the dead one's buffered batches held."""
    import multiprocessing
    import signal
    import threading
    import time

    make_text_dataset(tmp_path / "d", [200])
    killed = []

    def kill_worker_1() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for proc in multiprocessing.active_children():
                if proc.name == "headrace-worker-1" and proc.pid:
                    time.sleep(1.0)  # the run is training on both workers' batches
                    os.kill(proc.pid, signal.SIGKILL)
                    killed.append(proc.pid)
                    return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_worker_1, daemon=True)
    killer.start()
    out = tmp_path / "out"
    args = [*BASE, f"trainer.output_dir={out}", datasets(tmp_path / "d"), "data.num_workers=2", "data.epochs=null"]
    code = main([*args, "trainer.max_steps=100000", "trainer.max_minutes=3", "trainer.log_every=1"])
    killer.join()
    err = capfd.readouterr().err
    assert killed and code == 2, (killed, code, err[-2000:])
    assert err.strip().splitlines()[-1] == (
        f"error (rank 0): worker 1 (pid {killed[0]}) exited unexpectedly (killed by signal SIGKILL: Killed)"
    ), err[-2000:]


def test_a_full_disk_while_logging_or_exporting_is_one_line_and_leaves_no_hf_tmp(tmp_path, capfd, one_rank):
    """Issue 46 items 3, 10: the lock file, ``config.yaml`` and ``metrics.jsonl`` on a full disk are one line naming
    the file (they were tracebacks); an ``hf/`` export that fills the disk is one line and leaves no ``hf.tmp`` behind. On an
    8 MiB tmpfs (skipped where mounting one is not allowed)."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs is not allowed here")
    out = disk / "out"
    args = [*BASE, f"trainer.output_dir={out}", datasets(tmp_path / "d"), "checkpoint.save_final=false"]

    def fill(leave: int) -> None:
        (disk / "filler").unlink(missing_ok=True)
        st = os.statvfs(disk)
        (disk / "filler").write_bytes(bytes(st.f_bavail * st.f_frsize - leave))

    def refused(named: str, *extra: str) -> None:
        assert main([*args, "trainer.max_steps=2", *extra]) == 2
        err = capfd.readouterr().err
        assert err.count("\n") == 1 and named in err, err
        assert not (out / "hf.tmp").exists() and not (out / "hf").exists()

    try:
        make_text_dataset(tmp_path / "d", [40])
        fill(0)
        refused(f"trainer.output_dir: cannot write {out / '.headrace-train.lock'}: No space left on device")
        fill(4096)  # the lock's one page
        refused(f"{out / 'config.yaml'}: No space left on device")
        (disk / "filler").unlink()
        assert main([*args, "trainer.max_steps=1"]) == 0  # config.yaml's blocks, which the next run rewrites
        for name in ("metrics.jsonl", "summary.json"):
            (out / name).unlink()
        fill(0)
        refused(f"{out / 'metrics.jsonl'}: No space left on device")
        shutil.rmtree(out)
        fill(1 << 20)
        refused(f"cannot write {out / 'hf'}", "checkpoint.export_hf=true")  # hf/, or its hf.tmp
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
