"""Gloo multi-process check of the loader: run by tests/test_loader_dist.py with torch.multiprocessing.

Each process joins a gloo group, builds the loader WITHOUT dp coordinates (it must take them from the
process group), reads one epoch, and all_gathers its keys and batch count; rank 0 checks that the
ranks are disjoint, cover the dataset exactly once and yield the same number of batches. Then every
rank saves its state, the group shrinks its view to dp_size // 2 (explicit coordinates, as a trainer
would after an elastic restart) and the continuation is checked the same way. Last, a packed finite
stream read through ``headrace.dataio.feed.even.even_batches`` (the consumer's tail agreement) must give every
rank the same number of batches.
"""

from __future__ import annotations

import itertools
import json
import os
import sys

import torch.distributed as dist


def valid_keys(batch):
    return [k for k, v in zip(batch["__key__"], batch["__valid__"].tolist()) if v]


def main(rank: int, world: int, port: int, root: str, expected_path: str, result_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from headrace.dataio import build_loader

    expected = json.load(open(expected_path))
    cfg = {"datasets": [{"path": root}], "batch_size": 3, "epochs": 1, "num_workers": 1, "seed": "randomized",
           "shuffle_window": 4}
    loader = build_loader(cfg)
    assert (loader.dp_rank, loader.dp_size) == (rank, world)
    batches = [valid_keys(b) for b in loader]
    gathered = [None] * world
    dist.all_gather_object(gathered, batches)
    seeds = [None] * world
    dist.all_gather_object(seeds, loader.seed)
    checks = {}
    if rank == 0:
        keys = [k for rank_batches in gathered for b in rank_batches for k in b]
        checks["exactly_once"] = sorted(keys) == sorted(expected)
        checks["equal_batches"] = len({len(b) for b in gathered}) == 1
        checks["same_seed"] = len(set(seeds)) == 1

    # Elastic: every rank stops after 2 batches of epoch 2; the job restarts on half the ranks.
    loader = build_loader({**cfg, "epochs": 2, "seed": seeds[0]})
    head = [valid_keys(b) for b in itertools.islice(loader, 2)]
    states = [None] * world
    dist.all_gather_object(states, loader.state_dict())
    heads = [None] * world
    dist.all_gather_object(heads, head)
    new_size = world // 2
    rest = []
    if rank < new_size:
        resumed = build_loader({**cfg, "epochs": 2, "seed": seeds[0], "num_workers": 2}, dp_rank=rank, dp_size=new_size)
        resumed.load_state_dict(states)
        rest = [valid_keys(b) for b in resumed]
    rests = [None] * world
    dist.all_gather_object(rests, rest)
    # Packing: ranks pack different numbers of rows from their documents; the consumer evens the tail out.
    from headrace.dataio.feed.even import even_batches

    packed = build_loader({**cfg, "seed": 3, "packing": "best_fit", "seq_len": 16, "batch_size": 2,
                           "packing_buffer": 4})
    count = sum(1 for _ in even_batches(packed, None))
    counts = [None] * world
    dist.all_gather_object(counts, count)
    if rank == 0:
        checks["packed_equal_batches"] = len(set(counts)) == 1
        served = [k for h in heads for b in h for k in b] + [k for r in rests[:new_size] for b in r for k in b]
        checks["elastic_exactly_once"] = sorted(served) == sorted(expected * 2)
        checks["elastic_equal_batches"] = len({len(r) for r in rests[:new_size]}) == 1
        with open(result_path, "w") as f:
            json.dump(checks, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*[int(a) if a.isdigit() else a for a in sys.argv[1:]])
