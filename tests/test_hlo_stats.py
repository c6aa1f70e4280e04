"""Reading collectives and Mosaic kernel grids out of optimized HLO text (rollverify_jax/scale/hlo_stats.py)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from rollverify_jax.scale import hlo_stats


def test_collectives_in_a_loop_count_its_trips():
    """A real CPU program on 8 devices: a psum over 4 and an all-gather over 2, five times in a fori_loop."""
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)

    def body(x):
        def step(_, x):
            y = jax.lax.psum(x, "b")
            return x + jax.lax.all_gather(y, "a", tiled=True)[: x.shape[0]]
        return jax.lax.fori_loop(0, 5, step, x)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("a", "b"), out_specs=P("a", "b")))
    items = hlo_stats.collectives(f.lower(jnp.ones((8, 16), jnp.float32)).compile().as_text())
    kinds = {c.kind: c for c in items}
    assert set(kinds) == {"all-reduce", "all-gather"}
    assert kinds["all-reduce"].count == 5 and kinds["all-reduce"].group == 4
    assert kinds["all-reduce"].bytes == 4 * 4 * 4  # the [4, 4] float32 shard
    assert kinds["all-gather"].count == 5 and kinds["all-gather"].group == 2 and kinds["all-gather"].bytes == 128
    s = hlo_stats.summarize(items, runs=5)
    assert s["count"] == 2
    assert s["bytes_sent"] == pytest.approx(2 * 3 / 4 * 64 + 1 / 2 * 128)  # ring all-reduce, ring all-gather


# TPU-style text: nested loops (the inner one's trip count from its condition's constant), the three ways XLA
# prints replica groups, asynchronous starts (and their dones, not counted twice), a collective in a fusion.
HLO = """\
HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  ROOT %s = f32[] add(%x, %y)
}

%ar_fusion (p: bf16[64,8]) -> bf16[64,8] {
  %p = bf16[64,8]{1,0} parameter(0)
  ROOT %ar = bf16[64,8]{1,0} all-reduce(%p), replica_groups=[4,4]<=[16], to_apply=%add
}

%inner_cond (t: (s32[], f32[8])) -> pred[] {
  %c = s32[]{:T(128)} constant(3)
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

%inner_body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %x = f32[8]{0} get-tuple-element(%t), index=1
  %ag = f32[32]{0} all-gather(%x), replica_groups=mesh['axis_0'=4,'axis_1'=4] {'axis_0'}, dimensions={0}
  %ar2 = bf16[64,8]{1,0} fusion(%y), kind=kCustom, calls=%ar_fusion
  ROOT %r = (s32[], f32[8]) tuple(%i, %x)
}

%outer_cond (t: (s32[], f32[8])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

%outer_body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %w = (s32[], f32[8]) while(%t), condition=%inner_cond, body=%inner_body
  %cp = (f32[16]{0}, f32[16]{0}, u32[], u32[]) collective-permute-start(%z), source_target_pairs={{0,1},{1,0}}
  %cpd = f32[16]{0} collective-permute-done(%cp)
  ROOT %r = (s32[], f32[8]) tuple(%i, %x)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %w = (s32[],f32[8]) while(%t), body=%outer_body, condition=%outer_cond, backend_config={"known_trip_count":{"n":"16"}}
  %ags = (f32[8]{0}, f32[64]{0}) all-gather-start(%a), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %agd = f32[64]{0} all-gather-done(%ags)
  ROOT %o = f32[8] copy(%a)
}
"""


def test_collectives_of_tpu_text_with_nested_loops_and_async_pairs():
    by_name = {c.name: c for c in hlo_stats.collectives(HLO)}
    assert set(by_name) == {"ar", "ag", "cp", "ags"}
    assert (by_name["ar"].count, by_name["ar"].group, by_name["ar"].bytes) == (48, 4, 64 * 8 * 2)
    assert (by_name["ag"].count, by_name["ag"].group, by_name["ag"].bytes) == (48, 4, 32 * 4)
    assert (by_name["cp"].kind, by_name["cp"].count, by_name["cp"].bytes) == ("collective-permute", 16, 64)
    assert (by_name["ags"].count, by_name["ags"].group, by_name["ags"].bytes) == (1, 8, 64 * 4)


def test_collectives_need_an_entry_computation():
    with pytest.raises(ValueError, match="ENTRY"):
        hlo_stats.collectives("%x (a: f32[]) -> f32[] {\n}\n")


def test_no_mosaic_kernel_in_a_cpu_program():
    text = jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile().as_text()
    assert hlo_stats.mosaic_kernels(text) == []
