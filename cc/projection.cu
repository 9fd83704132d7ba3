// indexer_projection (SPEC §1): x bf16[M, K] @ w_cat bf16[N = 256 + H, K]^T, written as
// key bf16[M, 128] (w_cat rows 0..127), head_w f32[M, H] (rows 128..127+H) and gate
// bf16[M, 128] (the last 128 rows): fp32 sums of exact bf16 products, one RNE rounding to
// bf16 for key and gate, none for head_w.
//
// The GEMM core and its order of sums (fixed, so a tactic gives the same bits on every run)
// are in projection.cuh: grid (split, N / 16, ceil(M / 128)), each warp a span of K, its sums
// added in warp order in shared memory; the `split` CTAs of one N tile form a thread-block
// cluster that splits K, and the cluster adds its CTAs' sums in rank order over DSMEM. The
// tactic (warps, split) changes the order, hence the bits within the fp32 tolerance. It is
// chosen in Python at lowering (shapes are static there) and arrives as the attributes warps
// and split; the handler only validates it (check_tactic). Split kGemvSplit is the GEMV
// tactic (indexer_projection_gemv below): grid (N), no mma and no cluster.
#include <cuda_bf16.h>

#include <cstdint>

#include "bulk.cuh"
#include "cluster.cuh"
#include "common.h"
#include "handlers.h"
#include "projection.cuh"
#include "wgmma.cuh"
#include "wgmma_ring.cuh"

