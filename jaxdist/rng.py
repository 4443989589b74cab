"""Rows of a whole batch's random bits, drawn where only those rows are needed.

jax's partitionable threefry (``jax_threefry_partitionable``, the default) gives element
``i`` (row-major over the drawn shape) of ``random_bits(key, shape)`` the bits
``threefry2x32(key, (i >> 32, i & 0xffffffff))``, combined as ``bits1 ^ bits2``. A device
that runs one micro-batch of the step on its own rows draws ``random_bits`` of its own,
smaller shape: every device and micro-batch would get the first rows' bits. This draws
the rows ``[offset, offset + size)`` of the whole batch's bits instead, computing only
those (the same counters, offset), so dropout masks equal the single-device step's.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.random import threefry2x32_p

_UINT = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}


def supported(key, bit_width: int, full_shape: tuple[int, ...]) -> bool:
  """Whether :func:`rows` reproduces ``random_bits`` for this key, width and shape."""
  return (jax.config.jax_threefry_partitionable and bit_width in _UINT
          and math.prod(full_shape) < 2 ** 32 and getattr(key, "shape", None) == ()
          and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
          and "threefry" in str(jax.random.key_impl(key)))


def rows(key, bit_width: int, full_shape: tuple[int, ...], dim: int, size: int, offset):
  """``random_bits(key, bit_width, full_shape)`` sliced to ``[offset, offset + size)`` on
  dimension ``dim`` (``offset`` may be traced)."""
  shape = full_shape[:dim] + (size,) + full_shape[dim + 1:]
  strides = [math.prod(full_shape[d + 1:]) for d in range(len(full_shape))]
  index = jnp.asarray(offset).astype(jnp.uint32) * jnp.uint32(strides[dim])
  for d, stride in enumerate(strides):
    index = index + lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride)
  data = jax.random.key_data(key)
  k1, k2 = (jnp.broadcast_to(data[j], shape) for j in (0, 1))
  bits1, bits2 = threefry2x32_p.bind(k1, k2, jnp.zeros(shape, jnp.uint32), index)
  return (bits1 ^ bits2).astype(_UINT[bit_width])
