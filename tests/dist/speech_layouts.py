"""torchrun script (4 ranks): a SALM trains like one process under FSDP2 and FSDP2 + TP + SP, resumes exactly,
and its export loads back as the trained model.

``torchrun --nproc-per-node 4 -m tests.dist.speech_layouts WORKDIR``: every rank builds the same seeded tiny
SALM and the ranks export it together to ``WORKDIR/init`` (LLM ``hf/``, ``encoder/``, ``adapter/``). From
there FSDP2 (dp=4) and FSDP2 x TP=2 with sequence parallelism (dp=2, 2 micro-steps) train STEPS steps on
the same global batches (bucketed-collate audio batches of different audio and transcript lengths); their
losses and gradient norms, and the exported weights of all three parts, must match a single-process
reference that trains ``load_salm(init)`` on each rank. A run stopped at step 2 and resumed must
reproduce the uninterrupted losses. The SALM's validation loss (answer tokens, ``data.val``) of the
fsdp2 run's checkpoint at dp 4 and dp 2 x tp 2 equals one process's, and so does its loss with mismatched
audio (one process reading each dp rank's batches). The same for a SALM on Whisper's encoder (its own seeded init in
``WORKDIR/init_whisper``): built from scratch under FSDP2 its fixed position table is the unsharded one;
FSDP2 (dp=2) x TP=2 with activation checkpointing matches its reference, and a
bf16 run with the encoder frozen stays within bf16 rounding of the first loss and exports the encoder
unchanged. A Qwen2-Audio checkpoint directory trained in place under FSDP2 x TP + SP matches one process
training it. Prints ``OK <check>`` per passed check; any mismatch raises.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.dist.speech_common import audio_batches, salm_job, save_tokenizer, write_audio_dataset
from tests.dist.train_common import ListLoader
from tests.dist.train_layouts import check_close

from headrace.training.config.job_config import OptimConfig  # noqa: E402
from headrace.training.components.optim import build_optimizer, lr_at, set_lr  # noqa: E402
from headrace.training.speech.eval import evaluate  # noqa: E402
from headrace.training.speech.job import SpeechBatches, export_salm, load_salm, salm_loss_sum  # noqa: E402
from headrace.training.train import train  # noqa: E402

STEPS, GLOBAL_MICRO = 3, 4


def make_init(workdir: Path, encoder: str) -> Path:
    from headrace.training.models.build import build_hf_config
    from headrace.training.speech.model import build_meta_salm, materialize_salm

    cfg = salm_job(workdir, "fresh", encoder=encoder)
    torch.manual_seed(0)
    model = build_meta_salm(build_hf_config(cfg.model), cfg.model.speech)
    materialize_salm(model, torch.device("cpu"), None)
    out = workdir / ("init" if encoder == "parakeet" else f"init_{encoder}")
    export_salm(model, cfg, out)
    dist.barrier()
    return out


def check_whisper_sharded_init(workdir: Path, init: Path) -> None:
    """A Whisper SALM from scratch under FSDP2 over all ranks: every ``WhisperEncoderLayer`` is an FSDP2 unit and
    the fixed sinusoidal position table (a sharded, frozen parameter) is the single-process init's, row for row."""
    from safetensors.torch import load_file
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from headrace.training.distributed.parallel_dims import ParallelDims
    from headrace.training.speech.job import build_salm

    cfg = salm_job(workdir, "scratch", encoder="whisper")
    dims = ParallelDims.from_config(cfg.distributed, dist.get_world_size())
    model, _ = build_salm(cfg, dims.build_meshes("cpu"), torch.device("cpu"))
    layers = model.encoder.layers
    assert all(isinstance(layer, FSDPModule) and type(layer).__name__ == "FSDPWhisperEncoderLayer" for layer in layers)
    table = model.encoder.embed_positions.weight
    want = load_file(init / "encoder" / "model.safetensors")["embed_positions.weight"]
    assert isinstance(table, DTensor) and not table.requires_grad and torch.equal(table.full_tensor(), want)
    print("OK whisper from scratch under fsdp2", flush=True)


