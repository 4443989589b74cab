"""Collective counting from HLO text: every replica-group syntax, loop-aware."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxdist import inspect as hlo

SYNTHETIC = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%inner_body (p: (s32[], f32[256])) -> (s32[], f32[256]) {
  %p = (s32[], f32[256]{0}) parameter(0)
  %x = f32[256]{0} get-tuple-element(%p), index=1
  %ar = f32[256]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %cp = f32[256]{0} collective-permute(%ar), channel_id=2, source_target_pairs={{0,1},{1,0}}
  ROOT %t = (s32[], f32[256]{0}) tuple(%i, %cp)
}

%inner_cond (p: (s32[], f32[256])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

%outer_body (p: (s32[], f32[256])) -> (s32[], f32[256]) {
  %p = (s32[], f32[256]{0}) parameter(0)
  %w = (s32[], f32[256]{0}) while(%p), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  %y = f32[256]{0} get-tuple-element(%w), index=1
  %ag = f32[2048]{0} all-gather(%y), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}
  ROOT %t = (s32[], f32[256]{0}) tuple(%i, %y)
}

%wrapped (q: (s32[], f32[256])) -> (s32[], f32[256]) {
  %q = (s32[], f32[256]{0}) parameter(0)
  ROOT %w2 = (s32[], f32[256]{0}) while(%q), condition=%inner_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"5"}}
}

ENTRY %main (x: f32[64,32]) -> f32[8,32] {
  %x = f32[64,32]{1,0} parameter(0)
  %rs = f32[8,32]{1,0} reduce-scatter(%x), channel_id=4, replica_groups=mesh['a'=2,'b'=4] {'a','b'}, dimensions={0}, to_apply=%add
  %a2a = f32[64,32]{1,0} all-to-all(%x), channel_id=5, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}
  %c = (s32[], f32[256]{0}) call(%init), to_apply=%wrapped
  %ars = (f32[4]{0}, bf16[8]{0}) all-reduce-start(%x, %x), channel_id=6, replica_groups=mesh['a'=2,'b'=4] {'b'}, to_apply=%add
  %one = f32[64,32]{1,0} all-reduce(%x), channel_id=7, replica_groups={{0}}, use_global_device_ids=true, to_apply=%add
  ROOT %r = f32[8,32]{1,0} copy(%rs)
}
"""


def test_synthetic_module_every_syntax_and_nested_loops():
  found = {c.name: c for c in hlo.parse_collectives(SYNTHETIC)[0]}
  assert found["ar"].group_size == 4 and found["ar"].multiplicity == 15  # 3 inner × 5 outer
  assert found["cp"].multiplicity == 15 and found["cp"].wire_bytes == 1024
  assert found["ag"].group_size == 8 and found["ag"].multiplicity == 5
  assert found["rs"].group_size == 8 and found["rs"].result_bytes == 8 * 32 * 4
  assert found["a2a"].group_size == 2
  assert found["ars"].kind == "all-reduce" and found["ars"].group_size == 4
  assert found["ars"].result_bytes == 4 * 4 + 8 * 2
  assert found["one"].group_size == 1 and found["one"].wire_bytes == 0
  summary = hlo.collective_summary(SYNTHETIC)
  assert summary["all-reduce"].count == 16  # a psum over one device moves nothing: not counted
  assert summary["all-reduce"].wire_bytes == pytest.approx(15 * 2 * 3 / 4 * 1024 + 2 * 3 / 4 * 32)
  assert summary["all-gather"].result_bytes == 5 * 2048 * 4
  assert summary["reduce-scatter"].wire_bytes == 7 * 8 * 32 * 4


def test_compiled_loop_body_all_reduce_counted_per_iteration():
  mesh = Mesh(np.array(jax.devices()), ("d",), axis_types=(AxisType.Auto,))

  def f(w, x):
    def body(_, carry):
      # The all-reduce depends on the carry, so XLA cannot hoist it out of the loop.
      return carry + jnp.sum(x * carry, axis=0, keepdims=True)
    return jax.lax.fori_loop(0, 7, body, w)

  compiled = jax.jit(f, in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))),
                     out_shardings=NamedSharding(mesh, P())).lower(
                         jnp.ones((1, 16)), jnp.ones((64, 16))).compile()
  summary = hlo.collective_summary(compiled.as_text())
  assert summary["all-reduce"].count == 7
  assert summary["all-reduce"].result_bytes == 7 * 16 * 4
  assert not hlo.parse_collectives(compiled.as_text())[1]  # no loop of unknown trip count
