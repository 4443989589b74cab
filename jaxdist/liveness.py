"""Peak temporary memory of a jaxpr, walked in program order as XLA's buffers would live.

A value occupies ``size(v)`` bytes (per device) from the equation that defines it to its
last reader. What XLA keeps out of memory is left out:

- an elementwise (or broadcast) result read by exactly one elementwise op or reduction
  is fused into it (loop and input fusion) and never written; its operands then live
  until that reader; so is a cheap one computed from constants alone (a causal mask),
  or elementwise from one array (GELU's ``0.5 * (1 + tanh(...))``) and read by
  elementwise ops only, whatever its number of such readers (XLA duplicates it into each);
- reshapes and markers are bitcasts: their result shares the operand's buffer; a
  transpose read only by dots is folded into them;
- a scatter or dynamic_update_slice whose operand is read by nothing after it writes
  into the operand's buffer, and ``x + scatter_add(zeros, ...)`` scatters into ``x``'s
  (XLA's simplifier folds the zeros away);
- an elementwise result is written into the buffer of an operand of its shape that
  dies there;
- a slice or split whose parts are each read once, by elementwise ops or reductions, is
  fused into them; so is a dot that contracts only dims of size 1 (an outer product,
  which XLA rewrites as a multiply), and a transpose of one;
- a loop's carried result takes its initial value's buffer where that dies at the loop;
- the step's inputs are arguments and its outputs are written into output buffers, so
  neither is a temporary.

Calls (``pjit``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat``) are walked through
in place, with fresh values at each call of one body; a loop (``scan``, ``while``) or
``cond`` adds its body's own peak while it runs, with each iteration's values at their
per-iteration size.

XLA:CPU stores the bf16 / f16 values it writes between fusions as f32, rounded (the
optimized module's ``convert(convert(x))`` pairs and f32 fusion outputs), so on that
backend such a buffer takes twice its dtype's bytes (``platform="cpu"``). XLA:CPU also
expands a max-pool's gradient (``select_and_scatter_add``) into gathers and scatters over
index arrays: while it runs, one s32 iota per operand dim over the operand and one s32
index per source element and operand dim are alive (measured on a conv net's pooled
activations: four s32 copies of the operand and four of the source at the peak), and runs
a random draw (dropout's) as a threefry loop whose state is several 32-bit arrays of the
draw's shape (:data:`THREEFRY_STATE`). It multiplies and convolves in canonical
dimension order, so a dot or convolution that reads an input in another order reads a
transposed copy of it, made early and kept until that input's last such read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.extend.core as jex
import jax.numpy as jnp

from jaxdist import jaxpr_util
from jaxdist.shard.strategies import ELEMENTWISE, REDUCTIONS, nbytes

# A bitcast between types of one width (random bits to floats) is elementwise too where
# ``_kind`` says so.
FUSIBLE = ELEMENTWISE | {"broadcast_in_dim", "iota", "bitcast_convert_type"}
FUSING_READERS = FUSIBLE | REDUCTIONS | {"reshape", "squeeze", "expand_dims", "transpose"}
# Slicing read by elementwise ops or reductions only is fused into them (each part read once).
SLICES = frozenset({"split", "slice"})
BITCASTS = frozenset({"reshape", "squeeze", "expand_dims", *jaxpr_util.MARKERS})
CALLS = frozenset({*jaxpr_util.PLAN_CALLS, "remat", "checkpoint", "custom_lin"})
LOOPS = frozenset({"scan", "while", "cond"})
# What XLA's fusion recomputes in every fusion that reads it instead of writing it once
# (its cheap instructions, ``InstructionFusion::IsExpensive``): no division, exponential,
# logarithm, root or hyperbolic function.
CHEAP = frozenset("""
add add_any sub mul neg max min select_n convert_element_type copy eq ne lt le gt ge and or
not xor abs sign floor ceil round clamp integer_pow square is_finite stop_gradient
shift_left shift_right_logical shift_right_arithmetic broadcast_in_dim iota
bitcast_convert_type
""".split())
# Random bits: XLA:CPU runs threefry as a loop whose state (counters, keys, copies around
# the loop) is arrays of the draw's shape in 32-bit words: measured on a ViT's dropout
# draws, 7 such arrays beside the result while the loop runs. The loop's result is the
# hash's two 32-bit halves, which every fusion reading the bits combines (``xor``) itself:
# a dropout's draw keeps both halves until its mask's last reader, the backward's select
# (measured on an MLP-Mixer with 3 dropouts, one device's program: XLA's bytes grew by 6
# arrays of the draw's shape with dropout, where the estimate kept one float array per
# draw: 0.92x; a micro-batch's program likewise). Not so in ShardParallel's partitioned
# program, where a dropout net's draws were kept as their selects' float outputs: there
# the draws stay written (``Timeline(draws_in_readers=False)``).
THREEFRY = frozenset({"random_bits", "threefry2x32"})
THREEFRY_STATE = 7
# XLA:CPU hands a reduction of 4096 elements or more (per device) to its library
# (YNNPACK) fusion, which reads its computed operands written; a smaller one is a loop
# fusion that recomputes them (measured on LayerNorm backwards: 4000 and 4032 elements
# recomputed, 4096 and 4100 written).
CPU_LIBRARY_REDUCE = 4096
# Readers of a transposed weight gradient for which XLA holds one buffer (Timeline).
ACCUMULATING = frozenset({*jaxpr_util.MARKERS, "add", "add_any"})
IN_PLACE = frozenset({"scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter-min",
                      "scatter-max", "dynamic_update_slice"})


@dataclasses.dataclass(frozen=True)
class Peak:
  """The heaviest point of a timeline.

  Attributes:
    bytes: temporaries live there (per device).
    index: the position in the timeline where it occurs.
    live: (label, bytes) of the buffers live there, largest first.
  """

  bytes: float
  index: int
  live: tuple[tuple[object, float], ...]


class Timeline:
  """The buffers of one jaxpr on a line of program positions (one per equation, with
  calls flattened), each alive over ``[start, end]``; callers may add buffers (a
  collective's result, an accumulator) and move ends before taking the ``peak``.
  ``in_loop``: the jaxpr runs as a loop's body (a micro-batch loop's).
  ``draws_in_readers``: on CPU, a random draw's readers recompute its bits from the
  threefry loop's two halves (one device's program, or one micro-batch's; see
  :data:`THREEFRY`).
  ``unrolled``: the jaxpr's scans are unrolled in the compiled program too (their stacks
  read back slice by slice are never made: :meth:`_slices_of_stacks`). ``regions``: where
  the jaxpr's scans are unrolled but compile as loops, an equation → the loop iteration
  it runs in (None outside loops): a value read in another iteration, or outside the
  loop, is written (a loop carry or stacked result), not fused into its reader.

  Attributes:
    eqns: (equation, operands, results) per position.
    buffers: buffer (a variable, or a caller's label) → [start, end, bytes].
    extra: per position, bytes a loop body needs while its equation runs.
    position: id(equation) → its position.
  """

  def __init__(self, jaxpr, size: Callable[[object], float] = nbytes, platform: str | None = None,
               late_inputs: frozenset = frozenset(), unrolled: bool = False,
               regions: Callable[[object], object] | None = None, in_loop: bool = False,
               draws_in_readers: bool = False):
    base = size
    draws_in_readers = draws_in_readers and platform == "cpu"
    kind = lambda eqn: _kind(eqn, draws_in_readers)
    if platform == "cpu":
      size = _widened(size)
    self.eqns, self._rename = _linear(jaxpr)
    if platform == "cpu":
      self.eqns = _input_gradients_first(self.eqns)
    n = len(self.eqns)
    inputs = set(jaxpr.invars) | set(jaxpr.constvars)
    readers: dict = {}
    last: dict = {}
    for i, (eqn, ins, _) in enumerate(self.eqns):
      for v in ins:
        readers.setdefault(v, []).append(kind(eqn))
        last[v] = i
    # A value → the value whose buffer it shares (a bitcast's operand, an operand
    # updated in place); chains end at the buffer (``_root``).
    self._owner: dict = {}
    bitcast = [eqn.primitive.name in BITCASTS for eqn, _, _ in self.eqns]
    made_by = {o: eqn for eqn, _, outs in self.eqns for o in outs}
    for i, (eqn, ins, outs) in enumerate(self.eqns):
      # A weight gradient's dot result that only a transpose reads, the transposed
      # result read only by the gradient marker (the layout reduces it itself) or adds:
      # XLA's layout assignment writes the dot's result transposed, one buffer. Measured on a
      # 4-layer MLP under ZeRO-3, whose gradients go straight to their reduce-scatters:
      # 0.87 MB compiled, 1.09 MB estimated counting both. Added into an accumulator
      # instead, the transposed read fuses into the add and the dot's result stays:
      # one buffer too (a 4-stage MLP's last stage: 1.11x of XLA's bytes counting both).
      dot = made_by.get(ins[0]) if eqn.primitive.name == "transpose" and ins else None
      if (dot is not None and dot.primitive.name == "dot_general"
          and readers.get(ins[0]) == ["transpose"]
          and (set(readers.get(outs[0], ["none"])) <= ACCUMULATING
               or (_swaps_free_dims(eqn, dot) and not _outer_product(dot)))):  # (that fuses)
        bitcast[i] = True
      if bitcast[i]:
        for o, v in zip(outs, ins):
          self._owner[o] = v
    # The same slice of an input taken again (an unrolled scan's backward slicing each
    # layer's weights from the stack once more) is one value: XLA's CSE merges them,
    # unless the scans compile as loops (``regions``: each loop slices its own).
    sliced: dict = {}
    for i, (eqn, ins, outs) in enumerate(self.eqns):
      if (eqn.primitive.name == "slice" and ins and ins[0] in inputs
          and (regions is None or regions(eqn) is None)):
        key = (ins[0], tuple(sorted((k, str(v)) for k, v in eqn.params.items())))
        if key in sliced:
          bitcast[i] = True
          self._owner[outs[0]] = sliced[key]
        else:
          sliced[key] = outs[0]
    outputs = {self.buffer_of(v) for v in jaxpr.outvars if not isinstance(v, jex.Literal)}
    unstacked = self._slices_of_stacks(bitcast, outputs) if unrolled else set()
    stacked = self._stacks_written_by_loops(regions, last) if regions is not None else {}
    # A fused result is recomputed inside each reader's fusion: its operands stay live
    # until its last reader (walked backwards, so chains of fused values carry through).
    static = _static(self.eqns, jaxpr.constvars)
    made_at = {o: i for i, (_, _, outs) in enumerate(self.eqns) for o in outs}
    outer = [False] * n  # outer products, and transposes of one (see _outer_product)
    for i, (eqn, ins, _) in enumerate(self.eqns):
      outer[i] = (_outer_product(eqn) or (eqn.primitive.name == "transpose" and bool(ins)
                                          and outer[made_at.get(ins[0], i)]))
    fused = [_fused(eqn, outs, readers, outputs, static, outer[i], kind)
             for i, (eqn, _, outs) in enumerate(self.eqns)]
    for i, (eqn, ins, _) in enumerate(self.eqns):  # an outer product a transpose writes
      if eqn.primitive.name == "transpose" and (bitcast[i] or not fused[i]):
        j = made_at.get(ins[0]) if ins else None
        if j is not None and self.eqns[j][0].primitive.name == "dot_general":
          fused[j] = False
    small = ((lambda v: base(v) < CPU_LIBRARY_REDUCE * max(v.aval.dtype.itemsize, 1))
             if platform == "cpu" else (lambda v: False))
    self._recompute_cheap_values(fused, bitcast, readers, last, inputs, outputs, made_at,
                                 small)
    if regions is not None:  # nothing fuses across a loop's iterations or its boundary
      region = [regions(eqn) for eqn, _, _ in self.eqns]
      for i, (_, ins, _) in enumerate(self.eqns):
        for v in ins:
          if v in made_at and region[made_at[v]] != region[i]:
            fused[made_at[v]] = False
    for i in range(n - 1, -1, -1):
      eqn, ins, outs = self.eqns[i]
      if fused[i] or bitcast[i]:
        reach = max((last.get(o, i) for o in outs), default=i)
        for v in ins:
          last[v] = max(last.get(v, i), reach)
    end: dict = {}
    for v, i in last.items():
      b = self._root(v)
      end[b] = max(end.get(b, -1), i)
    # A scatter or dynamic_update_slice whose operand nothing reads afterwards updates
    # the operand's buffer in place (XLA's buffer assignment shares them).
    for i, (eqn, ins, outs) in enumerate(self.eqns):
      if eqn.primitive.name not in IN_PLACE or not ins:
        continue
      b, o = self._root(ins[0]), outs[0]
      if b in inputs or b in outputs or end.get(b, -1) != i or o in outputs:
        continue
      self._owner[o] = b
      end[b] = max(end.get(o, i), i)
    # A loop's carried result takes the buffer of its initial value where that dies at
    # the loop (XLA's while loops alias their state): a scan transpose's zero-filled
    # gradient accumulators are not a second copy of its results. Not an initial value
    # made from constants alone inside another loop: XLA hoists it out of that loop, and
    # each run of the inner one copies it (measured on an LSTM under ZeRO-3 with 4
    # micro-batches: aliased, the estimate was 0.77x of XLA's bytes).
    for i, (eqn, ins, outs) in enumerate(self.eqns):
      for v, o in _carried(eqn, ins, outs):
        b = self._root(v)
        if (isinstance(v, jex.Literal) or b in inputs or b in outputs or o in outputs
            or (in_loop and b in static)
            or end.get(b, -1) != i or b.aval.shape != o.aval.shape
            or b.aval.dtype != o.aval.dtype):
          continue
        self._owner[o] = b
        end[b] = max(end.get(o, i), i)
    start: dict = dict(stacked)  # a buffer written before the value naming it is made
    if regions is not None:
      # A conditional compiled as one, its branches written out and each output a
      # select_n of theirs: a branch writes its result into the conditional's output
      # (measured on an MLP whose Adam update runs under lax.cond: counted as buffers of
      # their own until the selection, the new states made the estimate 1.37x of XLA's).
      for i, (eqn, ins, outs) in enumerate(self.eqns):
        cases = [self._root(v) for v in ins[1:] if not isinstance(v, jex.Literal)]
        if (eqn.primitive.name != "select_n"
            or not any(v in made_at and region[made_at[v]] != region[i] for v in cases)):
          continue
        for b in cases:
          if b in made_at and b not in inputs and b not in outputs and b != outs[0]:
            self._owner[b] = outs[0]
            start[outs[0]] = min(start.get(outs[0], i), made_at[b])
            end[outs[0]] = max(end.get(outs[0], i), end.get(b, i))
    self._reuse_dying_operands(fused, end, inputs, outputs)
    elided = self._fold_scatters_into_sums(readers, end, inputs, outputs, fused)
    self.buffers: dict = {}
    if platform == "cpu":
      self._relay_operands(inputs, size, end)
    self.extra = [0.0] * n
    self.position: dict = {}
    for i, (eqn, ins, outs) in enumerate(self.eqns):
      self.position[id(eqn)] = i
      if eqn.primitive.name in LOOPS:
        self.extra[i] = max((Timeline(sub, base, platform, in_loop=True).peak().bytes
                             for sub in jex.jaxprs_in_params(eqn.params)), default=0.0)
      elif eqn.primitive.name == "select_and_scatter_add" and platform == "cpu":
        self.extra[i] = _expanded_indices(eqn, base)
      elif eqn.primitive.name in THREEFRY and platform == "cpu":
        self.extra[i] = THREEFRY_STATE * sum(4 * base(o) / max(o.aval.dtype.itemsize, 1)
                                             for o in outs[:1])
      if bitcast[i] or fused[i] or i in unstacked:
        continue
      for o in outs:
        if o in self._owner or o in elided:  # updated in place, or never written
          continue
        if isinstance(o, jex.DropVar) or o in outputs or o in inputs:
          continue
        halves = 2 if draws_in_readers and eqn.primitive.name == "random_bits" else 1
        self.buffers[o] = [start.get(o, i), max(end.get(o, i), i), halves * size(o)]
    if platform == "cpu":
      self._make_input_only_values_early(static, inputs - set(late_inputs))

  def _recompute_cheap_values(self, fused, bitcast, readers, last, inputs, outputs,
                              made_at, small: Callable[[object], bool]) -> None:
    """A cheap elementwise value read by several elementwise ops or reductions, computed
    from one full-size array that is written anyway and read at least as late as it is
    (and from small ones): XLA recomputes it in every fusion that reads it instead of
    writing it (its fusion duplicates a producer whose operands are no larger than its
    result). Measured on GroupNorm's affine output ``x_hat * scale + bias``, read by
    SiLU's forward and backward: written, a GroupNorm conv net's estimates were 1.07x
    (DataParallel) and 1.14x (ZeRO-3) of XLA's bytes, a WideResNet's at 32 px 1.11x
    and 1.16x. Not a sum of two full-size arrays (a residual connection), which XLA
    writes. A ``small`` value (on CPU, under :data:`CPU_LIBRARY_REDUCE` elements per
    device) is recomputed even where the full-size array it reads would die first, or
    where it reads none (a broadcast product of small arrays): its readers, reductions
    included, are loop fusions that read that array instead (LayerNorm's ``x - mean``
    and ``rsqrt · scale``, read by the backward; written, an encoder-decoder with
    [4, 12, 64] activations per device was estimated at 1.09x / 1.27x of XLA's bytes
    under DataParallel / ZeRO-3). From that size on, its reductions are library fusions,
    which read it written."""
    through = lambda j: fused[j] or bitcast[j]

    for i, (eqn, _, outs) in enumerate(self.eqns):
      if (fused[i] or bitcast[i] or len(outs) != 1 or eqn.primitive.name not in CHEAP
          or eqn.primitive.name not in ELEMENTWISE or outs[0] in outputs):
        continue
      o = outs[0]
      names = readers.get(o, ())
      if len(names) < 2 or not all(r in FUSIBLE | REDUCTIONS for r in names):
        continue
      read = list(self._fusion_inputs(i, made_at, through))
      full = [v for v in read if v.aval.size >= o.aval.size]
      if sum(v.aval.size for v in read) > 1.25 * o.aval.size:
        continue
      if small(o):
        fused[i] = len(full) <= 1
      elif len(full) == 1 and (full[0] in inputs or last.get(full[0], -1) >= last.get(o, -1)):
        fused[i] = True

  def _fusion_inputs(self, i: int, made_at: dict, through):
    """The arrays the fusion rooted at equation ``i`` reads: its operands, and those of
    each producer ``through(position)`` fuses into it, in turn."""
    stack, seen = list(self.eqns[i][1]), set()
    while stack:
      v = stack.pop()
      if isinstance(v, jex.Literal) or v in seen:
        continue
      seen.add(v)
      j = made_at.get(v)
      if j is not None and through(j):
        stack.extend(self.eqns[j][1])
      else:
        yield v

  def _stacks_written_by_loops(self, regions, last) -> dict:
    """A concatenation of values made in different iterations of a loop (the stacked
    results of a scan planned unrolled and compiled as a loop) is the loop's output
    buffer, written slot by slot as the loop runs: its reads of the values do not keep
    them alive, and a value nothing else reads is written into its slot (its buffer is
    the stack's). Only stacks of values read elsewhere too (a loop's carry, stacked as
    residuals). Returns each stack's start, its first value's position. Measured on a
    decoder writing a KV cache in a 32-step ``fori_loop``: each step's cache, read by the
    next step and stacked for the backward, counted until the stack was made, made the
    estimate 1.18x of XLA's bytes."""
    made_at = {o: i for i, (_, _, outs) in enumerate(self.eqns) for o in outs}
    reads: dict = {}
    for i, (_, ins, _) in enumerate(self.eqns):
      for v in ins:
        reads.setdefault(v, []).append(i)
    starts = {}
    for j, (eqn, ins, outs) in enumerate(self.eqns):
      if eqn.primitive.name != "concatenate" or len(ins) < 2:
        continue
      roots = [self._root(v) for v in ins]
      if not all(r in made_at for r in roots):
        continue
      where = [regions(self.eqns[made_at[r]][0]) for r in roots]
      if None in where or len(set(where)) < len(where) or regions(eqn) in where:
        continue
      if not any(len(reads.get(r, ())) > 1 for r in roots):
        # (values only stacked stay as they were counted, alive to the stack: a scanned
        # GPT's weight gradients written so from the backward loop's start made its
        # estimate 1.10x of XLA's bytes, 0.97x counted piece by piece)
        continue
      for v, r in zip(ins, roots):
        slot = {j}  # the stack and the reshapes making its slot of r
        u = v
        while u is not r:
          slot.add(made_at[u])
          u = self._owner.get(u, r)
        for u in {v, r}:
          last[u] = max((i for i in reads.get(u, ()) if i not in slot), default=made_at[r])
        if all(i in slot for i in reads.get(r, ())):
          self._owner[r] = outs[0]
      starts[outs[0]] = min(made_at[r] for r in roots)
    return starts

  def _slices_of_stacks(self, bitcast, outputs) -> set:
    """A concatenation that every reader slices one operand back out of (an unrolled
    scan's stacked residuals, each read by its iteration of the backward) is never made
    in a program compiled unrolled: XLA's simplifier reads the operands instead, each
    alive to its own reader. Marks those slices as sharing their operand's buffer and
    returns the concatenations' indices. Measured on a 4-block ``nn.scan`` LM under
    ShardParallel with 2 micro-batches: counted whole, the stacks made the estimate 1.18x
    of XLA's bytes. (A scan compiled as a loop does write its stacks.)"""
    readers: dict = {}
    for i, (_, ins, _) in enumerate(self.eqns):
      for v in set(ins):
        readers.setdefault(v, []).append(i)
    dropped = set()
    for j, (eqn, parts, outs) in enumerate(self.eqns):
      if eqn.primitive.name != "concatenate" or self.buffer_of(outs[0]) in outputs:
        continue
      picked = [(i, _picked_operand(self.eqns[i][0], eqn.params["dimension"], parts))
                for i in readers.get(outs[0], ())]
      if not picked or any(operand is None for _, operand in picked):
        continue
      for i, operand in picked:
        bitcast[i] = True
        self._owner[self.eqns[i][2][0]] = operand
      dropped.add(j)
    return dropped

  def _make_input_only_values_early(self, static, early_inputs) -> None:
    """XLA:CPU schedules what depends on constants and inputs alone first:
    - the zeros a scatter updates in place (an embedding's gradient: ``scatter_add``
      into a vocabulary-sized zeros) are made at the program's start and live through
      the forward: measured on a GPT with a vocabulary of 8192 and width 128 (a 4.2 MB
      table), with and without jaxdist, and on an embedding-bag model under ZeRO-3;
    - so is a cast of an input (a kernel cast to bf16 for the forward and kept for the
      backward), unless the input is gathered where it is read (``late_inputs``:
      ZeRO-3's streamed parameters): measured on a bf16-compute MLP under ZeRO-2, its
      four cast kernels all live at the forward's end;
    - and an elementwise value of operands that all broadcast to its shape, one an
      input (a LayerNorm's ``rsqrt(var) * scale``): XLA writes the input's broadcast
      instead, early, and makes the value in each fusion that reads it. Measured on a
      GPT whose blocks are rematerialized: each recomputation reads the broadcast XLA
      made in the forward (CSE), and 8 of them are live at the last block's backward
      (the estimate was 0.87x of XLA's bytes without them)."""
    arrays = lambda ins: [v for v in ins if not isinstance(v, jex.Literal)]
    barred = {}  # what a recomputation reads through its optimization barrier
    for eqn, ins, outs in self.eqns:
      if eqn.primitive.name == "optimization_barrier":
        barred.update((o, barred.get(self._root(v), self._root(v))) for o, v in zip(outs, ins))
    for eqn, ins, outs in self.eqns:
      if eqn.primitive.name.startswith("scatter") and ins:
        b = self._root(ins[0])
        if b in static and b in self.buffers:
          self.buffers[b][0] = 0
      elif (eqn.primitive.name == "convert_element_type" and ins and ins[0] in early_inputs
            and outs[0] in self.buffers):
        self.buffers[outs[0]][0] = 0
      elif (eqn.primitive.name in ELEMENTWISE and outs and outs[0] in self.buffers
            and all(v.aval.shape != outs[0].aval.shape for v in arrays(ins))
            and any(barred.get(self._root(v), self._root(v)) in early_inputs
                    for v in arrays(ins))):
        self.buffers[outs[0]][0] = 0

  def hoist_invariant_values(self, invariant_inputs, end: int) -> None:
    """What the jaxpr computes from ``invariant_inputs`` alone (the parameters of a
    micro-batch loop running positions ``[0, end]``), XLA's loop-invariant code motion
    computes once before the loop, and it lives through every iteration: a bf16 cast of
    each kernel. Measured on an encoder-decoder computing in bf16 with 2 micro-batches
    under DataParallel: all its kernels' casts live beside the loop (0.86x of XLA's bytes
    with each cast alive to its last reader only, 0.95x now). Not the copies layout
    assignment makes later (a kernel transposed for the backward's dot, ``relaid``): a
    GPT's DataParallel estimate with 2 micro-batches went from 1.00x to 1.05x of XLA's
    bytes counting them alive to the program's end. Only casts: a layer's slice of
    stacked (scanned) weights is read in place, and hoisting every parameter-only value
    put a scanned GPT's ShardParallel estimate with 2 micro-batches at 1.27x."""
    invariant, casts = set(invariant_inputs), set()
    for eqn, ins, outs in self.eqns:
      arrays = [v for v in ins if not isinstance(v, jex.Literal)]
      if arrays and eqn.primitive.name not in LOOPS and all(v in invariant for v in arrays):
        invariant.update(outs)
        if eqn.primitive.name == "convert_element_type":
          casts.update(outs)
    for value in casts & self.buffers.keys():
      buffer = self.buffers[value]
      if buffer[0] <= end:
        buffer[:2] = [0, max(buffer[1], end)]

  def _reuse_dying_operands(self, fused, end, inputs, outputs) -> None:
    """An elementwise op writes its result into the buffer of an operand of the same
    shape that dies there (XLA's buffer assignment shares a loop fusion's output with
    such an operand, also one its fused producers read): measured on a GPT's GELU
    backward, where two of six same-size values share buffers this way. Not zeros, a
    scatter-add's initial value that :meth:`_fold_scatters_into_sums` folds away
    (measured on a one-block GPT under ZeRO-3 with its block recomputed: given the
    zeros' buffer, the logits' gradient was counted nowhere, and the estimate was 0.77x
    of XLA's bytes)."""
    position = {o: i for i, (_, _, outs) in enumerate(self.eqns) for o in outs}
    written = lambda b: (b not in inputs and b not in outputs and b in position
                         and not fused[position[b]] and not _zeros(self.eqns[position[b]][0]))
    through = lambda j: fused[j] and self.eqns[j][0].primitive.name in ELEMENTWISE

    for i, (eqn, _, outs) in enumerate(self.eqns):
      if (fused[i] or len(outs) != 1 or outs[0] in outputs
          or eqn.primitive.name not in ELEMENTWISE):
        continue
      o = outs[0]
      for v in self._fusion_inputs(i, position, through):
        b = self._root(v)
        if (written(b) and end.get(b, -1) == i and b.aval.shape == o.aval.shape
            and b.aval.dtype == o.aval.dtype):
          self._owner[o] = b
          end[b] = max(end.get(o, i), i)
          break

  def _fold_scatters_into_sums(self, readers, end, inputs, outputs, fused) -> set:
    """``x + scatter_add(zeros, i, u)`` (a cross entropy's gradient through
    ``take_along_axis``) is ``scatter_add(x, i, u)`` after XLA's simplifier: the sum
    updates ``x``'s buffer in place where nothing reads ``x`` afterwards, and the zeros
    are never written. Where ``x`` is fused into the sum (a softmax's gradient that
    nothing else reads), XLA computes it where the sum's buffer is: the sum keeps the
    buffer it was given (a dying operand's, or its own). Returns the buffers that are
    never written."""
    made = {o: eqn for eqn, _, outs in self.eqns for o in outs}
    position = {o: i for i, (_, _, outs) in enumerate(self.eqns) for o in outs}
    elided = set()
    for i, (eqn, ins, outs) in enumerate(self.eqns):
      if eqn.primitive.name not in ("add", "add_any") or len(ins) != 2:
        continue
      for scattered, other in ((ins[0], ins[1]), (ins[1], ins[0])):
        source = made.get(scattered)
        if (source is None or source.primitive.name not in ("scatter-add", "scatter_add")
            or len(readers.get(scattered, ())) != 1
            or scattered.aval.shape != other.aval.shape):
          continue
        zeros = self._root(scattered) if scattered in self._owner else None
        init = made.get(zeros)
        if init is None or not _zeros(init):
          continue
        b = self._root(other)
        dies = end.get(b, -1) == i or self._root(outs[0]) == b  # (its buffer the sum's)
        if b in inputs or b in outputs or not dies or outs[0] in outputs:
          continue
        elided.add(zeros)
        if b in position and fused[position[b]]:
          break  # (the sum keeps the buffer it has: see _reuse_dying_operands)
        self._owner[outs[0]] = b
        end[b] = max(end.get(outs[0], i), i)
        break
    return elided

  def _relay_operands(self, inputs, size, end) -> None:
    """XLA:CPU multiplies in canonical form (lhs batch, free, contracting dims; rhs
    batch, contracting, free; one dim of each after merging): a dot reading an input in
    another order reads a transposed copy of it. XLA makes one such copy per input and
    order, early in the program (it depends on the input only), and keeps it until its
    last dot: measured on a GPT's attention kernels, ``[d, heads, head_dim]`` read by
    the backward's dot over ``(heads, head_dim)``, one copy each live from the start to
    the backward. Labelled ``("relaid", input, order)``. A computed operand read out of
    order is copied at its dot, ``("relaid", value, order, position)``: the output
    gradient of a dense layer over ``[batch, seq, features]``, read by the weight
    gradient's dot over ``(batch, seq)`` (a GPT with a vocabulary of 8192: an 8.4 MB copy
    of the logits' gradient; its DataParallel estimate went from 0.87x to 0.95x of XLA's
    bytes, ShardParallel's from 0.88x to 1.02x). A convolution's result out of order is
    written in canonical order first, ``("relaid", result, position)``: the backward's
    kernel gradients (a WideResNet's estimates went from 0.94x, 0.92x, 0.90x of XLA's
    bytes under DataParallel, ZeRO-2, ZeRO-3 to 1.04x, 1.07x, 0.97x)."""
    last: dict = {}
    read_at: dict = {}  # buffer → the positions reading it
    for i, (_, ins, _) in enumerate(self.eqns):
      for v in ins:
        if not isinstance(v, jex.Literal):
          read_at.setdefault(self.buffer_of(v), []).append(i)
    for i, (eqn, ins, outs) in enumerate(self.eqns):
      if eqn.primitive.name not in ("dot_general", "conv_general_dilated") or len(ins) != 2:
        continue  # (a literal operand)
      if eqn.primitive.name == "conv_general_dilated" and _conv_order(eqn, 2):
        # Computed in canonical order, then transposed into the result's.
        self.buffers[("relaid", outs[0], i)] = [i, i, size(outs[0])]
      for side, v in enumerate(ins):
        b = self.buffer_of(v)
        order = (_dot_order if eqn.primitive.name == "dot_general" else _conv_order)(eqn, side)
        if order is None:
          continue
        if b in inputs:
          last[(b, order)] = i
        else:
          # A computed operand is copied where it is read: a weight gradient's dot
          # reads the output gradient ``[batch, seq, out]`` over ``(batch, seq)``.
          # Where an earlier dot reads it too (the input gradient's for a cotangent, the
          # forward's for an activation), XLA makes the copy there, and the operand lives
          # only to its other readers.
          reads = [j for j in read_at.get(b, ()) if j < i]
          first = min((j for j in reads if self.eqns[j][0].primitive.name == "dot_general"),
                      default=i)
          self.buffers[("relaid", b, order, i)] = [first, i, size(b)]
          if first < i and end.get(b) == i:
            end[b] = max(reads)
    for (b, order), i in last.items():
      self.buffers[("relaid", b, order)] = [0, i, size(b)]

  def buffer_of(self, v):
    """The buffer holding variable ``v`` (through calls and bitcasts)."""
    return self._root(self._rename.get(v, v))

  def _root(self, v):
    while v in self._owner:
      v = self._owner[v]
    return v

  def add(self, label, start: int, end: int, nbytes: float) -> None:
    self.buffers[label] = [start, end, nbytes]

  def peak(self) -> Peak:
    n = len(self.eqns)
    delta = [0.0] * (n + 2)
    for start, end, b in self.buffers.values():
      delta[max(start, 0)] += b
      delta[min(end, n) + 1] -= b
    best, at, running = 0.0, 0, 0.0
    for i in range(n):
      running += delta[i]
      if running + self.extra[i] > best:
        best, at = running + self.extra[i], i
    live = sorted(((label, b) for label, (s, e, b) in self.buffers.items() if s <= at <= e),
                  key=lambda x: -x[1])
    return Peak(best, at, tuple(live))


def _picked_operand(eqn, dim: int, parts):
  """The operand among ``parts`` (concatenated along ``dim``) that the slice ``eqn``
  takes back whole, or None."""
  if eqn.primitive.name != "slice" or any(st != 1 for st in eqn.params.get("strides") or ()):
    return None
  offset = 0
  for part in parts:
    shape = part.aval.shape
    if (eqn.params["start_indices"] == tuple(offset if k == dim else 0 for k in range(len(shape)))
        and eqn.params["limit_indices"] == tuple(offset + n if k == dim else n
                                                 for k, n in enumerate(shape))):
      return part
    offset += shape[dim]
  return None


def _widened(size: Callable[[object], float]) -> Callable[[object], float]:
  """``size`` with 16-bit floats stored as f32 (XLA:CPU)."""
  def widened(v):
    dtype = getattr(getattr(v, "aval", None), "dtype", None)
    half = dtype is not None and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2
    return size(v) * 2 if half else size(v)
  return widened


def _expanded_indices(eqn, size: Callable[[object], float]) -> float:
  """Bytes of the s32 index arrays XLA:CPU builds for ``select_and_scatter_add(source,
  operand)``: a rank-long index per element of the operand (iotas) and of the source."""
  total = 0.0
  for v in eqn.invars[:2]:
    elements = size(v) / max(v.aval.dtype.itemsize, 1)
    total += 4 * len(v.aval.shape) * elements
  return total


def _dot_order(eqn, side: int) -> tuple[int, ...] | None:
  """The order XLA:CPU transposes operand ``side`` (0 lhs, 1 rhs) of a dot into, or
  None where it reads the operand as it is: already canonical (at most one contracting
  and one free dim, batch dims leading; a 2-D operand may be transposed) or in canonical
  order, so merging dims is a bitcast."""
  (contract, batch) = eqn.params["dimension_numbers"]
  contracting, batched = tuple(contract[side]), tuple(batch[side])
  rank = len(eqn.invars[side].aval.shape)
  free = tuple(d for d in range(rank) if d not in contracting and d not in batched)
  if (len(contracting) <= 1 and len(free) <= 1
      and batched == tuple(range(len(batched)))):
    return None
  order = batched + (free + contracting if side == 0 else contracting + free)
  return None if order == tuple(range(rank)) else order


def _conv_order(eqn, side: int) -> tuple[int, ...] | None:
  """The order XLA:CPU transposes a convolution's operand ``side`` (0 input, 1 kernel,
  2 result) into, or None where it is canonical: NHWC inputs and results, HWIO kernels
  (the backward's convolutions read the activations batch-last and the kernels with
  their feature dims swapped)."""
  spec = tuple(eqn.params["dimension_numbers"][side])
  first, second, spatial = spec[0], spec[1], spec[2:]
  order = (spatial + (second, first)) if side == 1 else ((first,) + spatial + (second,))
  return None if order == tuple(range(len(spec))) else order


def _fused(eqn, outs, readers, outputs, static, outer: bool, kind: Callable) -> bool:
  """Whether XLA fuses ``eqn`` into its reader instead of writing its result: an
  elementwise op (or broadcast) read by exactly one op that fuses its operands. A value
  read more than once is written once (measured on the CPU backend: a GPT's residual
  stream and GELU output, read by the next layer and by the backward, are buffers; so are
  LayerNorm statistics broadcast to the activations' shape), except a cheap one computed
  from constants alone (``static``: a causal mask broadcast to the attention scores'
  shape) or elementwise from one array and read by elementwise ops only (GELU's
  ``0.5 * (1 + t)``, read by its forward and backward multiplies: a ViT's estimate was
  1.07x to 1.14x of XLA's bytes with it written), which XLA recomputes in every fusion
  reading it."""
  names = [r for o in outs for r in readers.get(o, ())]
  if (eqn.primitive.name == "transpose" and names and not any(o in outputs for o in outs)
      and all(r == "dot_general" for r in names)):
    return True  # folded into the dots' dimension numbers (XLA's transpose folding)
  if any(o in outputs for o in outs):
    return False
  if eqn.primitive.name in SLICES:
    return bool(names) and all(len(readers.get(o, ())) <= 1 for o in outs) and all(
        r in FUSIBLE | REDUCTIONS for r in names)
  if outer:
    return bool(names) and all(r in FUSIBLE | REDUCTIONS | SLICES | {"transpose"}
                               for r in names)
  if kind(eqn) not in FUSIBLE:
    return False
  if len(names) > 1 and not (eqn.primitive.name in CHEAP and (
      all(o in static for o in outs) or _unary(eqn, kind) and all(r in FUSIBLE for r in names))):
    return False
  return all(r in FUSING_READERS for r in names)


def _zeros(eqn) -> bool:
  """Whether ``eqn`` broadcasts a literal zero (a scatter-add's initial value)."""
  return (eqn.primitive.name == "broadcast_in_dim" and isinstance(eqn.invars[0], jex.Literal)
          and eqn.invars[0].val == 0)


def _kind(eqn, elementwise_bitcasts: bool) -> str:
  """``eqn``'s primitive name, a bitcast named apart unless it is elementwise (one width,
  and ``elementwise_bitcasts``)."""
  name = eqn.primitive.name
  if name == "bitcast_convert_type" and (
      not elementwise_bitcasts or eqn.invars[0].aval.shape != eqn.outvars[0].aval.shape):
    return "bitcast_convert_type (written)"
  return name


def _unary(eqn, kind: Callable) -> bool:
  """Whether ``eqn`` is elementwise (``kind``: its name, see :func:`_kind`) on at most one
  array that is no scalar."""
  return kind(eqn) in FUSIBLE and kind(eqn) not in ("broadcast_in_dim", "iota") and sum(
      bool(getattr(v.aval, "shape", ())) for v in eqn.invars) <= 1


def _carried(eqn, ins, outs) -> list[tuple]:
  """(initial value, result) of each value a scan or while loop carries."""
  p = eqn.params
  if eqn.primitive.name == "scan":
    first, n = p["num_consts"], p["num_carry"]
  elif eqn.primitive.name == "while":
    first, n = p["cond_nconsts"] + p["body_nconsts"], len(outs)
  else:
    return []
  return list(zip(ins[first:first + n], outs[:n]))


def _swaps_free_dims(transpose, dot) -> bool:
  """Whether ``transpose`` of ``dot``'s result swaps its two free dims (one from each
  side) and keeps the batch dims: XLA's simplifier makes that the dot of the swapped
  operands, the transpose never written (a meta-learning step's per-task weight
  gradients ``[tasks, in, out]``: counted as a dot and its transpose, the estimate was
  1.3x of XLA's bytes)."""
  (contract, batch) = dot.params["dimension_numbers"]
  ranks = [len(v.aval.shape) for v in dot.invars]
  free = [r - len(c) - len(b) for r, c, b in zip(ranks, contract, batch)]
  n = len(batch[0])
  return free == [1, 1] and tuple(transpose.params["permutation"]) == (*range(n), n + 1, n)


def _outer_product(eqn) -> bool:
  """A dot_general that contracts nothing but dims of size 1: XLA's simplifier makes it
  (and a transpose of it) a multiply of broadcasts, which fuses into its readers (a
  weight gradient of one row, micro-batches of one example per device; an LSTM's 40
  per-step gradients, added up in one fusion, were estimated 12x of XLA's bytes written
  as matrices)."""
  if eqn.primitive.name != "dot_general":
    return False
  (contracting, _), _ = eqn.params["dimension_numbers"]
  shape = eqn.invars[0].aval.shape
  return all(shape[d] == 1 for d in contracting)


def _input_gradients_first(eqns: list) -> list:
  """``eqns`` with each weight gradient's dot (and the transpose or cast after it) moved
  after the next dot reading the same cotangent, the layer's input gradient: XLA runs that one
  first (the backward's next layer waits on it), so the layer's weights, or their bf16
  cast, die before its weight gradient is made. Only weight gradients the marker
  returns (``jaxdist.grad``'s) move, also through the sum of a tied weight's two
  gradients (an output layer reading the embedding: in program order, its estimate was
  1.14x of XLA's bytes). Measured on a bf16-compute MLP under ZeRO-3: in
  program order its estimate was 1.12x of XLA's bytes (a cast kernel too many at the
  peak), in XLA's order 1.0x. (Moving the gradients added into a pipeline stage's
  accumulators too took one 4-stage MLP plan's first stage from 1.16x to 1.0x, but the
  example GPT's 4 stages from 1.06-1.10x to 1.13-1.15x: XLA does not order those alike.)"""
  readers: dict = {}
  for i, (_, ins, _) in enumerate(eqns):
    for v in ins:
      readers.setdefault(v, []).append(i)
  moved: dict = {}  # position of the input gradient's dot → the weight gradient's chain
  for i, (eqn, ins, outs) in enumerate(eqns):
    if eqn.primitive.name != "dot_general" or len(outs) != 1:
      continue
    chain, users = [i], readers.get(outs[0], [])
    while len(users) == 1 and eqns[users[0]][0].primitive.name in (
        "transpose", "convert_element_type"):
      chain.append(users[0])
      users = readers.get(eqns[users[0]][2][0], [])
    summed = None  # (a tied weight's two gradients: their sum stays where it is)
    if len(users) == 1 and eqns[users[0]][0].primitive.name in ("add", "add_any"):
      summed = users[0]
      users = readers.get(eqns[summed][2][0], [])
    if not users or any(eqns[j][0].primitive.name not in jaxpr_util.MARKERS for j in users):
      continue
    later = [j for v in ins for j in readers.get(v, ())
             if j > i and j not in chain and eqns[j][0].primitive.name == "dot_general"
             and j not in moved]
    if later and (summed is None or summed > min(later)):
      moved[min(later)] = chain
  if not moved:
    return eqns
  skip = {j for chain in moved.values() for j in chain}
  out = []
  for i, entry in enumerate(eqns):
    if i not in skip:
      out.append(entry)
    out.extend(eqns[j] for j in moved.get(i, ()))
  return out


def _static(eqns, constvars) -> set:
  """The values computed from constants alone (a causal mask from iotas)."""
  static = set(constvars)
  for eqn, ins, outs in eqns:
    if eqn.primitive.name not in LOOPS and all(v in static for v in ins):
      static.update(outs)
  return static


def _first_body(eqn):
  for sub in jex.jaxprs_in_params(eqn.params):
    return jex.ClosedJaxpr(sub, ())
  return None


def _linear(jaxpr) -> tuple[list[tuple], dict]:
  """(eqn, invars, outvars) in program order with calls flattened (literals dropped), and
  the renaming of call results to their bodies' values. A body's values get fresh
  variables at each call: calls of one body (the blocks of a model under ``nn.remat``,
  whose traces jax shares) would otherwise share them, and each block's values would
  live until the last block read its own."""
  out, top = [], {}

  def visit(jx, rename, fresh):
    for eqn in jx.eqns:
      ins = [rename.get(v, v) for v in eqn.invars if not isinstance(v, jex.Literal)]
      if eqn.primitive.name in CALLS:
        body = jaxpr_util.call_body(eqn) or _first_body(eqn)
        if body is not None and len(body.jaxpr.invars) == len(eqn.invars):
          inner = {}
          for bv, v in zip(body.jaxpr.invars, eqn.invars):
            if not isinstance(v, jex.Literal):
              inner[bv] = rename.get(v, v)
          visit(body.jaxpr, inner, True)
          # The call's outputs are its body's outputs.
          for o, bo in zip(eqn.outvars, body.jaxpr.outvars):
            if not isinstance(bo, jex.Literal):
              rename[o] = inner.get(bo, bo)
          continue
      outs = list(eqn.outvars)
      if fresh:
        outs = [o if isinstance(o, jex.DropVar) else rename.setdefault(o, jex.Var(o.aval))
                for o in outs]
      out.append((eqn, ins, outs))

  visit(jaxpr, top, False)
  return out, top
