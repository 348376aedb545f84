"""The speech recipe: a NeMo manifest in, a SALM that transcribes and its held-out WER out (docs/speech-recipe.md).

    bash tools/speech_recipe.sh --manifest M.jsonl --out DIR [--text T.jsonl] [--minutes N]

Stages, each a ``headrace.training`` job run in this process (one process group for all), their configs written
beside their outputs (``DIR/<stage>/config.yaml``):

1. split: every manifest line goes to val when ``sha1(audio_filepath) mod 100 < val_percent`` (held-out
   sentences, the same split whatever the line order), else train; the LLM's text: ``--text`` documents, else
   documentation shipped with the install (``shipped_documents``), minus any document holding a held-out
   transcript, plus the train transcripts, 2% of it held out for the LLM's perplexity; a BPE tokenizer (512
   pieces, nearly characters: sub-words of unseen words still spell them) on that text; shards:
   ``DIR/shards/{train,val,text,text_val}`` (``dataio shard``);
2. ``llm``: a small Llama trained on the text shards (``model.kind: causal_lm``), its held-out loss logged;
3. ``ctc``: the speech encoder trained alone with CTC over the tokenizer's pieces (``model.kind: ctc``,
   ``ctc.units: tokens``; characters with ``--no-bridge``), validated by greedy decodes (its WER is the
   summary's ``ctc_wer``);
4. ``salm``: encoder from ``ctc/encoder``, LLM from ``llm/hf``, the ``ctc_bridge`` adapter over the CTC
   stage's head (``headrace.training.speech.bridge``: the head's token posteriors through the LLM's embedding
   table) with ``ctc_weight`` 0.3 on it; ``--llm trained`` (default) fine-tunes the LLM, ``lora`` trains LoRA
   on its projections, ``frozen`` freezes it; validation gives the listening ratio every ``eval_every``
   steps, and the val split is decoded every ``decode_every`` validations (WER on the curve);
5. eval: greedy transcripts of the val split with the SALM's export (``headrace.training.speech.eval``), each
   capped at the audio's duration times the train data's fastest token rate (+25%): the summary's ``wer``,
   ``listening_ratio`` and ``ended``.

The ``--minutes`` budget is the training wall time of stages 2-4 together (validation included), shared
``SHARES``; each stage stops at the first step past its share (``trainer.max_minutes``), its LR cosine run
over that share's wall clock (``optim.schedule: minutes``). Prints one JSON line and writes it to
``DIR/summary.json``: ``wer``, ``listening_ratio``, ``ctc_wer``, ``val_utterances``, ``ended``,
``train_minutes``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tools.speech_recipe_inputs import RecipeInputError, check_inputs

VAL_PERCENT = 5
TEXT_VAL = 0.02  # of the LLM's text documents (by their SHA-1), held out for its perplexity
VOCAB_SIZE = 512
SHARES = {"llm": 0.2, "ctc": 0.4, "salm": 0.4}  # of --minutes
PROMPT = "<|audio|> text:"

# model sizes per preset: ``cpu`` (the measured one: a 2-core machine), ``gpu`` (one GPU, bf16: tools/gpu_check.sh's
# speech_recipe part) and ``tiny`` (the smoke test's)
SIZES = {
    "cpu": dict(
        llm=dict(
            hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4
        ),
        encoder=dict(
            hidden_size=176,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=512,
            subsampling_factor=4,
            subsampling_conv_channels=128,
            conv_kernel_size=15,
            dropout=0.1,
            attention_dropout=0.0,
            activation_dropout=0.0,
        ),
        features=dict(kind="nemo", n_mels=80),
        batch_seconds=40.0,
        seq_len=256,
        text_batch=16,
        documents=12000,
        max_steps=100_000,
        eval_every=100,
        decode_every=2,
        precision="fp32",
    ),
    "gpu": dict(
        llm=dict(
            hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4
        ),
        encoder=dict(
            hidden_size=256,
            num_hidden_layers=8,
            num_attention_heads=4,
            intermediate_size=1024,
            subsampling_factor=4,
            subsampling_conv_channels=256,
            conv_kernel_size=15,
            dropout=0.1,
            attention_dropout=0.0,
            activation_dropout=0.0,
        ),
        features=dict(kind="nemo", n_mels=80),
        batch_seconds=300.0,
        seq_len=512,
        text_batch=64,
        documents=12000,
        max_steps=100_000,
        eval_every=100,
        decode_every=2,
        precision="bf16",
    ),
    "tiny": dict(
        llm=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2
        ),
        encoder=dict(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            subsampling_factor=4,
            subsampling_conv_channels=8,
            conv_kernel_size=3,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
        ),
        features=dict(kind="nemo", n_mels=16, n_fft=256, win_length=200),
        batch_seconds=8.0,
        seq_len=64,
        text_batch=4,
        documents=200,
        max_steps=2,
        eval_every=2,
        decode_every=1,
        precision="fp32",
    ),
}


@dataclass(kw_only=True)
class Recipe:
    manifest: Path
    out: Path
    text: Path | None = None
    minutes: float = 45.0
    size: str = "cpu"
    max_steps: int | None = None  # per stage; None: the preset's (the budget stops a stage first)
    llm: str = "trained"  # the SALM stage's LLM: frozen | lora | trained
    bridge: bool = True  # the ctc_bridge adapter over the CTC stage's token head (else the plain mlp)
    eval_every: int | None = None  # validation interval of the speech stages; None: the preset's


def is_val(audio_path: str) -> bool:
    """The held-out rule: the SHA-1 of the line's ``audio_filepath``, mod 100, below ``VAL_PERCENT``."""
    return int(hashlib.sha1(audio_path.encode()).hexdigest()[:8], 16) % 100 < VAL_PERCENT


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def split_manifest(manifest: Path, work: Path) -> dict[str, list[dict]]:
    """``work/{train,val}.jsonl``: the manifest's lines by ``is_val``, their audio paths made absolute (a
    relative path is relative to the manifest's folder, as NeMo reads them), each keyed (``id``) as ``dataio shard``
    keys the manifest itself: relative to its folder, not to ``work``'s."""
    from headrace.dataio.prepare.readers import nemo_key_name

    folders = (str(manifest.parent.absolute()), str(manifest.parent.resolve()))
    parts: dict[str, list[dict]] = {"train": [], "val": []}
    for line in read_jsonl(manifest):
        audio = Path(line["audio_filepath"])
        absolute = str(audio if audio.is_absolute() else (manifest.parent / audio).resolve())
        try:
            line = {"id": nemo_key_name(line, folders), **line, "audio_filepath": absolute}
        except (TypeError, ValueError):  # a broken offset: left for `dataio shard` to report with its line
            line = {**line, "audio_filepath": absolute}
        parts["val" if is_val(str(audio)) else "train"].append(line)
    if not parts["train"] or not parts["val"]:
        raise SystemExit(
            f"error: {manifest}: {len(parts['train'])} train / {len(parts['val'])} val utterances by the "
            f"key-hash split ({VAL_PERCENT}% val): the recipe needs both"
        )
    for name, rows in parts.items():
        (work / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return parts


def shard(source: Path, output: Path, split: str, tokenizer: Path) -> None:
    from headrace.dataio.cli import main as dataio

    if output.exists():  # a rerun: the same inputs give the same shards
        return
    if (
        dataio(
            [
                "shard",
                str(source),
                "--output",
                str(output),
                "--tokenizer",
                str(tokenizer),
                "--split",
                f"{split}=1.0",
                "--samples-per-shard",
                "100",
                "--quiet",
            ]
        )
        != 0
    ):
        raise SystemExit(f"error: dataio shard {source} failed")


def prepare(recipe: Recipe) -> dict[str, Path]:
    """Stage 1 (module docstring): the split, the tokenizer, the shards."""
    from tools.demo_corpus import train_tokenizer

    work = recipe.out / "data"
    work.mkdir(parents=True, exist_ok=True)
    parts = split_manifest(recipe.manifest, work)
    documents = read_jsonl(recipe.text) if recipe.text is not None else shipped_documents(SIZES[recipe.size])
    texts = [r["text"] for r in parts["train"]] + without_held_out(
        [d["text"] for d in documents], [r["text"] for r in parts["val"]]
    )
    held = set(sorted(texts, key=lambda t: hashlib.sha1(t.encode()).hexdigest())[: max(1, int(len(texts) * TEXT_VAL))])
    for name, rows in (("text", [t for t in texts if t not in held]), ("text_val", sorted(held))):
        (work / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows), encoding="utf-8")
    tokenizer = work / "tokenizer.json"
    if not tokenizer.exists():
        train_tokenizer(texts, VOCAB_SIZE, tokenizer)
    shards = recipe.out / "shards"
    paths = {name: shards / name for name in ("train", "val", "text", "text_val")}
    paths["tokenizer"] = tokenizer
    for name in paths:
        if name != "tokenizer":
            shard(work / f"{name}.jsonl", paths[name], "val" if name.endswith("val") else "train", tokenizer)
    return {
        **paths,
        "val_utterances": len(parts["val"]),
        "tokens_per_second": tokens_per_second(parts["train"], tokenizer),
        "vocab_size": vocab_size(tokenizer),
    }


