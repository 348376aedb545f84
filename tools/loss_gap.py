"""Two ``tools.bench_train --json-out`` results of the same steps: the second's last loss against the first's
(exit 1 past ``--max``, relative), and its tokens/s over the first's. ``tools/gpu_check.sh``'s float8_loss part:
float8 linears must train like bf16 (within float8 rounding) to be worth their speed.

    python -m tools.loss_gap runs/bf16.json runs/float8.json --max 0.02
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reference")
    parser.add_argument("candidate")
    parser.add_argument("--source", default="headrace", help="which source of each result file")
    parser.add_argument("--max", type=float, default=0.02, help="largest relative gap of the last losses")
    args = parser.parse_args()
    ref, new = (json.load(open(path))[args.source] for path in (args.reference, args.candidate))
    gap = new["last_loss"] / ref["last_loss"] - 1
    print(
        f"last loss {new['last_loss']:.4f} vs {ref['last_loss']:.4f} ({gap:+.2%}, limit {args.max:.0%}); "
        f"{new['tokens_per_s'] / ref['tokens_per_s']:.2f}x tok/s, peak mem {new['max_mem_gib']:.1f} vs "
        f"{ref['max_mem_gib']:.1f} GiB",
        flush=True,
    )
    raise SystemExit(int(abs(gap) > args.max))


if __name__ == "__main__":
    main()
