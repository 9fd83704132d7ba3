"""The built CUDA module's SASS keeps each kernel's model-weight loads before its PDL wait,
and the update epilogue's loads of the operands no GEMM writes.

Programmatic dependent launch lets a kernel start while the previous one finishes; the
projection kernels (indexer_projection and its GEMV, indexer_projection_fused,
indexer_update's first kernel) load their w_cat fragments and indexer_q bulk-copies its
wq_b rows before griddepcontrol.wait (ACQBULK in the SASS), so that those loads overlap the
previous kernel; mqa_logits prefetches its K-cache tensor map (a kernel parameter) there.
The source order is not enough: ptxas (CUDA 13.0, sm_90a) hoists the wait above ld.global.nc
loads, so cc/projection.cuh loads the weights with weak loads. This test reads the SASS
(cuobjdump) and fails if a change lets the wait move above them again.

It also holds indexer_projection's cluster kernels to no MEMBAR: cooperative_groups'
cluster.sync() (any cluster-scope release) compiles to MEMBAR.ALL.GPU, which ncu found in
17% of the kernel's stall samples at M=64; cc/cluster.cuh says how the kernel avoids it.

The SASS needs the built module and cuobjdump, not a GPU (marker cuda_build): CI runs these
tests after its CUDA compile, and a device-code change made without a GPU meets them on the
CPU machine.
"""
import re

import pytest
from conftest import missing

from glm5_testing.sass import module_sass

pytestmark = pytest.mark.cuda_build

# Kernel families (mangled-name pattern) and the instructions that must come before their
# first ACQBULK: a projection kernel's lane loads 2 x blocks 16-byte weight fragments (rows
# g and g + 8, `blocks` K blocks: its first template argument), the GEMV's lane `loads`
# fragments of its row (its template argument); indexer_q issues its TMA bulk copies (the
# mma tactic) or tensor copies (the wgmma tactic), as the projection's wgmma tactic does;
# mqa_logits its tensor-map prefetch.
PROJECTION = {re.compile(r"indexer_projection(?:_fused)?_kernelILi(\d+)E"): 2,
              re.compile(r"indexer_projection_gemvILi(\d+)E"): 1}
BEFORE_WAIT = {re.compile(r"indexer_q_kernelILi\d+E"): r"^(@\S+\s+)?UBLKCP",
               re.compile(r"indexer_q_wgmma_kernelILi\d+E"): r"^(@\S+\s+)?UTMALDG",
               re.compile(r"indexer_projection_wgmmaILi\d+E"): r"^(@\S+\s+)?UTMALDG",
               re.compile(r"mqa_logits_kernelILi\d+E"): r"^(@\S+\s+)?UTMACCTL\.PF"}
WAIT = "ACQBULK"


def _before_wait(instructions, pattern):
  """How many instructions matching `pattern` precede the first PDL wait (None: no wait)."""
  for i, ins in enumerate(instructions):
    if WAIT in ins:
      return sum(bool(re.search(pattern, x)) for x in instructions[:i])
  return None


@pytest.fixture(scope="module")
def functions():
  """{kernel: [instruction, ...]} of the built module (glm5_testing.sass; conftest has
  skipped or failed the test where the module is not built)."""
  from glm5_jax import _ffi
  try:
    return module_sass(_ffi._glm5_cuda.__file__)
  except RuntimeError as e:
    missing(str(e))


def test_weight_loads_precede_the_pdl_wait(functions):
  checked = {k.pattern: 0 for k in [*PROJECTION, *BEFORE_WAIT]}
  for name, instructions in functions.items():
    for kernel, per_block in PROJECTION.items():
      m = kernel.search(name)
      if m:
        want = per_block * int(m.group(1))
        loads = _before_wait(instructions, r"^(@\S+\s+)?LDG\.")
        assert loads is not None and loads >= want, (
            f"{name}: {loads} global loads before {WAIT}, want the {want} weight loads")
        checked[kernel.pattern] += 1
    for kernel, pattern in BEFORE_WAIT.items():
      if kernel.search(name):
        assert _before_wait(instructions, pattern), f"{name}: no {pattern} before {WAIT}"
        checked[kernel.pattern] += 1
  # Every family found (a renamed kernel must not make this test pass by matching nothing):
  # 9 projection and 18 fused instantiations, 8 GEMVs, 8 + 3 of indexer_q, 3 of the
  # projection's wgmma tactic, 2 of mqa_logits.
  mma, gemv = (checked[k.pattern] for k in PROJECTION)
  assert mma >= 27 and gemv >= 8 and all(checked.values()), checked


