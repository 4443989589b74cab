"""The collectives XLA's SPMD partitioner emits to move a tensor between two layouts.

A layout (a ``DimAxes`` spec on a logical mesh) is turned into XLA's own description of
it, a *tile assignment*: an array of device positions with one dimension per tensor
dimension (its tile count) and a last one for the devices holding the same tile (the
replication). ``A → B`` is then decided the way ``PartitionedHlo::ReshardNoCache`` decides
it (XLA's ``spmd_partitioner.cc``), step by step on those arrays:

1. the same tile counts in another device order: one collective-permute;
2. tile counts that trade places between dimensions: all-to-alls (several pairs in one
   op where XLA fuses them), then a collective-permute if the device order still
   differs;
3. from a partially replicated layout, a local slice where every device's new tile lies
   inside its old one in some device order (then a collective-permute into the target's
   order); to a partially replicated one, an all-gather of the dimensions that lose tiles
   (after a collective-permute into an order where that gather lands right);
4. dimensions with equal tile counts on both sides: the rest is resharded within each
   group of devices holding one tile of those dimensions;
5. otherwise the whole tensor is gathered and the target's tile sliced out of it (XLA's
   "involuntary full rematerialization").

This is why the order of axes on one dimension matters: ``("a", "b") → ("b", "a")`` is a
collective-permute, and taking the major axis ``a`` off ``("a", "b")`` leaves tiles that
no longer line up (an all-gather plus a collective-permute). Measured against XLA on
jax 0.10.2 for every pair of layouts of 1- to 3-dimensional tensors on 2 x 4, 4 x 2 and
8-device meshes (``tests/test_plan_predictions.py``). Shapes are taken as divisible by
their tile counts: the planner only splits dimensions that divide.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from jaxdist.shard.specs import DimAxes

ALL_GATHER, ALL_TO_ALL, PERMUTE = "all-gather", "all-to-all", "collective-permute"


class _Mesh:
  """Axis names and sizes, and each device position's coordinates on them."""

  def __init__(self, names: tuple[str, ...], sizes: tuple[int, ...]):
    self.names, self.sizes = names, sizes
    self.coords = np.stack(np.unravel_index(np.arange(math.prod(sizes)), sizes), axis=1)

  def tiling(self, spec: DimAxes) -> np.ndarray:
    """The tile assignment of ``spec``: shape (tiles per dim..., replication)."""
    order = [self.names.index(a) for axes in spec for a in axes]
    order += [i for i in range(len(self.names)) if i not in order]
    tiles = [math.prod(self.sizes[self.names.index(a)] for a in axes) for axes in spec]
    positions = np.arange(math.prod(self.sizes)).reshape(self.sizes)
    return positions.transpose(order).reshape(tiles + [-1])

  def axes_of(self, groups) -> tuple[str, ...]:
    """Mesh axes along which the devices of some group differ."""
    varying = np.zeros(len(self.names), dtype=bool)
    for group in groups:
      c = self.coords[list(group)]
      varying |= (c != c[0]).any(axis=0)
    return tuple(n for n, v in zip(self.names, varying) if v)


def _tiles(a: np.ndarray) -> tuple[int, ...]:
  return a.shape[:-1]


def _replicated(a: np.ndarray) -> bool:
  return math.prod(_tiles(a)) == 1


def _partial(a: np.ndarray) -> bool:
  return a.shape[-1] > 1 and not _replicated(a)


def _dims(a: np.ndarray) -> tuple[int, ...]:
  """XLA's tile-assignment dimensions: the replication only when partially replicated."""
  return _tiles(a) + ((a.shape[-1],) if _partial(a) else ())


def _same(a: np.ndarray, b: np.ndarray) -> bool:
  if _replicated(a) and _replicated(b):
    return True
  return a.shape == b.shape and bool((a == b).all())


def _can_permute(a: np.ndarray, b: np.ndarray) -> bool:
  return (not _replicated(a) and not _replicated(b) and _dims(a) == _dims(b)
          and not (a == b).all())


