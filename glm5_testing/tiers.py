"""The fast and slow test tiers of a parametrized grid: `python -m pytest -n 2 -m "not slow"`
(the README's command) runs a part that takes every value of every axis, CI's slow tier
(`-m slow`) the rest, so each combination still runs in CI."""
import itertools

import pytest

# The ops that update the K caches (the composites compile the most): their per-case
# variations (vmap over each operand, jax.export) are the slow tier's.
CACHE_OPS = ("kpool_update", "indexer_update", "update_epilogue", "update_epilogue_q",
             "indexer_update_q")


def diagonal(*axes):
  """pytest.params of the product of `axes` (each a list of values, a value a tuple of
  arguments or one argument): combination i of the diagonal, axis k's value i % len(k), for
  i below the longest axis's length, unmarked; every other combination marked slow."""
  axes = [[v if isinstance(v, tuple) else (v,) for v in axis] for axis in axes]
  fast = {tuple(i % len(axis) for axis in axes) for i in range(max(map(len, axes)))}
  return [pytest.param(*(x for k, i in enumerate(index) for x in axes[k][i]),
                       marks=() if index in fast else pytest.mark.slow)
          for index in itertools.product(*(range(len(axis)) for axis in axes))]


def first(*values):
  """pytest.params of `values` (a value a tuple of arguments or one argument): the first
  unmarked, the others marked slow."""
  values = [v if isinstance(v, tuple) else (v,) for v in values]
  return [pytest.param(*v, marks=() if i == 0 else pytest.mark.slow)
          for i, v in enumerate(values)]
