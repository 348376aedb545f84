"""Parallel degrees: the one DeviceMesh and the meshes derived from it.

``ParallelDims.from_config(cfg.distributed, world_size)`` infers ``dp_size`` (world / (tp * pp * cp)) after
the rules between the degrees (``headrace.training.config.validate.check_degrees``: a ``ConfigError`` naming the broken
rule), before any process group work. ``build_meshes`` then makes one mesh with the fixed dim order
``(pp, dp_replicate, dp_shard, cp, tp)`` (size-1 dims included, so code never branches on which dims exist)
and flattens the derived dims:

- ``dp``          = dp_replicate x dp_shard: the *batch* mesh; ranks differing only in tp/cp/pp read the same data.
- ``dp_shard_cp`` = dp_shard x cp: the FSDP shard dim (cp ranks hold different tokens, so they shard too).
- ``dp_cp``       = dp x cp: the *loss* mesh; token counts and losses are summed over it.

tp is innermost so tensor-parallel peers are neighbouring ranks (same node on GPU clusters).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from headrace.training.config.job_config import DistributedConfig
from headrace.training.config.validate import check_degrees

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    strategy: str
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    sequence_parallel: bool
    world_size: int

    @classmethod
    def from_config(cls, cfg: DistributedConfig, world_size: int) -> "ParallelDims":
        """The degrees of ``cfg`` over ``world_size`` ranks, after every rule between them
        (``headrace.training.config.validate.check_degrees``); dp inferred when ``dp_size`` is null."""
        dp = check_degrees(cfg, world_size)
        replicate = cfg.dp_replicate_size or 1
        return cls(strategy=cfg.strategy, dp_replicate=replicate, dp_shard=dp // replicate, cp=cfg.cp_size,
                   tp=cfg.tp_size, pp=cfg.pp_size, ep=cfg.ep_size, sequence_parallel=cfg.sequence_parallel,
                   world_size=world_size)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    def build_meshes(self, device_type: str) -> dict[str, DeviceMesh]:
        """The world mesh plus its named and flattened sub-meshes (see module doc), by name:
        ``world``, ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, ``dp``, ``dp_shard_cp``, ``dp_cp``,
        and ``fsdp`` (1-D ``dp_shard_cp``, or 2-D ``(dp_replicate, dp_shard_cp)`` for HSDP)."""
        world = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIMS)
        meshes = {"world": world, **{name: world[name] for name in MESH_DIMS}}
        meshes["dp"] = world["dp_replicate", "dp_shard"]._flatten("dp")
        meshes["dp_shard_cp"] = world["dp_shard", "cp"]._flatten("dp_shard_cp")
        meshes["dp_cp"] = world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        meshes["fsdp"] = (world["dp_replicate", "dp_shard_cp"] if self.dp_replicate > 1 else meshes["dp_shard_cp"])
        return meshes


def gather_objects(obj) -> list:
    """``obj`` of every rank, in rank order (a collective: call on all ranks)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def rank_coordinates(mesh: DeviceMesh) -> list[dict[str, int]]:
    """Every rank's coordinate along each named dim (a collective: call on all ranks)."""
    return gather_objects(dict(zip(MESH_DIMS, mesh.get_coordinate())))


def format_coordinates(coords: list[dict[str, int]]) -> str:
    header = "rank " + " ".join(f"{d:>12}" for d in MESH_DIMS)
    rows = [f"{r:>4} " + " ".join(f"{c[d]:>12}" for d in MESH_DIMS) for r, c in enumerate(coords)]
    return "\n".join([header, *rows])


__all__ = ["MESH_DIMS", "ParallelDims", "format_coordinates", "rank_coordinates"]
