// The select path of a decode step (SPEC §5b, §5c): MQA logits of each row's fp8 queries
// against its pools in the paged fp8 K cache, then the k best pools of each row.
//
//   glm5_mqa_logits    the logits kernel alone (op mqa_logits)
//   glm5_pool_topk     the top-k kernel alone (op pool_topk)
//   glm5_select_pools  both, back to back in one FFI call (op select_pools): rows whose
//                      pools all fit in k skip the logits and select every pool, so the
//                      stage needs no lax.cond.
//   glm5_select_slots  the same, its top-k writing each selected pool's sparse-MLA slots
//                      instead of its id (op select_slots, what indexer_stage runs: no
//                      expand_and_remap launch).
//
// Logits: persistent CTAs of a consumer warpgroup and a producer warp; a work item is 64
// pools of one row (the wgmma M side), its K tiles streamed by the TMA. Each CTA computes
// the row -> item prefix itself from the row lengths (no schedule kernel) and takes a
// contiguous range of items, so at M = 1 a 32K-pool row is spread over every SM. Scores come
// from fp8 wgmma.
//
// Top-k: one CTA per row (512 or 1024 threads by the logits width), or a cluster of 2-8
// CTAs per row at few rows of many pools; exact and deterministic by construction:
// order-preserving 32-bit keys in registers, a candidate bound that drops most of them, the
// kept ones gathered in id order, radix select of the threshold with 11-bit digits that
// start below the bits the bound and the row's largest key share, then one prefix sum of
// per-thread counts that places the selected pool ids in ascending id order (ties at the
// threshold by ascending id). No atomic decides an order; shared-memory atomics only count.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <cooperative_groups.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "bulk.cuh"
#include "common.h"
#include "constants.h"
#include "handlers.h"
#include "remap.cuh"
#include "wgmma.cuh"

namespace glm5 {
namespace {

namespace cg = cooperative_groups;

constexpr int kWarpPools = 16;                       // pools per tile: one warp's wgmma rows
constexpr int kConsumerWarps = 4;                   // + a producer warp: kLogitsWarps
constexpr int kItemPools = kWarpPools * kConsumerWarps;  // 64 pools per work item
// Top-k: a row's keys live in the registers of one CTA, at most 1024 threads x 32 keys
// (launch_topk's widest shape).
constexpr int kTopkMaxThreads = 1024, kTopkMaxKeys = 32;
constexpr int kTopkMaxPools = kTopkMaxThreads * kTopkMaxKeys;  // 32768
// Keys gathered into shared memory after the bound (pool_topk_kernel): 2 per thread at 1024
// threads; the bound leaves ~1000-1500 of 8K-32K normal logits (numpy model of the bound).
constexpr int kTopkCandidates = 2048;
constexpr int kTopkClusterBoundWarps = 16;          // J of the bound in a cluster (warp_bound)
constexpr int kTopkDigitBits = 11;                   // radix digits: at most 3 per row
constexpr int kTopkBins = 1 << kTopkDigitBits;

// Pools of a row: pool_lens[r], or (positions[r] + 1) / 4 (0 for pads) without the int32
// overflow of pos + 1; at most `width` (the logits width).
__device__ __forceinline__ int32_t row_pools(const int32_t* lens, bool from_positions, int r,
                                             int32_t width) {
  const int32_t v = lens[r];
  int32_t n;
  if (from_positions)
    n = v < 0 ? 0 : v / kPool + (v % kPool == kPool - 1 ? 1 : 0);
  else
    n = v < 0 ? 0 : v;
  return min(n, width);
}

// ------------------------------------------------------------------------------ logits

struct LogitsArgs {
  const uint8_t* q;           // e4m3 [rows, padded, 128]
  const float* w_out;         // f32 [rows, padded]
  const uint8_t* kv;          // u8 [pages, page, 132]
  const int32_t* page_table;  // s32 [tables, table_width]
  const int32_t* req_ids;     // s32 [rows], or nullptr: row r reads page_table row r
  const int32_t* lens;        // s32 [rows]: pool_lens, or positions when from_positions
  float* logits;              // f32 [rows, width]
  int32_t rows, tables, table_width, pages, width;
  Divisor page;               // PAGE (1 for an empty cache: no tile is read then)
  int32_t skip_upto;          // rows with at most this many pools are skipped (-1: none)
  bool from_positions;
  bool fill;                  // write -inf from each row's pool count up to width
  bool ue8m0;                 // scale format: UE8M0 byte (else fp32)
};

// The work items of a row of n pools.
__device__ __forceinline__ int32_t row_items(const LogitsArgs& a, int32_t n) {
  if (a.fill) return (a.width + kItemPools - 1) / kItemPools;
  return n > a.skip_upto ? (n + kItemPools - 1) / kItemPools : 0;
}

// Inclusive prefix sum over the CTA's threads in thread order, and the CTA's total.
// warp_sums is written here: the caller puts a barrier between this call and the next one.
struct Scan {
  uint32_t incl, total;
};

template <int kThreads>
__device__ __forceinline__ Scan block_scan(uint32_t v, uint32_t* warp_sums) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  uint32_t incl = v;
#pragma unroll
  for (int d = 1; d < kWarp; d <<= 1) {
    const uint32_t o = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += o;
  }
  if (lane == kWarp - 1) warp_sums[warp] = incl;
  __syncthreads();
  // The warps' totals scanned across the lanes of every warp (no second barrier).
  const uint32_t total = lane < kThreads / kWarp ? warp_sums[lane] : 0u;
  uint32_t across = total;
#pragma unroll
  for (int d = 1; d < kThreads / kWarp; d <<= 1) {
    const uint32_t o = __shfl_up_sync(0xffffffffu, across, d);
    if (lane >= d) across += o;
  }
  const uint32_t before = __shfl_sync(0xffffffffu, across - total, warp);
  return {before + incl, __shfl_sync(0xffffffffu, across, kThreads / kWarp - 1)};
}

// The per-row tables of a logits CTA in shared memory: the exclusive prefix of work items
// first_item[0..rows], then each row's pool count and page-table row (its request). They are
// read once, together, before the scan: the page lookups behind them then wait on one
// global load instead of two in a row (lens, then req_ids).
struct RowTables {
  int32_t* first_item;  // [rows + 1]
  int32_t* pools;       // [rows]
  int32_t* req;         // [rows]
  __device__ RowTables(int32_t* base, int32_t rows)
      : first_item(base), pools(base + rows + 1), req(base + 2 * rows + 1) {}
  static constexpr size_t bytes(int32_t rows) {
    return (3 * static_cast<size_t>(rows) + 1) * sizeof(int32_t);
  }
};

// The row tables (every CTA computes the same ones from the row lengths: no schedule
// kernel); then the CTA's contiguous share of the items, [begin, end), and the row of
// `begin`. All kThreads threads call it.
struct ItemRange {
  int32_t begin, end, row;
};

template <int kThreads>
__device__ __forceinline__ ItemRange cta_items(const LogitsArgs& a, const RowTables& t) {
  __shared__ uint32_t warp_sums[kThreads / kWarp];
  int32_t* const first_item = t.first_item;
  int32_t carry = 0;
  for (int base = 0; base < a.rows; base += kThreads) {
    const int r = base + threadIdx.x;
    int32_t own = 0;
    if (r < a.rows) {
      const int32_t n = row_pools(a.lens, a.from_positions, r, a.width);
      t.req[r] = a.req_ids != nullptr ? a.req_ids[r] : r;
      t.pools[r] = n;
      own = row_items(a, n);
    }
    const Scan scan = block_scan<kThreads>(static_cast<uint32_t>(own), warp_sums);
    if (r < a.rows) first_item[r] = carry + static_cast<int32_t>(scan.incl) - own;
    carry += static_cast<int32_t>(scan.total);
    if (base + kThreads < a.rows) __syncthreads();  // the next round writes warp_sums again
  }
  if (threadIdx.x == 0) first_item[a.rows] = carry;
  __syncthreads();

  const int64_t items = carry;
  ItemRange range;
  range.begin = static_cast<int32_t>(items * blockIdx.x / gridDim.x);
  range.end = static_cast<int32_t>(items * (blockIdx.x + 1) / gridDim.x);
  // The row of item `begin`: the last r with first_item[r] <= begin.
  int lo = 0, hi = a.rows - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first_item[mid] <= range.begin) lo = mid; else hi = mid - 1;
  }
  range.row = lo;
  return range;
}

// ReLU that keeps NaN (as the reference's maximum(dot, 0) does).
__device__ __forceinline__ float relu(float x) { return x < 0.f ? 0.f : x; }

