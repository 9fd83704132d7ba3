"""upcast_logits as a CUDA kernel inside jit (command buffers on, XLA default
flags), against the reference below every row end."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

import glm5_jax
from glm5_jax import reference as ref

from graphs import run_and_check_graphed

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("all_kernels")]
CALLS = 6          # >= XLA's minimum command-buffer size, so the calls are graphed


def _chain(*pairs):
  return [glm5_jax.upcast_logits(logits, ends) for logits, ends in pairs]


def test_lowers_to_the_kernel():
  logits, ends = jnp.zeros((2, 8), jnp.bfloat16), jnp.array([3, 8], jnp.int32)
  text = jax.jit(glm5_jax.upcast_logits).lower(logits, ends).as_text()
  assert "glm5_upcast_logits" in text


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("width", [1, 7, 8, 13, 2048, 8195, 32768, 70001])
def test_kernel_matches_reference(rows, width):
  rng = np.random.default_rng(rows * 100003 + width)
  pairs = []
  for _ in range(CALLS):
    logits = jnp.asarray(rng.standard_normal((rows, width)) * 30, jnp.bfloat16)
    ends = rng.integers(-3, width + 4, rows)
    ends[: min(rows, 3)] = [width, 0, width + 9][: min(rows, 3)]
    pairs.append((logits, jnp.asarray(ends, jnp.int32)))
  text = jax.jit(_chain).lower(*pairs).compile().as_text()
  assert text.count('custom_call_target="glm5_upcast_logits"') == CALLS
  got = jax.jit(_chain)(*pairs)
  for (logits, ends), out in zip(pairs, got):
    want = np.asarray(jax.jit(ref.upcast_logits)(logits, ends))
    keep = np.arange(width) < np.asarray(ends)[:, None]
    np.testing.assert_array_equal(np.asarray(out)[keep], want[keep])


def test_empty_inputs():
  for shape in [(0, 16), (4, 0)]:
    out = jax.jit(glm5_jax.upcast_logits)(jnp.zeros(shape, jnp.bfloat16),
                                          jnp.zeros(shape[:1], jnp.int32))
    assert out.shape == shape and out.dtype == jnp.float32


def test_kernel_runs_inside_a_command_buffer(tmp_path):
  """With XLA's default flags the FFI call is captured in a CUDA graph: the
  thunk sequence XLA dumps after its passes holds it inside a command buffer."""
  script = (
      "import jax, jax.numpy as jnp, glm5_jax\n"
      "x = jnp.ones((4, 64), jnp.bfloat16); e = jnp.array([1, 64, 9, 0], jnp.int32)\n"
      "f = jax.jit(lambda x, e: [glm5_jax.upcast_logits(x * (i + 1), e)\n"
      f"                         for i in range({CALLS})])\n"
      "print(float(f(x, e)[-1][1, 5]))\n")
  out = run_and_check_graphed(script, ["glm5_upcast_logits"], tmp_path)
  assert out.strip() == str(float(CALLS))
