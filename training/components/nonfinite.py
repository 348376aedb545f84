"""Non-finite steps: skipped on every rank, named, counted; a run of ``trainer.max_bad_steps`` stops the job.

Agreement without a collective of its own: the step all-reduces its loss over the loss mesh (dp x cp) before the
update, and the grad norm is already global (``optim.clip_grad_norm``: one reduction over every shard, and the
pipeline group), so ``bad = not (isfinite(loss) and isfinite(grad_norm))`` is the same value on every rank.

Skipping without a host read (``skip_if_nonfinite``): fused AdamW takes ``found_inf``, the flag
``torch.amp.GradScaler`` passes it: when it is 1 the kernel leaves parameters and moments untouched and puts the
step count back, on the device, so the step still never waits for it. headrace uses fused AdamW wherever every
parameter is of one tensor type, CPU and CUDA (``optim.optimizer_impl``); the one layout that cannot (TP without
FSDP: DTensors beside plain norms, the per-parameter loop) reads the flag on the host before the update: one
scalar read per step, said once in the log.

``NonFiniteGuard`` (host side): per step, two device ops keep the consecutive-bad count ``run = (run + bad) * bad``
and the window's longest run; the log step puts ``nonfinite_steps`` (the window's count) and ``nonfinite_run`` in
the step record, read with the loss in the window's one read. Only when a window had bad steps are its per-step
flags read once more, to name each skipped step and this rank's samples (``__key__``, else the packed rows'
``__docs__`` references: dataset << 40 | sample index). A run of ``max_bad_steps`` stops the job with one line
(``JobInputError``) after the window's record is written; detection waits for that read (the window's end, one
window later on CUDA), and the steps in between are skipped too, so nothing reaches the weights. An interval save
in the middle of a run is postponed (``ready_to_save``: one read, at a save), so the newest checkpoint stays the
last good one, and every save first checks the state it writes is finite (``check_finite_state``: one pass over
parameters and moments, beside the save's own copy of the same bytes).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from headrace.dataio.stream.ordering.refs import split_ref
from headrace.training.errors import JobInputError


def skip_if_nonfinite(optimizer: torch.optim.Optimizer, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
    """``optimizer.step()`` unless ``loss`` or ``grad_norm`` (the step's global figures) is not finite; returns the
    flag (a float 0/1 device scalar). Fused AdamW skips on the device (module docstring); other optimizers read
    the flag on the host."""
    bad = (~(torch.isfinite(loss) & torch.isfinite(grad_norm))).float()
    if optimizer.defaults["fused"]:
        optimizer.found_inf = bad.to(torch.float32)
        try:
            optimizer.step()
        finally:
            optimizer.found_inf = None
    elif not bad.item():  # the per-parameter loop takes no found_inf: one scalar read (module docstring)
        optimizer.step()
    return bad


def sample_names(batch: dict) -> list[str]:
    """What names a batch's samples in the log: ``__key__``, else each packed row's documents as
    ``datasets[D]#I`` (the I-th sample of ``data.datasets[D]``'s index, ``headrace.dataio.stream.ordering.refs``)."""
    if "__key__" in batch:
        return list(batch["__key__"])
    refs = sorted({ref for row in batch.get("__docs__", []) for ref, _, _ in row})
    return ["datasets[{}]#{}".format(*split_ref(ref)) for ref in refs]


class NonFiniteGuard:
    """Counts, names and bounds the skipped steps of a run (module docstring)."""

    def __init__(self, max_bad_steps: int, device: torch.device):
        self.max_bad_steps = max_bad_steps
        self.run = torch.zeros((), device=device)  # consecutive bad steps up to the last one
        self.longest = torch.zeros((), device=device)  # the window's longest run (counted from before it)
        self.steps: list[tuple[int, torch.Tensor, list]] = []  # this window's (step, flag, samples)
        self.windows: dict[int, list] = {}  # logged, not yet read: last step -> the window's steps
        self.handed_out: deque = deque()  # samples of the batches handed to the step, not yet stepped on
        self.skipped = 0  # skipped steps read so far (host)
        self.run_read = 0  # ``run`` as last read (host)

    def watch(self, batches: Iterator[dict]) -> Iterator[dict]:
        """``batches`` as they are, their samples noted for naming a bad step."""
        for batch in batches:
            self.handed_out.append(sample_names(batch))
            yield batch

    def add(self, step: int, bad: torch.Tensor, micro_batches: int) -> None:
        """Step ``step`` over the next ``micro_batches`` batches handed out; ``bad``: its flag (device)."""
        samples = [name for _ in range(micro_batches) for name in self.handed_out.popleft()]
        self.run = (self.run + bad) * bad
        self.longest = torch.maximum(self.longest, self.run)
        self.steps.append((step, bad, samples))

    def window_figures(self, step: int) -> dict:
        """The window ending at ``step``, as device scalars for its record; a new window starts."""
        figures = {
            "nonfinite_steps": torch.stack([flag for _, flag, _ in self.steps]).sum(),
            "nonfinite_run": self.longest,
        }
        self.windows[step], self.steps, self.longest = self.steps, [], self.run
        return figures

    def checked(self, write: Callable[[dict], None]) -> Callable[[dict], None]:
        """``write`` of a read record, which first names the window's skipped steps and, after writing, stops the
        run when it holds ``max_bad_steps`` in a row."""

        def check_then_write(record: dict) -> None:
            window = self.windows.pop(record["step"])
            record = record | {key: int(record[key]) for key in ("nonfinite_steps", "nonfinite_run")}
            if record["nonfinite_steps"]:
                self.name_skipped(window)
            write(record)
            if record["nonfinite_run"] >= self.max_bad_steps:
                raise JobInputError(
                    f"trainer.max_bad_steps: {self.max_bad_steps} steps in a row had a non-finite loss or grad "
                    f"norm (up to step {record['step']}, each skipped): stopped; the newest checkpoint is from before "
                    "them (lower optim.lr, check the samples named above)"
                )

        return check_then_write

    def name_skipped(self, window: list) -> None:
        """Say every skipped step of ``window`` with this rank's samples (one read of the window's flags)."""
        flags = torch.stack([flag for _, flag, _ in window]).tolist()
        rank = dist.get_rank()
        for (step, _, samples), bad in zip(window, flags):
            if bad:
                self.skipped += 1
                line = (
                    f"rank {rank}: step {step}: non-finite loss or grad norm: update skipped on every rank "
                    f"(this rank's samples: {', '.join(map(str, samples[:16]))}"
                    + (f" and {len(samples) - 16} more)" if len(samples) > 16 else ")")
                )
                # one write with its newline: every rank prints this at once, and under `python -u` print's
                # separate write of the end would let another rank's line in between
                print(line + "\n", end="", flush=True)

    def ready_to_save(self) -> bool:
        """Whether the last step was good (one read): an interval save in a run of bad steps waits for a good one."""
        self.run_read = int(self.run.item())
        return self.run_read == 0


def check_finite_state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """``JobInputError`` naming the first parameter or optimizer moment that holds a NaN/Inf, on every rank: no
    checkpoint is written from it. One pass over this rank's shards, one read, one host all-reduce. A collective."""
    names = {p: name for name, p in model.named_parameters()}
    tensors = [(name, p) for name, p in model.named_parameters()]
    tensors += [
        (f"{names.get(p, '?')} ({key})", value)
        for p, state in optimizer.state.items()
        for key, value in state.items()
        if isinstance(value, torch.Tensor) and value.is_floating_point()
    ]
    locals_ = [t.to_local() if isinstance(t, DTensor) else t for _, t in tensors]
    finite = torch.stack([torch.isfinite(t).all() for t in locals_]).tolist() if locals_ else []
    first = next((i for i, ok in enumerate(finite) if not ok), len(finite))
    everyone = torch.tensor([first < len(finite)], dtype=torch.int64)
    dist.all_reduce(everyone)
    if everyone.item():
        where = f"{tensors[first][0]} on rank {dist.get_rank()}" if first < len(finite) else "a tensor of another rank"
        raise JobInputError(f"checkpoint of step {step} refused: {where} is not finite")


__all__ = ["NonFiniteGuard", "check_finite_state", "sample_names", "skip_if_nonfinite"]
