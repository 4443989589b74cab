"""Sharding strategies per primitive.

A rule returns either :class:`Follow` (the equation takes the strategy index of one
operand's producer, mapping that operand's spec to its outputs; its variables are
shared with the producer, which keeps the ILP small) or a list of :class:`Strategy`
(an independent choice). The rules follow Alpa's (see shared/REFERENCE.md):

- elementwise ops, convert, select: follow the largest operand;
- broadcast_in_dim, reshape, transpose, squeeze, expand_dims: follow, mapping dims;
- slice, pad, concatenate, split, rev, dynamic_slice/update_slice, cumulative ops, sort:
  follow, with the touched dimensions unsplit (fft: all of them);
- reductions: follow, dropping reduced dims; a split reduced dim costs an all-reduce;
- dot_general: each mesh axis splits one batch dim, the lhs free dim, the rhs free dim or
  the contraction (a partial sum, reduced by an all-reduce over that axis), or nothing;
- reduced (or contracted) dims split over different mesh axes are all-reduced one dim at
  a time, as XLA's partitioner does (a loss summed over a batch split on one axis and a
  sequence split on the other: two all-reduces of the result, not one over both axes);
- conv_general_dilated: batch, output-feature or input-feature (all-reduce) splits;
- pooling (reduce_window_*, select_and_scatter_add): like slicing, the dims a window
  spans, strides or pads kept unsplit;
- dots and convs are "heavy": when some strategy splits them over every mesh axis,
  the strategies that leave an axis computing redundantly are dropped (Alpa's
  ``allow_recompute_heavy_op=False``): replicating a matmul wastes the devices it runs
  on, a cost the α-β model would otherwise miss for small tensors;
- stack / unstack: follow, the stacked dim unsplit; tile like slicing;
- gather: indices split on a batch dim, operand replicated; scatter-add: updates split
  on a batch dim, the partial sums all-reduced; a scatter (set, mul, min, max, add): the
  operand's passthrough dims (window dims no index reaches: an embedding's hidden dim)
  split alike in operand, updates and output, the indices replicated (for an add with
  batched indices, not in a micro-batch loop);
- iota: any spec at no cost;
- random_bits from one key (dropout masks): any spec, the key replicated: jax's
  partitionable threefry gives every element the same bits whatever the layout;
  threefry2x32 on arrays (``jaxdist.rng`` draws a part of a batch's bits) and
  random_clone (``nn.scan``'s split keys): elementwise;
- bitcast_convert_type between types of one width: elementwise;
- while, cond, scan, top_k (XLA gathers its operand) and the other RNG primitives:
  replicated;
- anything else: replicated, with one warning naming the primitive.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable

from jaxdist.shard.cost import CostModel
from jaxdist.shard.specs import DimAxes, divides, enumerate_specs, replicated


@dataclasses.dataclass(frozen=True)
class Strategy:
  """One way to run an equation (or hold an input).

  Attributes:
    name: readable label, e.g. ``"dot b=[] l=[x] r=[] k=[]"``.
    out_specs: the spec of each output.
    in_specs: the spec each operand must have (None: no requirement).
    cost: compute plus communication of the equation itself, in seconds.
    collectives: the collectives behind that communication, as (kind, mesh axes,
      per-device result bytes).
  """

  name: str
  out_specs: tuple[DimAxes, ...]
  in_specs: tuple[DimAxes | None, ...]
  cost: float = 0.0
  collectives: tuple = ()


@dataclasses.dataclass(frozen=True)
class Follow:
  """Take the strategy of operand ``operand``'s producer.

  ``mapper(operand_spec) -> Strategy`` builds this equation's strategy from the spec
  its followed operand has under that producer strategy.
  """

  operand: int
  mapper: Callable[[DimAxes], Strategy]


ELEMENTWISE = frozenset("""
abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp complex conj
convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor
ge gt igamma imag integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg
nextafter not or pow real reduce_precision rem round rsqrt select_n sign sin sinh sqrt square
sub tan tanh xor shift_left shift_right_logical shift_right_arithmetic population_count
stop_gradient optimization_barrier
""".split())

REDUCTIONS = frozenset("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or "
                       "reduce_xor argmax argmin".split())
CUMULATIVE = frozenset("cumsum cumprod cummax cummin cumlogsumexp".split())
# Pooling and its gradients: split anywhere but along the dims a window spans.
WINDOWED = frozenset("reduce_window_sum reduce_window_max reduce_window_min reduce_window "
                     "select_and_scatter_add select_and_gather_add".split())
SCATTERS = frozenset("scatter scatter-mul scatter_mul scatter-min scatter_min scatter-max "
                     "scatter_max".split())
# top_k: XLA's partitioner gathers its operand whole, whatever its split (measured on
# 2-, 3- and 4-D operands split on dim 0), so planning it replicated is what compiles.
# random_gamma (jax.random.beta's and gamma's draws; a mixup's mixing weight) draws each
# element from its own key: replicated, every device draws the same values.
REPLICATE_QUIETLY = frozenset("while cond scan random_bits random_seed random_wrap random_unwrap "
                              "random_split random_fold_in rng_bit_generator "
                              "rng_uniform top_k random_gamma".split())


def _shape(v):
  return tuple(getattr(v.aval, "shape", ()))


def _nbytes(v) -> float:
  aval = v.aval
  dtype = getattr(aval, "dtype", None)
  itemsize = getattr(dtype, "itemsize", 4) or 4
  return float(math.prod(_shape(v)) * itemsize)


def _unsplit(spec: DimAxes, dims) -> DimAxes:
  return tuple(() if d in dims else a for d, a in enumerate(spec))


def _replicated_strategy(eqn, name: str, cost: float = 0.0) -> Strategy:
  return Strategy(name, tuple(replicated(len(_shape(v))) for v in eqn.outvars),
                  tuple(replicated(len(_shape(v))) for v in eqn.invars), cost)


def rule_for(eqn, cost_model: CostModel, produced: Callable,
             freedom: Callable = lambda v: 0,
             expanded: Callable = lambda v: False,
             pinned: Callable = lambda v: False) -> Follow | list[Strategy] | None:
  """The rule for ``eqn``; None means: no rule (replicate and warn).

  ``produced(var)`` tells whether an operand comes from another node (not a literal):
  only those can be followed. ``freedom(var)`` is the number of choices of the
  operand's group: among equally large operands, one that is not a smaller value
  broadcast up (``expanded(var)``: BatchNorm's statistics, a softmax's row max) is
  followed, then one whose only choice splits it (``pinned(var)``: ZeRO's sharded
  optimizer state), then the freest (a causal mask built from an iota must not decide
  the layout of the attention scores).
  """
  name = eqn.primitive.name
  sizes = cost_model.axis_sizes
  if not any(produced(v) for v in eqn.invars):
    # Built from literals only (a broadcast constant, an iota): any layout, no cost.
    out = eqn.outvars[0]
    if len(eqn.outvars) == 1 and name in ELEMENTWISE | {"broadcast_in_dim", "iota",
                                                         "convert_element_type", "reshape"}:
      return [Strategy(f"{name} (constant)", (s,), (None,) * len(eqn.invars))
              for s in enumerate_specs(_shape(out), sizes)]
    return [_replicated_strategy(eqn, f"{name} (constant)")]
  if (name in ELEMENTWISE or _is_elementwise_call(eqn) or _same_width_bitcast(eqn)
      or name in ("threefry2x32", "random_clone")):
    return _elementwise(eqn, produced, freedom, expanded, pinned)
  if name == "random_bits" and not _shape(eqn.invars[0]):
    return [Strategy("random_bits", (s,), (replicated(0),))
            for s in enumerate_specs(_shape(eqn.outvars[0]), sizes)]
  if name == "dot_general":
    # A transformer's blocks repeat the same dots: their strategies are built once.
    key = (_shape(eqn.invars[0]), _shape(eqn.invars[1]), eqn.params["dimension_numbers"],
           _nbytes(eqn.outvars[0]), len(_shape(eqn.outvars[0])), cost_model)
    if key not in _DOT_CACHE:
      if len(_DOT_CACHE) > 4096:
        _DOT_CACHE.clear()
      _DOT_CACHE[key] = _dot_general(eqn, cost_model)
    return _DOT_CACHE[key]
  if name in REDUCTIONS:
    return _reduction(eqn, cost_model)
  if name == "broadcast_in_dim":
    return _broadcast(eqn, sizes)
  if name == "transpose":
    perm = eqn.params["permutation"]
    return Follow(0, lambda s: Strategy("transpose", (tuple(s[p] for p in perm),), (s,)))
  if name in ("reshape", "squeeze", "expand_dims"):
    return _reshape(eqn, sizes)
  if name in ("slice", "pad", "rev", "dynamic_slice", "dynamic_update_slice", "concatenate",
              "split", "sort", "fft", "tile") or name in CUMULATIVE or name in WINDOWED:
    return _touching(eqn, sizes)
  if name in ("stack", "unstack"):
    return _stacking(eqn, produced)
  if name == "iota":
    shape = _shape(eqn.outvars[0])
    return [Strategy("iota", (s,), (), 0.0) for s in enumerate_specs(shape, sizes)]
  if name == "gather":
    return _gather(eqn, sizes)
  if name in ("scatter-add", "scatter_add"):
    # Also its passthrough splits (x.at[:, 0].add(v); an embedding gradient split on the
    # hidden dim like its table: no all-reduce, and no whole-table gradient on every
    # device). In a micro-batch loop, one split after it over the batch axis and then
    # another is gathered before its slice: ``micro.gather_after_loop`` prices that.
    through = _scatter_passthrough(eqn, sizes)
    return _scatter_add(eqn, cost_model) + through
  if name in SCATTERS:
    return Follow(0, _scatter_mapper(eqn))
  if name == "conv_general_dilated":
    return _conv(eqn, cost_model)
  if name in REPLICATE_QUIETLY:
    return [_replicated_strategy(eqn, name)]
  return None


def _same_width_bitcast(eqn) -> bool:
  return (eqn.primitive.name == "bitcast_convert_type"
          and _shape(eqn.invars[0]) == _shape(eqn.outvars[0]))


def _is_elementwise_call(eqn) -> bool:
  """custom_jvp / custom_vjp wrappers of elementwise functions (relu, gelu, ...)."""
  if eqn.primitive.name not in ("custom_jvp_call", "custom_vjp_call"):
    return False
  shapes = {_shape(v) for v in list(eqn.invars) + list(eqn.outvars) if _shape(v)}
  body = eqn.params.get("call_jaxpr")
  inner = getattr(body, "jaxpr", body)
  return (len(shapes) == 1 and inner is not None
          and all(e.primitive.name in ELEMENTWISE | {"broadcast_in_dim"} for e in inner.eqns))


def _elementwise(eqn, produced, freedom, expanded=lambda v: False,
                 pinned=lambda v: False) -> Follow | None:
  shape = _shape(eqn.outvars[0])
  candidates = [i for i, v in enumerate(eqn.invars)
                if produced(v) and len(_shape(v)) == len(shape)]
  if eqn.primitive.name == "select_n" and any(i > 0 for i in candidates):
    candidates = [i for i in candidates if i > 0]  # follow the data, not the predicate
  if not candidates:
    return None
  # Follow the produced operand with the most elements (all operands may broadcast),
  # then one held split with no other choice (so that an update of a sharded state runs
  # on its shards, instead of the state being gathered to follow a replicated operand),
  # then the one whose group has the most choices.
  lead = max(candidates, key=lambda i: (math.prod(_shape(eqn.invars[i])),
                                        not expanded(eqn.invars[i]), pinned(eqn.invars[i]),
                                        freedom(eqn.invars[i]), -i))

  def full_dims(v):
    # Operands of the output's rank may have size-1 dims that broadcast (jax 0.10's
    # binary ops accept them): those dims stay unsplit, the others keep the split.
    # None: another rank (a scalar), replicated.
    vs = _shape(v)
    return None if len(vs) != len(shape) else tuple(a == b for a, b in zip(vs, shape))

  ranks = [len(_shape(v)) for v in eqn.invars]
  name = eqn.primitive.name

  def part(f, rank=0):
    """How a spec becomes an operand's or output's, decided once (the mapper runs for
    every choice of every elementwise equation): replicated (another rank), whole, or
    without its broadcast dims."""
    return ("replicated", replicated(rank)) if f is None else \
        ("whole", None) if all(f) else ("masked", f)

  def cut(spec, how):
    kind, x = how
    return (x if kind == "replicated" else spec if kind == "whole"
            else tuple(a if k else () for a, k in zip(spec, x)))

  lead_part = part(full_dims(eqn.invars[lead]))
  in_parts = [part(full_dims(v), r) for v, r in zip(eqn.invars, ranks)]
  out_parts = [part(full_dims(v)) for v in eqn.outvars]

  def mapper(spec):
    # The split of a dim carries over only where the followed operand is full-size.
    spec = cut(spec, lead_part)
    return Strategy(name, tuple(cut(spec, p) for p in out_parts),
                    tuple(cut(spec, p) for p in in_parts))

  return Follow(lead, mapper)


def _reduction(eqn, cost_model: CostModel) -> Follow:
  axes = tuple(eqn.params.get("axes", ()))
  if eqn.primitive.name in ("argmax", "argmin"):
    axes = tuple(eqn.params["axes"])
  out = eqn.outvars[0]

  def mapper(spec):
    reduced = tuple(a for d in axes for a in spec[d])
    out_spec = tuple(s for d, s in enumerate(spec) if d not in axes)
    shards = math.prod(cost_model.axis_sizes[a] for s in out_spec for a in s)
    comm = partial_sums([spec[d] for d in axes], _nbytes(out) / shards)
    if reduced and eqn.primitive.name in ("argmax", "argmin"):
      # XLA gathers every shard's (value, index) candidates and picks among them locally.
      gathered = math.prod(cost_model.axis_sizes[a] for a in reduced) / shards
      size = math.prod(out.aval.shape) * gathered
      comm = (("all-gather", reduced, size * eqn.invars[0].aval.dtype.itemsize),
              ("all-gather", reduced, size * out.aval.dtype.itemsize))
    return Strategy(eqn.primitive.name, (out_spec,), (spec,),
                    sum(cost_model.collective(*c) for c in comm), comm)

  return Follow(0, mapper)


def _broadcast(eqn, sizes) -> Follow | list[Strategy]:
  operand = eqn.invars[0]
  in_shape, out_shape = _shape(operand), _shape(eqn.outvars[0])
  dims = eqn.params["broadcast_dimensions"]

  def mapper(spec):
    out = [()] * len(out_shape)
    kept = list(spec)
    for d, od in enumerate(dims):
      if in_shape[d] == out_shape[od]:
        out[od] = spec[d]
      else:
        kept[d] = ()
    return Strategy("broadcast_in_dim", (tuple(out),), (tuple(kept),) + (None,) * (len(eqn.invars) - 1))

  if not in_shape:
    # A scalar broadcast: any output layout is a local fill.
    return [Strategy("broadcast_in_dim (scalar)", (s,), (replicated(0),) + (None,) * (len(eqn.invars) - 1))
            for s in enumerate_specs(out_shape, sizes)]
  return Follow(0, mapper)


def _dim_groups(a: tuple[int, ...], b: tuple[int, ...]):
  """Pairs (dims of a, dims of b) whose sizes multiply to the same value, in order."""
  groups, i, j = [], 0, 0
  while i < len(a) or j < len(b):
    ga, gb = [], []
    pa = pb = 1
    if i < len(a):
      ga.append(i); pa *= a[i]; i += 1
    if j < len(b):
      gb.append(j); pb *= b[j]; j += 1
    while pa != pb:
      if pa < pb and i < len(a):
        ga.append(i); pa *= a[i]; i += 1
      elif pb < pa and j < len(b):
        gb.append(j); pb *= b[j]; j += 1
      else:
        return None
    # Trailing size-1 dims join the group that precedes them.
    while i < len(a) and a[i] == 1 and (j >= len(b) or b[j] != 1):
      ga.append(i); i += 1
    while j < len(b) and b[j] == 1 and (i >= len(a) or a[i] != 1):
      gb.append(j); j += 1
    groups.append((ga, gb))
  return groups


def _reshape(eqn, sizes) -> Follow | None:
  in_shape, out_shape = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
  groups = _dim_groups(in_shape, out_shape)
  if groups is None:
    return None

  def mapper(spec):
    out = [()] * len(out_shape)
    kept = list(spec)
    for ga, gb in groups:
      # Only the group's leading dims carry a split across the reshape.
      split = [d for d in ga if spec[d]]
      if not split:
        continue
      first_in = next((d for d in ga if in_shape[d] > 1), ga[0])
      first_out = next((d for d in gb if out_shape[d] > 1), gb[0] if gb else None)
      n = math.prod(sizes[a] for a in spec[first_in]) if spec[first_in] else 1
      if (split == [first_in] and first_out is not None and out_shape[first_out] % n == 0
          and (len(ga) == 1 or len(gb) == 1 or in_shape[first_in] % out_shape[first_out] == 0
               or out_shape[first_out] % in_shape[first_in] == 0)):
        out[first_out] = spec[first_in]
      else:
        for d in ga:
          kept[d] = ()
    return Strategy(eqn.primitive.name, (tuple(out),), (tuple(kept),) + (None,) * (len(eqn.invars) - 1))

  return Follow(0, mapper)


def _touching(eqn, sizes) -> Follow:
  """Ops that need whole extents along some dims: those dims are kept unsplit."""
  name = eqn.primitive.name
  in_shape, out_shape = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
  if name in ("sort",) or name in CUMULATIVE:
    touched = {eqn.params.get("dimension", eqn.params.get("axis", len(in_shape) - 1))}
  elif name == "concatenate":
    touched = {eqn.params["dimension"]}
  elif name == "split":
    touched = {eqn.params["axis"]}
  elif name == "rev":
    touched = set(eqn.params["dimensions"])
  elif name == "fft":  # XLA's partitioner gathers its operand whole, even split on batch
    # dims only (an FNet's token mixing: 2 all-gathers predicted, 6 compiled, 14x the
    # bytes); left unconstrained, XLA split one on its FFT dim and aborted the process
    touched = set(range(len(in_shape)))
  elif name in WINDOWED:  # pooling: the dims a window spans, strides or pads
    p = eqn.params
    touched = {d for d, w in enumerate(p["window_dimensions"])
               if w != 1 or p["window_strides"][d] != 1 or tuple(p["padding"][d]) != (0, 0)
               or p.get("base_dilation", (1,) * len(in_shape))[d] != 1}
  else:
    touched = {d for d in range(len(in_shape)) if d >= len(out_shape) or in_shape[d] != out_shape[d]}
    if name == "dynamic_update_slice":
      touched |= {d for d in range(len(in_shape)) if _shape(eqn.invars[1])[d] != in_shape[d]}

  def mapper(spec):
    # Operands and outputs of the same rank (concatenated pieces, the update of
    # dynamic_update_slice, sort's extra operands) share the spec, touched dims unsplit;
    # start indices and other scalars are unconstrained.
    spec = _unsplit(spec, touched)
    ins = tuple(spec if len(_shape(v)) == len(spec) else None for v in eqn.invars)
    outs = tuple(spec if len(_shape(v)) == len(spec) else replicated(len(_shape(v)))
                 for v in eqn.outvars)
    return Strategy(name, outs, ins)

  return Follow(0, mapper)


_DOT_CACHE: dict = {}


def _stacking(eqn, produced: Callable) -> Follow:
  """stack: follows its first produced piece, the new dim unsplit and every piece split
  alike (a literal piece is whole everywhere); unstack: its inverse (the unstacked dim
  unsplit)."""
  axis = eqn.params["axis"]
  if eqn.primitive.name == "unstack":
    def unstack(spec):
      spec = _unsplit(spec, {axis})
      return Strategy("unstack", (spec[:axis] + spec[axis + 1:],) * len(eqn.outvars), (spec,))
    return Follow(0, unstack)
  pieces = [produced(v) for v in eqn.invars]

  def stack(spec):
    return Strategy("stack", (spec[:axis] + ((),) + spec[axis:],),
                    tuple(spec if p else None for p in pieces))
  return Follow(pieces.index(True), stack)


def _dot_general(eqn, cost_model: CostModel) -> list[Strategy]:
  lhs, rhs = eqn.invars
  out = eqn.outvars[0]
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  ls, rs = _shape(lhs), _shape(rhs)
  lfree = [d for d in range(len(ls)) if d not in lc and d not in lb]
  rfree = [d for d in range(len(rs)) if d not in rc and d not in rb]
  sizes = cost_model.axis_sizes
  # Roles a mesh axis can take: a batch pair, any lhs or rhs free dim, any contraction
  # pair. (A (B, S, D) activation must be splittable on B as well as S, and so must the
  # weight gradient that contracts it over both.)
  roles = [("b", i) for i in range(len(lb))]
  roles += [("l", d) for d in lfree] + [("r", d) for d in rfree]
  roles += [("k", i) for i in range(len(lc))]
  axes = [a for a, n in sizes.items() if n > 1]
  flops = 2.0 * math.prod(ls) * math.prod(rs[d] for d in rfree)
  out_rank = len(_shape(out))
  strategies = []
  for choice in itertools.product([None] + roles, repeat=len(axes)):
    l_spec = [[] for _ in ls]
    r_spec = [[] for _ in rs]
    o_spec = [[] for _ in range(out_rank)]
    for axis, role in zip(axes, choice):
      if role is None:
        continue
      kind, i = role
      if kind == "b":
        l_spec[lb[i]].append(axis); r_spec[rb[i]].append(axis); o_spec[i].append(axis)
      elif kind == "l":
        l_spec[i].append(axis); o_spec[len(lb) + lfree.index(i)].append(axis)
      elif kind == "r":
        r_spec[i].append(axis); o_spec[len(lb) + len(lfree) + rfree.index(i)].append(axis)
      else:
        l_spec[lc[i]].append(axis); r_spec[rc[i]].append(axis)
    l_spec = tuple(map(tuple, l_spec)); r_spec = tuple(map(tuple, r_spec))
    o_spec = tuple(map(tuple, o_spec))
    if not (divides(ls, l_spec, sizes) and divides(rs, r_spec, sizes)):
      continue
    shards = math.prod(sizes[a] for a, r in zip(axes, choice) if r is not None)
    out_shards = math.prod(sizes[a] for s in o_spec for a in s)
    comm = partial_sums([l_spec[d] for d in lc], _nbytes(out) / out_shards)
    cost = cost_model.compute(flops, shards) + sum(cost_model.collective(*c) for c in comm)
    label = " ".join(f"{a}:{r[0]}{r[1]}" for a, r in zip(axes, choice) if r) or "replicated"
    strategies.append((all(choice), Strategy(f"dot {label}", (o_spec,), (l_spec, r_spec), cost,
                                             comm)))
  return _no_heavy_recompute(strategies)


def partial_sums(reduced_specs, nbytes: float) -> tuple:
  """The all-reduces of a result summed over dims split as ``reduced_specs`` (the mesh
  axes of each reduced dim): one per split dim, over its axes. XLA's partitioner reduces
  a dim at a time (measured on jax 0.10: a sum over dims split as ``P("a", "b")`` compiles
  to two all-reduces, one over ``("a", "b")`` on one dim to one)."""
  return tuple(("all-reduce", tuple(axes), nbytes) for axes in reduced_specs if axes)


def _no_heavy_recompute(tagged: list[tuple[bool, Strategy]]) -> list[Strategy]:
  """Keeps only the strategies that use every mesh axis, if there are any."""
  full = [s for uses_all, s in tagged if uses_all]
  return full or [s for _, s in tagged]


def _index_batch_specs(idx_shape, sizes):
  """Splits of an indices array over its batch dims (the last dim is the index vector)."""
  if not idx_shape:
    return [()]
  return [spec for spec in enumerate_specs(idx_shape, sizes) if not spec[-1]]


def _gather(eqn, sizes) -> list[Strategy]:
  """Gather: split the indices' batch dims, and the operand's passthrough dims (taken
  whole by every slice); the output follows both. Where an index dim is also an operand
  batching dim (take_along_axis) the operand is split alike."""
  operand, indices = eqn.invars[0], eqn.invars[1]
  out_shape, idx_shape, op_shape = _shape(eqn.outvars[0]), _shape(indices), _shape(operand)
  dnums = eqn.params["dimension_numbers"]
  out_batch = [d for d in range(len(out_shape)) if d not in set(dnums.offset_dims)]
  idx_batch = list(range(len(idx_shape) - 1))
  paired = dict(zip(getattr(dnums, "start_indices_batching_dims", ()),
                    getattr(dnums, "operand_batching_dims", ())))
  windowed = [d for d in range(len(op_shape)) if d not in set(dnums.collapsed_slice_dims)
              and d not in set(getattr(dnums, "operand_batching_dims", ()))]
  to_out = dict(zip(windowed, dnums.offset_dims))
  slice_sizes = eqn.params["slice_sizes"]
  passthrough = [d for d in windowed if slice_sizes[d] == op_shape[d]
                 and d not in set(dnums.start_index_map)]
  strategies = []
  for ispec in _index_batch_specs(idx_shape, sizes):
    used = {a for axes in ispec for a in axes}
    free = {a: n for a, n in sizes.items() if a not in used}
    through = [t for t in enumerate_specs(op_shape, free)
               if all(not t[d] for d in range(len(op_shape)) if d not in passthrough)]
    for tspec in through or [replicated(len(op_shape))]:
      o = [()] * len(out_shape)
      op = list(tspec)
      for d in passthrough:
        o[to_out[d]] = tspec[d]
      for k, idd in enumerate(idx_batch):
        if ispec[idd] and k < len(out_batch):
          o[out_batch[k]] = ispec[idd]
          if idd in paired:
            op[paired[idd]] = ispec[idd]
      if not divides(op_shape, tuple(op), sizes) or not divides(out_shape, tuple(o), sizes):
        continue
      strategies.append(Strategy(f"gather {_describe_short(ispec)} {_describe_short(tspec)}",
                                 (tuple(o),),
                                 (tuple(op), ispec) + (None,) * (len(eqn.invars) - 2)))
  return strategies


def _scatter_add(eqn, cost_model: CostModel) -> list[Strategy]:
  """Scatter-add: split the indices' batch dims (and the updates' scatter dims). A dim
  paired with an operand batching dim splits the operand too, at no cost; any other
  split leaves partial sums that are all-reduced over its axes."""
  operand, indices, updates = eqn.invars[:3]
  out = eqn.outvars[0]
  dnums = eqn.params["dimension_numbers"]
  us, ish, os_ = _shape(updates), _shape(indices), _shape(operand)
  u_scatter = [d for d in range(len(us)) if d not in set(dnums.update_window_dims)]
  idx_batch = list(range(len(ish) - 1))
  paired = dict(zip(getattr(dnums, "scatter_indices_batching_dims", ()),
                    getattr(dnums, "operand_batching_dims", ())))
  sizes = cost_model.axis_sizes
  strategies = []
  for ispec in _index_batch_specs(ish, sizes):
    u = [()] * len(us)
    op = [()] * len(os_)
    partial = []
    for k, idd in enumerate(idx_batch):
      if not ispec[idd] or k >= len(u_scatter):
        continue
      u[u_scatter[k]] = ispec[idd]
      if idd in paired:
        op[paired[idd]] = ispec[idd]
      else:
        partial += list(ispec[idd])
    if not (divides(us, tuple(u), sizes) and divides(os_, tuple(op), sizes)):
      continue
    out_shards = math.prod(sizes[a] for a in sum(op, ()))
    comm = (("all-reduce", tuple(partial), _nbytes(out) / out_shards),) if partial else ()
    strategies.append(Strategy(f"scatter-add {_describe_short(ispec)}", (tuple(op),),
                               (tuple(op), ispec, tuple(u)) + (None,) * (len(eqn.invars) - 3),
                               sum(cost_model.collective(*c) for c in comm), comm))
  return strategies


def _scatter_dims(eqn):
  """A scatter's passthrough dims (operand dim → updates dim: the window dims every update
  covers whole, which no index reaches), the rank of its indices and of its updates."""
  dnums = eqn.params["dimension_numbers"]
  operand, indices, updates = eqn.invars[:3]
  os_, us = _shape(operand), _shape(updates)
  skipped = set(dnums.inserted_window_dims) | set(getattr(dnums, "operand_batching_dims", ()))
  windowed = [d for d in range(len(os_)) if d not in skipped]
  through = {d: u for d, u in zip(windowed, dnums.update_window_dims)
             if us[u] == os_[d] and d not in set(dnums.scatter_dims_to_operand_dims)}
  return through, len(_shape(indices)), len(us)


def _scatter_mapper(eqn):
  """Scatter (set, multiply, min, max): each device updates its own slice of the
  operand's passthrough dims; the indices are replicated; nothing is communicated."""
  through, idx_rank, upd_rank = _scatter_dims(eqn)

  def mapper(spec):
    spec = tuple(s if d in through else () for d, s in enumerate(spec))
    upd = [()] * upd_rank
    for d, u in through.items():
      upd[u] = spec[d]
    return Strategy(eqn.primitive.name, (spec,),
                    (spec, replicated(idx_rank), tuple(upd)) + (None,) * (len(eqn.invars) - 3))

  return mapper


