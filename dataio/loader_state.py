"""What makes a loader state safe to load: the data's identity in its fingerprint, and a check of
every field before any of them is used.

Identity: a state records positions in a blended, shuffled stream, so it is only meaningful for the
very same samples. ``data_identity(source)`` hashes (blake2b) the source's whole index -- every
sample's shard, byte span, member rows, lengths and key, every shard's name, size and checksum, and
the ``dataio shard`` job id (inputs' sizes and mtimes, tokenizer hash) -- so a dataset rebuilt in place
with the same sample count no longer passes for the old one, while a copy of it (other paths, other
mtimes) still does. Cost: none for a saved index (``DatasetIndex.save`` keeps the digest in its
manifest); one pass over the index arrays (~1 s per 10M samples) for one built in memory (energon, Shar).

Fields: ``check_states`` raises ``StateError`` naming the field and its rule for a hand-edited or
damaged state (``consumed: -50``), instead of numpy's message from deep inside the order code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from headrace.dataio.usererror import UserError

if TYPE_CHECKING:
    from headrace.dataio.stream.sources.interop import LhotseCutSource
    from headrace.dataio.stream.sources.shard_source import ShardSource

STATE_VERSION = 1


class StateError(ValueError, UserError):
    """A loader state that cannot be loaded here; names the field or the mismatch."""


def data_identity(source: ShardSource | LhotseCutSource) -> str:
    """A digest of the samples ``source`` serves: its index (every source type has one; a fallback to
    less, e.g. the sample count, would let a rebuilt dataset pass for the old one)."""
    return source.index.content_digest()  # saved with the index (dataio index / shard): no pass here


_COUNTERS = ("consumed", "bad_samples", "dp_rank", "seed")  # seed < 0: numpy's error (found by tests/fuzz.py)
_SKIP_KEYS = {"start", "dp_size", "consumed"}


MAX_COUNT = 1 << 62  # positions, counts and seeds are int64 in the order code: larger ones overflow there


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_COUNT


def _skip_ok(skip) -> bool:
    """One ``ConsumedLayout`` of ``headrace.dataio.stream.ordering.split``: start, dp_size >= 1, one count per old rank."""
    return (
        isinstance(skip, dict)
        and set(skip) == _SKIP_KEYS
        and _count(skip["start"])
        and _count(skip["dp_size"])
        and skip["dp_size"] >= 1
        and isinstance(skip["consumed"], list)
        and len(skip["consumed"]) == skip["dp_size"]
        and all(map(_count, skip["consumed"]))
    )


def check_states(states: list, fingerprint: str, max_bad_samples: int, end: int | None) -> None:
    """StateError for the first state that is not a loader state of this data (module docstring).
    Checked here: the fields the loader and ``headrace.dataio.stream.ordering.split`` read, a bad-sample count already
    over this run's ``max_bad_samples``, that the states are the ranks of one run (one dp_size, one
    layout, each rank once) and that none consumed past ``end`` (the finite stream's global positions;
    None: endless); the packing and bucketing sub-states are checked by their own stages."""
    _check_fields(states, fingerprint, max_bad_samples)
    first, ranks = states[0], set()
    for n, s in enumerate(states):
        where = f"loader state {n}"
        for name in ("dp_size", "layout"):
            if s[name] != first[name]:
                raise StateError(
                    f"{where}: {name!r} {s[name]!r} differs from loader state 0's {first[name]!r}: "
                    "states of different runs (or saves) mixed"[:300]
                )
        if s["dp_rank"] in ranks:
            raise StateError(f"{where}: 'dp_rank' {s['dp_rank']} appears twice: states of different runs mixed")
        ranks.add(s["dp_rank"])
        reached = _consumed_end(s)
        if end is not None and reached > end:
            raise StateError(
                f"{where}: 'consumed' {s['consumed']} (with 'layout' start {s['layout']['start']}) "
                f"reaches position {reached}, past the end of this data's {end} positions "
                "(a state of a longer stream: more epochs, other weights)"
            )


def _consumed_end(state: dict) -> int:
    """One past the highest global position the rank of ``state`` (or an older layout it skips) consumed
    (``headrace.dataio.stream.ordering.split``'s arithmetic in Python integers, after the fields were checked)."""
    layout = state["layout"]
    start, size, consumed = layout["start"], layout["dp_size"], state["consumed"]
    own = start + state["dp_rank"] + size * (consumed - 1) + 1 if consumed else start
    skips = [
        k["start"] + r + k["dp_size"] * (c - 1) + 1
        for k in layout.get("skips", [])
        for r, c in enumerate(k["consumed"])
    ]
    return max([own, *skips])


def _check_fields(states: list, fingerprint: str, max_bad_samples: int) -> None:
    for n, s in enumerate(states):
        where = f"loader state {n}"
        if not isinstance(s, dict):
            raise StateError(f"{where}: expected a mapping, got {type(s).__name__}")
        if s.get("version") != STATE_VERSION:
            raise StateError(f"{where}: version {s.get('version')!r}, expected {STATE_VERSION}")
        if s.get("fingerprint") != fingerprint:
            raise StateError(
                f"{where} comes from other data (the datasets' contents, weights, shuffle, "
                "shuffle_window or epochs differ); positions would mean other samples"
            )
        for name in _COUNTERS:
            if not _count(s.get(name)):
                bound = " below 2**62" if isinstance(s.get(name), int) and s[name] >= MAX_COUNT else ""
                raise StateError(f"{where}: {name!r} must be a non-negative integer{bound}, got {s.get(name)!r}")
        size = s.get("dp_size")
        if not _count(size) or s["dp_rank"] >= size:
            raise StateError(f"{where}: 'dp_size' must be an integer above dp_rank {s['dp_rank']}, got {size!r}")
        if s["bad_samples"] > max_bad_samples:  # found by tests/fuzz.py: was "see the warnings above"
            raise StateError(
                f"{where}: already counts {s['bad_samples']} bad samples, over max_bad_samples="
                f"{max_bad_samples}; raise max_bad_samples to resume"
            )
        reseeds = s.get("reseeds", [])
        if not (
            isinstance(reseeds, list)
            and all(
                isinstance(r, (list, tuple))
                and len(r) == 2
                and _count(r[0])
                and isinstance(r[1], (list, tuple))
                and all(map(_count, r[1]))
                for r in reseeds
            )
        ):
            raise StateError(
                f"{where}: 'reseeds' must be a list of [seed, [first position per dataset]] of "
                f"non-negative integers below 2**62, got {reseeds!r}"[:300]
            )
        layout = s.get("layout")
        if not (
            isinstance(layout, dict)
            and set(layout) <= {"start", "dp_size", "skips"}
            and _count(layout.get("start"))
            and layout.get("dp_size") == size
            and isinstance(layout.get("skips", []), list)
            and all(map(_skip_ok, layout.get("skips", [])))
        ):
            raise StateError(
                f"{where}: 'layout' must be a mapping of start >= 0, dp_size {size} and skips "
                f"(start, dp_size, one consumed count per old rank), got {layout!r}"[:300]
            )


__all__ = ["MAX_COUNT", "STATE_VERSION", "StateError", "check_states", "data_identity"]