def shipped_documents(size: dict) -> list[dict]:
    """The LLM's text when ``--text`` is absent: documentation that ships with the install (the demo corpus's:
    package READMEs and standard-library docstrings, ``headrace.dataio.bench.documents``), ``size["documents"]``
    of them: far more language than the transcripts, so the LLM learns it instead of memorising them."""
    from headrace.dataio.bench.documents import select_documents

    return [{"text": d.text} for d in select_documents(size["documents"])]


def without_held_out(documents: list[str], held_out: list[str]) -> list[str]:
    """``documents`` minus every one that contains a held-out transcript (the demo corpus speaks sentences of
    these very documents: the LLM must not have read the val sentences)."""
    return [d for d in documents if not any(h in d for h in held_out)]


def vocab_size(tokenizer: Path) -> int:
    """The tokenizer's pieces (up to ``VOCAB_SIZE``; fewer on a small text): the LLM's vocabulary, so that the CTC
    stage's token head (its units + blank) is the bridge's head over exactly the LLM's tokens."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer)).get_vocab_size(with_added_tokens=True)


def tokens_per_second(rows: list[dict], tokenizer: Path) -> float:
    """The generation cap's rate (``model.speech.max_tokens_per_second``): the fastest train utterance's answer
    tokens a second, with a quarter more room."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    return 1.25 * max(len(tok.encode(r["text"]).ids) / max(r["duration"], 0.1) for r in rows)


