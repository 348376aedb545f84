"""Parallel degrees: their rules, the one DeviceMesh and every mesh derived from it.

``ParallelDims.from_config(cfg.distributed, world_size)`` checks the rules between the degrees and the world size
(a ``ConfigError`` naming the broken rule and its fix) and infers ``dp_size`` (world / (tp * pp * cp)) before any
process group work: the trainer runs it right after ``check_job``. ``build_meshes`` then makes one mesh with the
fixed dim order ``(pp, dp_replicate, dp_shard, cp, tp)`` (size-1 dims included, so code never branches on which
dims exist) and keeps it with the meshes derived from it; ``get_mesh(name)`` hands each out:

- ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``: the world mesh's dims (``world``: the whole mesh);
- ``dp``          = dp_replicate x dp_shard: the *batch* mesh; ranks differing only in tp/cp/pp read the same data;
- ``dp_shard_cp`` = dp_shard x cp: the FSDP shard dim (cp ranks hold different tokens, so they shard too);
- ``dp_cp``       = dp x cp: the *loss* mesh; token counts and losses are summed over it;
- ``fsdp``        = ``dp_shard_cp``, or the 2-D ``(dp_replicate, dp_shard_cp)`` for HSDP;
- ``ep``, ``ep_shard`` (ep > 1): ``dp_cp`` unflattened into (ep_shard, ep), ep innermost: experts are sharded
  over ``ep`` and their FSDP2 over ``ep_shard`` (``headrace.training.distributed.moe``).

tp is innermost so tensor-parallel peers are neighbouring ranks (same node on GPU clusters). Cost: the meshes'
process groups, made once per job.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from headrace.config import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def check_degrees(cfg, world_size: int) -> int:
    """``dp_size`` of ``cfg`` (a ``DistributedConfig``) over ``world_size`` ranks (world / (tp * pp * cp) when
    null), after every rule between the degrees and the world size."""
    for name in ("tp_size", "pp_size", "cp_size", "ep_size", "dp_size", "dp_replicate_size"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ConfigError(f"distributed.{name} must be >= 1, got {value}")
    tp, pp, cp, ep = cfg.tp_size, cfg.pp_size, cfg.cp_size, cfg.ep_size
    if cfg.strategy == "ddp":
        bad = {n: v for n, v in dict(tp_size=tp, pp_size=pp, cp_size=cp, ep_size=ep).items() if v > 1}
        if bad:
            raise ConfigError(
                f"distributed: strategy ddp replicates the whole model: it cannot combine with "
                f"{bad}; use strategy fsdp2 for model parallelism"
            )
        if cfg.dp_replicate_size not in (None, 1):
            raise ConfigError(
                "distributed: dp_replicate_size (HSDP) needs strategy fsdp2; ddp already replicates everywhere"
            )
    non_dp = tp * pp * cp
    if cfg.dp_size is None:
        if world_size % non_dp:
            raise ConfigError(
                f"distributed: world size {world_size} is not divisible by tp_size * pp_size * cp_size = {non_dp}"
            )
        dp = world_size // non_dp
    else:
        dp = cfg.dp_size
    if dp * non_dp != world_size:
        raise ConfigError(
            f"distributed: dp_size * tp_size * pp_size * cp_size = {dp}*{tp}*{pp}*{cp} = "
            f"{dp * non_dp} must equal the world size {world_size}"
        )
    replicate = cfg.dp_replicate_size or 1
    if dp % replicate:
        raise ConfigError(f"distributed: dp_replicate_size {replicate} must divide dp_size {dp}")
    if cfg.sequence_parallel and tp == 1:
        raise ConfigError("distributed: sequence_parallel shards activations over the tp group: it needs tp_size > 1")
    if ep > 1 and (dp * cp) % ep:
        raise ConfigError(
            f"distributed: ep_size {ep} must divide dp_size * cp_size = {dp * cp} (experts borrow those ranks)"
        )
    if cfg.activation_checkpointing_every < 1:
        raise ConfigError("distributed: activation_checkpointing_every must be >= 1")
    return dp


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
    # name -> mesh, filled once by build_meshes (the degrees above stay the object's identity)
    meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_config(cls, cfg, world_size: int) -> ParallelDims:
        """The degrees of ``cfg`` (a ``DistributedConfig``) over ``world_size`` ranks, after every rule between
        them (``check_degrees``); dp inferred when ``dp_size`` is null. No mesh yet (``build_meshes``)."""
        dp = check_degrees(cfg, world_size)
        replicate = cfg.dp_replicate_size or 1
        return cls(
            strategy=cfg.strategy,
            dp_replicate=replicate,
            dp_shard=dp // replicate,
            cp=cfg.cp_size,
            tp=cfg.tp_size,
            pp=cfg.pp_size,
            ep=cfg.ep_size,
            sequence_parallel=cfg.sequence_parallel,
            world_size=world_size,
        )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def dp_sharded(self) -> bool:
        """Whether FSDP2 has more than one rank to shard over (dp_replicate x dp_shard x cp > 1)."""
        return self.dp * self.cp > 1

    def build_meshes(self, device_type: str) -> ParallelDims:
        """Make the world mesh and every mesh derived from it (module docstring); returns ``self``. Collective."""
        world = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIMS)
        meshes = {"world": world, **{name: world[name] for name in MESH_DIMS}}
        meshes["dp"] = world["dp_replicate", "dp_shard"]._flatten("dp")
        meshes["dp_shard_cp"] = world["dp_shard", "cp"]._flatten("dp_shard_cp")
        meshes["dp_cp"] = world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        meshes["fsdp"] = world["dp_replicate", "dp_shard_cp"] if self.dp_replicate > 1 else meshes["dp_shard_cp"]
        if self.ep_enabled:
            moe_mesh = meshes["dp_cp"]._unflatten(0, ((self.dp * self.cp) // self.ep, self.ep), ("ep_shard", "ep"))
            meshes |= {"ep": moe_mesh["ep"], "ep_shard": moe_mesh["ep_shard"]}
        self.meshes.clear()
        self.meshes.update(meshes)
        return self

    def get_mesh(self, name: str) -> DeviceMesh:
        """The mesh called ``name`` (module docstring); a clear error before ``build_meshes`` or for ``ep``
        without expert parallelism."""
        try:
            return self.meshes[name]
        except KeyError:
            built = ", ".join(self.meshes) or "none: call build_meshes first"
            raise KeyError(f"ParallelDims has no mesh {name!r} (built: {built})") from None


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


__all__ = ["MESH_DIMS", "ParallelDims", "check_degrees", "format_coordinates", "gather_objects", "rank_coordinates"]