namespace glm5 {
namespace {

using namespace gemm;

// Element (token t, output n) of the product, n uniform over the CTA's region.
__device__ __forceinline__ void store(const ProjectionArgs& a, int64_t t, int32_t n,
                                      float total) {
  if (n < kKeyRows)
    a.key[t * kKeyRows + n] = bf16_bits(total);
  else if (n < kKeyRows + a.heads)
    a.head_w[t * a.heads + (n - kKeyRows)] = total;
  else
    a.gate[t * kKeyRows + (n - kKeyRows - a.heads)] = bf16_bits(total);
}

// Gemm::inputs_ready: the grid completes after its predecessor (a dependent's wait on this
// grid then covers both), so every thread waits for it before it exits, after its stores:
// the results are written while q's GEMM still runs, not behind its completion (before,
// the wait ended project(), ahead of the cluster's sums and the stores).
__device__ __forceinline__ void exit_after_predecessor(const Gemm& a) {
  if (a.inputs_ready) pdl_wait();
}

// Dynamic shared memory: partial f32[warps][chunk_pad][16] (token-major, n fastest); with a
// cluster (split > 1) also recv f32[split][span] and one mbarrier (cluster_bytes).
//
// The cluster's sums: rank r owns elements [r span, (r + 1) span) of the chunk (span: the
// chunk's elements over split, whole float4s); every CTA sends its warp totals of those to
// rank r's recv row [its rank] by st.async, counted on r's mbarrier, and r adds the rows in
// rank order (the same order, hence the same bits, as reading its peers' partial in rank
// order). No cluster-scope release fence (MEMBAR.ALL.GPU on sm_90: cluster.cuh): the only
// cluster barrier, a relaxed one, says that every CTA's mbarrier is initialised, and no CTA
// reads a peer's shared memory, so none waits for its peers before exiting.
template <int kBlocks, bool kStaged>
__global__ void __launch_bounds__(kMaxWarps * kWarp)
    indexer_projection_kernel(const ProjectionArgs a) {
  extern __shared__ __align__(16) float partial[];
  const int split = static_cast<int>(cluster::size());
  const int rank = static_cast<int>(cluster::rank());
  const int warps = blockDim.x / kWarp;
  const int32_t n0 = blockIdx.y * kTileN;
  const int64_t chunk0 = static_cast<int64_t>(blockIdx.z) * kChunk;
  const int chunk = static_cast<int>(min(static_cast<int64_t>(kChunk), a.gemm.rows - chunk0));
  const int elements = chunk * kTileN;
  const int span = cluster_span(elements, split);
  const int owned = max(0, min(elements - rank * span, span));  // elements this rank adds
  float* const recv = partial + warps * a.gemm.chunk_pad * kTileN;
  const uint32_t bar = bulk::smem_address(recv + cluster_recv_floats(a.gemm, split));
  if (split > 1) {
    // Before the weight loads: nothing of this thread is in flight for the fence to wait on.
    if (threadIdx.x == 0) {
      bulk::init(bar);
      if (owned > 0) bulk::arrive_expect(bar, static_cast<uint32_t>(sizeof(float) * split * owned));
      bulk::fence_init();
    }
    cluster::arrive_relaxed();
  }
  const int warp = threadIdx.x / kWarp;
  project<kBlocks, kStaged>(a.gemm, partial, n0, rank * warps + warp, chunk0, chunk);
  __syncthreads();

  if (split == 1) {  // the CTA's sums are the totals
    for (int e = threadIdx.x; e < elements; e += blockDim.x)
      store(a, chunk0 + e / kTileN, n0 + e % kTileN, warp_total(partial, a.gemm, warps, e));
    exit_after_predecessor(a.gemm);
    return;
  }
  cluster::wait();  // every CTA of the cluster has initialised its mbarrier
  const uint32_t recv_row = bulk::smem_address(recv + rank * span);
  for (int e = 4 * threadIdx.x; e < elements; e += 4 * blockDim.x) {
    const float4 total = warp_total4(partial, a.gemm, warps, e);
    const uint32_t owner = static_cast<uint32_t>(e / span);
    cluster::store16_async(cluster::peer_address(recv_row + sizeof(float) * (e - owner * span),
                                                 owner),
                           total, cluster::peer_address(bar, owner));
  }
  if (owned == 0) {
    exit_after_predecessor(a.gemm);
    return;
  }
  bulk::wait(bar, 0);
  for (int i = threadIdx.x; i < owned; i += blockDim.x) {
    float total = recv[i];
    for (int c = 1; c < split; ++c) total += recv[c * span + i];
    const int e = rank * span + i;
    store(a, chunk0 + e / kTileN, n0 + e % kTileN, total);
  }
  exit_after_predecessor(a.gemm);
}

// The GEMV tactic (split = kGemvSplit): no mma and no cluster, for few tokens. CTA n owns
// w_cat row n; lane l of warp v loads the 16 bytes at K offset 8 (l + 32 (v + warps j)) for
// j < kLoads (a coalesced 512 B per warp and load), held in registers across the tokens.
// Order of a token's sum: the lane's products in (j, element) order (fmaf: a bf16 product is
// exact in fp32, so each step is one rounding of acc + w x), then a butterfly over the lanes
// (xor 16, 8, 4, 2, 1: both lanes of a pair add the same two values, so all lanes agree),
// then the warps' sums in warp order. The weights are loaded before the PDL wait; x after.
__device__ __forceinline__ float dot8(const uint4& w, const uint4& x, float acc) {
  const uint32_t wv[4] = {w.x, w.y, w.z, w.w}, xv[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc = fmaf(__uint_as_float(wv[i] << 16), __uint_as_float(xv[i] << 16), acc);
    acc = fmaf(__uint_as_float(wv[i] & 0xffff0000u), __uint_as_float(xv[i] & 0xffff0000u), acc);
  }
  return acc;
}

template <int kLoads>
__device__ __forceinline__ void load_token(uint4 (&x)[kLoads], const uint16_t* xt,
                                           int64_t stride) {
#pragma unroll
  for (int j = 0; j < kLoads; ++j) x[j] = __ldg(reinterpret_cast<const uint4*>(xt + j * stride));
}

// Token t + 1's x is loaded before token t's sum is reduced, and the warps' sums alternate
// between two slots, so that one barrier a token suffices: a warp writes slot t % 2 again
// (token t + 2) only past token t + 1's barrier, which thread 0 reaches after reading it.
template <int kLoads>
__global__ void __launch_bounds__(kMaxWarps * kWarp)
    indexer_projection_gemv(const ProjectionArgs a) {
  __shared__ float sums[2][kMaxWarps];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int warps = blockDim.x / kWarp;
  const int32_t n = blockIdx.x;
  const int64_t k = a.gemm.k, stride = int64_t{kGemvK} * warps;
  const int64_t k0 = int64_t{8} * (lane + kWarp * warp);
  uint4 w[kLoads];
#pragma unroll
  for (int j = 0; j < kLoads; ++j) w[j] = load_weight(a.gemm.w + n * k + k0 + j * stride);
  if (!a.gemm.inputs_ready) pdl_wait();
  pdl_launch_dependents();  // dependents still wait for this grid's completion to read
  uint4 x[kLoads];
  load_token(x, a.gemm.x + k0, stride);
#pragma unroll 1
  for (int64_t t = 0; t < a.gemm.rows; ++t) {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kLoads; ++j) acc = dot8(w[j], x[j], acc);
    if (t + 1 < a.gemm.rows) load_token(x, a.gemm.x + (t + 1) * k + k0, stride);
#pragma unroll
    for (int o = kWarp / 2; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    float* const slot = sums[t % 2];
    if (lane == 0) slot[warp] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
      float total = slot[0];
      for (int v = 1; v < warps; ++v) total += slot[v];
      store(a, t, n, total);
    }
  }
  exit_after_predecessor(a.gemm);
}

// ---------------------------------------------------------------------------------------
// The wgmma tactic (split = kWgmmaSplit): indexer_q's wgmma kernel (q_gemm.cu) applied to
// w_cat, for the projection beside q's GEMM (glm5_indexer_update_q). A CTA (one warpgroup)
// owns 64 w_cat rows (one m64 tile; rows past N = 256 + H read as zeros by the TMA and never
// stored) and a kWgmmaCluster-th of K; the cluster's CTAs (ranks) take the K parts of the
// same rows. The part streams through a ring of kSlots slots, each one 64-K box of the
// weights and of the chunk's kN token rows (rows past M zero-filled), counted on the slot's
// mbarrier; thread 0 refills the slot of box b - 1 once its wgmma group has completed. The
// mma tactics load every 16-row tile's weights and x with their own loads, whose latency
// beside q's weight stream set the projection's end;
// here a CTA issues a few bulk copies, and x is read once per 64 rows, not per 16.
//
// The parts meet at the rows' owners over DSMEM: rank r owns the tile's rows 8 r .. 8 r + 7,
// which every rank's warp r / 2 holds in the half r % 2 of its m64 fragment (rows g + 8 h of
// the warp's 16). That warp of each other rank st.async's its two values of every token
// pair j, j + 1 (16 bytes) into the owner's receive slot of its rank, counted on the owner's
// receive mbarrier; the owner adds the eight parts in rank order, from registers for its own.
//
// Order of the sums: per (token, row), one fp32 accumulator per rank from +0 takes the rank's
// 16-K wgmma steps in K order (the order inside a step is the tensor core's), then the ranks'
// sums are added in rank order, ((s0 + s1) + ..) + s7; key and gate are rounded once to bf16
// (RNE), head_w not. A token's bits do not depend on the other tokens of its grid row.
//
// Programmatic dependent launch as the mma tactics': the weights before the wait; x before
// it with Gemm::inputs_ready (then the wait just before exit), after it otherwise.
namespace pwg {

constexpr int kThreads = kWgmmaWarps * kWarp;   // one warpgroup
constexpr int kRows = 64;                       // w_cat rows per CTA: one m64 tile
constexpr int kSplit = kWgmmaCluster;           // CTAs per cluster: parts of K
constexpr int kOwned = kRows / kSplit;          // rows each rank adds up and stores
constexpr int kSlots = 4;                       // the ring (a CTA beside q's on one SM)
static_assert(kThreads == 128, "one warpgroup");
static_assert(kOwned == 8, "rank r's rows are one half of warp r / 2's m64 fragment");

// Dynamic shared memory from a 1024-aligned base: the ring's slots (the weights' box
// [kRows][128 B], then the tokens' [kN][128 B]), then the receive slots, one a rank (its
// own unused): f32[kSplit][kN / 16 pairs of j][kWarp lanes][4].
template <int kN>
struct Layout {
  using Ring = wgmma::Ring<kRows, kN, kSlots>;
  static constexpr int kOperands = Ring::kBytes;
  static constexpr int kPairs = kN / 16;
  static constexpr int kFromPeer = kPairs * kWarp * 16;   // bytes one rank sends an owner
  static constexpr int kReceive = kSplit * kFromPeer;
  static constexpr int kBytes = wgmma::kAtom + kOperands + kReceive;
  static_assert(kN % 16 == 0, "token pairs of 8-column groups");
};

template <int kN>
__global__ void __launch_bounds__(kThreads, 1) indexer_projection_wgmma(
    const ProjectionArgs a, const int32_t boxes, const __grid_constant__ CUtensorMap w_map,
    const __grid_constant__ CUtensorMap x_map) {
  using L = Layout<kN>;
  __shared__ __align__(8) uint64_t bars[kSlots + 1];   // the slots' full barriers, receive
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t base = L::Ring::base_of(smem_raw);
  const uint32_t full = bulk::smem_address(bars), receive_bar = full + 8 * kSlots;
  const int rank = static_cast<int>(cluster::rank());
  const int32_t n0 = static_cast<int32_t>(blockIdx.x / kSplit) * kRows;
  const int32_t k0 = rank * boxes * wgmma::kBoxK;
  const int32_t chunk0 = static_cast<int32_t>(blockIdx.y) * kN;
  const int first = L::Ring::first(boxes);           // boxes issued before the loop
  const typename L::Ring ring{base, full, &w_map, &x_map, k0, n0, chunk0};

  if (threadIdx.x == 0) {
    ring.init();
    bulk::init(receive_bar);
    // The other ranks' parts of this rank's rows, expected before any can send (the cluster
    // barrier below).
    bulk::arrive_expect(receive_bar, (kSplit - 1) * L::kFromPeer);
    bulk::fence_init();
    for (int b = 0; b < first; ++b) ring.load_weights(b);   // model parameters
    if (a.gemm.inputs_ready)
      for (int b = 0; b < first; ++b) ring.load_tokens(b);  // x is complete at the start
  }
  cluster::arrive_relaxed();  // waited on after the mainloop, before the first send
  if (!a.gemm.inputs_ready) {
    pdl_wait();
    if (threadIdx.x == 0)
      for (int b = 0; b < first; ++b) ring.load_tokens(b);
  }
  pdl_launch_dependents();  // dependents still wait for this grid's completion to read
  __syncthreads();          // the barriers are initialised

  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp, g = lane / 4, t = lane % 4;
  float d[kN / 2];  // the first wgmma writes it (accumulate = false)
  ring.sum(d, boxes);

  // d[4 j + 2 h + u] is (row 16 warp + g + 8 h, token 8 j + 2 t + u); pair p = (j 2p, 2p + 1).
  const auto pair = [&](int p, int h) {
    return make_float4(d[8 * p + 2 * h], d[8 * p + 2 * h + 1], d[8 * p + 4 + 2 * h],
                       d[8 * p + 4 + 2 * h + 1]);
  };
  const uint32_t receive = base + L::kOperands;
  cluster::wait();  // every receive mbarrier of the cluster is initialised
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int owner = 2 * warp + h;
    if (owner == rank) continue;
    const uint32_t to = cluster::peer_address(receive + rank * L::kFromPeer + 16 * lane, owner);
    const uint32_t bar = cluster::peer_address(receive_bar, owner);
#pragma unroll
    for (int p = 0; p < L::kPairs; ++p) cluster::store16_async(to + 16 * kWarp * p, pair(p, h), bar);
  }
  if (warp != rank / 2) {  // nothing of this warp is read by the peers after the sends
    exit_after_predecessor(a.gemm);
    return;
  }
  bulk::wait(receive_bar, 0);
  const int valid = static_cast<int>(min(static_cast<int64_t>(kN), a.gemm.rows - chunk0));
  const int32_t n = n0 + kOwned * rank + g;             // this thread's w_cat row
  const bool real = n < 2 * kKeyRows + a.heads;         // not a zero-filled row past N
  // The rank's half of the fragment, named at compile time: indexed at run time, d would
  // live in local memory (and the wgmma serialise on it).
  float4 mine[L::kPairs];
#pragma unroll
  for (int p = 0; p < L::kPairs; ++p) mine[p] = rank % 2 == 0 ? pair(p, 0) : pair(p, 1);
#pragma unroll
  for (int p = 0; p < L::kPairs; ++p) {
    const float4 own = mine[p];
    float4 total = own;
    for (int src = 0; src < kSplit; ++src) {  // rank order
      float4 v = own;
      if (src != rank) {
        const uint4 q = bulk::load16(receive + src * L::kFromPeer + 16 * (kWarp * p + lane));
        v = make_float4(__uint_as_float(q.x), __uint_as_float(q.y), __uint_as_float(q.z),
                        __uint_as_float(q.w));
      }
      if (src == 0) {
        total = v;
      } else {
        total.x += v.x;
        total.y += v.y;
        total.z += v.z;
        total.w += v.w;
      }
    }
    const float sums[4] = {total.x, total.y, total.z, total.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int c = 8 * (2 * p + i / 2) + 2 * t + i % 2;   // the token in the chunk
      if (real && c < valid) store(a, chunk0 + c, n, sums[i]);
    }
  }
  exit_after_predecessor(a.gemm);
}

template <int kN>
cudaError_t launch_as(cudaStream_t stream, bool pdl, const ProjectionLaunch& plan) {
  const Gemm& g = plan.args.gemm;
  const int64_t n = 2 * kKeyRows + plan.args.heads;
  CUtensorMap w_map{}, x_map{};
  if (cudaError_t err = wgmma::bf16_map(&w_map, g.w, n, g.k, kRows); err != cudaSuccess)
    return err;
  if (cudaError_t err = wgmma::bf16_map(&x_map, g.x, g.rows, g.k, kN); err != cudaSuccess)
    return err;
  const auto kernel = indexer_projection_wgmma<kN>;
  const size_t smem = Layout<kN>::kBytes;
  if (cudaError_t err = allow_smem(kernel, smem); err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>((n + kRows - 1) / kRows * kSplit),
                  static_cast<unsigned>((g.rows + kN - 1) / kN));
  return launch_cluster(kernel, grid, dim3(kThreads), smem, stream, pdl, kSplit, plan.args,
                        plan.wgmma_boxes, w_map, x_map);
}

cudaError_t launch(cudaStream_t stream, bool pdl, const ProjectionLaunch& plan) {
  const int tokens = wgmma::tokens_per_cta(plan.args.gemm.rows);
  return tokens == 16   ? launch_as<16>(stream, pdl, plan)
         : tokens == 32 ? launch_as<32>(stream, pdl, plan)
                        : launch_as<wgmma::kMaxTokens>(stream, pdl, plan);
}

}  // namespace pwg

