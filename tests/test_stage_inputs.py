"""indexer_stage's boundary: bad arguments and configs raise at trace time, naming
the argument (issue 11's cases as a new user met them); eager == jit on CPU."""
import dataclasses
import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import glm5_jax
from glm5_jax import synthetic
from glm5_testing.cases import stage_state

CONFIG = glm5_jax.IndexerConfig(max_pools=1024)
HIDDEN, Q_LORA = 256, 256


def state(contexts=(10, 1500, 3001, 77), next_n=1, seed=0, config=CONFIG, hidden=HIDDEN,
          q_lora=Q_LORA):
  """(weights, cache, x, qr, batch) of len(contexts) requests x next_n rows."""
  return stage_state(contexts, next_n, seed, config=config, hidden=hidden, q_lora=q_lora)


def trace(weights, cache, x, qr, batch, config=CONFIG):
  """Traces the stage (shapes only: where the checks run), as jit would."""
  return jax.eval_shape(functools.partial(glm5_jax.indexer_stage, config=config),
                        weights, cache, x, qr, batch)


def _with(obj, **fields):
  return dataclasses.replace(obj, **fields)


def _weights(fn):
  return lambda w, c, x, qr, b: (fn(w), c, x, qr, b)


def _cache(fn):
  return lambda w, c, x, qr, b: (w, fn(c), x, qr, b)


def _x(fn):
  return lambda w, c, x, qr, b: (w, c, fn(x), qr, b)


def _qr(fn):
  return lambda w, c, x, qr, b: (w, c, x, fn(qr), b)


def _batch(fn):
  return lambda w, c, x, qr, b: (w, c, x, qr, fn(b))


S = "glm5_jax.indexer_stage: "
BAD_ARGS = {
    # x with 3 rows for a batch of 4 requests x 1 (was a raw reshape error).
    "x_rows": (_x(lambda x: x[:3]), ValueError,
               S + r"x must have shape \(rows, hidden\) = \(4, 256\): rows = requests x "
               r"next_n = 4 x 1 .* got \(3, 256\)"),
    "x_hidden": (_x(lambda x: x[:, :128]), ValueError, S + r"x must have shape .* got \(4, 128\)"),
    "x_dtype": (_x(lambda x: x.astype(jnp.float32)), TypeError, S + "x must be bfloat16"),
    # qr of the wrong width for wq_b (was a dot_general error) or dtype (was accepted).
    "qr_width": (_qr(lambda qr: jnp.zeros((4, 1024), jnp.bfloat16)), ValueError,
                 S + r"qr must have shape \(rows, q_lora\) = \(4, 256\).*q_lora = "
                 r"weights.wq_b's dim 1; got \(4, 1024\)"),
    "qr_rows": (_qr(lambda qr: qr[:2]), ValueError, S + r"qr must have shape .* got \(2, 256\)"),
    "qr_f32": (_qr(lambda qr: qr.astype(jnp.float32)), TypeError,
               S + "qr must be bfloat16, got float32"),
    "qr_rank": (_qr(lambda qr: qr[None]), ValueError, S + r"qr must have shape \(\*, \*\)"),
    # a tail ring of fewer blocks than requests (was accepted, dropping cache writes).
    "tail_blocks": (_cache(lambda c: _with(c, tail=c.tail[:3])), ValueError,
                    S + r"cache.tail must have a block per request \(dim 0 >= requests = 4\)"),
    "tail_ring": (_cache(lambda c: _with(c, tail=c.tail[:, :, :2])), ValueError,
                  S + "cache.tail ring size"),
    "tail_dtype": (_cache(lambda c: _with(c, tail=c.tail.astype(jnp.float32))), TypeError,
                   S + "cache.tail must be bfloat16"),
    "kv_cache": (_cache(lambda c: _with(c, kv_cache=c.kv_cache[:, :, :128])), ValueError,
                 S + r"cache.kv_cache must have shape \(\*, \*, 132\)"),
    # the batch's metadata: i32, positions/loc/tslot [B, N], req_ids [B*N], tables rank 2.
    "positions_dtype": (_batch(lambda b: _with(b, positions=b.positions.astype(jnp.float32))),
                        TypeError, S + "batch.positions must be int32"),
    "positions_rank": (_batch(lambda b: _with(b, positions=b.positions.reshape(-1))),
                       ValueError, S + r"batch.positions must have shape \(\*, \*\)"),
    "loc_shape": (_batch(lambda b: _with(b, loc=b.loc.reshape(1, 4))), ValueError,
                  S + r"batch.loc must have shape \(4, 1\), got \(1, 4\)"),
    "tslot_shape": (_batch(lambda b: _with(b, tslot=b.tslot[:2])), ValueError,
                    S + r"batch.tslot must have shape \(4, 1\)"),
    "tslot_dtype": (_batch(lambda b: _with(b, tslot=b.tslot.astype(jnp.int16))), TypeError,
                    S + "batch.tslot must be int32"),
    "req_ids_len": (_batch(lambda b: _with(b, req_ids=b.req_ids[:3])), ValueError,
                    S + r"batch.req_ids must have shape \(4,\), got \(3,\)"),
    "page_table_dtype": (_batch(lambda b: _with(b, page_table=b.page_table.astype(jnp.int16))),
                         TypeError, S + "batch.page_table must be int32"),
    "page_table_rank": (_batch(lambda b: _with(b, page_table=b.page_table.reshape(-1))),
                        ValueError, S + r"batch.page_table must have shape \(\*, \*\)"),
    "block_table_dtype": (_batch(lambda b: _with(b, block_table=b.block_table.astype(
        jnp.uint32))), TypeError, S + "batch.block_table must be int32"),
    "block_table_rank": (_batch(lambda b: _with(b, block_table=b.block_table[None])),
                         ValueError, S + r"batch.block_table must have shape \(\*, \*\)"),
    # the weights' own fields.
    "norm_weight": (_weights(lambda w: _with(w, norm_weight=w.norm_weight.astype(
        jnp.bfloat16))), TypeError, S + "weights.norm_weight must be float32"),
    "ape": (_weights(lambda w: _with(w, ape=w.ape[:3])), ValueError,
            S + r"weights.ape must have shape \(4, 128\)"),
    "wq_b_dtype": (_weights(lambda w: _with(w, wq_b=w.wq_b.astype(jnp.float32))), TypeError,
                   S + "weights.wq_b must be bfloat16"),
    # the pytree types themselves.
    "weights_type": (lambda w, c, x, qr, b: (dataclasses.astuple(w), c, x, qr, b), TypeError,
                     S + "weights must be a glm5_jax.IndexerWeights, got tuple"),
    "batch_type": (_batch(lambda b: dataclasses.asdict(b)), TypeError,
                   S + "batch must be a glm5_jax.DecodeBatch, got dict"),
}


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_bad_argument(case):
  mutate, error, message = BAD_ARGS[case]
  with pytest.raises(error, match=message):
    trace(*mutate(*state()))