// The head-weighted sum of a thread's accumulators (d[4j..4j+3] = the fragment of head
// tile j: rows g, g + 8 x heads 8j + 2t, 8j + 2t + 1), the 4-lane butterfly, then the scales.
template <int kHeadTiles>
__device__ __forceinline__ void head_sum(const float (&d)[4 * kHeadTiles],
                                         const float (&w0)[kHeadTiles],
                                         const float (&w1)[kHeadTiles], float scale_lo,
                                         float scale_hi, float& s_lo, float& s_hi) {
  float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
  for (int j = 0; j < kHeadTiles; ++j) {
    sum_lo = fmaf(w0[j], relu(d[4 * j]), sum_lo);
    sum_lo = fmaf(w1[j], relu(d[4 * j + 1]), sum_lo);
    sum_hi = fmaf(w0[j], relu(d[4 * j + 2]), sum_hi);
    sum_hi = fmaf(w1[j], relu(d[4 * j + 3]), sum_hi);
  }
  sum_lo += __shfl_xor_sync(0xffffffffu, sum_lo, 1);
  sum_hi += __shfl_xor_sync(0xffffffffu, sum_hi, 1);
  sum_lo += __shfl_xor_sync(0xffffffffu, sum_lo, 2);
  sum_hi += __shfl_xor_sync(0xffffffffu, sum_hi, 2);
  s_lo = sum_lo * scale_lo;
  s_hi = sum_hi * scale_hi;
}

// The logits kernel: CTAs of one consumer warpgroup (four warps) and one producer warp.
// The K-cache tiles come through a ring of kRingStages stages in shared memory, filled by
// the TMA: the producer looks up the pages of the next kLookahead items at once, one lane
// per 16-pool tile, and issues one tensor copy of the tile (2 KB: its 16 entries are
// contiguous in their page) plus one bulk copy of its 64 scale bytes; the consumers wait
// on the stage's full barrier, score the item and release the stage on its empty barrier.
// So the loads in flight per SM are the ring's bytes, not what registers can hold (tiles
// loaded into registers behind a dependent page lookup read 2.7 TB/s on the H200 at
// 64 x 32768, the ring 3.5 with the same arithmetic).
//
// Scores: sm_90's fp8 tensor cores are reached only through wgmma (it has no fp8 mma.sync:
// ptxas emulates m16n8k32.e4m3 by converting both operands to f16 at every call, which left
// the kernel issue-bound; an f16 mma.sync on exactly converted fp8 ran 80.6 µs at 64 x 32768
// where wgmma runs 74.8, H200, ncu, L2 flushed). The warpgroup scores a whole 64-pool item
// with kDim / 32 = 4 wgmma m64nNk32 e4m3 (N = the padded heads): A = the item's four K
// tiles, B = the row's queries, both in shared memory in the 128-byte swizzle. The TMA
// swizzles the tiles (a tensor map of the cache: boxes of 16 entries x 128 bytes of one
// page); the consumers write the queries swizzled by hand when the row changes. The
// accumulator fragment of thread (g, t) of warp w holds rows 16w + g and 16w + g + 8 of the
// item, heads 8j + 2t and 8j + 2t + 1 (j = 0..N/8-1): head_sum's layout.
//
// Summation order of a logit (fixed, documented): per head, one fp32 accumulator from +0
// takes the four 32-product wgmma steps (dims 0-31, 32-63, 64-95, 96-127) in order (the
// order of the products inside a step is the tensor core's); per thread,
// s = fma(w[h1], relu(dot_h1), fma(w[h0], relu(dot_h0), s)) over its heads h0 = 8j + 2t,
// h1 = h0 + 1 for j = 0.. in order, from s = +0; then the four threads of a pool add by
// butterfly (xor 1, then xor 2); then times the entry's scale.
constexpr int kRingStages = 4;
constexpr int kLogitsWarps = kConsumerWarps + 1;          // consumers + the producer
constexpr int kLogitsThreads = kLogitsWarps * kWarp;
constexpr int kTileBytes = kWarpPools * kDim;            // a tile's fp8 entries: 2048 B
constexpr int kTileScaleBytes = kWarpPools * 4;          // its scales: 64 B
constexpr int kLookahead = kWarp / kConsumerWarps;        // items per lookup round
// Where tile `tile` (16 pools) of work item `item` lives: its page and the entry of its
// first pool there; page -1 when it is not read (past the row's pools, an unknown request,
// a page slot past the table, or a page id outside the cache: SPEC D4). `row` is advanced
// to the item's row (a thread visits items in ascending order).
struct TileSource {
  int32_t page, entry;
};

__device__ __forceinline__ TileSource tile_source(const LogitsArgs& a, const RowTables& t,
                                                  int32_t item, int tile, int& row) {
  while (t.first_item[row + 1] <= item) ++row;
  const int32_t n = t.pools[row];
  const int32_t p0 = (item - t.first_item[row]) * kItemPools + tile * kWarpPools;
  const int32_t req = t.req[row];
  const int32_t slot = a.page.div(p0);  // PAGE % 16 == 0: the tile is in one page
  if (p0 < n && req >= 0 && req < a.tables && slot < a.table_width) {
    const int32_t pg = a.page_table[static_cast<int64_t>(req) * a.table_width + slot];
    if (pg >= 0 && pg < a.pages) return {pg, a.page.mod(p0)};
  }
  return {-1, 0};
}

using wgmma::kAtom;

template <int kHeadTiles>
struct LogitsLayout {  // offsets from the 1024-aligned base of dynamic shared memory
  static constexpr int kPadded = 8 * kHeadTiles;
  static constexpr int kKeys = 0;                                          // [stage][64][128]
  static constexpr int kQueries = kKeys + kRingStages * kItemPools * kDim;  // [padded][128]
  static constexpr int kScales = kQueries + kPadded * kDim;                 // [stage][64] x 4 B
  static constexpr int kBars = kScales + kRingStages * kItemPools * 4;      // full, empty
  static constexpr int kFlags = kBars + 2 * 8 * kRingStages;               // s32[stage][4]
  static constexpr int kRowTables = kFlags + 4 * kRingStages * kConsumerWarps;
  static_assert(kQueries % kAtom == 0 && kScales % 16 == 0 && kBars % 8 == 0);
  static size_t bytes(int32_t rows) {  // + slack to align the base
    return kAtom + kRowTables + RowTables::bytes(rows);
  }
};

template <int kHeadTiles>
__device__ __forceinline__ void wgmma_item(float (&d)[4 * kHeadTiles], uint32_t keys,
                                           uint32_t queries) {
#pragma unroll
  for (int k = 0; k < kDim / 32; ++k) {
    if constexpr (kHeadTiles == 4)
      wgmma::mma_e4m3<32>(d, wgmma::desc(keys + 32 * k), wgmma::desc(queries + 32 * k));
    else
      wgmma::mma_e4m3<64>(d, wgmma::desc(keys + 32 * k), wgmma::desc(queries + 32 * k));
  }
}