def _loads_before_each_wait(instructions):
  """Per PDL wait, the global loads since the EXIT or wait before it: the code that runs
  before that wait on a path of its own."""
  counts, loads = [], 0
  for ins in instructions:
    if WAIT in ins:
      counts.append(loads)
    if WAIT in ins or re.search(r"^(@\S+\s+)?EXIT", ins):
      loads = 0
    elif re.search(r"^(@\S+\s+)?LDG\.", ins):
      loads += 1
  return counts


def test_update_epilogue_loads_operands_before_the_pdl_wait(functions):
  """update_epilogue_kernel's early path (cc/kpool.cu, request_operands): a single-token
  request warp's pos, loc and tslot and its four APE rows are loaded before
  griddepcontrol.wait (weak loads, common.h's load_before_wait). ptxas lays that path out
  after the others (its own wait at the end of the function: 13 LDG before it on the H200,
  the ring rows' 6 too), so some wait of every instantiation (3 scale modes x f32/bf16 w_out
  x raw or not) must have at least those 7 LDG before it on its path."""
  kernels = {name: ins for name, ins in functions.items()
             if re.search(r"update_epilogue_kernelI", name)}
  assert len(kernels) == 12, sorted(functions)
  for name, instructions in kernels.items():
    counts = _loads_before_each_wait(instructions)
    assert counts and max(counts) >= 7, f"{name}: global loads before each {WAIT}: {counts}"


def test_projection_cluster_kernels_have_no_membar(functions):
  kernels = {name: ins for name, ins in functions.items()
             if re.search(r"indexer_projection_kernelILi\d+E", name)}
  assert len(kernels) >= 9, sorted(functions)  # 8 one-stage and 1 staged instantiation
  for name, instructions in kernels.items():
    assert not [x for x in instructions if "MEMBAR" in x], name
    assert any("STAS" in x for x in instructions), f"{name}: no st.async of the cluster's sums"


@pytest.mark.parametrize("kernel,sent", [(r"indexer_q_wgmma_kernelILi\d+E", "the halves"),
                                         (r"indexer_projection_wgmmaILi\d+E", "the parts")])
def test_wgmma_kernels_hand_over_sums_without_fences(functions, kernel, sent):
  """The wgmma kernels (indexer_q's wgmma tactic, and indexer_projection's in cc/projection.cu,
  pwg): HGMMA, the sums the peers own (q: the peer's half of each row; the projection: each
  rank's part of the owners' rows) handed over from registers by st.async (STAS), and no
  MEMBAR of any scope (the one cluster barrier, at the start, is relaxed; nothing is staged
  in shared memory for a copy). Three instantiations each: 16, 32 and 64 token rows."""
  kernels = {name: ins for name, ins in functions.items() if re.search(kernel, name)}
  assert len(kernels) == 3, sorted(functions)
  for name, instructions in kernels.items():
    assert any(x.startswith("HGMMA") for x in instructions), name
    assert any("STAS" in x for x in instructions), f"{name}: no st.async of {sent}"
    assert not [x for x in instructions if "MEMBAR" in x], name


def test_topk_cluster_exchanges_without_fences(functions):
  """The wide top-k's cluster (pool_topk_parts_kernel) hands its bounds, counts and the
  kept keys to CTA 0 by st.async onto mbarriers: no MEMBAR where a row fits one CTA's
  registers (its fallback is CTA 0's own top-k), and where it does not, no GPU-scope one
  but the three barriers of the cluster's radix select (histograms, lower counts, done),
  the fallback for rows that keep more than kTopkCandidates keys."""
  kernels = {name: ins for name, ins in functions.items()
             if re.search(r"pool_topk_parts_kernelILi\d+ELi\d+EE", name)}
  assert len(kernels) >= 9, sorted(functions)
  for name, instructions in kernels.items():
    parts, per = map(int, re.search(r"pool_topk_parts_kernelILi(\d+)ELi(\d+)E", name).groups())
    if parts * per <= 32:
      assert not [x for x in instructions if "MEMBAR" in x], name
    else:
      assert sum("MEMBAR.ALL.GPU" in x for x in instructions) <= 3, name
    assert any("STAS" in x for x in instructions), f"{name}: no st.async to the cluster"