def test_not_an_array():
  """Eagerly (under jit, jax itself refuses a str argument)."""
  weights, cache, x, qr, batch = state()
  with pytest.raises(TypeError, match=S + "batch.req_ids must be an array, got str"):
    glm5_jax.indexer_stage(weights, cache, x, qr, dataclasses.replace(batch, req_ids="0,1"),
                           config=CONFIG)


def test_good_arguments_trace():
  out, cache = trace(*state())
  assert out.slots.shape == (4, CONFIG.width) and cache.tail.shape[0] == 4


def test_checks_run_under_jit_before_any_op():
  """The error comes from the stage's boundary, not from the op that would trip."""
  step = jax.jit(glm5_jax.indexer_stage, static_argnames=("config", "use_reference"))
  weights, cache, x, qr, batch = state()
  for use_reference in (False, True):
    with pytest.raises(ValueError, match=S + "x must have shape"):
      step(weights, cache, x[:3], qr, batch, config=CONFIG, use_reference=use_reference)


def test_heads_disagree_with_weights():
  """IndexerConfig(heads=16) with 32-head weights (was a reshape error), and weights
  whose wq_b and w_cat disagree with each other."""
  weights, cache, x, qr, batch = state()
  config16 = glm5_jax.IndexerConfig(heads=16, max_pools=1024)
  with pytest.raises(ValueError, match=S + r"weights.wq_b must have config.heads \* 128 = "
                     r"2048 rows \(heads = 16\), got shape \(4096, 256\)"):
    trace(weights, cache, x, qr, batch, config=config16)
  w16 = synthetic.layer(np.random.default_rng(1), config16, hidden=HIDDEN, q_lora=Q_LORA)
  mixed = dataclasses.replace(w16, w_cat=weights.w_cat)
  with pytest.raises(ValueError, match=S + r"weights.w_cat must have 256 \+ config.heads = "
                     r"272 rows .* got shape \(288, 256\)"):
    trace(mixed, cache, x, qr, batch, config=config16)
  out, _ = trace(w16, cache, x, qr, batch, config=config16)
  assert out.q_fp8.shape == (4, 32, 128)          # 16 heads padded to 32


