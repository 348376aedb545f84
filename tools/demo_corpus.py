"""Build the embedded demo corpus: real English text, speech synthesized from it, a BPE tokenizer.

Nothing is downloaded. The text is documentation that ships inside every install of the stack:
the long descriptions (READMEs) in the ``METADATA`` of headrace's installed dependency tree (torch,
transformers, numpy, ... and what they pull in) and the docstrings of the Python standard library
(read with ``ast``, never imported). Together they have the natural
long-tailed length distribution of real corpora: thousands of one-line docstrings, a few hundred
paragraph-long ones, and a few dozen READMEs of 10-100 kB.

Algorithm:
  1. Collect documents; drop exact duplicates; keep every package README and fill up to ``docs``
     with docstrings ranked by the SHA-1 of their text (a selection that does not depend on file
     order, hash seeds or the number of CPUs). Write ``text.jsonl`` sorted by source.
  2. Pick ``utterances`` plain sentences (letters and light punctuation only, 4-25 words) the same
     way and speak them with ``espeak-ng`` (a voice, speed and pitch derived from the sentence hash),
     resample to 16 kHz with soxr and store 16-bit FLAC; write a NeMo-style ``audio_manifest.jsonl``.
     Without espeak-ng, a clearly labelled synthetic formant-tone signal stands in
     (``"synthetic": true`` on every manifest line).
  3. Train a byte-level BPE tokenizer on the text with ``tokenizers`` (special tokens
     ``<|bos|> <|eos|> <|pad|>``), saved as ``tokenizer.json``.

The output appears atomically: it is built in a hidden sibling folder and renamed into place.
Two builds with the same Python and dependency versions are byte-identical (other packages in the
environment do not matter). Cost: ~10 s on 2 cores for the defaults (3000 documents, 300
utterances, 4096 tokens), about half of it parsing the standard library.

    python -m tools.demo_corpus --out demo/corpus
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from headrace.dataio.bench.documents import Document, select_documents

SAMPLE_RATE = 16_000
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]
ESPEAK_VOICES = ["en-us", "en-gb", "en-gb-x-rp", "en-gb-scotland", "en-029"]
SENTENCE = re.compile(r"[A-Z][A-Za-z ,;:'()\-]*[a-z][.!?]")
SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


@dataclass(kw_only=True)
class CorpusConfig:
    """Size of the demo corpus; the defaults build in seconds and give a few shards per kind."""

    docs: int = 3000  # text documents (all package READMEs, then docstrings)
    utterances: int = 300  # spoken sentences
    vocab_size: int = 4096  # BPE vocabulary, special tokens included (fits uint16 token ids)
    speech: str = "auto"  # auto (espeak-ng when installed) | espeak | synthetic
    workers: int = 4  # concurrent espeak-ng processes


# ------------------------------------------------------------------------------------- speech


def pick_sentences(docs: list[Document], n: int) -> list[tuple[str, str]]:
    """(sentence, source) pairs: plain prose a speech engine reads as written, chosen by hash."""
    found: dict[str, str] = {}
    for doc in docs:
        for paragraph in doc.text.split("\n\n"):
            if paragraph.lstrip().startswith((">>>", "..", "#", "-", "*", "|")):
                continue  # code, directives, lists, tables
            for sentence in SENTENCE_BREAK.split(" ".join(paragraph.split())):
                if SENTENCE.fullmatch(sentence) and 4 <= len(sentence.split()) <= 25:
                    found.setdefault(sentence, doc.source)
    ranked = sorted(found, key=lambda s: hashlib.sha1(s.encode()).hexdigest())
    return [(s, found[s]) for s in ranked[:n]]


def espeak_binary() -> str | None:
    return shutil.which("espeak-ng")


def speak_espeak(text: str, scratch: Path) -> tuple[np.ndarray, str]:
    """16 kHz int16 speech for ``text`` from espeak-ng, and the voice used."""
    import soundfile as sf
    import soxr

    h = int(hashlib.sha1(text.encode()).hexdigest(), 16)
    voice = ESPEAK_VOICES[h % len(ESPEAK_VOICES)]
    speed, pitch = 140 + (h >> 8) % 50, 35 + (h >> 16) % 30
    wav = scratch / f"{h:040x}.wav"
    subprocess.run(
        [espeak_binary(), "-v", voice, "-s", str(speed), "-p", str(pitch), "--stdin", "-w", str(wav)],
        input=text.encode(),
        check=True,
        capture_output=True,
    )
    audio, rate = sf.read(wav, dtype="float32")
    wav.unlink()
    audio = soxr.resample(audio, rate, SAMPLE_RATE, quality="HQ")
    return _to_int16(audio), f"espeak-ng:{voice}:s{speed}:p{pitch}"


# Rough (F1, F2) formants in Hz; a letter picks one, so words get a stable vowel-like timbre.
FORMANTS = [(730, 1090), (530, 1840), (270, 2290), (570, 840), (300, 870), (660, 1720), (490, 1350)]


def speak_synthetic(text: str) -> tuple[np.ndarray, str]:
    """A labelled stand-in for speech: one harmonic, formant-shaped tone per word, with pauses.

    Not speech; it only has speech-like duration, pitch and spectral envelope so that the audio path
    (shard, decode, bucket by duration) runs where espeak-ng is missing.
    """
    t_pause = np.zeros(int(0.06 * SAMPLE_RATE), np.float32)
    pieces = [t_pause]
    words = text.split()
    for i, word in enumerate(words):
        n = int(min(0.06 * len(word) + 0.08, 0.6) * SAMPLE_RATE)
        t = np.arange(n) / SAMPLE_RATE
        f0 = 135.0 - 25.0 * i / max(len(words) - 1, 1)  # declining intonation
        f1, f2 = FORMANTS[sum(map(ord, word)) % len(FORMANTS)]
        tone = np.zeros(n)
        for k in range(1, int(4000 // f0)):
            gain = np.exp(-(((k * f0 - f1) / 150) ** 2)) + 0.6 * np.exp(-(((k * f0 - f2) / 200) ** 2))
            tone += gain * np.sin(2 * np.pi * k * f0 * t) / k**0.5
        envelope = np.sin(np.pi * np.arange(n) / n) ** 0.5
        pieces += [(0.3 * tone * envelope / max(np.abs(tone).max(), 1e-9)).astype(np.float32), t_pause]
    return _to_int16(np.concatenate(pieces)), "synthetic-formant-tones"


def _to_int16(audio: np.ndarray) -> np.ndarray:
    return np.clip(np.round(audio * 32767.0), -32768, 32767).astype(np.int16)


def synthesize(sentences: list[tuple[str, str]], out: Path, engine: str, workers: int) -> list[dict]:
    """Write ``audio/utt-NNNNNN.flac`` per sentence; return the manifest rows in sentence order."""
    import soundfile as sf

    (out / "audio").mkdir()

    def one(item: tuple[int, tuple[str, str]], scratch: Path) -> dict:
        i, (text, source) = item
        audio, speaker = speak_espeak(text, scratch) if engine == "espeak" else speak_synthetic(text)
        rel = f"audio/utt-{i:06d}.flac"
        sf.write(out / rel, audio, SAMPLE_RATE, format="FLAC", subtype="PCM_16")
        return {
            "audio_filepath": rel,
            "duration": len(audio) / SAMPLE_RATE,
            "text": text,
            "speaker": speaker,
            "source": source,
            "synthetic": engine == "synthetic",
        }

    with tempfile.TemporaryDirectory() as scratch, ThreadPoolExecutor(max(workers, 1)) as pool:
        return list(pool.map(lambda item: one(item, Path(scratch)), enumerate(sentences)))


# ---------------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int, path: Path) -> None:
    """Byte-level BPE: every string round-trips through encode/decode exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer, length=len(texts))
    tokenizer.save(str(path))


