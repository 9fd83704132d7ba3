// The select path's top-k past one CTA per row (SPEC §5c): pool_topk_parts_kernel, a
// thread-block cluster of 2-16 CTAs per row at few rows of many pools and always past one
// CTA's registers (32,768 pools), and the launch of every top-k kernel (launch_topk), for
// cc/select.cu. The per-row steps it shares with the one-CTA kernel are in select_topk.cuh.
#pragma once

#include <cooperative_groups.h>

#include <cstdint>

#include "bulk.cuh"
#include "cluster.cuh"
#include "common.h"
#include "select.cuh"
#include "select_topk.cuh"

namespace glm5 {
namespace {

namespace cg = cooperative_groups;
static_assert(kTopkClusterParts == static_cast<int>(kPortableCluster) &&
              kTopkWideParts > kTopkClusterParts);

template <int kParts>
struct ClusterScope {
  uint32_t* part_gt;  // this CTA's selected counts (above, equal), read by the higher CTAs
  uint32_t* part_eq;

  __device__ __forceinline__ void histograms_ready() const { cg::this_cluster().sync(); }
  __device__ __forceinline__ uint32_t bin(uint32_t* h, int i) const {
    uint32_t sum = 0;
#pragma unroll
    for (int q = 0; q < kParts; ++q) sum += cg::this_cluster().map_shared_rank(h, q)[i];
    return sum;
  }
  // total: this CTA's packed counts (above << 16 | equal: at most kTopkCtaPools each).
  __device__ __forceinline__ void add_lower_counts(uint32_t total, uint32_t& gt,
                                                   uint32_t& eq) const {
    const cg::cluster_group cluster = cg::this_cluster();
    if (threadIdx.x == 0) {
      *part_gt = total >> 16;
      *part_eq = total & 0xffffu;
    }
    cluster.sync();
    for (int q = 0; q < static_cast<int>(cluster.block_rank()); ++q) {
      gt += *cluster.map_shared_rank(part_gt, q);
      eq += *cluster.map_shared_rank(part_eq, q);
    }
  }
  __device__ __forceinline__ void done() const { cg::this_cluster().sync(); }
};

// kParts CTAs of kTopkMaxThreads per row, a thread-block cluster (few rows of many pools:
// one CTA would walk the row alone on one SM). CTA q of the cluster holds pools
// [q * span, (q + 1) * span), span = ceil(n / kParts) rounded up to 4, kPer keys per thread
// at most. The cluster shares one candidate bound (the minimum of the CTAs'), then every CTA
// writes its kept keys, in id order, into CTA 0's shared memory at its offset (the sum of
// the lower CTAs' counts), and CTA 0 alone runs the radix select among them. The bounds,
// the counts and the keys are pushed into the CTAs' shared memory by st.async, each
// completed on an mbarrier of the receiving CTA: no cluster barrier after the first (a
// relaxed one: every CTA's mbarriers are initialised), no cluster-scope fence
// (cluster.cuh). Where more than kTopkCandidates keys are kept (ties, adversarial rows),
// CTA 0 runs the one-CTA path (topk_row) on the whole row instead, or, for a row wider than
// one CTA's registers, every CTA the cluster's radix select on its own keys
// (radix_select_emit in a ClusterScope).
template <int kParts, int kPer>
__global__ void __launch_bounds__(kTopkMaxThreads, 1) pool_topk_parts_kernel(TopkArgs a) {
  constexpr int kThreads = kTopkMaxThreads, kWarps = kThreads / kWarp;
  constexpr int kRowPer = kParts * kPer;  // the whole row in one CTA, where it fits
  constexpr bool kOneCta = kRowPer <= kTopkMaxKeys;
  static_assert(kPer % 4 == 0 && kPer <= kTopkMaxKeys && kParts <= kWarp);
  __shared__ TopkShared sh;
  // Read by the cluster's radix select (ClusterScope): this CTA's selected counts.
  __shared__ uint32_t part_gt, part_eq;
  // Every CTA's bound ([0]) and {count, lo, hi} ([1]) pushed into each CTA's exchange by
  // st.async, counted on its mbarriers (bounds, counts; CTA 0's third counts the gathered
  // keys).
  __shared__ __align__(16) uint32_t xchg[2][kParts][4];
  __shared__ __align__(8) uint64_t xbar[3];
  // The mbarriers' shared addresses where used (held in registers, they spilled).
  const auto bar_bound = [&] { return bulk::smem_address(&xbar[0]); };
  const auto bar_count = [&] { return bulk::smem_address(&xbar[1]); };
  const auto bar_keys = [&] { return bulk::smem_address(&xbar[2]); };
  const cg::cluster_group cluster = cg::this_cluster();
  const int part = static_cast<int>(cluster.block_rank());
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int r = blockIdx.x / kParts;
  const int32_t k = a.k;
  // Before any load: nothing of this thread is in flight for the init fence to wait on.
  if (threadIdx.x == 0) {
    bulk::init(bar_bound());
    bulk::init(bar_count());
    bulk::init(bar_keys());
    bulk::arrive_expect(bar_bound(), kParts * 16);
    bulk::arrive_expect(bar_count(), kParts * 16);
    bulk::fence_init();
  }
  cluster::arrive_relaxed();  // waited on before the first push
  RowOut out = row_out(a, r);
  const int32_t n = pools_to_select<kThreads>(a, r, out, part == 0, sh);
  if (n < 0) return;  // the whole cluster returns here: no cluster barrier was passed

  // 1. This CTA's keys, its share of the bound (the full warps of every CTA count).
  const int32_t span = ((n + kParts - 1) / kParts + 3) / 4 * 4;
  // A multiple of 4 (kPer is one): 16-byte loads (span is a multiple of 4), where 7 keys a
  // thread (202,752 tokens on 8 CTAs) took 7 scalar loads strided across the warp.
  const int32_t chunk = min(kPer, ((span + kThreads - 1) / kThreads + 3) / 4 * 4);
  const int32_t first = part * span + threadIdx.x * chunk;
  const int32_t end = min(n, (part + 1) * span);
  const float* row = a.logits + static_cast<int64_t>(r) * a.width;
  uint32_t key[kPer];
  load_keys<kPer>(row, first, chunk, end, chunk % 4 == 0 && a.width % 4 == 0, key);
  for (int i = threadIdx.x; i < kTopkBins; i += kThreads) sh.hist[0][i] = 0;
  // Lane q finds part q's full warps, one division a thread (a loop over the parts in every
  // thread issued kParts of them, each a dozen integer instructions at 1024 threads); then
  // the offered warps of the cluster (sum_j) and this CTA's full warps (mine).
  const uint32_t part_keys = lane < kParts ? min(max(n - lane * span, 0), span) : 0;
  const int f = static_cast<int>((part_keys + chunk - 1) / static_cast<uint32_t>(chunk) / kWarp);
  const int sum_j = static_cast<int>(
      __reduce_add_sync(0xffffffffu, static_cast<uint32_t>(min(f, kTopkClusterBoundWarps))));
  const int mine = __shfl_sync(0xffffffffu, f, part);
  const int c = bound_c(k, sum_j), j = min(mine, kTopkClusterBoundWarps);
  uint32_t hi = 0u;
#pragma unroll
  for (int i = 0; i < kPer; ++i) hi = max(hi, key[i]);
  const uint32_t v = warp_bound(hi, c, warp < mine);
  if (lane == 0) sh.warp_bound[warp] = v;
  __syncthreads();
  cluster::wait();  // every CTA's mbarriers are initialised
  if (warp == 0) {  // b: the j-th largest v (no bound where c > 32; neutral where j = 0)
    const uint32_t b = c > kWarp ? 0u
                       : j == 0  ? 0xffffffffu
                                 : warp_nth_largest(lane < kWarps ? sh.warp_bound[lane] : 0u, j);
    if (lane < kParts)  // lane q pushes b to CTA q
      cluster::store16_async(cluster::peer_address(bulk::smem_address(&xchg[0][part][0]), lane),
                             make_uint4(b, 0u, 0u, 0u), cluster::peer_address(bar_bound(), lane));
  }
  uint32_t bound = 0xffffffffu;
  bulk::wait(bar_bound(), 0);  // 1: the parts' bounds
  for (int q = 0; q < kParts; ++q) bound = min(bound, xchg[0][q][0]);

  // 2. The kept keys (>= the bound): their count, smallest and largest, per CTA.
  uint32_t own = 0, lo = 0xffffffffu;
  hi = 0u;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    if (key[i] < bound) key[i] = 0u;
    own += key[i] != 0u;
    if (key[i] != 0u) lo = min(lo, key[i]);
    hi = max(hi, key[i]);
  }
  lo = __reduce_min_sync(0xffffffffu, lo);
  hi = __reduce_max_sync(0xffffffffu, hi);
  if (lane == 0) {
    sh.warp_lo[warp] = lo;
    sh.warp_hi[warp] = hi;
  }
  const Scan kept = block_scan<kThreads>(own, sh.warp_sums);  // its barrier orders warp_lo/hi
  if (warp == 0) {  // lane w takes warp w's values, as topk_row combines them
    static_assert(kWarps == kWarp);
    lo = __reduce_min_sync(0xffffffffu, sh.warp_lo[lane]);
    hi = __reduce_max_sync(0xffffffffu, sh.warp_hi[lane]);
    if (lane < kParts)  // lane q pushes them to CTA q
      cluster::store16_async(cluster::peer_address(bulk::smem_address(&xchg[1][part][0]), lane),
                             make_uint4(kept.total, lo, hi, 0u),
                             cluster::peer_address(bar_count(), lane));
  }
  uint32_t offset = 0, total = 0;
  bulk::wait(bar_count(), 0);  // 2: the parts' counts
  for (int q = 0; q < kParts; ++q) {
    const uint32_t c = xchg[1][q][0];
    offset += q < part ? c : 0u;
    total += c;
    lo = min(lo, xchg[1][q][1]);
    hi = max(hi, xchg[1][q][2]);
  }
  // 3. The kept keys into CTA 0, in id order.
  const bool gathered = total <= kTopkCandidates;  // the same in every CTA
  // No barrier after: CTA 0 waits for the keys' bytes; no CTA reads a peer's shared memory
  // from here (the cluster's radix select below has its own barriers).
  if (gathered) {
    if (part == 0 && threadIdx.x == 0) bulk::arrive_expect(bar_keys(), 8 * total);
    const uint32_t key_dst = cluster::peer_address(bulk::smem_address(sh.cand_key), 0);
    const uint32_t id_dst = cluster::peer_address(bulk::smem_address(sh.cand_id), 0);
    const uint32_t bar = cluster::peer_address(bar_keys(), 0);
    gather_keys<kPer>(key, first, offset + kept.incl - own,
                      [&](uint32_t at, uint32_t v, int32_t id) {
                        cluster::store4_async(key_dst + 4 * at, v, bar);
                        cluster::store4_async(id_dst + 4 * at, static_cast<uint32_t>(id), bar);
                      });
  }
  if constexpr (!kOneCta) {
    if (!gathered) {  // the same branch in every CTA; CTA 0 counts every CTA's kept slots
      RowOut mine = out;
      if (part != 0 && out.slots() && slots_kept(a, out, n) < 0)
        mine.valid = cluster.map_shared_rank(&sh.valid, 0);
      radix_select_emit<kThreads>(key, [&](int i) { return first + i; }, lo, hi, k, mine, sh,
                                  ClusterScope<kParts>{&part_gt, &part_eq});
      if (part == 0) {
        finish_row<kThreads>(a, r, out, sh, true);
      }
      pdl_launch_dependents();
      return;
    }
  }
  if (part == 0) {
    if (gathered) {
      bulk::wait(bar_keys(), 0);  // 3: the kept keys are in CTA 0
      select_gathered<kThreads>(total, lo, hi, k, out, sh);
    } else if constexpr (kOneCta) {
      // warp 0's reads of warp_lo/hi and warp_bound above precede topk_row's writes (the
      // count mbarrier orders them too, but only through the async proxy)
      __syncthreads();
      topk_row<kThreads, kRowPer>(a, r, n, out, sh);
    }
    finish_row<kThreads>(a, r, out, sh);
  }
  pdl_launch_dependents();
}

template <int kParts, int kPer>
cudaError_t launch_topk_parts(cudaStream_t stream, bool pdl, const TopkArgs& args) {
  return launch_cluster(pool_topk_parts_kernel<kParts, kPer>,
                        dim3(static_cast<unsigned>(args.rows) * kParts), dim3(kTopkMaxThreads),
                        0, stream, pdl, static_cast<unsigned>(kParts), args);
}

// CTAs per row (a cluster) from the rows (a static shape): one SM per row leaves most of
// the GPU idle at few rows. 8 (the portable cluster size) up to 8 rows, 4 up to
// TOPK_CLUSTER_MAX_ROWS, 2 up to TOPK_PAIR_MAX_ROWS (at most 128 CTAs of 1024 threads: one
// wave on 132 SMs), then 1: the split is faster at the widest rows (ncu) and no slower at
// narrower ones, except rows of up to 8,192 pools (launch_topk).
int topk_parts(int32_t rows) {
  return rows <= 8                              ? 8
         : rows <= limits::kTopkClusterMaxRows ? 4
         : rows <= limits::kTopkPairMaxRows    ? 2
                                               : 1;
}

// The 1024-thread shapes, kRowPer keys per thread were one CTA to hold the row (up to twice
// kTopkMaxKeys): split over topk_parts CTAs, at most kRowPer / 4 (4 keys per thread at
// least, one 16-byte load); one CTA past TOPK_PAIR_MAX_ROWS rows where it holds the row,
// else still a pair.
template <int kRowPer>
cudaError_t launch_topk_wide(cudaStream_t stream, bool pdl, const TopkArgs& args) {
  static_assert(kRowPer <= 2 * kTopkMaxKeys);
  const int parts = std::min(topk_parts(args.rows), kRowPer / 4);
  if constexpr (kRowPer / 4 >= 8)
    if (parts == 8) return launch_topk_parts<8, kRowPer / 8>(stream, pdl, args);
  if constexpr (kRowPer / 4 >= 4)
    if (parts == 4) return launch_topk_parts<4, kRowPer / 4>(stream, pdl, args);
  if constexpr (kRowPer <= kTopkMaxKeys)
    if (parts == 1) return launch_topk_as<kTopkMaxThreads, kRowPer>(stream, pdl, args);
  return launch_topk_parts<2, kRowPer / 2>(stream, pdl, args);
}

// Threads and keys per thread from the logits width (a static shape): at least 16 warps
// (k = 512 then has its candidate bound: c = 32 maxima per warp), more keys per thread
// past 4 and 8 (one and two 16-byte loads), 32 at most (the 64 registers of a thread at
// 1024 threads per CTA). Narrower CTAs at the 2048 and 4096 widths are slower (ncu): below
// 16 warps there is no bound, and the key loops of the fewer threads are longer than what
// the fewer warps save at the barriers.
// Past one CTA's registers a cluster of kTopkClusterParts holds the row, 8 to 32 keys per
// thread, at any rows (the plan, plan.topk_row_pools, cuts more than TOPK_CLUSTER_MAX_ROWS
// such rows into chunks, except rows of two CTAs' width at up to TOPK_PAIR_MAX_ROWS: their
// clusters would take several waves of the SMs), except:
// - up to kTopkWideRows rows wider than 4 CTAs' registers (1M tokens), kTopkWideParts CTAs
//   of 16 keys: past 16 keys a thread the CTAs' key loops cost more than the wider cluster's
//   exchange (at 8 keys they cost less);
// - at 9-16 rows (topk_parts: 4) of up to 2 CTAs' registers (GLM-5's window), 4 CTAs of 16
//   keys, as narrower rows there: faster than 8 of 8 (docs/performance.md, section 5);
// - at more rows of up to 2 CTAs' registers, a pair of CTAs of 32 keys: one wave of the SMs
//   up to TOPK_PAIR_MAX_ROWS rows, where the plan's one call replaces its chunks;
// - rows of up to 8,192 pools, one CTA of 8 keys a row at any rows: a 2-CTA cluster's
//   exchange costs more than the halved key loop saves (a CTA of 16 warps and 16 keys loses
//   to both).
cudaError_t launch_topk(cudaStream_t stream, bool pdl, const TopkArgs& args) {
  constexpr int kParts = kTopkClusterParts;
  if (args.width <= 2048) return launch_topk_as<512, 4>(stream, pdl, args);
  if (args.width <= 4096) return launch_topk_as<512, 8>(stream, pdl, args);
  if (args.width <= 8192) return launch_topk_as<kTopkMaxThreads, 8>(stream, pdl, args);
  if (args.width <= 16384) return launch_topk_wide<16>(stream, pdl, args);
  if (args.width <= kTopkCtaPools) return launch_topk_wide<kTopkMaxKeys>(stream, pdl, args);
  if (args.width <= 2 * kTopkCtaPools) return launch_topk_wide<2 * kTopkMaxKeys>(stream, pdl, args);
  if (args.width <= 4 * kTopkCtaPools) return launch_topk_parts<kParts, 16>(stream, pdl, args);
  if (args.rows <= kTopkWideRows)
    return launch_topk_parts<kTopkWideParts, kTopkMaxPools / kTopkWideParts / kTopkMaxThreads>(
        stream, pdl, args);
  return launch_topk_parts<kParts, kTopkMaxKeys>(stream, pdl, args);
}

}  // namespace
}  // namespace glm5