def test_config_must_be_an_indexer_config():
  with pytest.raises(TypeError, match=S + "config must be a glm5_jax.IndexerConfig, got dict"):
    trace(*state(), config={"heads": 32})


C = "glm5_jax.IndexerConfig: "
BAD_CONFIGS = [
    (dict(topk_tokens=-4), ValueError, C + "topk_tokens must be a positive multiple of 4, got -4"),
    (dict(topk_tokens=5), ValueError, C + "topk_tokens must be a positive multiple of 4, got 5"),
    (dict(topk_tokens=0), ValueError, C + "topk_tokens must be a positive multiple of 4"),
    (dict(topk_tokens=2048.0), TypeError, C + "topk_tokens must be an int"),
    (dict(heads=0), ValueError, C + "heads must be > 0, got 0"),
    (dict(heads=True), TypeError, C + "heads must be an int"),
    (dict(max_pools=0), ValueError, C + "max_pools must be > 0, got 0"),
    (dict(block_size=6), ValueError, C + "block_size must be a positive multiple of 4, got 6"),
    (dict(block_size=-128), ValueError, C + "block_size must be a positive multiple of 4"),
    (dict(softmax_scale=float("nan")), ValueError, C + "softmax_scale must be finite, got nan"),
    (dict(softmax_scale="0.1"), TypeError, C + "softmax_scale must be a number"),
    (dict(eps=-1e-6), ValueError, C + "eps must be finite and >= 0"),
    (dict(eps=float("inf")), ValueError, C + "eps must be finite and >= 0, got inf"),
    (dict(scale_format="mx"), ValueError, C + "scale_format must be one of"),
    (dict(w_out_dtype="float16"), TypeError, C + "w_out_dtype must be one of"),
    (dict(w_out_dtype="fp32"), TypeError, C + "w_out_dtype must be one of"),
    (dict(fused=1), TypeError, C + "fused must be a bool"),
    (dict(update="kernel"), ValueError, C + r"update must be one of \('auto', 'ops', "
     r"'fused'\), got 'kernel'"),
    (dict(update=True), ValueError, C + "update must be one of"),
    (dict(update="fused", fused=True), ValueError, C + "update must be 'ops' with fused=True: "
     r"'fused' \(indexer_update\) runs indexer_projection and indexer_query"),
    (dict(routing="kernels"), TypeError, C + "routing must be a glm5_jax.Routing, got str"),
]


@pytest.mark.parametrize("fields,error,message", BAD_CONFIGS)
def test_bad_config(fields, error, message):
  with pytest.raises(error, match=message):
    glm5_jax.IndexerConfig(**fields)


@pytest.mark.parametrize("fields", [dict(), dict(heads=16, topk_tokens=4, max_pools=1),
                                    dict(block_size=4, eps=0.0, softmax_scale=1),
                                    dict(w_out_dtype="bfloat16", scale_format="ue8m0"),
                                    dict(w_out_dtype=jnp.bfloat16, heads=np.int64(64)),
                                    dict(update="fused"), dict(update="ops", fused=True),
                                    dict(update="auto", fused=True)])
def test_good_config(fields):
  config = glm5_jax.IndexerConfig(**fields)
  assert hash(config) == hash(glm5_jax.IndexerConfig(**fields))


@pytest.mark.parametrize("fused", [False, True])
def test_eager_equals_jit(fused):
  """On CPU the eager stage (op by op) and the jitted one give the same bytes, q included:
  q = qr wq_b^T was `jnp.dot(qr, wq_b.T)`, a bf16 GEMM after a transpose eagerly but an
  f32 GEMM of upcast operands under jit (XLA folds the transpose), which rounded a few
  values of q differently at the full q_lora (1536); now one dot_general both ways."""
  config = glm5_jax.IndexerConfig(max_pools=1024, fused=fused)
  args = state(next_n=2, config=config, q_lora=synthetic.Q_LORA)
  eager = glm5_jax.indexer_stage(*args, config=config)
  jitted = jax.jit(glm5_jax.indexer_stage, static_argnames="config")(*args, config=config)
  names = ["q_fp8", "w_out", "slots", "counts", "kv_cache", "tail"]
  for name, e, j in zip(names, jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
    diff = np.asarray(e).view(np.uint8) != np.asarray(j).view(np.uint8)
    assert not diff.any(), f"{name}: {diff.sum()} of {diff.size} bytes differ"