def reference(workdir: Path, init: Path, batches,
              tokenizer: Path | None = None) -> tuple[list[float], list[float], dict]:
    """Single-process losses, gradient norms and final parameters of ``load_salm(init)`` trained on ``batches``
    (``tokenizer``: the job's, by default the test tokenizer)."""
    model, speech = load_salm(init)
    model.train()
    convert = SpeechBatches([], model, speech, str(tokenizer or workdir / "tokenizer.json")).convert
    cfg = OptimConfig(**salm_job(workdir, "x").optim.__dict__)
    opt = build_optimizer(model, cfg)
    losses, norms = [], []
    for step in range(1, STEPS + 1):
        micro = [convert(b) for b in batches[(step - 1) * GLOBAL_MICRO: step * GLOBAL_MICRO]]
        tokens = sum(int((mb["labels"] != -100).sum()) for mb in micro)
        total = sum(salm_loss_sum(model, mb, False) for mb in micro) / tokens
        total.backward()
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])))
        set_lr(opt, lr_at(step, cfg, STEPS))
        opt.step()
        opt.zero_grad()
        losses.append(float(total))
    # Parameters only: the encoder's BatchNorm running statistics are per rank (each sees its own
    # micro-batches, as under DDP without SyncBatchNorm); the export writes rank 0's.
    return losses, norms, {k: v.detach().clone() for k, v in model.named_parameters()}


def check_qwen2_audio_in_place(workdir: Path, batches, loaders) -> None:
    """A Qwen2-Audio checkpoint directory trained in place (``model.pretrained_path``, empty speech section) under
    FSDP2 (dp 2) x TP 2 + SP: each rank reads its own slices of the LLM (``language_model.*``), encoder
    (``audio_tower.*``) and projector, and the losses and gradient norms match one process training
    ``load_salm(CKPT)``."""
    from headrace.training.config.load import load_job_config
    from tests.test_speech_checkpoints import qwen2_audio_job, save_qwen2_audio

    if dist.get_rank() == 0:
        save_qwen2_audio(workdir / "qwen2-audio")
    dist.barrier()
    ref_losses, ref_norms, _ = reference(workdir, workdir / "qwen2-audio", batches, workdir / "qwen2-audio")
    raw = qwen2_audio_job(workdir)
    raw["distributed"] = dict(strategy="fsdp2", tp_size=2, sequence_parallel=True)
    raw["trainer"].update(grad_accum=2, max_steps=STEPS)
    history = train(load_job_config(None, base=raw), loaders(2))
    check_close("qwen2_audio in place losses", [r["loss"] for r in history], ref_losses, 2e-5)
    check_close("qwen2_audio in place relative grad norms", [r["grad_norm"] / n - 1 for r, n in zip(history, ref_norms)],
                [0.0] * STEPS, 1e-5)
    print("OK qwen2_audio checkpoint in place under fsdp2 x tp2 + sp matches", flush=True)


def exported(out_dir: Path) -> dict:
    from safetensors.torch import load_file

    params = {f"llm.{k}": v for f in sorted((out_dir / "hf").glob("model-*-of-*.safetensors"))
              for k, v in load_file(f).items()}  # the sharded hf/ export (headrace.training.checkpoint.export.export_hf)
    for part in ("encoder", "adapter"):
        params |= {f"{part}.{k}": v for k, v in load_file(out_dir / part / "model.safetensors").items()}
    return params


def val_stream(workdir: Path) -> dict:
    return dict(datasets=[dict(path=str(workdir / "audio"))])