template <int kHeadTiles>
__global__ void __launch_bounds__(kLogitsThreads) mqa_logits_kernel(
    const LogitsArgs a, const __grid_constant__ CUtensorMap keys_map) {
  using L = LogitsLayout<kHeadTiles>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t raw = bulk::smem_address(smem_raw);
  unsigned char* const smem = smem_raw + ((kAtom - raw % kAtom) % kAtom);
  const uint32_t base = bulk::smem_address(smem);
  const RowTables tables(reinterpret_cast<int32_t*>(smem + L::kRowTables), a.rows);
  const int32_t* const first_item = tables.first_item;
  int32_t* const copied = reinterpret_cast<int32_t*>(smem + L::kFlags);
  const uint32_t full = base + L::kBars, empty = full + 8 * kRingStages;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (threadIdx.x == 0) {
    bulk::prefetch_map(&keys_map);
    for (int s = 0; s < kRingStages; ++s) {
      bulk::init(full + 8 * s, kConsumerWarps);           // one arrival per tile
      bulk::init(empty + 8 * s, kConsumerWarps * kWarp);  // one per consumer thread
    }
    bulk::fence_init();
  }
  pdl_wait();
  const ItemRange range = cta_items<kLogitsThreads>(a, tables);  // barriers inside
  const int32_t begin = range.begin, end = range.end;

  if (warp == kConsumerWarps) {
    // Producer. Round by round, lane L takes tile L % 4 of item round + L / 4: its page
    // (one lookup per lane, all in flight together), then, item by item, the lanes of that
    // item wait for the stage to be free and issue their copies.
    const int tile = lane % kConsumerWarps;
    const int64_t page_bytes = static_cast<int64_t>(a.page.d) * kEntryBytes;
    int r = range.row;
    for (int32_t round = begin; round < end; round += kLookahead) {
      const int32_t item = round + lane / kConsumerWarps;
      TileSource at{-1, 0};
      int row = r;
      if (item < end) at = tile_source(a, tables, item, tile, row);
      r = __reduce_max_sync(0xffffffffu, row);
      for (int i = 0; i < kLookahead && round + i < end; ++i) {
        const int32_t k = round + i - begin;
        const int s = k % kRingStages;
        if (k >= kRingStages) bulk::wait(empty + 8 * s, (k / kRingStages - 1) & 1);
        if (lane / kConsumerWarps == i) {
          copied[s * kConsumerWarps + tile] = at.page >= 0;
          const uint32_t bar = full + 8 * s;
          bulk::arrive_expect(bar, at.page >= 0 ? kTileBytes + kTileScaleBytes : 0);
          if (at.page >= 0) {
            bulk::copy_box(base + L::kKeys + (s * kConsumerWarps + tile) * kTileBytes,
                           &keys_map, 0, at.entry, at.page, bar);
            bulk::copy(base + L::kScales + (s * kConsumerWarps + tile) * kTileScaleBytes,
                       a.kv + at.page * page_bytes + static_cast<int64_t>(a.page.d) * kDim +
                           4 * at.entry,
                       kTileScaleBytes, bar);
          }
        }
      }
    }
  } else {
    // Consumers: one warpgroup, every item together; warp w finishes rows 16w.. of it.
    const int g = lane >> 2, t = lane & 3;
    int r = range.row, row = -1;
    float w0[kHeadTiles], w1[kHeadTiles];
    int32_t n = 0;
    const uint32_t queries = base + L::kQueries;
    for (int32_t item = begin; item < end; ++item) {
      const int32_t k = item - begin;
      const int s = k % kRingStages;
      while (first_item[r + 1] <= item) ++r;
      if (r != row) {
        // The row's queries into shared memory, swizzled: 16-byte chunk c of head h at
        // chunk c ^ (h % 8) of its 128-byte row. Every consumer thread is past its last
        // wgmma on the old ones (each waited for its group) before any overwrites them.
        if (row >= 0) bulk::named_sync(1, kConsumerWarps * kWarp);
        row = r;
        n = tables.pools[r];
        const uint4* qrow = reinterpret_cast<const uint4*>(
            a.q + static_cast<int64_t>(r) * L::kPadded * kDim);
        for (int c = threadIdx.x; c < L::kPadded * (kDim / 16); c += kConsumerWarps * kWarp) {
          const int h = c / (kDim / 16), chunk = c % (kDim / 16);
          const uint4 v = __ldg(qrow + c);
          bulk::store16(queries + h * kDim + ((chunk ^ (h % 8)) * 16), v);
        }
#pragma unroll
        for (int j = 0; j < kHeadTiles; ++j) {
          const float* wr = a.w_out + static_cast<int64_t>(r) * L::kPadded + 8 * j + 2 * t;
          w0[j] = __ldg(wr);
          w1[j] = __ldg(wr + 1);
        }
        bulk::fence_proxy_async();  // the generic-proxy writes, before wgmma reads them
        bulk::named_sync(1, kConsumerWarps * kWarp);
      }
      const int32_t p0 = (item - first_item[r]) * kItemPools + warp * kWarpPools;
      float* out = a.logits + static_cast<int64_t>(r) * a.width;
      const int32_t mine = p0 + g + (t == 1 ? 8 : 0);  // t = 0: pool g, t = 1: pool g + 8
      bulk::wait(full + 8 * s, (k / kRingStages) & 1);
      float d[4 * kHeadTiles];
#pragma unroll
      for (int i = 0; i < 4 * kHeadTiles; ++i) d[i] = 0.f;
      wgmma::fence();
      wgmma_item<kHeadTiles>(d, base + L::kKeys + s * kConsumerWarps * kTileBytes, queries);
      wgmma::commit();
      wgmma::wait();
      // Tiles not copied hold stale bytes: their rows (this warp's, when so) are masked.
      const bool have = copied[s * kConsumerWarps + warp];
      const unsigned char* sc = smem + L::kScales + (s * kConsumerWarps + warp) * kTileScaleBytes;
      float scale_lo, scale_hi;
      if (a.ue8m0) {
        scale_lo = __uint_as_float(static_cast<uint32_t>(sc[4 * g]) << 23);
        scale_hi = __uint_as_float(static_cast<uint32_t>(sc[4 * (g + 8)]) << 23);
      } else {
        scale_lo = reinterpret_cast<const float*>(sc)[g];
        scale_hi = reinterpret_cast<const float*>(sc)[g + 8];
      }
      bulk::arrive(empty + 8 * s);  // this thread's reads of the stage (wgmma's too) are done
      float s_lo, s_hi;
      head_sum<kHeadTiles>(d, w0, w1, scale_lo, scale_hi, s_lo, s_hi);
      if (!have) s_lo = s_hi = -INFINITY;
      if (t < 2) {
        if (mine < n) out[mine] = t == 0 ? s_lo : s_hi;
        else if (a.fill && mine < a.width) out[mine] = -INFINITY;
      }
    }
  }
  pdl_launch_dependents();
}

// ------------------------------------------------------------------------------ top-k

// select_slots: the top-k writes a selected pool's slots instead of its id, the pool's four
// tokens remapped through the request's block table (SPEC §7: expand_and_remap with
// seq_offset 1, compact), one quad at the pool's rank; the tail quad after the selected
// pools, then -1 quads to the row's width. A pool's slots are kept or dropped as a whole
// (block_size % 4 == 0), and the ones dropped for a block past the table are the row's
// largest tokens (the ids ascend with the rank; the tail is above every pool), so a pool
// written at its rank is already the compacted layout. A pool dropped for an entry that names
// no block (SPEC §12) leaves a -1 quad inside the row; close_holes moves the kept ones down.
struct SlotArgs {
  const int32_t* req_ids;      // s32 [rows]
  const int32_t* block_table;  // s32 [requests, max_blocks]
  int32_t* out;                // s32 [rows, width]; nullptr: pool ids (TopkArgs::out)
  int32_t* counts;             // s32 [rows]
  int64_t requests, max_blocks;
  Divisor block_size;
  int32_t stride_rows, width;
  int32_t max_block;           // max_block_id(block_size, stride_rows)
  bool vector;                 // width % 4 == 0 and 16-byte aligned rows: one store a quad
};

struct TopkArgs {
  const float* logits;  // f32 [rows, width]
  const int32_t* lens;  // s32 [rows]: pool_lens, or positions when from_positions
  int32_t* out;         // s32 [rows, k]: pool ids (unless slots.out)
  SlotArgs slots;
  int32_t rows, width, k;
  bool from_positions;
  // Select path: rows that keep every pool do not read the logits, so they write their
  // ids before waiting for the logits kernel (whose own wait already covered `lens`).
  bool early_rows;
};