class _Plan:
  """The collectives of one reshard, as (kind, axes, per-device result elements / full)."""

  def __init__(self, mesh: _Mesh):
    self.mesh, self.ops = mesh, []

  def emit(self, kind: str, groups, tiles_after) -> None:
    axes = self.mesh.axes_of(groups)
    if axes:
      self.ops.append((kind, axes, 1.0 / math.prod(tiles_after)))

  def permute(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    pairs = [(s, d) for s, d in zip(a.reshape(-1), b.reshape(-1)) if s != d]
    self.emit(PERMUTE, pairs, _tiles(b))
    return b

  def all_gather(self, a: np.ndarray, dims, factors) -> None:
    """Gathers ``factors[i]`` consecutive tiles of each dimension ``dims[i]``: one
    all-gather per dimension, the last dimension first, as XLA emits them."""
    for d, f in sorted(zip(dims, factors), reverse=True):
      shape = a.shape[:d] + (a.shape[d] // f, f) + a.shape[d + 1:]
      split = np.moveaxis(a.reshape(shape), d + 1, -1)
      self.emit(ALL_GATHER, split.reshape(-1, f), shape[:d + 1] + shape[d + 2:-1])
      a = split.reshape(split.shape[:-2] + (-1,))


def _all_to_all_tiling(a: np.ndarray, sources, targets) -> np.ndarray:
  """XLA's ``GetAllToAllSharding``: each source dimension hands tiles to its target."""
  result = a
  for s, t in zip(sources, targets):
    shape_1, added_source, added_target = [], None, None
    for i, n in enumerate(result.shape):
      if i == s:
        shape_1 += [result.shape[t], n // result.shape[t]]
        added_source = len(shape_1) - 1
      elif i == t:
        shape_1 += [n, 1]
        added_target = len(shape_1) - 1
      else:
        shape_1.append(n)
    perm = list(range(len(shape_1)))
    perm[added_source], perm[added_target] = perm[added_target], perm[added_source]
    shape_2 = list(result.shape)
    shape_2[s], shape_2[t] = shape_2[t], shape_2[s]
    result = result.reshape(shape_1).transpose(perm).reshape(shape_2)
  return result


def _all_to_all_groups(temp: np.ndarray, targets, group_sizes):
  groups: dict[int, list[int]] = {}
  for index in np.ndindex(*temp.shape):
    gid = 0
    for d, i in enumerate(index):
      if d in targets:
        g = group_sizes[targets.index(d)]
        gid = gid * (temp.shape[d] // g) + i // g
      else:
        gid = gid * temp.shape[d] + i
    groups.setdefault(gid, []).append(int(temp[index]))
  return list(groups.values())


def _all_to_all_dims(a: np.ndarray, b: np.ndarray):
  """XLA's ``GetReshardAllToAllSourceTargetDims``: (source dim, target dim) pairs, or None."""
  if (_replicated(a) or _replicated(b) or _partial(a) != _partial(b)
      or math.prod(_tiles(a)) != math.prod(_tiles(b))):
    return None
  ta, tb = _tiles(a), _tiles(b)
  src: dict[int, list[int]] = {}
  tgt: dict[int, list[int]] = {}
  for i, (x, y) in enumerate(zip(ta, tb)):
    if x != y:
      src.setdefault(x, []).append(i)
      tgt.setdefault(y, []).append(i)
  if not src or len(src) != len(tgt) or any(len(tgt.get(k, ())) != len(v)
                                            for k, v in src.items()):
    return None

  def remove(size, dim, table):
    table[size] = [d for d in table[size] if d != dim]
    if not table[size]:
      del table[size]

  result = []
  while src:
    size = min(src)
    i = src[size][-1]
    want = tb[i]
    if want == size:
      remove(size, i, src)
      remove(size, i, tgt)
      continue
    if want not in src:
      return None
    candidates = src[want]
    j = candidates[0]
    if size == 1:
      for c in candidates:
        j = c
        if tb[c] != 1:
          break
    elif want % size == 0:
      for c in candidates:
        j = c
        if tb[c] == size:
          break
    else:
      return None
    result.append((j, i))
    remove(want, i, tgt)
    src[size][-1] = j
    remove(want, j, src)
  return result


def _with_all_to_all(plan: _Plan, a, b, pairs, multiple: bool = True) -> np.ndarray:
  """XLA's ``ReshardWithAllToAll`` (and ``TryMultipleSourceTargetDims``)."""
  if _same(a, b):
    return b
  if not pairs:
    return plan.permute(a, b)
  if multiple:
    eligible, rest, seen = [], [], set()
    for s, t in sorted(pairs, key=lambda p: p[1]):
      if s in seen or t in seen:
        rest.append((s, t))
      else:
        eligible.append((s, t))
        seen.update((s, t))
    if len(eligible) >= 2:
      sources, targets = [s for s, _ in eligible], [t for _, t in eligible]
      sizes = [a.shape[s] // a.shape[t] for s, t in eligible]
      temp = _all_to_all_tiling(a, sources, targets)
      plan.emit(ALL_TO_ALL, _all_to_all_groups(temp, targets, sizes), _tiles(temp))
      return _with_all_to_all(plan, temp, b, rest, False)
  s, t = pairs[0]
  temp = _all_to_all_tiling(a, [s], [t])
  plan.emit(ALL_TO_ALL, _all_to_all_groups(temp, [t], [a.shape[s] // a.shape[t]]), _tiles(temp))
  return _with_all_to_all(plan, temp, b, pairs[1:])


def _sub_tiling(fine: np.ndarray, coarse: np.ndarray) -> bool:
  """Whether every device's tile under ``fine`` lies within its tile under ``coarse``."""
  where_fine = {int(d): idx[:-1] for idx, d in np.ndenumerate(fine)}
  ratio = [f // c for f, c in zip(_tiles(fine), _tiles(coarse))]
  for idx, d in np.ndenumerate(coarse):
    if tuple(i // r for i, r in zip(where_fine[int(d)], ratio)) != idx[:-1]:
      return False
  return True


def _compatible(partial: np.ndarray, target: np.ndarray) -> np.ndarray | None:
  """XLA's ``PartialReplicateReshardCompatibleSharding``: ``target``'s tile counts in a
  device order that a local slice of the partially replicated ``partial`` reaches."""
  if not _partial(partial):
    return None
  expand = []
  for p, t in zip(_tiles(partial), _tiles(target)):
    if t % p:
      return None
    expand.append(t // p)
  if _sub_tiling(target, partial):
    return target
  rank = len(expand)
  sizes = [e for e in expand if e > 1]
  shape = list(_tiles(partial)) + sizes + [-1]
  perm, k = [], rank
  for d in range(rank):
    perm.append(d)
    if expand[d] > 1:
      perm.append(k)
      k += 1
  perm.append(k)
  return partial.reshape(shape).transpose(perm).reshape(target.shape)


def _from_partial(plan: _Plan, a, b):
  """XLA's ``ReshardFromPartialReplicateWithDynamicSlice``: slice, then permute."""
  compatible = _compatible(a, b)
  if compatible is None:
    return None
  if _can_permute(compatible, b):
    return plan.permute(compatible, b)
  return b


def _to_partial(plan: _Plan, a, b):
  """XLA's ``ReshardToPartialReplicateWithAllGather``: permute, then gather."""
  compatible = _compatible(b, a)
  if compatible is None:
    return None
  if _can_permute(a, compatible):
    plan.permute(a, compatible)
  dims, factors = [], []
  for d, (x, y) in enumerate(zip(_tiles(compatible), _tiles(b))):
    if x // y > 1:
      dims.append(d)
      factors.append(x // y)
  plan.all_gather(compatible, dims, factors)
  return b


def _partial_with_all_to_all(plan: _Plan, a, b):
  """XLA's ``ReshardPartialReplicateWithAllToAll``: [1, x, y] partial ↔ [x, y] tiled."""
  from_partial = _partial(a)
  partial, tiled = (a, b) if from_partial else (b, a)
  if not _partial(partial) or _partial(tiled) or _replicated(tiled):
    return None
  replicas = partial.shape[-1]
  # The tiled layout's tile counts are the partial one's shifted by a dimension: the
  # partial one's first is 1 and its replication is the tiled one's last split.
  if len(_dims(partial)) != len(_dims(tiled)) + 1:
    return None
  dims_p, dims_t = _dims(partial), _dims(tiled)
  if dims_p[0] != 1:
    return None
  to_replicate = -1
  for i in range(len(dims_t) - 1, -1, -1):
    if dims_t[i] > 1 and to_replicate == -1:
      if dims_t[i] != replicas:
        return None
      to_replicate = i
    if dims_t[i] != dims_p[i + 1]:
      return None
  if to_replicate == -1 or not (partial.reshape(tiled.shape) == tiled).all():
    return None
  tmp_dims = list(dims_t)
  tmp_dims[to_replicate] = 1
  tmp = tiled.reshape(tmp_dims + [replicas])
  if from_partial:
    pairs = _all_to_all_dims(a, tmp)
    if pairs is None:
      return None
    return _reshard(plan, _with_all_to_all(plan, a, tmp, pairs), b)
  mid = _reshard(plan, a, tmp)
  pairs = _all_to_all_dims(mid, b)
  if pairs is None:
    return None
  return _with_all_to_all(plan, mid, b, pairs)


def _group_equal_dims(plan: _Plan, a, b):
  """XLA's grouping of the dimensions with one tile count on both sides: the rest is
  resharded within each group of devices holding one tile of them. Where the target's
  groups hold other devices, each group is first resharded to the target's pattern on
  its own devices, and a collective-permute finishes."""
  equal = [d for d, (x, y) in enumerate(zip(_tiles(a), _tiles(b))) if x > 1 and x == y]
  if not equal:
    return None
  groups = list(np.ndindex(*[a.shape[d] if d in equal else 1 for d in range(a.ndim)]))
  pick = lambda g: tuple(slice(g[d], g[d] + 1) if d in equal else slice(None)
                         for d in range(a.ndim))
  first = pick(groups[0])
  if all(set(a[pick(g)].reshape(-1)) == set(b[pick(g)].reshape(-1)) for g in groups):
    _reshard(plan, a[first], b[first])
    return b
  aligned = np.empty_like(b)
  for g in groups:
    aligned[pick(g)] = a[pick(g)].reshape(b[pick(g)].shape)
  _reshard(plan, a[first], aligned[first])
  return _reshard(plan, aligned, b)


def _split_dim(a: np.ndarray, d: int, size: int) -> np.ndarray:
  """XLA's ``SplitShardingDimension``: tile dimension ``d`` as (``size``, the rest)."""
  return a.reshape(a.shape[:d] + (size, a.shape[d] // size) + a.shape[d + 1:])


def _merge_or_split(a, b):
  """XLA's ``PatternMatchMergeOrSplitSharding``: two dimensions whose tile counts multiply
  alike on both sides, one of them split so that the move becomes a swap of tile counts.
  Returns (``a`` split, ``b`` in the split shape, the split dimension) or None."""
  if _replicated(a) or _replicated(b) or _partial(a) != _partial(b) or a.shape[-1] != b.shape[-1]:
    return None
  ta, tb = _tiles(a), _tiles(b)
  diff = [d for d in range(len(ta)) if ta[d] != tb[d]]
  for x in range(len(diff)):
    for y in range(x + 1, len(diff)):
      i, j = diff[x], diff[y]
      ones = [ta[i] == 1, ta[j] == 1, tb[i] == 1, tb[j] == 1].count(True)
      if ones == 1:
        if ta[i] * ta[j] != tb[i] * tb[j]:
          continue
        if ta[i] == 1 or tb[i] == 1:
          i, j = j, i
        size = ta[i] if tb[j] == 1 else tb[i]
      elif ones == 0:
        if ta[i] < tb[i]:
          i, j = j, i
        if ta[i] != tb[i] * tb[j]:
          continue
        size = tb[i]
      else:
        continue
      split = _split_dim(a, i, size)
      dims = list(split.shape)
      k = j + (1 if j > i else 0)
      dims[i + 1], dims[k] = dims[k], dims[i + 1]
      return split, b.reshape(dims), i
  return None


def _replicate_dims(a: np.ndarray, dims) -> np.ndarray:
  """XLA's ``PartiallyReplicateTiledShardingOnDims``: ``dims``' tiles become replicas."""
  rank = a.ndim - 1
  order = [d for d in range(rank) if d not in dims] + [d for d in range(rank) if d in dims]
  moved = a.transpose(order + [rank])
  shape = [1 if d in dims else n for d, n in enumerate(_tiles(a))]
  return moved.reshape(shape + [-1])


def _complex(plan: _Plan, a, b):
  """XLA's ``TryComplexReshardHandling``; returns ``b`` or None."""
  matched = _merge_or_split(a, b)
  if matched is not None:
    split, target, d = matched
    if not _same(_reshard(plan, split, target, full=False), target):
      return None
    merged = target.reshape(target.shape[:d] + (-1,) + target.shape[d + 2:])
    if not _same(merged, b) and not _same(_reshard(plan, merged, b, full=False), b):
      return None
    return b
  if _partial(b):
    for d, n in enumerate(_tiles(a)):
      if n > 1 and n * (a.shape[-1] if _partial(a) else 1) == b.shape[-1]:
        middle = _reshard(plan, a, _replicate_dims(a, [d]))
        return b if _same(_reshard(plan, middle, b, full=False), b) else None
    return None
  if _partial(a):
    for d, (x, y) in enumerate(zip(_tiles(a), _tiles(b))):
      if x != y and x == 1 and y % a.shape[-1] == 0:
        perm = list(range(a.ndim))
        perm[d], perm[-1] = perm[-1], perm[d]
        middle = _reshard(plan, a, a.transpose(perm))
        return b if _same(_reshard(plan, middle, b, full=False), b) else None
  return None


def _replicate(plan: _Plan, a) -> None:
  dims = [d for d, n in enumerate(_tiles(a)) if n > 1]
  plan.all_gather(a, dims, [a.shape[d] for d in dims])


def _attempt(plan: _Plan, step, a, b):
  """Runs one of XLA's strategies; its collectives are kept only if it reached ``b``."""
  mark = len(plan.ops)
  done = step(plan, a, b)
  if done is None or not _same(done, b):
    del plan.ops[mark:]
    return None
  return done


def _reshard(plan: _Plan, a: np.ndarray, b: np.ndarray, full: bool = True) -> np.ndarray:
  """XLA's ``ReshardNoCache`` from ``a`` to ``b``: the collectives go to ``plan``; returns
  the layout reached (``a`` itself where ``full`` is False and only a full
  rematerialization would do)."""
  if _same(a, b):
    return b
  if _can_permute(a, b):
    return plan.permute(a, b)
  pairs = _all_to_all_dims(a, b)
  if pairs:
    return _with_all_to_all(plan, a, b, pairs)
  steps = []
  if not _replicated(b) and _partial(a):
    steps += [_from_partial, _partial_with_all_to_all]
  if not _replicated(a) and _partial(b):
    steps += [_to_partial, _partial_with_all_to_all]
  if not _replicated(a) and not _replicated(b):
    steps += [_complex, _group_equal_dims]
  for step in steps:
    done = _attempt(plan, step, a, b)
    if done is not None:
      return done
  if not _replicated(a):
    if not _replicated(b) and not full:
      return a
    _replicate(plan, a)
  return b


@functools.lru_cache(maxsize=65536)
def reshard_ops(src: DimAxes, dst: DimAxes, names: tuple[str, ...], sizes: tuple[int, ...]
                ) -> tuple[tuple[str, tuple[str, ...], float], ...]:
  """The collectives XLA emits to move a tensor laid out as ``src`` to ``dst`` on a mesh
  of axes ``names`` with ``sizes``, in order: (kind, mesh axes it runs over, per-device
  result bytes as a fraction of the whole tensor's)."""
  if src == dst:
    return ()
  mesh = _Mesh(names, sizes)
  plan = _Plan(mesh)
  _reshard(plan, mesh.tiling(src), mesh.tiling(dst))
  return tuple(plan.ops)
