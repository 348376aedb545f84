from dataclasses import dataclass, field
from typing import Literal

import pytest

from headrace.config import ConfigError, apply_overrides, from_dict, to_dict


@dataclass(kw_only=True)
class Dataset:
    path: str
    weight: float = 1.0


@dataclass(kw_only=True)
class Section:
    datasets: list[Dataset] = field(default_factory=list)
    packing: Literal["none", "greedy", "best_fit"] = "none"
    seed: int | Literal["randomized"] = 0
    workers: int = 0
    extra: dict[str, int] = field(default_factory=dict)


@dataclass(kw_only=True)
class Root:
    data: Section = field(default_factory=Section)
    name: str | None = None


def test_round_trip_and_defaults():
    cfg = from_dict(Root, {"data": {"datasets": [{"path": "a", "weight": 2}], "seed": "randomized"}})
    assert cfg.data.datasets[0].weight == 2.0 and isinstance(cfg.data.datasets[0].weight, float)
    assert cfg.data.seed == "randomized" and cfg.name is None
    assert from_dict(Root, to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            {"data": {"datasets": [{"path": "a"}, {"path": "b", "weight": "heavy"}]}},
            "Root.data.datasets[1].weight: expected float",
        ),
        ({"data": {"wokers": 2}}, "Root.data.wokers: unknown key"),
        ({"data": {"packing": "tight"}}, "Root.data.packing: expected one of"),
        ({"data": {"workers": True}}, "Root.data.workers: expected int"),
        ({"data": {"datasets": [{"weight": 1.0}]}}, "Root.data.datasets[0].path: required key is missing"),
        ({"data": {"extra": {"a": "x"}}}, "Root.data.extra.a: expected int"),
    ],
)
def test_errors_name_the_dotted_path(raw, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        from_dict(Root, raw)


def test_overrides_parse_yaml_scalars():
    raw = apply_overrides(
        {"data": {"workers": 0}},
        ["data.workers=4", "data.packing=best_fit", "name=run1", "data.datasets=[{path: a, weight: 1e-3}]"],
    )
    cfg = from_dict(Root, raw)
    assert (cfg.data.workers, cfg.data.packing, cfg.name) == (4, "best_fit", "run1")
    assert cfg.data.datasets[0].weight == 0.001  # YAML 1.1 reads 1e-3 as a string
    with pytest.raises(ConfigError, match="expected KEY.PATH=VALUE"):
        apply_overrides({}, ["data.workers"])
    with pytest.raises(ConfigError, match="data.workers is not a section"):
        apply_overrides({"data": {"workers": 1}}, ["data.workers.x=1"])
