"""Checkpoint I/O through the real entry points (``python -m headrace.training``'s ``main``, ``headrace.training.eval``):
loads never unpickle (a pickle payload planted in every file of a checkpoint never runs), the seal key is the
user's and a key someone else could have written is refused, the former pickled layout is refused in one
line, and background saves (``checkpoint.async_mode``): a failure surfaces at the next step naming the
checkpoint; a kill -9 during a background write resumes from the previous complete checkpoint with the
losses of an uninterrupted run."""

from __future__ import annotations

import ast
import inspect
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, child_env
from tests.loader_util import make_text_dataset

from headrace.training.__main__ import main
from headrace.training.eval import main as eval_main

BASE = [
    "--config",
    str(REPO / "configs" / "debug_llama.yaml"),
    "logging.console=false",
    "checkpoint.export_hf=false",
    "data.seq_len=64",
    "data.packing_buffer=8",
    "trainer.log_every=1",
    "optim.decay_steps=6",
]


def args(tmp_path, *overrides, data: Path | None = None) -> list[str]:
    return [
        *BASE,
        f"trainer.output_dir={tmp_path / 'out'}",
        f"data.datasets=[{{path: {data or tmp_path / 'd'}}}]",
        *overrides,
    ]


def losses(out: Path) -> dict[int, float]:
    """step -> loss of the metrics log (a step logged twice, before a kill and after the resume: the later)."""
    return {
        r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    }


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """``(dataset, losses)`` of an uninterrupted 6-step run (checkpoints every 2 steps): what a run killed or cut
    off and resumed must reproduce."""
    work = tmp_path_factory.mktemp("straight")
    make_text_dataset(work / "d", [80])
    with pytest.MonkeyPatch.context() as m:
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HEADRACE_DEBUG"):
            m.delenv(key, raising=False)
        assert main(args(work, "trainer.max_steps=6", "checkpoint.interval=2")) == 0
    return work / "d", losses(work / "out")