# -------------------------------------------------------------------------------------- build


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def resolve_engine(speech: str) -> str:
    if speech == "auto":
        return "espeak" if espeak_binary() else "synthetic"
    if speech == "espeak" and not espeak_binary():
        raise SystemExit(
            "demo_corpus: --speech espeak but espeak-ng is not on PATH "
            "(apt-get install espeak-ng, or use --speech synthetic)"
        )
    return speech


def build(cfg: CorpusConfig, out: Path) -> dict:
    """Build the corpus into ``out`` (replacing it atomically); return the summary also saved as
    ``corpus_info.json``."""
    engine = resolve_engine(cfg.speech)
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()

    docs = select_documents(cfg.docs)
    _write_jsonl(staging / "text.jsonl", [{"text": d.text, "source": d.source} for d in docs])
    rows = synthesize(pick_sentences(docs, cfg.utterances), staging, engine, cfg.workers)
    _write_jsonl(staging / "audio_manifest.jsonl", rows)
    train_tokenizer([d.text for d in docs], cfg.vocab_size, staging / "tokenizer.json")

    lengths = np.array([len(d.text) for d in docs])
    info = {
        "documents": len(docs),
        "package_readmes": sum(d.source.startswith("pypi:") for d in docs),
        "text_chars": int(lengths.sum()),
        "doc_chars_quantiles": {q: int(np.quantile(lengths, float(q))) for q in ("0.5", "0.9", "0.99", "1.0")},
        "utterances": len(rows),
        "audio_hours": round(sum(r["duration"] for r in rows) / 3600, 4),
        "speech": engine,
        "synthetic_speech": engine == "synthetic",
        "vocab_size": cfg.vocab_size,
        "python": sys.version.split()[0],
    }
    (staging / "corpus_info.json").write_text(json.dumps(info, indent=2) + "\n")

    if out.exists():
        old = out.parent / f".{out.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        staging.rename(out)
        shutil.rmtree(old)
    else:
        staging.rename(out)
    return info