using Kernel = void (*)(ProjectionArgs);

template <int kBlocks, bool kStaged>
struct Pick {
  static constexpr Kernel kernel = indexer_projection_kernel<kBlocks, kStaged>;
};

// check_tactic gives the GEMV one stage (pick_kernel still names the staged entry).
template <int kLoads, bool kStaged>
struct PickGemv {
  static constexpr Kernel kernel = kStaged ? nullptr : indexer_projection_gemv<kLoads>;
};

}  // namespace

ffi::ErrorOr<ProjectionLaunch> prepare_projection(const Check& check, ffi::BufferR2<ffi::BF16> x,
                                                  ffi::BufferR2<ffi::BF16> w_cat,
                                                  ffi::ResultBufferR2<ffi::BF16> key,
                                                  ffi::ResultBufferR2<ffi::F32> head_w,
                                                  ffi::ResultBufferR2<ffi::BF16> gate,
                                                  int32_t warps, int32_t split) {
  const auto fail = [&](std::string_view what) { return ffi::Unexpected(check.fail(what)); };
  const auto xd = x.dimensions();
  const int64_t rows = xd[0], k = xd[1];
  const auto wd = head_w->dimensions();
  const int64_t heads = wd[1];
  if (wd[0] != rows || heads <= 0 || heads % kTileN != 0)
    return fail("head_w result must be f32[M, H] with H % " + std::to_string(kTileN) + " == 0");
  const auto cd = w_cat.dimensions();
  if (cd[0] != 2 * kKeyRows + heads || cd[1] != k) return fail("w_cat must be bf16[256 + H, K]");
  const auto kd = key->dimensions(), gd = gate->dimensions();
  if (kd[0] != rows || kd[1] != kKeyRows || gd[0] != rows || gd[1] != kKeyRows)
    return fail("key and gate results must be bf16[M, 128]");
  if (heads > kI32Max / 2) return fail("too many heads");

  const ffi::ErrorOr<Staging> st = check_tactic(check, k, warps, split, kMaxSplit);
  if (st.has_error()) return ffi::Unexpected(st.error());
  if (!aligned(x.untyped_data(), 16) || !aligned(w_cat.untyped_data(), 16))
    return fail("x and w_cat must be 16 B aligned");
  ProjectionLaunch plan;
  if (rows == 0) return plan;
  const int64_t chunks = (rows + kChunk - 1) / kChunk;
  if (chunks > 65535) return fail("too many rows for one grid");

  plan.args.gemm = make_gemm(x.untyped_data(), w_cat.untyped_data(), rows, k, st->stages);
  plan.args.key = reinterpret_cast<uint16_t*>(key->untyped_data());
  plan.args.head_w = head_w->typed_data();
  plan.args.gate = reinterpret_cast<uint16_t*>(gate->untyped_data());
  plan.args.heads = static_cast<int32_t>(heads);
  plan.warps = warps;
  if (split == kWgmmaSplit) {  // its instantiation and tensor maps at launch (pwg::launch)
    if ((rows + wgmma::kMaxTokens - 1) / wgmma::kMaxTokens > 65535)
      return fail("too many rows for one grid");
    plan.wgmma_boxes = st->blocks;
    return plan;
  }
  if (split == kGemvSplit) {  // one CTA per w_cat row; its sums in static shared memory
    plan.kernel = pick_kernel<Kernel, PickGemv>(*st);
    plan.grid = dim3(static_cast<unsigned>(cd[0]));
    return plan;
  }
  plan.kernel = pick_kernel<Kernel, Pick>(*st);
  plan.smem = partial_bytes(plan.args.gemm, warps) + cluster_bytes(plan.args.gemm, split);
  plan.grid = dim3(static_cast<unsigned>(split), static_cast<unsigned>(cd[0] / kTileN),
                   static_cast<unsigned>(chunks));
  plan.cluster = split;
  return plan;
}