class _Payload:
    """Unpickling this creates ``marker``: the code execution a crafted checkpoint would get from pickle."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_pickle_payload_in_any_checkpoint_file_never_runs_through_resume_or_eval(
    tmp_path, capsys, one_rank, monkeypatch
):
    make_text_dataset(tmp_path / "d", [60])
    assert main(args(tmp_path, "trainer.max_steps=2", "checkpoint.interval=1")) == 0
    ckpts = tmp_path / "out" / "checkpoints"
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(marker), protocol=2)
    pickle.loads(payload)  # the payload is live: unpickled, it writes the marker
    assert marker.exists()
    marker.unlink()

    step2 = ckpts / "step-00000002"
    cfg = str(REPO / "configs" / "debug_llama.yaml")
    val = f"data.val={{datasets: [{{path: {tmp_path / 'd'}}}], batch_size: 2}}"
    shards = sorted(p.name for p in step2.glob("*.safetensors"))
    assert shards and sorted(p.name for p in step2.iterdir()) == [*shards, "trainer_state.json"]
    for name in shards:  # each data file in turn replaced by the payload, plus the files DCP's default reader unpickles
        saved = (step2 / name).read_bytes()
        for planted in (name, ".metadata", "__0_0.distcp"):
            (step2 / planted).write_bytes(payload)
        code = main(args(tmp_path, "trainer.max_steps=3", "checkpoint.interval=1"))
        err = capsys.readouterr().err
        assert not marker.exists(), name
        assert code == 2 and err.startswith(
            f"error: checkpoint {step2}: refused: holds files its save did not write: .metadata, __0_0.distcp"
        ), (name, err)
        assert eval_main(["--config", cfg, "--checkpoint", str(step2), val, "data.seq_len=64"]) == 2
        assert not marker.exists(), name
        assert capsys.readouterr().err.startswith(f"error: --checkpoint {step2}: refused: ")
        (step2 / name).write_bytes(saved)
        for planted in (".metadata", "__0_0.distcp"):
            (step2 / planted).unlink()

    # the state file replaced by the payload: step 2 is incomplete for the trainer (it falls back to step 1) and
    # refused by eval; and nothing is unpickled while tensors are read (a tripwire on pickle for the whole read)
    (step2 / "trainer_state.json").write_bytes(payload)
    assert eval_main(["--config", cfg, "--checkpoint", str(step2), val, "data.seq_len=64"]) == 2
    assert "trainer_state.json does not read" in capsys.readouterr().err
    from headrace.training.checkpoint import restore

    real_read = restore.read_tensors

    def read_without_pickle(path, tensors):
        with monkeypatch.context() as m:
            for name in ("load", "loads", "Unpickler"):
                m.setattr(pickle, name, None)
            m.setattr("torch.load", None)
            real_read(path, tensors)

    monkeypatch.setattr(restore, "read_tensors", read_without_pickle)
    assert main(args(tmp_path, "trainer.max_steps=3", "checkpoint.interval=1")) == 0
    assert not marker.exists()
    assert f"checkpoint {step2} is incomplete (trainer_state.json does not read" in capsys.readouterr().out
    assert [s for s in losses(tmp_path / "out")][-2:] == [2, 3]  # resumed from step 1


def test_no_unpickling_is_reachable_from_a_checkpoint_load():
    """The scan: our checkpoint load path names no pickle and no ``torch.load`` without ``weights_only=True``,
    every ``dcp.load`` passes a safetensors reader, and that torch reader overrides every method of the file
    system reader that unpickles (``.metadata``, byte items) with code that names no pickle."""
    from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageReader

    for rel in [
        *(str(p.relative_to(REPO)) for p in sorted((REPO / "training/checkpoint").glob("*.py"))),
        "training/eval.py",
    ]:
        tree = ast.parse((REPO / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any("pickle" in n for n in names), f"{rel}:{node.lineno} imports pickle"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = ast.unparse(node.func.value)
                if node.func.attr == "load" and owner == "torch":
                    assert any(k.arg == "weights_only" and ast.unparse(k.value) == "True" for k in node.keywords), (
                        f"{rel}:{node.lineno} torch.load without weights_only=True"
                    )
                if node.func.attr == "load" and owner == "dcp":
                    reader = [k for k in node.keywords if k.arg == "storage_reader"]
                    assert reader and "HuggingFaceStorageReader" in ast.unparse(reader[0].value), (
                        f"{rel}:{node.lineno} dcp.load without the safetensors reader"
                    )
    for method in ("read_metadata", "read_data"):
        assert method in vars(HuggingFaceStorageReader), method
        assert getattr(HuggingFaceStorageReader, method) is not getattr(FileSystemReader, method)
        source = inspect.getsource(getattr(HuggingFaceStorageReader, method))
        assert "pickle" not in source and "torch.load" not in source, method


def test_the_seal_key_is_the_users_and_one_others_could_write_is_refused(tmp_path, capsys, one_rank, monkeypatch):
    make_text_dataset(tmp_path / "d", [40])
    key = tmp_path / "keys" / "seal-key"
    monkeypatch.setenv("HEADRACE_SEAL_KEY", str(key))
    key.parent.mkdir(mode=0o700)
    key.write_bytes(os.urandom(32))
    key.chmod(0o666)  # planted world-writable before the first save: refused, not adopted
    assert main(args(tmp_path, "trainer.max_steps=1")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: checkpoint: refused: seal key {key}: mode 666"), err

    key.unlink()
    assert main(args(tmp_path, "trainer.max_steps=1")) == 0  # a fresh key, private
    assert key.stat().st_mode & 0o777 == 0o600 and not (tmp_path / "out" / "checkpoints" / ".seal-key").exists()
    target = tmp_path / "elsewhere"
    key.rename(target)
    key.symlink_to(target)  # a link is not followed
    assert main(args(tmp_path, "trainer.max_steps=2")) == 2
    assert "does not open without following a link" in capsys.readouterr().err
    key.unlink()
    target.rename(key)
    key.parent.chmod(0o777)
    assert main(args(tmp_path, "trainer.max_steps=2")) == 2
    assert f"its folder {key.parent} is writable by others" in capsys.readouterr().err
    key.parent.chmod(0o700)

    # another user's key (here: a fresh one) does not accept this checkpoint
    monkeypatch.setenv("HEADRACE_SEAL_KEY", str(tmp_path / "other" / "seal-key"))
    assert main(args(tmp_path, "trainer.max_steps=2")) == 2
    assert "refused: this user has no seal key" in capsys.readouterr().err


def test_a_checkpoint_of_the_former_pickled_layout_is_refused_saying_what_to_do(tmp_path, capsys, one_rank):
    make_text_dataset(tmp_path / "d", [40])
    old = tmp_path / "out" / "checkpoints" / "step-00000001"
    old.mkdir(parents=True)
    (old / ".metadata").write_bytes(b"\x80\x02}q\x00.")
    (old / "trainer_state.json").write_text(json.dumps({"step": 1, "files": {".metadata": 6}, "seal": "00"}))
    assert main(args(tmp_path, "trainer.max_steps=2")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "former pickled DCP layout" in err and "export hf/" in err, err


def test_a_failed_background_save_stops_the_next_step_naming_the_checkpoint(tmp_path, capsys, one_rank, monkeypatch):
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    make_text_dataset(tmp_path / "d", [60])

    def full_disk(self, plan, planner):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(HuggingFaceStorageWriter, "write_data", full_disk)
    assert main(args(tmp_path, "trainer.max_steps=6", "checkpoint.interval=2", "checkpoint.async_mode=async")) == 2
    err = capsys.readouterr().err
    ckpts = tmp_path / "out" / "checkpoints"
    assert err.count("\n") == 1 and err.startswith(
        f"error: checkpoint {ckpts / 'step-00000002'}: the background save failed: "
    ), err
    assert "No space left on device" in err
    assert not (ckpts / "step-00000002").exists()
    assert max(losses(tmp_path / "out")) < 6  # stopped at the first step after the failure was known, not at the end


_BLOCK_AT_STEP_4 = """
import sys, threading
from pathlib import Path
from torch.distributed.checkpoint import HuggingFaceStorageWriter
real = HuggingFaceStorageWriter.write_data
def write_data(self, plan, planner):
    if Path(str(self.path)).name == "step-00000004.tmp":
        Path(sys.argv[1]).write_text("writing")
        threading.Event().wait()  # the write never ends: the kill comes while it is in flight
    return real(self, plan, planner)