def common(recipe: Recipe, stage: str, lr: float) -> dict:
    size = SIZES[recipe.size]
    return dict(
        distributed=dict(strategy="fsdp2"),
        optim=dict(
            lr=lr,
            warmup_steps=min(50, recipe.max_steps or 50),
            weight_decay=0.01,
            max_grad_norm=1.0,
            schedule="minutes",  # the cosine ends with the stage's share of the budget, whatever its step rate
            min_lr_ratio=0.05,
        ),
        trainer=dict(
            max_steps=recipe.max_steps or size["max_steps"],
            max_minutes=recipe.minutes * SHARES[stage],
            eval_every=recipe.eval_every or size["eval_every"],
            seed=0,
            log_every=min(10, recipe.max_steps or 10),
            precision=size["precision"],
            output_dir=str(recipe.out / stage),
        ),
        checkpoint=dict(interval=0, export_hf=True),
        logging=dict(console=True, tensorboard=False),
    )


def speech_data(paths: dict, recipe: Recipe) -> dict:
    return dict(
        datasets=[dict(path=str(paths["train"]))],
        val=dict(datasets=[dict(path=str(paths["val"]), split="val")]),
        seed=0,
        num_workers=1,
        decode=dict(sample_rate=16000),
        bucketing=dict(max_duration=SIZES[recipe.size]["batch_seconds"], num_buckets=4),
    )


def llm_job(recipe: Recipe, paths: dict) -> dict:
    size = SIZES[recipe.size]
    model = dict(
        model_type="llama",
        vocab_size=paths["vocab_size"],
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        **size["llm"],
    )
    return dict(
        common(recipe, "llm", 3e-3),
        model=dict(config=model, tokenizer=str(paths["tokenizer"])),
        data=dict(
            datasets=[dict(path=str(paths["text"]))],
            val=dict(datasets=[dict(path=str(paths["text_val"]), split="val")]),
            seq_len=size["seq_len"],
            batch_size=size["text_batch"],
            packing="best_fit",
            seed=0,
            num_workers=1,
        ),
    )


def ctc_job(recipe: Recipe, paths: dict) -> dict:
    size = SIZES[recipe.size]
    speech = dict(
        encoder=dict(kind="parakeet", config=size["encoder"]),
        features=size["features"],
        spec_augment=dict(freq_masks=2, freq_width=15, time_masks=4, time_width=0.05),
    )
    # the bridge reads the head's posteriors through the LLM's embedding table: its units are the LLM's tokens
    units = (
        dict(ctc=dict(units="tokens"), tokenizer=str(paths["tokenizer"]))
        if recipe.bridge
        else dict(ctc=dict(units="chars"))
    )
    return dict(
        common(recipe, "ctc", 1.5e-3),
        model=dict(kind="ctc", speech=speech, **units),
        data=speech_data(paths, recipe),
    )


