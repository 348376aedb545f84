"""The fields of a sealed ``trainer_state.json``, checked before the trainer uses them.

The seal vouches that this user's key signed the state, not that the state is what a save writes (a state
edited and resealed by hand, a tool of the user's own): each field the resume reads is checked for its type
here, so a wrong one is one line naming it (``NotSealed``: the checkpoint is refused) instead of a
``TypeError`` deep in the resume. Cost: a walk over the state's top-level fields and the RNG entries.
"""

from __future__ import annotations

import base64
import binascii
import math

from headrace.training.checkpoint.seal import NotSealed


def _number_or_none(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))


def _rng_entry(value, cpu_bytes: int) -> bool:
    if not isinstance(value, dict) or not isinstance(value.get("cpu"), str):
        return False
    try:
        return len(base64.b64decode(value["cpu"], validate=True)) == cpu_bytes
    except (binascii.Error, ValueError):
        return False


def checked_fields(state: dict, state_file: str, cpu_rng_bytes: int) -> dict:
    """``state`` once ``step``, ``loader``, ``rng``, ``optim_plain``, ``model_config`` and ``first_loss`` have the
    types a save writes (``cpu_rng_bytes``: the size of this torch's CPU generator state)."""
    rules = {
        "step": ("a whole number >= 0", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
        "loader": ("a list (one loader state per data-parallel rank)", lambda v: isinstance(v, list)),
        "rng": (
            "a list of per-rank RNG states",
            lambda v: isinstance(v, list) and all(_rng_entry(r, cpu_rng_bytes) for r in v),
        ),
        "optim_plain": ("an object of optimizer settings", lambda v: isinstance(v, dict)),
        "model_config": ("an object (the model's config)", lambda v: v is None or isinstance(v, dict)),
        "first_loss": ("a finite number or null", _number_or_none),
    }
    for name, (rule, ok) in rules.items():
        if not ok(state.get(name)):
            raise NotSealed(f"{state_file}: field {name} is not {rule}")
    return state


__all__ = ["checked_fields"]