// Order-preserving key: larger float -> larger key. NaN ranks as -inf, -0 and subnormals
// as +0 (the reference's rule). Every eligible key is >= key(-inf) = 0x007fffff > 0, so 0
// marks "no pool".
__device__ __forceinline__ uint32_t order_key(float f) {
  uint32_t b = __float_as_uint(f);
  if (f != f) b = 0xff800000u;
  else if (fabsf(f) < 1.17549435e-38f) b = 0u;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The top-k kernel's shared memory.
struct TopkShared {
  uint32_t hist[2][kTopkBins];  // double-buffered: one barrier less per digit
  uint32_t warp_sums[kTopkMaxThreads / kWarp];
  uint32_t warp_lo[kTopkMaxThreads / kWarp], warp_hi[kTopkMaxThreads / kWarp];
  uint32_t warp_bound[kTopkMaxThreads / kWarp];
  uint32_t digit, above, count;
  uint32_t valid;  // select_slots: the selected pools the block table keeps (RowOut::valid)
  uint32_t cand_key[kTopkCandidates];  // the keys kept after the bound, gathered in id order
  int32_t cand_id[kTopkCandidates];
};

// Where the top-k of row r writes: its k pool ids, or its slots (SlotArgs). Only the row
// and its request are held here; the rest is read from the kernel's parameters where it is
// used (registers are short at 1024 threads: holding the pointers and sizes spilled).
struct RowOut {
  const TopkArgs& a;
  int32_t r;
  int32_t req;      // select_slots: the row's block-table row, -1 where the request has none
  uint32_t* valid;  // counts the kept selected pools where the table may drop some, else null
  mutable bool dropped = false;  // this thread wrote a -1 quad for a selected pool

  __device__ __forceinline__ bool slots() const { return a.slots.out != nullptr; }
  __device__ __forceinline__ Remap remap() const {
    const SlotArgs& s = a.slots;
    return Remap{s.block_table + (req >= 0 ? req * s.max_blocks : 0), s.max_blocks,
                 s.block_size, s.stride_rows, s.max_block};
  }
  __device__ __forceinline__ void quad(int q, int4 v) const {
    const SlotArgs& s = a.slots;
    int32_t* row = s.out + static_cast<int64_t>(r) * s.width;
    if (s.vector) store_quad<true>(row, q, s.width, v);
    else store_quad<false>(row, q, s.width, v);
  }
  // The pool at rank `at` of the selection is `id`.
  __device__ __forceinline__ void put(int32_t at, int32_t id) const {
    if (!slots()) {
      a.out[static_cast<int64_t>(r) * a.k + at] = id;
      return;
    }
    int32_t first = 0;
    const bool live = req >= 0 && remap().slot(wrap_mul(id, kPool), &first);
    quad(at, live ? run4(first) : none4());
    if (valid != nullptr && live) atomicAdd(valid, 1u);
    dropped |= !live;
  }
};

__device__ __forceinline__ RowOut row_out(const TopkArgs& a, int r) {
  int32_t req = -1;
  if (a.slots.out != nullptr) {
    req = __ldg(a.slots.req_ids + r);
    if (req >= a.slots.requests) req = -1;
  }
  return RowOut{a, r, req < 0 ? -1 : req, nullptr, false};
}

// Row r's tail quad (its incomplete pool: positions + 1 tokens) into `quad`; its kept slots.
__device__ __forceinline__ int32_t row_tail(const TopkArgs& a, int r, const RowOut& o,
                                            int4* quad) {
  const Tail t = tail_of(__ldg(a.lens + r), 1);
  int32_t first = 0;
  const bool kept = o.req >= 0 && t.count > 0 && o.remap().slot(t.start, &first);
  *quad = kept ? tail_quad(first, t.count) : none4();
  return kept ? t.count : 0;
}

// select_slots, by the CTA that writes row r: what lies outside the quads of the
// `selected` pools (the tail quad, then -1 quads), and the count where it is known before
// the selection (`kept` pools kept by the table; -1: counted while emitting, finish_count).
template <int kThreads>
__device__ __forceinline__ void write_row_rest(const TopkArgs& a, int r, const RowOut& o,
                                               int32_t selected, int64_t kept) {
  const int quads = (a.slots.width + kPool - 1) / kPool;  // > k >= selected: width >= 4k + 3
  for (int q = selected + 1 + static_cast<int>(threadIdx.x); q < quads; q += kThreads)
    o.quad(q, none4());
  if (threadIdx.x == 0) {
    int4 tail;
    const int32_t tail_slots = row_tail(a, r, o, &tail);
    o.quad(selected, tail);
    if (kept >= 0) a.slots.counts[r] = kPool * static_cast<int32_t>(kept) + tail_slots;
  }
}

// The count of a row whose pools the table may drop, once they are emitted (every thread
// of the writing CTA calls it; the same branch in all).
__device__ __forceinline__ void finish_count(const TopkArgs& a, int r, const RowOut& o) {
  if (o.valid == nullptr) return;
  __syncthreads();
  if (threadIdx.x == 0) {
    int4 tail;
    const int32_t tail_slots = row_tail(a, r, o, &tail);
    a.slots.counts[r] = kPool * static_cast<int32_t>(*o.valid) + tail_slots;
  }
}

// select_slots, by every thread of the CTA that wrote row r's `selected` pools (the same
// branch in all): where a pool was dropped, its -1 quad may lie between kept ones (an entry
// that names no block, SPEC §12); the kept quads move down over the holes in rank order (a
// pool quad is run4 of its first slot: the first column says it), then the tail quad and
// -1 quads, and the count is the kept slots'. Rows without a dropped pool pass one barrier.
template <int kThreads>
__device__ __forceinline__ void close_holes(const TopkArgs& a, int r, const RowOut& o,
                                            int32_t selected, TopkShared& sh) {
  if (!__syncthreads_or(o.dropped)) return;  // also orders the quads' stores before the reads
  const int32_t* row = a.slots.out + static_cast<int64_t>(r) * a.slots.width;
  int32_t kept = 0;
  for (int32_t base = 0; base < selected; base += kThreads) {
    const int32_t q = base + static_cast<int32_t>(threadIdx.x);
    const int32_t first = q < selected ? row[kPool * q] : -1;
    const Scan scan = block_scan<kThreads>(first >= 0 ? 1u : 0u, sh.warp_sums);
    __syncthreads();  // this round's quads are read before any moves (destinations <= sources)
    if (first >= 0) o.quad(kept + static_cast<int32_t>(scan.incl) - 1, run4(first));
    kept += static_cast<int32_t>(scan.total);
  }
  for (int32_t q = kept + 1 + static_cast<int32_t>(threadIdx.x); q <= selected; q += kThreads)
    o.quad(q, none4());
  if (threadIdx.x == 0) {
    int4 tail;
    const int32_t tail_slots = row_tail(a, r, o, &tail);
    o.quad(kept, tail);
    a.slots.counts[r] = kPool * kept + tail_slots;
  }
}

// Gathering the keys left after the bound pays where it cuts the keys per thread at least
// 4-fold (launch_topk's 1024-thread shapes: 8-32 keys per thread become 2).
template <int kThreads, int kPer>
constexpr bool kCompact = kPer >= 4 * (kTopkCandidates / kThreads);

// Radix select of the k-th largest of the CTA's keys, then the selected ids written to `out`
// in ascending id order. key[i] (0: no key) has id id_of(i), and the ids ascend with
// (thread, i) across the CTA; lo and hi are the CTA's smallest and largest nonzero keys,
// and at least k keys are nonzero. hist[0] is zero and a barrier separates that from here.
//
// The keys are first taken relative to lo (key - lo + 1: the order and the ties kept, 0
// still "no key"), so the digits cover [lo, hi] linearly. Bit-aligned digits of the keys
// themselves start below the bits lo and hi share, which a range across a power of two
// (0.5 to 3.5: exponents 126 to 128) leaves at bit 31: the first 11-bit digit is then
// 8 exponent and 3 mantissa bits, ~1700 kept keys of a 2048-pool row pile into ~24 bins
// (shared atomics on the same address serialise), and three digits are needed. Relative
// keys spread over the bins, so the threshold's bin mostly holds every key still needed
// after one or two digits (numpy model: 1.65 digits instead of 2.1 at 32768 pools). The
// H200 timed no change from it (ncu and chains within noise at every bench shape): a
// digit's barriers and scan, not its atomics, are what it costs. The key array is
// rewritten in place.
//
// The digits (at most kTopkDigitBits each) start below the bits the relative lo and hi
// share. After each digit the selection is "keys whose bits above `shift` exceed the
// prefix, plus the first `remaining` (by id) of those equal to it"; it stops when every key
// equal to the prefix is selected, or at shift 0 (ties at the k-th key, taken by ascending
// id). Shared-memory atomics only count; the order of the output is fixed by one prefix sum
// of per-thread counts.
template <int kThreads, int kSlots, typename IdOf>
__device__ __forceinline__ void radix_select_emit(uint32_t (&key)[kSlots], IdOf id_of,
                                                  uint32_t lo, uint32_t hi, int32_t k,
                                                  const RowOut& out, TopkShared& sh) {
  constexpr int kBinsPerThread = kTopkBins / kThreads;
  static_assert(kBinsPerThread >= 1 && kTopkBins % kThreads == 0);
#pragma unroll
  for (int i = 0; i < kSlots; ++i) key[i] = key[i] != 0u ? key[i] - lo + 1u : 0u;
  hi = hi - lo + 1u;  // lo >= 1 (keys are > 0): no wrap
  lo = 1u;
  // Invariant: the keys whose bits above `bits` equal the prefix number at least
  // `remaining`, and the keys above them fewer than k.
  int bits = lo == hi ? 0 : 32 - __clz(lo ^ hi);
  uint32_t prefix = bits == 32 ? 0u : hi & ~((1u << bits) - 1u);
  uint32_t remaining = static_cast<uint32_t>(k);
  int shift = 0, buffer = 0;
  while (bits > 0) {
    shift = bits > kTopkDigitBits ? bits - kTopkDigitBits : 0;
    const uint32_t digit_mask = (1u << (bits - shift)) - 1u;
    uint32_t* h = sh.hist[buffer];
#pragma unroll
    for (int i = 0; i < kSlots; ++i)
      if (key[i] != 0u && (bits == 32 || (key[i] >> bits) == (prefix >> bits)))
        atomicAdd(&h[(key[i] >> shift) & digit_mask], 1u);
    __syncthreads();
    // Thread t owns kBinsPerThread bins, thread 0 the highest: the thread whose prefix
    // sum crosses `remaining` holds the digit.
    const int first_bin = kTopkBins - (threadIdx.x + 1) * kBinsPerThread;
    uint32_t mine[kBinsPerThread], sum = 0;
#pragma unroll
    for (int b = 0; b < kBinsPerThread; ++b) sum += mine[b] = h[first_bin + b];
    const uint32_t incl = block_scan<kThreads>(sum, sh.warp_sums).incl;
    uint32_t above = incl - sum;
    if (above < remaining && remaining <= incl) {
#pragma unroll
      for (int b = kBinsPerThread - 1; b >= 0; --b) {
        if (above + mine[b] >= remaining) {
          sh.digit = static_cast<uint32_t>(first_bin + b);
          sh.above = above;
          sh.count = mine[b];
          break;
        }
        above += mine[b];
      }
    }
    for (int i = threadIdx.x; i < kTopkBins; i += kThreads) sh.hist[buffer ^ 1][i] = 0;
    __syncthreads();
    prefix |= sh.digit << shift;
    remaining -= sh.above;
    bits = shift;
    if (sh.count == remaining) break;  // every key equal to the prefix is selected
    buffer ^= 1;
  }

  // Emit: keys above the prefix, and the first `remaining` keys equal to it, in id order
  // (counts packed: above in the high half, equal in the low; each <= 32768).
  const uint32_t top = prefix >> shift;
  uint32_t gt = 0, eq = 0;
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    if (key[i] == 0u) continue;
    gt += (key[i] >> shift) > top;
    eq += (key[i] >> shift) == top;
  }
  const uint32_t packed = (gt << 16) | eq;
  const uint32_t before = block_scan<kThreads>(packed, sh.warp_sums).incl - packed;
  const uint32_t gt_before = before >> 16, eq_before = before & 0xffffu;
  uint32_t take = eq_before >= remaining ? 0u : min(remaining - eq_before, eq);
  int32_t at = static_cast<int32_t>(gt_before + min(eq_before, remaining));
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    if (key[i] == 0u) continue;
    const uint32_t d = key[i] >> shift;
    if (d > top || (d == top && take > 0u)) {
      if (d == top) --take;
      out.put(at++, id_of(i));
    }
  }
}