def _scatter_passthrough(eqn, sizes) -> list[Strategy]:
  """:func:`_scatter_mapper`'s strategies for every split of the passthrough dims."""
  through, _, _ = _scatter_dims(eqn)
  shape = _shape(eqn.invars[0])
  mapper = _scatter_mapper(eqn)
  return [mapper(s) for s in enumerate_specs(shape, sizes)
          if any(s) and all(not a for d, a in enumerate(s) if d not in through)]


def _describe_short(spec) -> str:
  return ",".join("+".join(a) if a else "-" for a in spec)


def _conv(eqn, cost_model: CostModel) -> list[Strategy]:
  lhs, rhs = eqn.invars[:2]
  out = eqn.outvars[0]
  dn = eqn.params["dimension_numbers"]
  lspec, rspec, ospec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
  ls, rs = _shape(lhs), _shape(rhs)
  sizes = cost_model.axis_sizes
  flops = 2.0 * math.prod(_shape(out)) * math.prod(rs) / max(rs[rspec[0]], 1)
  # Grouped (a depthwise convolution: feature groups; its kernel gradient: batch groups):
  # each device takes whole groups, split along the grouped dim of the input with the
  # kernel's and the result's output features ("out"); a feature-grouped convolution
  # splits its batch as any does, and a batch-grouped one sums over its input features
  # ("in": the examples of the forward).
  feature_groups = eqn.params.get("feature_group_count", 1)
  batch_groups = eqn.params.get("batch_group_count", 1)
  groups = max(feature_groups, batch_groups)
  axes = [a for a, n in sizes.items() if n > 1]
  strategies = []
  for choice in itertools.product([None, "batch", "out", "in"], repeat=len(axes)):
    if (feature_groups > 1 and "in" in choice) or (batch_groups > 1 and "batch" in choice):
      continue
    if groups > 1 and groups % math.prod(sizes[a] for a, c in zip(axes, choice) if c == "out"):
      continue
    l = [[] for _ in ls]; r = [[] for _ in rs]; o = [[] for _ in _shape(out)]
    partial = []
    for axis, role in zip(axes, choice):
      if role == "batch":
        l[lspec[0]].append(axis); o[ospec[0]].append(axis)
      elif role == "out":
        r[rspec[0]].append(axis); o[ospec[1]].append(axis)
        if groups > 1:  # the input's grouped dim goes with them
          l[lspec[1] if feature_groups > 1 else lspec[0]].append(axis)
      elif role == "in":
        l[lspec[1]].append(axis); r[rspec[1]].append(axis); partial.append(axis)
    l, r, o = tuple(map(tuple, l)), tuple(map(tuple, r)), tuple(map(tuple, o))
    if not (divides(ls, l, sizes) and divides(rs, r, sizes)):
      continue
    shards = math.prod(sizes[a] for a, c in zip(axes, choice) if c)
    out_shards = math.prod(sizes[a] for s in o for a in s)
    comm = (("all-reduce", tuple(partial), _nbytes(out) / out_shards),) if partial else ()
    cost = cost_model.compute(flops, shards) + sum(cost_model.collective(*c) for c in comm)
    strategies.append((all(choice), Strategy(f"conv {choice}", (o,), (l, r), cost, comm)))
  return _no_heavy_recompute(strategies)


def input_strategies(shape: tuple[int, ...], sizes: dict[str, int], nbytes: float,
                     replicated_penalty: float) -> list[Strategy]:
  """An input leaf: any divisible spec; replicated carries a small tie-breaking penalty."""
  out = []
  for spec in enumerate_specs(shape, sizes):
    penalty = replicated_penalty if not any(spec) and nbytes > 0 else 0.0
    out.append(Strategy("input", (spec,), (), penalty))
  return out


def nbytes(v) -> float:
  return _nbytes(v)