HuggingFaceStorageWriter.write_data = write_data
from headrace.training.__main__ import main
sys.exit(main(sys.argv[2:]))
"""


def test_kill_9_during_a_background_write_resumes_from_the_previous_checkpoint_exactly(tmp_path, one_rank, straight):
    data, expected = straight
    run_args = args(
        tmp_path,
        "trainer.max_steps=6",
        "checkpoint.interval=2",
        "checkpoint.async_mode=async_with_pinned_mem",
        data=data,
    )

    marker = tmp_path / "writing"
    proc = subprocess.Popen(
        [sys.executable, "-c", _BLOCK_AT_STEP_4, str(marker), *run_args],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 240
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.exists(), proc.stderr.read().decode()[-2000:] if proc.poll() is not None else "no write started"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    ckpts = tmp_path / "out" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000002", "step-00000004.tmp"]

    assert main(run_args) == 0  # resumes from step 2 (the .tmp is ignored), then runs to the end
    got = losses(tmp_path / "out")
    assert [s for s in got if s > 2] == [3, 4, 5, 6]
    assert {s: got[s] for s in (3, 4, 5, 6)} == {s: expected[s] for s in (3, 4, 5, 6)}
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000002", "step-00000004", "step-00000006"]


@pytest.fixture
def s3_bucket(monkeypatch):
    """A moto S3 server on loopback with bucket ``ckpts``, reached through the standard AWS variables."""
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    import boto3
    import s3fs

    from tests.helpers import free_port

    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    for name, value in {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket="ckpts")
    try:
        yield client
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


def test_checkpoints_on_s3_commit_last_prune_resume_and_ignore_a_save_cut_off(
    tmp_path, one_rank, s3_bucket, monkeypatch, straight
):
    """``checkpoint.folder: s3://...``: saves upload each rank's files then the state file (the commit marker);
    keep_last prunes; a save cut off mid-upload leaves a step folder without the marker, which the rerun ignores
    (resuming from the previous one, with the losses of an uninterrupted run) and overwrites; the hf/ export is
    uploaded to URL/hf/."""
    from headrace.training.checkpoint import store

    data, expected = straight
    url = "s3://ckpts/run/checkpoints"
    common = ("trainer.max_steps=6", "checkpoint.interval=2", "checkpoint.keep_last=1", f"checkpoint.folder={url}")

    real_upload = store.upload

    def cut_off_at_step_4(local_dir, names, where):
        if where.endswith("step-00000004") and names != ["trainer_state.json"]:
            real_upload(local_dir, names[:1], where)
            raise SystemExit(9)  # the job dies after the first file of step 4 reached the bucket
        real_upload(local_dir, names, where)

    monkeypatch.setattr(store, "upload", cut_off_at_step_4)
    with pytest.raises(SystemExit):
        main(args(tmp_path, *common, data=data))
    monkeypatch.setattr(store, "upload", real_upload)
    keys = lambda: sorted(o["Key"] for o in s3_bucket.list_objects_v2(Bucket="ckpts").get("Contents", []))  # noqa: E731
    assert [k for k in keys() if k.endswith("trainer_state.json")] == [
        "run/checkpoints/step-00000002/trainer_state.json"
    ]
    assert any(k.startswith("run/checkpoints/step-00000004/") for k in keys())  # the partial one
    assert str(store.step_folders(url, "trainer_state.json", complete_only=True)) == str([f"{url}/step-00000002"])

    assert main(args(tmp_path, *common, "checkpoint.export_hf=true", data=data)) == 0
    got = losses(tmp_path / "out")
    assert {s: got[s] for s in (3, 4, 5, 6)} == {s: expected[s] for s in (3, 4, 5, 6)}
    complete = [k for k in keys() if k.endswith("trainer_state.json")]
    assert complete == ["run/checkpoints/step-00000006/trainer_state.json"], keys()  # keep_last: 1
    assert {k.split("/")[2] for k in keys()} == {"step-00000006", "hf"}
    exported = {k.split("/", 3)[3] for k in keys() if k.split("/")[2] == "hf"}
    assert exported == {
        p.relative_to(tmp_path / "out" / "hf").as_posix() for p in (tmp_path / "out" / "hf").rglob("*") if p.is_file()
    }
    assert {"config.json", "headrace_export.json"} <= exported and any(n.endswith(".safetensors") for n in exported)
    assert not list((tmp_path / "out" / "checkpoints").glob("step-*"))  # local copies removed after the upload


def test_async_mode_names_and_automodels_is_async():
    from headrace.config import ConfigError
    from headrace.training.config.load import load_job_config

    cfg = str(REPO / "configs" / "debug_llama.yaml")
    assert load_job_config(cfg).checkpoint.async_mode == "disabled"
    assert load_job_config(cfg, ["checkpoint.is_async=true"]).checkpoint.async_mode == "async"
    assert (
        load_job_config(
            cfg, ["checkpoint.is_async=true", "checkpoint.async_mode=async_with_pinned_mem"]
        ).checkpoint.async_mode
        == "async_with_pinned_mem"
    )
    for bad, says in (
        (["checkpoint.is_async=false", "checkpoint.async_mode=async"], "contradicts"),
        (["checkpoint.async_mode=sometimes"], "checkpoint.async_mode"),
    ):
        with pytest.raises(ConfigError, match=says):
            load_job_config(cfg, bad)