def _logits_kernels(functions):
  """[(name, instructions, kHeadTiles, kGroup, batch)] of the 8 mqa_logits_kernel
  instantiations (32 and 64 heads x kGroup 1..4); batch: the rows a wgmma chain scores,
  min(kGroup, 16 / kHeadTiles) (select_logits.cuh's unit_batch, restated as the tests'
  oracle)."""
  kernels = []
  for name, instructions in functions.items():
    m = re.search(r"mqa_logits_kernelILi(\d+)ELi(\d+)EE", name)
    if m:
      tiles, group = map(int, m.groups())
      kernels.append((name, instructions, tiles, group, min(group, 16 // tiles)))
  assert len(kernels) == 8, sorted(functions)
  return kernels


def test_logits_units_score_a_batch_in_one_wgmma_chain(functions):
  """mqa_logits scores an item with kDim / 32 = 4 fp8 wgmma (QGMMA) a chain: N = a row's
  padded heads (8 * kHeadTiles) where rows are alone (kGroup 1), and where a unit's rows
  share the item (MTP), N = the heads of a batch of the unit's rows, whose query slots are
  consecutive (64 accumulators a thread: 4 rows at 32 heads, 2 at 64), one chain a batch
  instead of one a row."""
  for name, instructions, tiles, group, batch in _logits_kernels(functions):
    shapes = [re.search(r"QGMMA\.64x(\d+)x32\.F32\.E4M3\.E4M3", x) for x in instructions]
    widths = [int(m.group(1)) for m in shapes if m]
    assert widths == [8 * tiles * batch] * (4 * -(-group // batch)), (name, widths)


def test_logits_relu_is_one_instruction_an_accumulator(functions):
  """head_sum's ReLU keeps NaN in one FMNMX.NAN per accumulator it reads (4 * kHeadTiles a
  row, for every row of every batch: 4 * kHeadTiles * batch * ceil(kGroup / batch)), where
  a compare and a select (FSETP.GEU, FSEL) took two."""
  for name, instructions, tiles, group, batch in _logits_kernels(functions):
    maxima = sum("FMNMX.NAN" in x for x in instructions)
    assert maxima == 4 * tiles * batch * -(-group // batch), (name, maxima)
    assert not any("FSETP.GEU" in x for x in instructions), name


def test_logits_quad_sums_shared_out_over_the_quad(functions):
  """A pool's four lanes add their head sums once for every slot of a batch (2 * batch:
  the batch's rows x pools g, g + 8) and share them out, each lane ending with its
  ceil(slots / 4) slots to store: 2 * ceil(slots / 4) exchanges with lane t ^ 1 (fewer where
  neither lane of a pair has a slot) and ceil(slots / 4) with lane t ^ 2, where a butterfly
  in every lane took 2 shuffles per slot (SHFL.BFLY: 4 a row). Oracle restated from
  select_logits.cuh's quad_sum: the exchange of round 1 at position i carries slots
  (i // per) * 2 * per + i % per and that + per."""
  for name, instructions, _tiles, group, batch in _logits_kernels(functions):
    slots = 2 * batch
    per = -(-slots // 4)
    first = sum((i // per) * 2 * per + i % per < slots for i in range(2 * per))
    exchanges = sum("SHFL.BFLY" in x for x in instructions)
    assert exchanges == (first + per) * -(-group // batch), (name, exchanges)
    assert exchanges < 4 * group, name


def test_logits_descriptors_computed_once_a_chain(functions):
  """A wgmma chain's operand descriptors are computed once (the address masked and shifted,
  LOP3 with 0x3fff0, per operand) and advanced by one add a K step (wgmma::advance), where
  each of the kDim / 32 = 4 steps masked and shifted both addresses again (8 a chain)."""
  for name, instructions, _tiles, group, batch in _logits_kernels(functions):
    masks = sum("0x3fff0" in x for x in instructions)
    assert masks <= 2 * -(-group // batch), (name, masks)