// Thread t's `chunk` keys of a row, pools [first, first + chunk) (0 past `end`: no pool);
// vector loads where the row and the chunk are 16-byte aligned (`aligned`).
template <int kPer>
__device__ __forceinline__ void load_keys(const float* row, int32_t first, int32_t chunk,
                                          int32_t end, bool aligned, uint32_t (&key)[kPer]) {
  float val[kPer];
  if (aligned) {
#pragma unroll
    for (int j = 0; j < kPer / 4; ++j) {
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (4 * j < chunk && first + 4 * j < end)  // may pass `end`, never the row's width
        v = __ldg(reinterpret_cast<const float4*>(row + first) + j);
      val[4 * j] = v.x;
      val[4 * j + 1] = v.y;
      val[4 * j + 2] = v.z;
      val[4 * j + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kPer; ++i) val[i] = i < chunk && first + i < end ? __ldg(row + first + i) : 0.f;
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) key[i] = i < chunk && first + i < end ? order_key(val[i]) : 0u;
}

// The c-th largest of the warp's values `v` (c in 1..32): the minimum or maximum where c
// is 32 or 1 (one instruction: the bound of a 16-warp CTA has c = 32), else a bitonic sort,
// descending (15 dependent shuffles: ~1000 cycles of a 512-thread CTA, H200 clock64 trace).
__device__ __forceinline__ uint32_t warp_nth_largest(uint32_t v, int c) {
  if (c == kWarp) return __reduce_min_sync(0xffffffffu, v);
  if (c == 1) return __reduce_max_sync(0xffffffffu, v);
  const int lane = threadIdx.x % kWarp;
#pragma unroll
  for (int size = 2; size <= kWarp; size <<= 1)
#pragma unroll
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      const uint32_t other = __shfl_xor_sync(0xffffffffu, v, stride);
      const bool descending = (lane & size) == 0 || size == kWarp;
      const bool lower = (lane & stride) == 0;
      v = lower == descending ? max(v, other) : min(v, other);
    }
  return __shfl_sync(0xffffffffu, v, c - 1);
}

// The candidate bound B <= the k-th largest key, in two levels. A warp with a pool in every
// thread (a full one) offers v = its c-th largest thread maximum: at least c of its keys are
// >= v. A CTA with f full warps (its first ones) offers b = the j-th largest v among them,
// j = min(f, J): at least c * j of its keys are >= b. B = the minimum b over the CTAs of the
// row, so with c = ceil(k / (the sum of their j)) at least k keys are >= B; no bound (0)
// where c > 32. One CTA per row takes J = 32 >= f (B = the minimum v over its full warps); a
// cluster of 4-8 takes J = 16: the minimum over 256 warps' v of 4 keys per thread left
// ~2000 of 32768 normal logits (numpy model), the 16th largest per CTA ~1100.
//
// Keys below B are never selected: they are dropped, and the digits start below the bits B
// and the row's largest key share (a range much narrower than the row's, so the first digit
// spreads over the bins instead of piling onto a few exponents, and fewer keys take part).
// This warp's v (0 where c > 32; 0 too for a warp that is not full, so it never ranks among
// the j largest of j <= f full warps).
__device__ __forceinline__ uint32_t warp_bound(uint32_t thread_max, int c, bool is_full) {
  if (c > kWarp) return 0u;
  const uint32_t nth = warp_nth_largest(thread_max, c);
  return is_full ? nth : 0u;
}

// c for `sum_j` offered warps (above); 33 (no bound) where none.
__device__ __forceinline__ int bound_c(int32_t k, int sum_j) {
  return sum_j > 0 ? (k + sum_j - 1) / sum_j : kWarp + 1;
}

// Writes the thread's nonzero keys (key[i] of pool first + i) and their ids into
// `key_dst`/`id_dst` (shared memory, maybe another CTA's) from position `at`, the thread's
// exclusive prefix of kept keys: in (thread, key) order, so the ids ascend.
template <int kPer>
__device__ __forceinline__ void gather_keys(const uint32_t (&key)[kPer], int32_t first,
                                            uint32_t at, uint32_t* key_dst, int32_t* id_dst) {
#pragma unroll
  for (int i = 0; i < kPer; ++i)
    if (key[i] != 0u) {
      key_dst[at] = key[i];
      id_dst[at] = first + i;
      ++at;
    }
}

// Radix select among the `total` <= kTopkCandidates gathered keys in sh.cand_* (thread t
// takes a contiguous run of them, so the ids still ascend with (thread, key)); lo and hi:
// their smallest and largest. hist[0] is zero and a barrier separates that from here.
template <int kThreads>
__device__ __forceinline__ void select_gathered(uint32_t total, uint32_t lo, uint32_t hi,
                                                int32_t k, const RowOut& out,
                                                TopkShared& sh) {
  constexpr int kCandidatePer = kTopkCandidates / kThreads;
  const uint32_t per = (total + kThreads - 1) / kThreads;  // <= kCandidatePer
  uint32_t ckey[kCandidatePer];
  int32_t cid[kCandidatePer];
#pragma unroll
  for (int j = 0; j < kCandidatePer; ++j) {
    const uint32_t c = threadIdx.x * per + j;
    const bool in = j < per && c < total;
    ckey[j] = in ? sh.cand_key[c] : 0u;
    cid[j] = in ? sh.cand_id[c] : -1;
  }
  radix_select_emit<kThreads>(ckey, [&](int i) { return cid[i]; }, lo, hi, k, out, sh);
}

// The top-k of row r (n > k pools) by one CTA. Thread t holds the keys of pools
// [t * chunk, (t + 1) * chunk) in registers, chunk = ceil(n / kThreads) <= kPer (kThreads *
// kPer >= the logits width): `chunk` from the row's length, not its width, so a short row
// in wide logits (the stage: max_pools wide) still spreads over every thread; the ids
// ascend with (thread, key), so emitting the selection in ascending id order is one prefix
// sum of per-thread counts. The candidate bound drops most keys first; where few are left
// (kCompact), they are gathered into shared memory and spread over the threads before the
// radix select.
template <int kThreads, int kPer>
__device__ __forceinline__ void topk_row(const TopkArgs& a, int r, int32_t n, const RowOut& out,
                                         TopkShared& sh) {
  constexpr int kWarps = kThreads / kWarp;
  static_assert(kPer % 4 == 0 && kThreads <= kTopkMaxThreads);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int32_t k = a.k;
  const float* row = a.logits + static_cast<int64_t>(r) * a.width;
  const int32_t chunk = min(kPer, (n + kThreads - 1) / kThreads);  // n > k >= 1: >= 1
  const int32_t base = threadIdx.x * chunk;
  uint32_t key[kPer];
  load_keys<kPer>(row, base, chunk, n, chunk % 4 == 0 && a.width % 4 == 0, key);
  for (int i = threadIdx.x; i < kTopkBins; i += kThreads) sh.hist[0][i] = 0;

  uint32_t lo = 0xffffffffu, hi = 0u;  // the thread's smallest and largest key
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    if (key[i] != 0u) lo = min(lo, key[i]);
    hi = max(hi, key[i]);
  }
  const int full = (n + chunk - 1) / chunk / kWarp;  // the first `full` warps
  const int c = bound_c(k, full);                     // j = f: J = 32 >= f
  const uint32_t bound_share = warp_bound(hi, c, warp < full);
  lo = __reduce_min_sync(0xffffffffu, lo);
  hi = __reduce_max_sync(0xffffffffu, hi);
  if (lane == 0) {
    sh.warp_lo[warp] = lo;
    sh.warp_hi[warp] = hi;
    sh.warp_bound[warp] = bound_share;
  }
  __syncthreads();
  // Across the warps: lane w takes warp w's values (three reductions, where a loop over the
  // warps in every thread issued 16 x 3 shared loads and min/max per thread).
  const bool offered = lane < kWarps;
  lo = __reduce_min_sync(0xffffffffu, offered ? sh.warp_lo[lane] : 0xffffffffu);
  hi = __reduce_max_sync(0xffffffffu, offered ? sh.warp_hi[lane] : 0u);
  // The minimum v over the full warps; none (0) where c > 32.
  uint32_t bound = __reduce_min_sync(0xffffffffu, lane < full ? sh.warp_bound[lane] : 0xffffffffu);
  if (c > kWarp) bound = 0u;
  if (bound > lo) {
    lo = bound;
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      if (key[i] < bound) key[i] = 0u;
  }
  if constexpr (kCompact<kThreads, kPer>) {
    uint32_t own = 0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) own += key[i] != 0u;
    const Scan kept = block_scan<kThreads>(own, sh.warp_sums);
    if (kept.total <= kTopkCandidates) {  // the same branch in every thread
      gather_keys<kPer>(key, base, kept.incl - own, sh.cand_key, sh.cand_id);
      __syncthreads();
      select_gathered<kThreads>(kept.total, lo, hi, k, out, sh);
      return;
    }
  }
  radix_select_emit<kThreads>(key, [&](int i) { return base + i; }, lo, hi, k, out, sh);
}