def salm_job(recipe: Recipe, paths: dict) -> dict:
    size = SIZES[recipe.size]
    adapter = (
        dict(kind="ctc_bridge", subsampling=2, head_path=str(recipe.out / "ctc" / "head"))
        if recipe.bridge
        else dict(subsampling=2)
    )
    speech = dict(
        encoder=dict(kind="parakeet", pretrained_path=str(recipe.out / "ctc" / "encoder")),
        adapter=adapter,
        features=size["features"],
        prompt=PROMPT,
        freeze_llm=recipe.llm == "frozen",
        ctc_weight=0.3 if recipe.bridge else 0.0,  # keeps the bridge's head a CTC head while the rest moves
        spec_augment=dict(freq_masks=2, freq_width=15, time_masks=2, time_width=0.05),
        max_new_tokens=96,
        max_tokens_per_second=paths["tokens_per_second"],
        eval_split="val",
        eval_data=str(paths["val"]),
        eval_every=size["decode_every"] * (recipe.eval_every or size["eval_every"]),
        eval_batch_duration=120.0,
    )
    peft = dict(peft=dict(target_modules=["*_proj"], dim=16, alpha=32)) if recipe.llm == "lora" else {}
    return dict(
        common(recipe, "salm", 1e-3),
        **peft,
        model=dict(
            kind="salm",
            pretrained_path=str(recipe.out / "llm" / "hf"),
            tokenizer=str(paths["tokenizer"]),
            speech=speech,
        ),
        data=speech_data(paths, recipe),
    )


def run_stage(job: dict) -> tuple[list[dict], float]:
    """Train ``job``; its metrics.jsonl records and the wall minutes it took."""
    from headrace.training.config.load import load_job_config
    from headrace.training.train import train

    start = time.perf_counter()
    cfg = load_job_config(None, base=job)
    train(cfg)
    records = read_jsonl(Path(cfg.trainer.output_dir) / "metrics.jsonl")
    return records, (time.perf_counter() - start) / 60


def last_val(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if key in r]
    return values[-1] if values else None


def run(recipe: Recipe) -> dict:
    """Every stage (module docstring); returns the summary, also written to ``out/summary.json``."""
    import torch.distributed as dist

    from headrace.training.distributed.process_group import init_distributed, pick_device
    from headrace.training.speech.eval import evaluate

    paths = prepare(recipe)
    init_distributed(pick_device("auto").type)
    try:
        minutes = 0.0
        _, spent = run_stage(llm_job(recipe, paths))
        minutes += spent
        ctc_records, spent = run_stage(ctc_job(recipe, paths))
        minutes += spent
        _, spent = run_stage(salm_job(recipe, paths))
        minutes += spent
        result = evaluate(
            str(recipe.out / "salm"),
            str(paths["val"]),
            split="val",
            batch_duration=120.0,
            out=str(recipe.out / "salm" / "eval-val.jsonl"),
        )
    finally:
        dist.destroy_process_group()
    summary = {
        "wer": result["wer"],
        "listening_ratio": result["listening_ratio"],
        "ctc_wer": last_val(ctc_records, "val_wer"),
        "val_utterances": result["utterances"],
        "ended": result["ended"],
        "train_minutes": round(minutes, 2),
    }
    if result["utterances"] != paths["val_utterances"]:
        raise SystemExit(
            f"error: the eval decoded {result['utterances']} of the {paths['val_utterances']} val "
            "utterances (decode skips: see the log above)"
        )
    (recipe.out / "summary.json").write_text(json.dumps(summary) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bash tools/speech_recipe.sh",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--manifest", required=True, type=Path, help="NeMo manifest (audio_filepath, duration, text)")
    parser.add_argument("--out", required=True, type=Path, help="output folder (stages, shards, summary.json)")
    parser.add_argument("--text", type=Path, default=None, help="JSONL of {'text': ...} documents for the LLM's stage")
    parser.add_argument("--minutes", type=float, default=45.0, help="training wall time of all stages together")
    parser.add_argument(
        "--llm",
        choices=["frozen", "lora", "trained"],
        default="trained",
        help="the SALM stage's LLM: frozen (encoder + adapter trained), LoRA on its projections, or fine-tuned",
    )
    parser.add_argument(
        "--no-bridge",
        action="store_true",
        help="the plain mlp adapter instead of the ctc_bridge (CTC over chars, no token posteriors to the LLM)",
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu", help="model sizes (tiny: the smoke test's)")
    parser.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="per stage (default: the size's; the budget usually stops a stage first)",
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="validation interval of the CTC and SALM stages in steps (default: the size's)",
    )
    args = parser.parse_args(argv)
    try:
        check_inputs(args, is_val, VAL_PERCENT)  # every input, before any stage writes (tools/speech_recipe_inputs)
    except RecipeInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = run(
        Recipe(
            manifest=args.manifest,
            out=args.out,
            text=args.text,
            minutes=args.minutes,
            size=args.size,
            max_steps=args.max_steps,
            llm=args.llm,
            bridge=not args.no_bridge,
            eval_every=args.eval_every,
        )
    )
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