def main(argv: list[str] | None = None) -> int:
    defaults = CorpusConfig()
    p = argparse.ArgumentParser(
        prog="python -m tools.demo_corpus",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", type=Path, required=True, help="output folder (replaced atomically)")
    p.add_argument("--docs", type=int, default=defaults.docs, help="text documents")
    p.add_argument("--utterances", type=int, default=defaults.utterances, help="spoken sentences")
    p.add_argument("--vocab-size", type=int, default=defaults.vocab_size, help="BPE vocabulary size")
    p.add_argument(
        "--speech",
        choices=["auto", "espeak", "synthetic"],
        default=defaults.speech,
        help="speech engine; auto uses espeak-ng when installed, else a synthetic signal",
    )
    p.add_argument("--workers", type=int, default=defaults.workers, help="concurrent espeak-ng processes")
    args = p.parse_args(argv)
    cfg = CorpusConfig(
        docs=args.docs, utterances=args.utterances, vocab_size=args.vocab_size, speech=args.speech, workers=args.workers
    )
    info = build(cfg, args.out)
    print(
        f"demo corpus -> {args.out}: {info['documents']} documents ({info['package_readmes']} package "
        f"READMEs + stdlib docstrings, {info['text_chars'] / 1e6:.1f}M chars; median "
        f"{info['doc_chars_quantiles']['0.5']}, p99 {info['doc_chars_quantiles']['0.99']}, "
        f"max {info['doc_chars_quantiles']['1.0']} chars), {info['utterances']} utterances "
        f"({info['audio_hours'] * 60:.1f} min), BPE vocab {info['vocab_size']}"
    )
    if info["synthetic_speech"]:
        print(
            "demo corpus: espeak-ng not found: the audio is a SYNTHETIC formant-tone signal, not speech "
            '(marked "synthetic": true in audio_manifest.jsonl); apt-get install espeak-ng for real speech'
        )
    else:
        print("demo corpus: speech synthesized with espeak-ng")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