// Row r's pool count, past the PDL wait the logits need; or -1 where every pool is selected
// (n <= k): then the CTA has written ids 0..n-1 in order and -1 past them, or their slots
// (where `writes`), released its dependents, and returns at once. With early_rows such a
// row writes before its wait. select_slots' rows get their tail and -1 quads here too.
template <int kThreads>
__device__ __forceinline__ int32_t pools_to_select(const TopkArgs& a, int r, RowOut& out,
                                                   bool writes, TopkShared& sh) {
  uint32_t* const valid = &sh.valid;
  if (!a.early_rows) pdl_wait();
  const int32_t n = row_pools(a.lens, a.from_positions, r, a.width);
  if (writes && out.slots()) {
    // The table keeps pools below table_pools (blocks ascend with the ids): all of a top-k
    // from n <= table_pools pools; ids 0..min(n, table_pools)-1 of the causal fill.
    const int64_t table_pools = a.slots.max_blocks * a.slots.block_size.d / kPool;
    const int64_t kept = out.req < 0    ? 0
                         : n <= a.k     ? (n < table_pools ? n : table_pools)
                         : n <= table_pools ? a.k
                                            : -1;
    if (kept < 0) {
      out.valid = valid;
      if (threadIdx.x == 0) *valid = 0u;  // barriers of the selection come before its use
    }
    write_row_rest<kThreads>(a, r, out, min(n, a.k), kept);
  }
  if (n <= a.k) {
    if (writes) {
      if (!out.slots())
        for (int32_t i = threadIdx.x; i < a.k; i += kThreads)
          a.out[static_cast<int64_t>(r) * a.k + i] = i < n ? i : -1;
      else
        for (int32_t i = threadIdx.x; i < n; i += kThreads) out.put(i, i);
      if (out.slots()) close_holes<kThreads>(a, r, out, n, sh);
    }
    if (a.early_rows) pdl_wait();  // a grid must not finish before its own wait
    pdl_launch_dependents();
    return -1;
  }
  if (a.early_rows) pdl_wait();
  return n;
}

// One CTA of kThreads per row.
template <int kThreads, int kPer>
__global__ void __launch_bounds__(kThreads, 1) pool_topk_kernel(TopkArgs a) {
  __shared__ TopkShared sh;
  const int r = blockIdx.x;
  RowOut out = row_out(a, r);
  const int32_t n = pools_to_select<kThreads>(a, r, out, true, sh);
  if (n < 0) return;
  topk_row<kThreads, kPer>(a, r, n, out, sh);
  finish_count(a, r, out);
  if (out.slots()) close_holes<kThreads>(a, r, out, a.k, sh);
  pdl_launch_dependents();
}

// kParts CTAs of kTopkMaxThreads per row, a thread-block cluster (few rows of many pools:
// one CTA would walk the row alone on one SM). CTA q of the cluster holds pools
// [q * span, (q + 1) * span), span = ceil(n / kParts) rounded up to 4, kPer keys per thread
// at most. The cluster shares one candidate bound (the minimum of the CTAs'), then every CTA
// writes its kept keys, in id order, into CTA 0's shared memory at its offset (the sum of
// the lower CTAs' counts), and CTA 0 alone runs the radix select among them. Three cluster
// barriers in all. Where more than kTopkCandidates keys are kept (ties, adversarial rows),
// CTA 0 runs the one-CTA path (topk_row) on the whole row instead.
template <int kParts, int kPer>
__global__ void __launch_bounds__(kTopkMaxThreads, 1) pool_topk_parts_kernel(TopkArgs a) {
  constexpr int kThreads = kTopkMaxThreads, kWarps = kThreads / kWarp;
  constexpr int kRowPer = kParts * kPer;  // the whole row in one CTA
  static_assert(kPer % 4 == 0 && kRowPer <= kTopkMaxKeys);
  __shared__ TopkShared sh;
  __shared__ uint32_t part_bound, part_count, part_lo, part_hi;  // read by the cluster
  const cg::cluster_group cluster = cg::this_cluster();
  const int part = static_cast<int>(cluster.block_rank());
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int r = blockIdx.x / kParts;
  const int32_t k = a.k;
  RowOut out = row_out(a, r);
  const int32_t n = pools_to_select<kThreads>(a, r, out, part == 0, sh);
  if (n < 0) return;  // the whole cluster returns here: no cluster barrier was passed

  // 1. This CTA's keys, its share of the bound (the full warps of every CTA count).
  const int32_t span = ((n + kParts - 1) / kParts + 3) / 4 * 4;
  const int32_t chunk = min(kPer, (span + kThreads - 1) / kThreads);
  const int32_t first = part * span + threadIdx.x * chunk;
  const int32_t end = min(n, (part + 1) * span);
  const float* row = a.logits + static_cast<int64_t>(r) * a.width;
  uint32_t key[kPer];
  load_keys<kPer>(row, first, chunk, end, chunk % 4 == 0 && a.width % 4 == 0, key);
  for (int i = threadIdx.x; i < kTopkBins; i += kThreads) sh.hist[0][i] = 0;
  int sum_j = 0, mine = 0;  // the offered warps of the cluster; this CTA's full warps
  for (int q = 0; q < kParts; ++q) {
    const int32_t keys = min(max(n - q * span, 0), span);
    const int f = (keys + chunk - 1) / chunk / kWarp;
    sum_j += min(f, kTopkClusterBoundWarps);
    if (q == part) mine = f;
  }
  const int c = bound_c(k, sum_j), j = min(mine, kTopkClusterBoundWarps);
  uint32_t hi = 0u;
#pragma unroll
  for (int i = 0; i < kPer; ++i) hi = max(hi, key[i]);
  const uint32_t v = warp_bound(hi, c, warp < mine);
  if (lane == 0) sh.warp_bound[warp] = v;
  __syncthreads();
  if (warp == 0) {  // b: the j-th largest v (no bound where c > 32; neutral where j = 0)
    const uint32_t b = c > kWarp ? 0u
                       : j == 0  ? 0xffffffffu
                                 : warp_nth_largest(lane < kWarps ? sh.warp_bound[lane] : 0u, j);
    if (lane == 0) part_bound = b;
  }
  cluster.sync();  // 1: the parts' bounds
  uint32_t bound = 0xffffffffu;
  for (int q = 0; q < kParts; ++q) bound = min(bound, *cluster.map_shared_rank(&part_bound, q));

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
    if (lane == 0) {
      part_count = kept.total;
      part_lo = lo;
      part_hi = hi;
    }
  }
  cluster.sync();  // 2: the parts' counts
  uint32_t offset = 0, total = 0;
  for (int q = 0; q < kParts; ++q) {
    const uint32_t c = *cluster.map_shared_rank(&part_count, q);
    offset += q < part ? c : 0u;
    total += c;
  }
  if (part == 0) {
    for (int q = 0; q < kParts; ++q) {
      lo = min(lo, *cluster.map_shared_rank(&part_lo, q));
      hi = max(hi, *cluster.map_shared_rank(&part_hi, q));
    }
  }
  // 3. The kept keys into CTA 0, in id order.
  const bool gathered = total <= kTopkCandidates;  // the same in every CTA
  if (gathered)
    gather_keys<kPer>(key, first, offset + kept.incl - own,
                      cluster.map_shared_rank(sh.cand_key, 0),
                      cluster.map_shared_rank(sh.cand_id, 0));
  cluster.sync();  // 3: the keys are in CTA 0; no CTA reads another's shared memory after it
  if (part == 0) {
    if (gathered)
      select_gathered<kThreads>(total, lo, hi, k, out, sh);
    else
      topk_row<kThreads, kRowPer>(a, r, n, out, sh);
    finish_count(a, r, out);
    if (out.slots()) close_holes<kThreads>(a, r, out, k, sh);
  }
  pdl_launch_dependents();
}

// ------------------------------------------------------------------------------ launch

// Device properties belong to the current device (XLA makes the stream's device current
// before it calls a handler): never cache them process-wide, or the second GPU of a
// process launches with the first one's settings.
int sm_count() {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms > 0 ? sms : 1;
}


