"""ParallelDims: dp inference and every invalid combination's ValueError (pure logic, no process group)."""

import pytest

from headrace.training.config.job_config import DistributedConfig
from headrace.training.distributed.parallel_dims import ParallelDims


def dims(world, **kw):
    return ParallelDims.from_config(DistributedConfig(**kw), world)


def test_dp_is_inferred_from_the_other_degrees():
    d = dims(8, tp_size=2)
    assert (d.dp, d.dp_shard, d.dp_replicate, d.tp) == (4, 4, 1, 2)
    d = dims(8, tp_size=2, dp_replicate_size=2)
    assert (d.dp, d.dp_shard, d.dp_replicate) == (4, 2, 2)
    assert d.shape == (1, 2, 2, 1, 2)
    assert dims(4, strategy="ddp").dp == 4


@pytest.mark.parametrize(
    "world, kw, rule",
    [
        (4, dict(strategy="ddp", tp_size=2), "strategy ddp replicates the whole model"),
        (4, dict(strategy="ddp", pp_size=2), "strategy ddp replicates the whole model"),
        (4, dict(strategy="ddp", cp_size=2), "strategy ddp replicates the whole model"),
        (4, dict(strategy="ddp", ep_size=2), "strategy ddp replicates the whole model"),
        (4, dict(strategy="ddp", dp_replicate_size=2), "dp_replicate_size \\(HSDP\\) needs strategy fsdp2"),
        (6, dict(tp_size=4), "world size 6 is not divisible by tp_size \\* pp_size \\* cp_size = 4"),
        (8, dict(dp_size=2, tp_size=2), "must equal the world size 8"),
        (8, dict(dp_replicate_size=3), "dp_replicate_size 3 must divide dp_size 8"),
        (4, dict(sequence_parallel=True), "sequence_parallel .* needs tp_size > 1"),
        (4, dict(ep_size=3), "ep_size 3 must divide dp_size \\* cp_size = 4"),
        (4, dict(tp_size=0), "distributed.tp_size must be >= 1"),
        (4, dict(activation_checkpointing_every=0), "activation_checkpointing_every must be >= 1"),
    ],
)
def test_invalid_layouts_name_the_broken_rule(world, kw, rule):
    with pytest.raises(ValueError, match=rule):
        dims(world, **kw)


def test_enabled_flags_and_no_mesh_before_build_meshes():
    d = dims(8, tp_size=2, ep_size=4)
    assert (d.tp_enabled, d.cp_enabled, d.pp_enabled, d.ep_enabled, d.dp_sharded) == (True, False, False, True, True)
    assert not dims(1).dp_sharded
    with pytest.raises(KeyError, match="no mesh 'tp' .*call build_meshes first"):
        d.get_mesh("tp")


def test_one_rank_gets_every_mesh_but_ep(process_group):
    d = dims(1).build_meshes("cpu")
    assert {
        "world",
        "pp",
        "dp_replicate",
        "dp_shard",
        "cp",
        "tp",
        "dp",
        "dp_shard_cp",
        "dp_cp",
        "fsdp",
    } == d.meshes.keys()
    assert d.get_mesh("dp_cp").size() == 1 and d == dims(1)  # the meshes are not part of the degrees' identity
    with pytest.raises(KeyError, match="no mesh 'ep'"):
        d.get_mesh("ep")