def check_validation(workdir: Path, init: Path) -> None:
    """The fsdp2 run's last checkpoint validated by ``headrace.training.eval`` at dp 4 and at dp 2 x tp 2 (+SP) equals
    one process's validation of it (a plain SALM on each rank, the val stream read as one dp rank); the
    figures logged in training count the same utterances and answer tokens (its loss differs: each rank's
    encoder BatchNorm keeps running statistics of its own batches, the checkpoint holds one rank's)."""
    import functools
    import json

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from headrace.dataio import build_loader
    from headrace.training.checkpoint.layout import split_state
    from headrace.training.eval import evaluate_checkpoint, resolve_checkpoint
    from headrace.training.models.build import build_hf_config
    from headrace.training.speech.listening import with_mismatched_audio
    from headrace.training.speech.model import build_meta_salm, materialize_salm
    from headrace.training.validation import evaluate as evaluate_val
    from headrace.training.validation import val_batches
    from headrace.training.config.job_config import val_data_config

    ckpt, _ = resolve_checkpoint(str(workdir / "fsdp2" / "checkpoints"))
    got = {}
    for name, distributed in (("dp4", dict(strategy="fsdp2")),
                              ("dp2_tp2_sp", dict(strategy="fsdp2", tp_size=2, sequence_parallel=True))):
        cfg = salm_job(workdir, f"val_{name}", init=init, distributed=distributed)
        cfg.data.val = val_stream(workdir)
        got[name] = evaluate_checkpoint(cfg, str(ckpt))
    model = build_meta_salm(build_hf_config(cfg.model), cfg.model.speech)
    materialize_salm(model, torch.device("cpu"), None)
    tensors, _ = split_state(get_model_state_dict(model))  # the checkpoint's keys: model.<fqn>
    dcp.load(tensors, storage_reader=dcp.HuggingFaceStorageReader(str(ckpt)), no_dist=True)
    set_model_state_dict(model, {k.removeprefix("model."): v for k, v in tensors.items()})
    solo, _ = dist.new_subgroups(group_size=1)
    loader = SpeechBatches(build_loader(val_data_config(cfg.data), 0, 1), model, cfg.model.speech,
                           cfg.model.tokenizer)
    want = evaluate_val(model, functools.partial(salm_loss_sum, autocast=False),
                        val_batches(loader, torch.device("cpu")),
                        torch.device("cpu"), loss_group=solo, dp_group=solo)
    assert want["val_docs"] == 8 and want["val_tokens"] > 0, want
    for name, figures in got.items():
        assert (figures["val_docs"], figures["val_tokens"]) == (want["val_docs"], want["val_tokens"]), (name, figures)
        check_close(f"salm {name} val_loss", torch.tensor(figures["val_loss"]), torch.tensor(want["val_loss"]), 1e-5)
        # the listening pass pairs utterances within each dp rank's batches: one process reading each dp
        # rank's share in turn (the same batches) gives the same mismatched loss
        dp = 4 if name == "dp4" else 2
        mismatched = functools.partial(with_mismatched_audio(salm_loss_sum), autocast=False)
        shares = [evaluate_val(model, mismatched, val_batches(SpeechBatches(
            build_loader(val_data_config(cfg.data), r, dp), model, cfg.model.speech, cfg.model.tokenizer),
            torch.device("cpu")), torch.device("cpu"), loss_group=solo, dp_group=solo) for r in range(dp)]
        want_mismatched = sum(f["val_loss"] * f["val_tokens"] for f in shares) / want["val_tokens"]
        check_close(f"salm {name} val_mismatched_loss", torch.tensor(figures["val_mismatched_loss"]),
                    torch.tensor(want_mismatched), 1e-5)
        assert figures["val_listening_ratio"] == figures["val_loss"] / figures["val_mismatched_loss"], figures
    dist.barrier()  # rank 0 has closed metrics.jsonl
    logged = [r for r in map(json.loads, open(workdir / "fsdp2" / "metrics.jsonl")) if "val_loss" in r]
    assert [(r["step"], r["val_docs"], r["val_tokens"]) for r in logged] == [(STEPS, 8, want["val_tokens"])], logged
    assert logged[0]["val_listening_ratio"] == logged[0]["val_loss"] / logged[0]["val_mismatched_loss"], logged
    print(f"OK salm validation at dp4 and dp2 x tp2 equals one process's ({want['val_tokens']} answer tokens)",
          flush=True)