// The cache's fp8 bytes as a 3-d tensor (128 bytes of an entry, entries of a page, pages),
// read in boxes of one 16-entry tile in the 128-byte swizzle (mqa_logits_kernel).
cudaError_t keys_tensor_map(const LogitsArgs& args, CUtensorMap* map) {
  const auto encode = wgmma::tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[3] = {kDim, static_cast<cuuint64_t>(args.page.d),
                              static_cast<cuuint64_t>(args.pages)};
  const cuuint64_t strides[2] = {kDim, static_cast<cuuint64_t>(args.page.d) * kEntryBytes};
  const cuuint32_t box[3] = {kDim, kWarpPools, 1}, unit[3] = {1, 1, 1};
  const CUresult res = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3,
                              const_cast<uint8_t*>(args.kv), dims, strides, box, unit,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The logits kernel on a persistent grid: at most one CTA per possible item, at most what is
// resident at once (shapes only: the command-buffer contract); the kernel spreads the actual
// items over it.
template <int kHeadTiles>
cudaError_t launch_logits_as(cudaStream_t stream, bool pdl, const LogitsArgs& args) {
  CUtensorMap map{};  // a cache of no pages is never read: no map to encode
  if (args.pages > 0)
    if (cudaError_t err = keys_tensor_map(args, &map); err != cudaSuccess) return err;
  const auto kernel = mqa_logits_kernel<kHeadTiles>;
  const size_t smem = LogitsLayout<kHeadTiles>::bytes(args.rows);
  if (cudaError_t err = allow_smem(kernel, smem); err != cudaSuccess) return err;
  int per_sm = 0;  // CTAs per SM on this device (a cheap host query, asked every launch)
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kLogitsThreads, smem);
  per_sm = std::max(per_sm, 1);
  const int64_t bound = static_cast<int64_t>(args.rows) *
                        ((args.width + kItemPools - 1) / kItemPools);
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(bound, int64_t{sm_count()} * per_sm));
  return launch(kernel, dim3(static_cast<unsigned>(grid)), dim3(kLogitsThreads), smem, stream,
                pdl, args, map);
}

cudaError_t launch_logits(cudaStream_t stream, bool pdl, const LogitsArgs& args,
                          int32_t padded) {
  return padded == 64 ? launch_logits_as<8>(stream, pdl, args)
                      : launch_logits_as<4>(stream, pdl, args);
}

template <int kThreads, int kPer>
cudaError_t launch_topk_as(cudaStream_t stream, bool pdl, const TopkArgs& args) {
  return launch(pool_topk_kernel<kThreads, kPer>, dim3(static_cast<unsigned>(args.rows)),
                dim3(kThreads), 0, stream, pdl, args);
}

template <int kParts, int kPer>
cudaError_t launch_topk_parts(cudaStream_t stream, bool pdl, const TopkArgs& args) {
  return launch_cluster(pool_topk_parts_kernel<kParts, kPer>,
                        dim3(static_cast<unsigned>(args.rows) * kParts), dim3(kTopkMaxThreads),
                        0, stream, pdl, static_cast<unsigned>(kParts), args);
}

// CTAs per row (a cluster) from the rows (a static shape): one SM per row leaves most of
// the H200 idle at few rows. 8 (the portable cluster size) up to 8 rows, 4 up to 16, 2 up
// to 64 (at most 128 CTAs of 1024 threads: one wave on 132 SMs), then 1. Measured on the
// H200 (ncu, L2 flushed, µs, one CTA per row -> the split): 1 x 32768 16.64 -> 12.74,
// 16 x 32768 18.18 -> 11.94, 64 x 32768 20.74 -> 13.89; at 8192 (2 CTAs) within 0.6 either
// way.
int topk_parts(int32_t rows) { return rows <= 8 ? 8 : rows <= 16 ? 4 : rows <= 64 ? 2 : 1; }

// The 1024-thread shapes, kRowPer keys per thread when one CTA holds the row: split over
// topk_parts CTAs, at most kRowPer / 4 (4 keys per thread at least, one 16-byte load).
template <int kRowPer>
cudaError_t launch_topk_wide(cudaStream_t stream, bool pdl, const TopkArgs& args) {
  const int parts = std::min(topk_parts(args.rows), kRowPer / 4);
  if constexpr (kRowPer / 4 >= 8)
    if (parts == 8) return launch_topk_parts<8, kRowPer / 8>(stream, pdl, args);
  if constexpr (kRowPer / 4 >= 4)
    if (parts == 4) return launch_topk_parts<4, kRowPer / 4>(stream, pdl, args);
  if (parts == 2) return launch_topk_parts<2, kRowPer / 2>(stream, pdl, args);
  return launch_topk_as<kTopkMaxThreads, kRowPer>(stream, pdl, args);
}

// Threads and keys per thread from the logits width (a static shape): at least 16 warps
// (k = 512 then has its candidate bound: c = 32 maxima per warp), more keys per thread
// past 4 and 8 (one and two 16-byte loads), 32 at most (the 64 registers of a thread at
// 1024 threads per CTA). Narrower CTAs at the 2048 and 4096 widths lose (H200, ncu, L2
// flushed, 1 / 16 / 64 rows x 2048: 512 x 4 6.69 / 6.02 / 6.85 µs, 256 x 8 7.46 / 6.24 /
// 7.23, 128 x 16 8.80 / 8.45 / 9.25): below 16 warps there is no bound, and the key loops
// of the fewer threads are longer than what the fewer warps save at the barriers.
cudaError_t launch_topk(cudaStream_t stream, bool pdl, const TopkArgs& args) {
  if (args.width <= 2048) return launch_topk_as<512, 4>(stream, pdl, args);
  if (args.width <= 4096) return launch_topk_as<512, 8>(stream, pdl, args);
  if (args.width <= 8192) return launch_topk_wide<8>(stream, pdl, args);
  if (args.width <= 16384) return launch_topk_wide<16>(stream, pdl, args);
  return launch_topk_wide<kTopkMaxKeys>(stream, pdl, args);
}

// --------------------------------------------------------------------------- handlers

// Shapes shared by the logits handlers (the limits are decided in glm5_jax/logits.py;
// here they are only validated).
ffi::Error check_logits(const Check& check, ffi::AnyBuffer& q, ffi::BufferR2<ffi::F32>& w_out,
                        ffi::BufferR3<ffi::U8>& kv, int64_t rows, int64_t width) {
  const auto qd = q.dimensions();
  if (q.element_type() != ffi::DataType::F8E4M3FN || qd.size() != 3 || qd[0] != rows ||
      qd[2] != kDim)
    return check.fail("q_fp8 must be e4m3[rows, padded, 128]");
  if (qd[1] != 32 && qd[1] != 64) return check.fail("q_fp8 must have 32 or 64 (padded) heads");
  if (w_out.dimensions()[0] != rows || w_out.dimensions()[1] != qd[1])
    return check.fail("w_out must be f32[rows, padded]");
  const auto cd = kv.dimensions();
  if (cd[2] != kEntryBytes || cd[1] % kWarpPools != 0 || cd[1] == 0)
    return check.fail("kv_cache must be u8[pages, PAGE, 132] with PAGE % 16 == 0");
  if (rows > 8192) return check.fail("at most 8192 rows");
  if (rows * ((width + kItemPools - 1) / kItemPools) > kI32Max)
    return check.fail("rows * max_pools / 64 must fit in 32 bits");
  if (width > kI32Max / 2 ||
      cd[0] * cd[1] > kI32Max)
    return check.fail("logits width or cache too large for 32-bit pool ids");
  if (!aligned(q.untyped_data(), 16) || !aligned(kv.untyped_data(), 16))
    return check.fail("q_fp8 and kv_cache must be 16-byte aligned");
  return ffi::Error::Success();
}

LogitsArgs logits_args(ffi::AnyBuffer& q, ffi::BufferR2<ffi::F32>& w_out,
                       ffi::BufferR3<ffi::U8>& kv, ffi::BufferR2<ffi::S32>& page_table,
                       float* logits, int64_t rows, int64_t width, bool ue8m0) {
  LogitsArgs a{};
  a.q = static_cast<const uint8_t*>(q.untyped_data());
  a.w_out = w_out.typed_data();
  a.kv = kv.typed_data();
  a.page_table = page_table.typed_data();
  a.logits = logits;
  a.rows = static_cast<int32_t>(rows);
  a.tables = static_cast<int32_t>(page_table.dimensions()[0]);
  a.table_width = static_cast<int32_t>(page_table.dimensions()[1]);
  a.pages = static_cast<int32_t>(kv.dimensions()[0]);
  a.page = Divisor::extent(kv.dimensions()[1]);
  a.width = static_cast<int32_t>(width);
  a.skip_upto = -1;
  a.ue8m0 = ue8m0;
  return a;
}

// The top-k arguments both handlers share (shapes already checked against the limits).
TopkArgs topk_args(const float* logits, const int32_t* lens, int32_t* out, int64_t rows,
                   int64_t width, int64_t k) {
  TopkArgs a{};
  a.logits = logits;
  a.lens = lens;
  a.out = out;
  a.rows = static_cast<int32_t>(rows);
  a.width = static_cast<int32_t>(width);
  a.k = static_cast<int32_t>(k);
  return a;
}

ffi::Error MqaLogitsImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::BufferR2<ffi::F32> w_out,
                         ffi::BufferR3<ffi::U8> kv, ffi::BufferR2<ffi::S32> page_table,
                         ffi::BufferR1<ffi::S32> pool_lens, ffi::ResultBufferR2<ffi::F32> logits,
                         bool ue8m0, bool pdl) {
  const Check check{targets::glm5_mqa_logits};
  const int64_t rows = logits->dimensions()[0], width = logits->dimensions()[1];
  if (ffi::Error err = check_logits(check, q, w_out, kv, rows, width); err.failure()) return err;
  if (page_table.dimensions()[0] != rows || pool_lens.dimensions()[0] != rows)
    return check.fail("page_table and pool_lens need `rows` rows");
  if (rows == 0 || width == 0) return ffi::Error::Success();
  LogitsArgs a = logits_args(q, w_out, kv, page_table, logits->typed_data(), rows, width, ue8m0);
  a.lens = pool_lens.typed_data();
  a.fill = true;
  return check.cuda(launch_logits(stream, pdl, a, q.dimensions()[1]));
}

