"""Peak RSS of tokenizing one huge document: one whole ``encode`` against ``headrace.dataio.prepare.tokenize``'s
bounded pieces, each in a fresh process (``ru_maxrss``), with a small BPE tokenizer (vocabulary 200)
trained on the standard library's ``os`` module source (``headrace.dataio.bench.corpus.write_bpe_tokenizer``).

Usage: ``python -m tools.bench_tokenize_memory [--mb 50]``
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from headrace.dataio.bench.corpus import write_bpe_tokenizer

CODE = """
import resource, sys, time, numpy as np
from tokenizers import Tokenizer
from headrace.dataio.prepare.tokenize import encode_texts
tok = Tokenizer.from_file(sys.argv[1])
text = ("the quick brown fox jumps over a lazy dog " * (int(sys.argv[2]) * 25_000))[:int(sys.argv[2]) * 1_000_000]
start = time.perf_counter()
if sys.argv[3] == "whole":
    n = len(tok.encode(text, add_special_tokens=False).ids)
else:
    n = len(encode_texts(tok, [text], np.dtype("<u2"))[0])
print(n, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, time.perf_counter() - start)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=50, help="document size in MB (characters)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tok = write_bpe_tokenizer(Path(d) / "tokenizer.json", [Path(os.__file__).read_text()], vocab_size=200)
        for mode in ("whole", "bounded"):
            out = subprocess.run(
                [sys.executable, "-c", CODE, str(tok), str(args.mb), mode],
                capture_output=True,
                text=True,
                cwd=Path(__file__).resolve().parents[1],
            )
            if out.returncode:
                print(f"{mode:8s} failed: {out.stderr.strip().splitlines()[-1]}")
                continue
            tokens, peak, seconds = out.stdout.split()
            print(
                f"{mode:8s} {args.mb} MB document: {int(tokens):,} tokens, peak RSS {int(peak):,} MB, {float(seconds):.1f} s"
            )


if __name__ == "__main__":
    main()