def main() -> None:
    workdir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if dist.get_rank() == 0:
        save_tokenizer(workdir / "tokenizer.json")
        write_audio_dataset(workdir / "audio")
    dist.barrier()
    inits = {encoder: make_init(workdir, encoder) for encoder in ("parakeet", "whisper")}
    batches = audio_batches(STEPS * GLOBAL_MICRO)
    refs = {encoder: reference(workdir, init, batches) for encoder, init in inits.items()}
    check_whisper_sharded_init(workdir, inits["whisper"])

    def loaders(k):
        return lambda dp_rank, dp_size: ListLoader(batches, dp_rank, dp_size, k)

    results = {}
    # FSDP2 also decodes its training data at the last step (model.speech.eval_every) with the sharded model
    evals = dict(data_path=str(workdir / "audio"), speech_extra=dict(eval_every=STEPS, eval_split="train",
                                                                     max_new_tokens=4))
    for name, encoder, distributed, k, extra in (
            ("fsdp2", "parakeet", dict(strategy="fsdp2"), 1, evals),
            ("fsdp2_tp_sp", "parakeet", dict(strategy="fsdp2", tp_size=2, sequence_parallel=True), 2, {}),
            ("whisper_fsdp2_tp_ac", "whisper", dict(strategy="fsdp2", tp_size=2, activation_checkpointing=True),
             2, {})):
        ref_losses, ref_norms, ref_params = refs[encoder]
        cfg = salm_job(workdir, name, init=inits[encoder], distributed=distributed, grad_accum=k, max_steps=STEPS,
                       encoder=encoder, **extra)
        if name == "fsdp2":  # + the val loss at the last step (trainer.eval_every)
            cfg.data.val, cfg.trainer.eval_every = val_stream(workdir), STEPS
        history = train(cfg, loaders(k))
        check_close(f"{name} losses", [r["loss"] for r in history], ref_losses, 2e-5)
        check_close(f"{name} relative grad norms", [r["grad_norm"] / n - 1 for r, n in zip(history, ref_norms)],
                    [0.0] * STEPS, 1e-5)  # the first step's norm is ~2.6e3 (fresh weights)
        if dist.get_rank() == 0:
            params = exported(workdir / name)
            assert ref_params.keys() <= params.keys(), sorted(ref_params.keys() - params.keys())
            params = {k: params[k] for k in ref_params}
            for key, value in params.items():
                check_close(f"{name} param {key}", value, ref_params[key], 5e-5)
        results[name] = history
        print(f"OK {name} matches the single-process reference", flush=True)

    check_validation(workdir, inits["parakeet"])

    # Whisper in bf16 (MixedPrecisionPolicy) with its encoder frozen: the first loss (same weights as the
    # reference's) within bf16 rounding, the encoder exported bit-for-bit as loaded
    history = train(salm_job(workdir, "whisper_bf16_frozen", init=inits["whisper"], max_steps=STEPS, encoder="whisper",
                             precision="bf16", speech_extra=dict(encoder=dict(
                                 kind="whisper", pretrained_path=str(inits["whisper"] / "encoder"), freeze=True))),
                    loaders(1))
    # bf16's unit roundoff is 2^-9 ~ 2e-3; the summed loss's relative error is far below it (measured 8e-5)
    check_close("whisper bf16 first loss", history[0]["loss"] / refs["whisper"][0][0], 1.0, 1e-3)
    if dist.get_rank() == 0:
        params = exported(workdir / "whisper_bf16_frozen")
        initial = exported(inits["whisper"])
        encoder_keys = [k for k in initial if k.startswith("encoder.")]
        assert encoder_keys and all(torch.equal(params[k], initial[k]) for k in encoder_keys)
        assert not torch.equal(params["adapter.proj_in.weight"], initial["adapter.proj_in.weight"])
    print(f"OK whisper bf16 with a frozen encoder (first loss / fp32 reference - 1: "
          f"{history[0]['loss'] / refs['whisper'][0][0] - 1:.1e})", flush=True)

    # Eval: the export decoded by python -m headrace.training.speech.eval's path (every rank holds the whole model)
    # gives the hypotheses the sharded model gave during training.
    result = evaluate(str(workdir / "fsdp2"), str(workdir / "audio"), split="train", batch_duration=60.0,
                      out=str(workdir / "exported.jsonl"), max_new_tokens=4)
    if dist.get_rank() == 0:
        import json

        read = lambda p: [json.loads(line) for line in open(p)]  # noqa: E731
        during = read(workdir / "fsdp2" / f"eval-train-step{STEPS:08d}.jsonl")
        after = read(workdir / "exported.jsonl")
        assert result["utterances"] == 8 and [r["key"] for r in after] == [f"u{i:04d}" for i in range(8)], after
        assert [r["hypothesis"] for r in during] == [r["hypothesis"] for r in after], (during, after)
        logged = [r for r in read(workdir / "fsdp2" / "metrics.jsonl") if "val_wer" in r]  # the WER curve's points
        assert logged == [{"step": STEPS, "val_wer": result["wer"], "val_wer_utterances": 8}], logged
    print("OK eval during training equals eval of the export, and its WER is in metrics.jsonl", flush=True)

    check_qwen2_audio_in_place(workdir, batches, loaders)

    train(salm_job(workdir, "resumed", init=inits["parakeet"], max_steps=2), loaders(1))
    history = train(salm_job(workdir, "resumed", init=inits["parakeet"], max_steps=STEPS), loaders(1))
    assert [r["step"] for r in history] == [3], history
    check_close("resumed losses", [r["loss"] for r in history], [r["loss"] for r in results["fsdp2"][2:]], 1e-6)
    print("OK resume reproduces the uninterrupted losses", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