cudaError_t launch_projection(cudaStream_t stream, bool pdl, const ProjectionLaunch& plan) {
  if (plan.wgmma_boxes > 0) return pwg::launch(stream, pdl, plan);
  if (plan.kernel == nullptr) return cudaSuccess;
  if (cudaError_t err = allow_smem(plan.kernel, plan.smem); err != cudaSuccess) return err;
  return launch_cluster(plan.kernel, plan.grid, dim3(plan.warps * kWarp), plan.smem, stream, pdl,
                        static_cast<unsigned>(plan.cluster), plan.args);
}

namespace {

ffi::Error IndexerProjectionImpl(cudaStream_t stream, ffi::BufferR2<ffi::BF16> x,
                                 ffi::BufferR2<ffi::BF16> w_cat,
                                 ffi::ResultBufferR2<ffi::BF16> key,
                                 ffi::ResultBufferR2<ffi::F32> head_w,
                                 ffi::ResultBufferR2<ffi::BF16> gate, int32_t warps,
                                 int32_t split, bool pdl) {
  const Check check{targets::glm5_indexer_projection};
  const ffi::ErrorOr<ProjectionLaunch> plan =
      prepare_projection(check, x, w_cat, key, head_w, gate, warps, split);
  if (plan.has_error()) return plan.error();
  return check.cuda(launch_projection(stream, pdl, *plan));
}

}  // namespace
}  // namespace glm5

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5IndexerProjection, glm5::IndexerProjectionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::BufferR2<ffi::BF16>>()        // x
                                  .Arg<ffi::BufferR2<ffi::BF16>>()        // w_cat
                                  .Ret<ffi::BufferR2<ffi::BF16>>()        // key
                                  .Ret<ffi::BufferR2<ffi::F32>>()         // head_w
                                  .Ret<ffi::BufferR2<ffi::BF16>>()        // gate
                                  .Attr<int32_t>("warps")
                                  .Attr<int32_t>("split")
                                  .Attr<bool>("pdl"),
                              {ffi::Traits::kCmdBufferCompatible});
