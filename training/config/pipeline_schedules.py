"""The accepted spellings of ``distributed.pipeline.pp_schedule`` and the torch schedule class each names.

NeMo Automodel's names (1f1b, gpipe, interleaved_1f1b, looped_bfs, dfs = depth-first = interleaved,
v_schedule, zero_bubble) and torchtitan's (the class names without "Schedule": 1F1B, Interleaved1F1B,
ZBVZeroBubble, DualPipeV ...) are keys after lower-casing and dropping "_", "-" and spaces. The config
checks a name here; ``headrace.training.distributed.pipeline`` builds the class it names.
"""

from __future__ import annotations

import re

from headrace.config import ConfigError

SCHEDULES = {
    "1f1b": "Schedule1F1B",
    "gpipe": "ScheduleGPipe",
    "interleaved1f1b": "ScheduleInterleaved1F1B",
    "dfs": "ScheduleInterleaved1F1B",
    "loopedbfs": "ScheduleLoopedBFS",
    "bfs": "ScheduleLoopedBFS",
    "interleavedzerobubble": "ScheduleInterleavedZeroBubble",
    "zerobubble": "ScheduleInterleavedZeroBubble",
    "zbvzerobubble": "ScheduleZBVZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "vschedule": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}

SINGLE_STAGE = ("Schedule1F1B", "ScheduleGPipe")
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def schedule_class_name(name: str) -> str:
    """The torch schedule class for an Automodel or torchtitan spelling; ConfigError listing them otherwise."""
    key = re.sub(r"[_\-\s]", "", name.lower()).removeprefix("schedule")
    if key not in SCHEDULES:
        raise ConfigError(
            f"distributed.pipeline.pp_schedule: unknown schedule {name!r} (accepted: "
            f"{', '.join(sorted(SCHEDULES))}; case, '_' and '-' are ignored)"
        )
    return SCHEDULES[key]


__all__ = ["SCHEDULES", "SINGLE_STAGE", "V_SHAPED", "schedule_class_name"]