ffi::Error PoolTopkImpl(cudaStream_t stream, ffi::BufferR2<ffi::F32> logits,
                        ffi::BufferR1<ffi::S32> pool_lens, ffi::ResultBufferR2<ffi::S32> ids,
                        bool pdl) {
  const Check check{targets::glm5_pool_topk};
  const int64_t rows = logits.dimensions()[0], width = logits.dimensions()[1];
  const int64_t k = ids->dimensions()[1];
  if (ids->dimensions()[0] != rows || pool_lens.dimensions()[0] != rows)
    return check.fail("pool_lens and the result need `rows` rows");
  if (width > kTopkMaxPools) return check.fail("logits wider than 32768 pools");
  if (rows > kI32Max || k > kI32Max) return check.fail("too many rows or k");
  if (rows == 0 || k == 0) return ffi::Error::Success();
  return check.cuda(launch_topk(stream, pdl, topk_args(logits.typed_data(), pool_lens.typed_data(),
                                                      ids->typed_data(), rows, width, k)));
}

// The select path's two kernels back to back (select_pools, select_slots): the logits of
// the rows with more than k pools, then the top-k writing pool ids (ids) or slots
// (slots.out). Shapes of the logits side are checked here; the caller checks its results.
ffi::Error launch_select(const Check& check, cudaStream_t stream, ffi::AnyBuffer& q,
                         ffi::BufferR2<ffi::F32>& w_out, ffi::BufferR3<ffi::U8>& kv,
                         ffi::BufferR2<ffi::S32>& page_table, ffi::BufferR1<ffi::S32>& req_ids,
                         ffi::BufferR1<ffi::S32>& positions, ffi::Result<ffi::BufferR2<ffi::F32>>& logits,
                         int32_t* ids, const SlotArgs& slots, int64_t k, bool ue8m0, bool pdl) {
  const int64_t rows = logits->dimensions()[0], width = logits->dimensions()[1];
  if (ffi::Error err = check_logits(check, q, w_out, kv, rows, width); err.failure()) return err;
  if (req_ids.dimensions()[0] != rows || positions.dimensions()[0] != rows)
    return check.fail("req_ids and positions need `rows` rows");
  if (width > kTopkMaxPools) return check.fail("max_pools above 32768");
  if (k <= 0 || k > kI32Max) return check.fail("k must be in [1, 2^31)");
  if (rows == 0) return ffi::Error::Success();
  LogitsArgs a = logits_args(q, w_out, kv, page_table, logits->typed_data(), rows, width, ue8m0);
  a.req_ids = req_ids.typed_data();
  a.lens = positions.typed_data();
  a.from_positions = true;
  a.skip_upto = static_cast<int32_t>(std::min<int64_t>(k, width));
  cudaError_t err = launch_logits(stream, pdl, a, q.dimensions()[1]);
  if (err != cudaSuccess) return check.cuda(err);
  TopkArgs b = topk_args(logits->typed_data(), positions.typed_data(), ids, rows, width, k);
  b.slots = slots;
  b.from_positions = true;
  b.early_rows = pdl;
  // Without PDL the top-k simply runs after the logits; with it, it overlaps their tail.
  return check.cuda(launch_topk(stream, pdl, b));
}

ffi::Error SelectPoolsImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::BufferR2<ffi::F32> w_out,
                           ffi::BufferR3<ffi::U8> kv, ffi::BufferR2<ffi::S32> page_table,
                           ffi::BufferR1<ffi::S32> req_ids, ffi::BufferR1<ffi::S32> positions,
                           ffi::ResultBufferR2<ffi::S32> ids,
                           ffi::ResultBufferR2<ffi::F32> logits, bool ue8m0, bool pdl) {
  const Check check{targets::glm5_select_pools};
  if (ids->dimensions()[0] != logits->dimensions()[0])
    return check.fail("the ids need `rows` rows");
  const int64_t k = ids->dimensions()[1];
  if (k == 0) return ffi::Error::Success();
  return launch_select(check, stream, q, w_out, kv, page_table, req_ids, positions, logits,
                       ids->typed_data(), SlotArgs{}, k, ue8m0, pdl);
}

ffi::Error SelectSlotsImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::BufferR2<ffi::F32> w_out,
                           ffi::BufferR3<ffi::U8> kv, ffi::BufferR2<ffi::S32> page_table,
                           ffi::BufferR1<ffi::S32> req_ids, ffi::BufferR1<ffi::S32> positions,
                           ffi::BufferR2<ffi::S32> block_table,
                           ffi::ResultBufferR2<ffi::S32> slots,
                           ffi::ResultBufferR1<ffi::S32> counts,
                           ffi::ResultBufferR2<ffi::F32> logits, int64_t k, int64_t block_size,
                           int64_t stride_rows, bool ue8m0, bool pdl) {
  const Check check{targets::glm5_select_slots};
  const int64_t rows = logits->dimensions()[0], width = slots->dimensions()[1];
  if (slots->dimensions()[0] != rows || counts->dimensions()[0] != rows)
    return check.fail("the slots and counts need `rows` rows");
  SlotArgs s{};
  s.requests = block_table.dimensions()[0];
  s.max_blocks = block_table.dimensions()[1];
  if (ffi::Error err = check_remap(check, s.requests, s.max_blocks, block_size, stride_rows, k,
                                   width);
      err.failure())
    return err;
  s.req_ids = req_ids.typed_data();
  s.block_table = block_table.typed_data();
  s.out = slots->typed_data();
  s.counts = counts->typed_data();
  s.block_size = Divisor(static_cast<int32_t>(block_size));
  s.stride_rows = static_cast<int32_t>(stride_rows);
  s.max_block = max_block_id(block_size, stride_rows);
  s.width = static_cast<int32_t>(width);
  s.vector = width % kPool == 0 && aligned(s.out, 16);
  return launch_select(check, stream, q, w_out, kv, page_table, req_ids, positions, logits,
                       nullptr, s, k, ue8m0, pdl);
}

// The stream and the operands both select handlers take first, in launch_select's order.
auto bind_select() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()            // q_fp8 (e4m3)
      .Arg<ffi::BufferR2<ffi::F32>>()   // w_out
      .Arg<ffi::BufferR3<ffi::U8>>()    // kv_cache
      .Arg<ffi::BufferR2<ffi::S32>>()   // page_table
      .Arg<ffi::BufferR1<ffi::S32>>()   // req_ids
      .Arg<ffi::BufferR1<ffi::S32>>();  // positions
}

}  // namespace
}  // namespace glm5

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5MqaLogits, glm5::MqaLogitsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()            // q_fp8 (e4m3)
                                  .Arg<ffi::BufferR2<ffi::F32>>()   // w_out
                                  .Arg<ffi::BufferR3<ffi::U8>>()    // kv_cache
                                  .Arg<ffi::BufferR2<ffi::S32>>()   // page_table
                                  .Arg<ffi::BufferR1<ffi::S32>>()   // pool_lens
                                  .Ret<ffi::BufferR2<ffi::F32>>()   // logits
                                  .Attr<bool>("ue8m0")              // ue8m0
                                  .Attr<bool>("pdl"),               // pdl
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5PoolTopk, glm5::PoolTopkImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::BufferR2<ffi::F32>>()   // logits
                                  .Arg<ffi::BufferR1<ffi::S32>>()   // pool_lens
                                  .Ret<ffi::BufferR2<ffi::S32>>()   // pool_ids
                                  .Attr<bool>("pdl"),               // pdl
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5SelectPools, glm5::SelectPoolsImpl,
                              glm5::bind_select()
                                  .Ret<ffi::BufferR2<ffi::S32>>()   // pool_ids
                                  .Ret<ffi::BufferR2<ffi::F32>>()   // logits
                                  .Attr<bool>("ue8m0")              // ue8m0
                                  .Attr<bool>("pdl"),               // pdl
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5SelectSlots, glm5::SelectSlotsImpl,
                              glm5::bind_select()
                                  .Arg<ffi::BufferR2<ffi::S32>>()   // block_table
                                  .Ret<ffi::BufferR2<ffi::S32>>()   // slots
                                  .Ret<ffi::BufferR1<ffi::S32>>()   // counts
                                  .Ret<ffi::BufferR2<ffi::F32>>()   // logits
                                  .Attr<int64_t>("k")               // k
                                  .Attr<int64_t>("block_size")      // block_size
                                  .Attr<int64_t>("stride_rows")     // stride_rows
                                  .Attr<bool>("ue8m0")              // ue8m0
                                  .Attr<bool>("pdl"),               // pdl
                              {ffi::Traits::kCmdBufferCompatible});
