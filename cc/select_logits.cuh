// The select path's logits kernel (SPEC §5b) and its launch: mqa_logits_kernel, for
// glm5_mqa_logits, glm5_select_pools and glm5_select_slots (cc/select.cu).
//
// Logits: persistent CTAs of a consumer warpgroup and a producer warp; a work item is 64
// pools of one row (the wgmma M side), its K tiles streamed by the TMA. Each CTA computes
// the row -> item prefix itself from the row lengths (no schedule kernel) and takes a
// contiguous range of items, so at M = 1 a 32K-pool row is spread over every SM. Scores come
// from fp8 wgmma.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>

#include "bulk.cuh"
#include "common.h"
#include "constants.h"
#include "limits.h"
#include "select.cuh"
#include "wgmma.cuh"

namespace glm5 {
namespace {

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
  int32_t group;              // rows of one request scored from one read of its tiles, <= 4
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
//
// Units (kGroup > 1, the select path with next_n rows a request): a unit is a run of at most
// a.group consecutive rows of one request, each unit's rows scored from one read of each
// K tile. unit[r] of a unit's first row is (its rows << kUnitShift) | its span (the most
// pools a row of it scores); 0 for the unit's other rows, which own no items.
constexpr int kUnitShift = 28;
constexpr int32_t kUnitSpan = (1 << kUnitShift) - 1;
// Rows of one request looked back to find a row's place in its run: a multiple of every
// group (1..LOGITS_GROUP_ROWS), so a run longer than it still splits at a unit boundary.
constexpr int kUnitLookback = 48;
static_assert(limits::kLogitsGroupRows <= 4 && kUnitLookback % 12 == 0);

template <int kGroup>
struct RowTables {
  static constexpr int kArrays = kGroup > 1 ? 4 : 3;
  int32_t* first_item;  // [rows + 1]
  int32_t* pools;       // [rows]
  int32_t* req;         // [rows]
  int32_t* unit;        // [rows] (kGroup > 1)
  __device__ RowTables(int32_t* base, int32_t rows)
      : first_item(base), pools(base + rows + 1), req(base + 2 * rows + 1),
        unit(base + 3 * rows + 1) {}
  static constexpr size_t bytes(int32_t rows) {
    return (kArrays * static_cast<size_t>(rows) + 1) * sizeof(int32_t);
  }
  // The pools a row's (unit's) items cover: its span.
  __device__ __forceinline__ int32_t span(int r) const {
    if constexpr (kGroup > 1) return unit[r] & kUnitSpan;
    else return pools[r];
  }
  __device__ __forceinline__ int rows_of(int r) const {
    if constexpr (kGroup > 1) return unit[r] >> kUnitShift;
    else return 1;
  }
};

// The row tables (every CTA computes the same ones from the row lengths: no schedule
// kernel); then the CTA's contiguous share of the items, [begin, end), and the row of
// `begin`. All kThreads threads call it.
struct ItemRange {
  int32_t begin, end, row;
};

// A unit's first row (kGroup > 1): whether row r starts one, given the rows of its request
// right before it (d, at most kUnitLookback); its rows and span into t.unit[r]; its items.
template <int kGroup>
__device__ __forceinline__ int32_t unit_items(const LogitsArgs& a, const RowTables<kGroup>& t,
                                              int r) {
  const int32_t req = t.req[r];
  int d = 0;
  while (d < kUnitLookback && r - d - 1 >= 0 && t.req[r - d - 1] == req) ++d;
  if (d < kUnitLookback && d % a.group != 0) {
    t.unit[r] = 0;
    return 0;
  }
  // Rows that need no logits (at most skip_upto pools, select path) widen no span.
  const auto needs = [&](int32_t n) { return a.fill || n > a.skip_upto ? n : 0; };
  int rows = 1;
  int32_t span = needs(t.pools[r]);
  if (d < kUnitLookback)
    for (; rows < a.group && r + rows < a.rows && t.req[r + rows] == req; ++rows)
      span = max(span, needs(t.pools[r + rows]));
  t.unit[r] = (rows << kUnitShift) | span;
  return row_items(a, span);
}

template <int kThreads, int kGroup>
__device__ __forceinline__ ItemRange cta_items(const LogitsArgs& a, const RowTables<kGroup>& t) {
  __shared__ uint32_t warp_sums[kThreads / kWarp];
  int32_t* const first_item = t.first_item;
  if constexpr (kGroup > 1) {  // every row's request first: a unit reads its neighbours'
    for (int r = threadIdx.x; r < a.rows; r += kThreads) {
      t.req[r] = a.req_ids != nullptr ? load_before_wait(a.req_ids + r) : r;
      t.pools[r] = pools_of(load_before_wait(a.lens + r), a.from_positions, a.width);
    }
    __syncthreads();
  }
  int32_t carry = 0;
  for (int base = 0; base < a.rows; base += kThreads) {
    const int r = base + threadIdx.x;
    int32_t own = 0;
    if (r < a.rows) {
      if constexpr (kGroup > 1) {
        own = unit_items<kGroup>(a, t, r);
      } else {
        const int32_t n = pools_of(load_before_wait(a.lens + r), a.from_positions, a.width);
        t.req[r] = a.req_ids != nullptr ? load_before_wait(a.req_ids + r) : r;
        t.pools[r] = n;
        own = row_items(a, n);
      }
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

// ReLU that keeps NaN (as the reference's maximum(dot, 0) does): one max.NaN (FMNMX.NAN), where
// a compare and a select took two instructions per accumulator. It returns +0 for -0 (the
// select kept -0): head_sum's sums start at +0, so a logit can differ only in the sign of a
// zero (a sum that underflowed to -0), which ranks as +0 in the top-k.
__device__ __forceinline__ float relu(float x) {
  float y;
  asm("max.NaN.f32 %0, %1, 0f00000000;" : "=f"(y) : "f"(x));
  return y;
}

// The head-weighted sums of a thread's accumulators for one row (d[4j..4j+3] = the fragment
// of head tile j: rows g, g + 8 x heads 8j + 2t, 8j + 2t + 1), before the quad adds them.
template <int kHeadTiles>
__device__ __forceinline__ void head_sum(const float (&d)[4 * kHeadTiles],
                                         const float (&w0)[kHeadTiles],
                                         const float (&w1)[kHeadTiles], float& sum_lo,
                                         float& sum_hi) {
  sum_lo = 0.f;
  sum_hi = 0.f;
#pragma unroll
  for (int j = 0; j < kHeadTiles; ++j) {
    sum_lo = fmaf(w0[j], relu(d[4 * j]), sum_lo);
    sum_lo = fmaf(w1[j], relu(d[4 * j + 1]), sum_lo);
    sum_hi = fmaf(w0[j], relu(d[4 * j + 2]), sum_hi);
    sum_hi = fmaf(w1[j], relu(d[4 * j + 3]), sum_hi);
  }
}

// The slots a lane of a quad ends with: kSlots sums (slot s: row s / 2 of a batch, pool
// g + 8 * (s % 2)) over the quad's four lanes, lane t taking slots t * kPer .. t * kPer +
// kPer - 1.
template <int kSlots>
constexpr int kQuadPer = (kSlots + 3) / 4;

// The quad's sums of kSlots values (v: this lane's partial sums), shared out: lane t ends
// with slots t * kPer + j (j < kPer; slots past kSlots hold nothing). Each slot is the
// butterfly's sum, (t0 + t1) + (t2 + t3) in every lane, so the bits do not change; but a
// lane exchanges half of its slots with lane t ^ 1 (keeping those of its own and of lane
// t ^ 2), then half of the rest with lane t ^ 2: 2 kPer + kPer shuffles and adds, where the
// butterfly took two of each per slot in every lane.
template <int kSlots>
__device__ __forceinline__ void quad_sum(const float (&v)[kSlots], int t,
                                         float (&out)[kQuadPer<kSlots>]) {
  constexpr int kPer = kQuadPer<kSlots>;
  const bool odd = t & 1, high = t & 2;
  // Round 1: position p * kPer + j pairs slot (2p) * kPer + j (kept where t is even) with
  // (2p + 1) * kPer + j (kept where t is odd), p = t's bit 1 in the end.
  float r1[2 * kPer];
#pragma unroll
  for (int i = 0; i < 2 * kPer; ++i) {
    const int s0 = (i / kPer) * 2 * kPer + i % kPer, s1 = s0 + kPer;
    if (s0 >= kSlots) {  // neither lane's slot exists
      r1[i] = 0.f;
    } else if (s1 >= kSlots) {  // only the even lane's: it keeps and gets v[s0]
      r1[i] = v[s0] + __shfl_xor_sync(0xffffffffu, v[s0], 1);
    } else {
      const float keep = odd ? v[s1] : v[s0], send = odd ? v[s0] : v[s1];
      r1[i] = keep + __shfl_xor_sync(0xffffffffu, send, 1);
    }
  }
  // Round 2: position j (kept where t < 2) pairs with kPer + j (kept where t >= 2).
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (2 * kPer + j >= kSlots) {  // no lane t >= 2 has a slot here
      out[j] = r1[j] + __shfl_xor_sync(0xffffffffu, r1[j], 2);
    } else {
      const float keep = high ? r1[kPer + j] : r1[j], send = high ? r1[j] : r1[kPer + j];
      out[j] = keep + __shfl_xor_sync(0xffffffffu, send, 2);
    }
  }
}

// The logits kernel: CTAs of one consumer warpgroup (four warps) and one producer warp.
// The K-cache tiles come through a ring of kRingStages stages in shared memory, filled by
// the TMA: the producer looks up the pages of the next kLookahead items at once, one lane
// per 16-pool tile, and issues one tensor copy of the tile (2 KB: its 16 entries are
// contiguous in their page) plus one bulk copy of its 64 scale bytes; the consumers wait
// on the stage's full barrier, score the item and release the stage on its empty barrier.
// So the loads in flight per SM are the ring's bytes, not what registers can hold (tiles
// loaded into registers behind a dependent page lookup read the cache more slowly than the
// ring, with the same arithmetic).
//
// Scores: sm_90's fp8 tensor cores are reached only through wgmma (it has no fp8 mma.sync:
// ptxas emulates m16n8k32.e4m3 by converting both operands to f16 at every call, which left
// the kernel issue-bound; an f16 mma.sync on exactly converted fp8 is slower than wgmma).
// The warpgroup scores a whole 64-pool item with kDim / 32 = 4 wgmma m64nNk32 e4m3 (N = the
// padded heads): A = the item's four K tiles, B = the row's queries, both in shared memory in
// the 128-byte swizzle. The TMA
// swizzles the tiles (a tensor map of the cache: boxes of 16 entries x 128 bytes of one
// page); the consumers write the queries swizzled by hand when the row changes. The
// accumulator fragment of thread (g, t) of warp w holds rows 16w + g and 16w + g + 8 of the
// item, heads 8j + 2t and 8j + 2t + 1 (j = 0..N/8-1): head_sum's layout.
//
// Summation order of a logit (fixed, documented): per head, one fp32 accumulator from +0
// takes the four 32-product wgmma steps (dims 0-31, 32-63, 64-95, 96-127) in order (the
// order of the products inside a step is the tensor core's); per thread,
// s = fma(w[h1], relu(dot_h1), fma(w[h0], relu(dot_h0), s)) over its heads h0 = 8j + 2t,
// h1 = h0 + 1 for j = 0.. in order, from s = +0; then the four threads of a pool add in
// pairs, (t0 + t1) + (t2 + t3) (quad_sum); then times the entry's scale.
constexpr int kRingStages = 4;
constexpr int kLogitsWarps = kConsumerWarps + 1;          // consumers + the producer
constexpr int kLogitsThreads = kLogitsWarps * kWarp;
constexpr int kTileBytes = kWarpPools * kDim;            // a tile's fp8 entries: 2048 B
constexpr int kTileScaleBytes = kWarpPools * 4;          // its scales: 64 B
constexpr int kLookahead = kWarp / kConsumerWarps;        // items per lookup round
// Where tile `tile` (16 pools) of work item `item` lives: its page-table entry and the
// entry of its first pool in that page; page -1 when it is not read (past the row's pools,
// an unknown request, a page slot past the table). The entry is not yet checked against the
// cache (readable() does that, SPEC D4), so its load stays in flight until then. `row` is
// advanced to the item's row (a thread visits items in ascending order).
struct TileSource {
  int32_t page, entry;
};

template <int kGroup>
__device__ __forceinline__ TileSource tile_source(const LogitsArgs& a, const RowTables<kGroup>& t,
                                                  int32_t item, int tile, int& row) {
  while (t.first_item[row + 1] <= item) ++row;
  const int32_t n = t.span(row);
  const int32_t p0 = (item - t.first_item[row]) * kItemPools + tile * kWarpPools;
  const int32_t req = t.req[row];
  const int32_t slot = a.page.div(p0);  // PAGE % 16 == 0: the tile is in one page
  if (p0 < n && req >= 0 && req < a.tables && slot < a.table_width)
    return {load_before_wait(a.page_table + static_cast<int64_t>(req) * a.table_width + slot),
            a.page.mod(p0)};
  return {-1, 0};
}

// A looked-up tile that is read: a page id inside the cache.
__device__ __forceinline__ bool readable(const LogitsArgs& a, const TileSource& at) {
  return at.page >= 0 && at.page < a.pages;
}

using wgmma::kAtom;

// The rows of a unit scored at once (score_unit): 64 accumulator registers a thread.
__host__ __device__ constexpr int unit_batch(int head_tiles, int group) {
  return group < 16 / head_tiles ? group : 16 / head_tiles;
}

template <int kHeadTiles, int kGroup>
struct LogitsLayout {  // offsets from the 1024-aligned base of dynamic shared memory
  static constexpr int kPadded = 8 * kHeadTiles;
  static constexpr int kKeys = 0;                                          // [stage][64][128]
  static constexpr int kQueries = kKeys + kRingStages * kItemPools * kDim;  // [slot][padded][128]
  static constexpr int kQueryBytes = kPadded * kDim;                       // a row's queries
  // A slot a row of the unit, rounded up to whole batches (score_unit reads a batch's slots)
  static constexpr int kBatch = unit_batch(kHeadTiles, kGroup);
  static constexpr int kQuerySlots = (kGroup + kBatch - 1) / kBatch * kBatch;
  static constexpr int kScales = kQueries + kQuerySlots * kQueryBytes;     // [stage][64] x 4 B
  static constexpr int kBars = kScales + kRingStages * kItemPools * 4;      // full, empty
  static constexpr int kFlags = kBars + 2 * 8 * kRingStages;               // s32[stage][4]
  static constexpr int kWeights = kFlags + 4 * kRingStages * kConsumerWarps;  // f32[group][padded]
  static constexpr int kRowTables = kWeights + (kGroup > 1 ? kGroup * kPadded * 4 : 0);
  static_assert(kQueries % kAtom == 0 && kQueryBytes % kAtom == 0 && kScales % 16 == 0 &&
                kBars % 8 == 0 && kWeights % 16 == 0);
  static constexpr size_t bytes(int32_t rows) {  // + slack to align the base
    return kAtom + kRowTables + RowTables<kGroup>::bytes(rows);
  }
};

// Pool `pool`'s score v into `out` (its address in a row of n pools); past them, -inf where
// the logits are filled to the width.
__device__ __forceinline__ void write_pool(const LogitsArgs& a, float* out, int32_t pool,
                                           int32_t n, float v) {
  if (pool < n) *out = v;
  else if (a.fill && pool < a.width) *out = -INFINITY;
}

// A batch's scores, kQuadPer<2 * kBatch> a lane after quad_sum (slot s: row s / 2, pool
// g + 8 * (s % 2); lane t from slot t * kPer): a thread computes one row's address and
// stores its scores. n: the rows' written pools (written_pools).
template <int kBatch>
__device__ __forceinline__ void write_batch(const LogitsArgs& a, int row0,
                                            const int32_t (&n)[kBatch], int32_t pool_g, int t,
                                            const float (&v)[kQuadPer<2 * kBatch>]) {
  constexpr int kSlots = 2 * kBatch, kPer = kQuadPer<kSlots>;
  static_assert(kPer <= 2);  // a lane's slots (from an even one at 2): one row
  const int first = t * kPer;
  if (first >= kSlots) return;
  const int b = kBatch == 1 ? 0 : first / 2;
  int32_t nb = n[0];
#pragma unroll
  for (int c = 1; c < kBatch; ++c)
    if (b == c) nb = n[c];
  if (nb < 0) return;  // a row whose logits are not written
  const int32_t pool = pool_g + 8 * (first % 2);
  float* out = a.logits + static_cast<int64_t>(row0 + b) * a.width + pool;
#pragma unroll
  for (int i = 0; i < kPer; ++i) write_pool(a, out + 8 * i, pool + 8 * i, nb, v[i]);
}

// This lane's scale for slot s of quad_sum's (pool g where s is even, g + 8 where odd).
__device__ __forceinline__ float slot_scale(int s, float scale_lo, float scale_hi) {
  return s % 2 ? scale_hi : scale_lo;
}

// An item's scores against kN / 8 groups of 8 query rows (one row's padded heads, or the
// heads of consecutive rows of a unit, whose queries lie one after another): d[4 j + i] is
// column group j's fragment, so a row's are the 4 * kHeadTiles after its first group's.
template <int kN>
__device__ __forceinline__ void wgmma_item(float (&d)[kN / 2], uint32_t keys,
                                           uint32_t queries) {
  const uint64_t a = wgmma::desc(keys), b = wgmma::desc(queries);
#pragma unroll
  for (int k = 0; k < kDim / 32; ++k)
    wgmma::mma_e4m3<kN>(d, wgmma::advance(a, 32 * k), wgmma::advance(b, 32 * k));
}

// Row r + j's pools whose logits are written, or -1: a row past its unit (j >= rows), or
// one with no logits to write (the select path's skipped rows). Taken once a unit, when the
// consumers move to it: a row scores an item whose first pool is below this.
template <int kGroup>
__device__ __forceinline__ int32_t written_pools(const LogitsArgs& a,
                                                 const RowTables<kGroup>& tables, int r, int j,
                                                 int rows) {
  if (j >= rows) return -1;
  const int32_t n = tables.pools[r + j];
  return a.fill || n > a.skip_upto ? n : -1;
}

// A unit's rows (kGroup > 1) scored from one stage, kBatch rows at a time: one wgmma chain
// whose N spans the batch's rows (their query slots are consecutive), waited for once (64
// accumulator registers a thread). Each output column is its own dot product from +0
// whatever the N, and each row's head_sum the same, so its logits are the bits it has
// alone. The whole batch is scored, also a row past the unit or with nothing in this item
// (its result is not used; its slot holds stale bytes): a wgmma on a path of its own makes
// ptxas serialize every wgmma of the kernel. The stage is released after the unit's last
// wgmma has completed.
template <int kHeadTiles, int kGroup>
__device__ __forceinline__ void score_unit(const LogitsArgs& a, const int32_t (&unit_n)[kGroup],
                                           int r, int rows, int32_t first, int32_t pool_g, int t,
                                           bool have, uint32_t keys, uint32_t queries,
                                           const float* weights, float scale_lo,
                                           float scale_hi, uint32_t empty) {
  constexpr int kPadded = 8 * kHeadTiles, kQueryBytes = kPadded * kDim;
  constexpr int kBatch = unit_batch(kHeadTiles, kGroup), kFragment = 4 * kHeadTiles;
#pragma unroll
  for (int j0 = 0; j0 < kGroup; j0 += kBatch) {
    if (j0 >= rows) break;
    // Rows with nothing in this item (or none to write: n -1) need no wgmma (the same in
    // the whole warpgroup).
    int32_t n[kBatch];
    bool any = false;
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      n[b] = j0 + b < kGroup ? unit_n[j0 + b] : -1;
      any |= first < n[b];
    }
    constexpr int kPer = kQuadPer<2 * kBatch>;
    float v[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) v[i] = -INFINITY;
    if (any) {
      float d[kBatch * kFragment];
#pragma unroll
      for (int i = 0; i < kBatch * kFragment; ++i) d[i] = 0.f;
      wgmma::fence();
      wgmma_item<kBatch * kPadded>(d, keys, queries + j0 * kQueryBytes);
      wgmma::commit();
      wgmma::wait();
      float sums[2 * kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        float w0[kHeadTiles], w1[kHeadTiles];
        const float* wr = weights + (j0 + b) % kGroup * kPadded + 2 * t;
#pragma unroll
        for (int i = 0; i < kHeadTiles; ++i) {
          const float2 w = *reinterpret_cast<const float2*>(wr + 8 * i);
          w0[i] = w.x;
          w1[i] = w.y;
        }
        head_sum<kHeadTiles>(reinterpret_cast<const float(&)[kFragment]>(d[b * kFragment]),
                             w0, w1, sums[2 * b], sums[2 * b + 1]);
      }
      float mine[kPer];
      quad_sum<2 * kBatch>(sums, t, mine);
      // A tile not copied scores -inf; a pool past its row's pools is not written with it.
#pragma unroll
      for (int i = 0; i < kPer; ++i)
        if (have) v[i] = mine[i] * slot_scale(t * kPer + i, scale_lo, scale_hi);
    }
    if (j0 + kBatch >= rows) bulk::arrive(empty);  // the stage's reads are done
    write_batch<kBatch>(a, r + j0, n, pool_g, t, v);
  }
}

template <int kHeadTiles, int kGroup>
__global__ void __launch_bounds__(kLogitsThreads) mqa_logits_kernel(
    const LogitsArgs a, const __grid_constant__ CUtensorMap keys_map) {
  using L = LogitsLayout<kHeadTiles, kGroup>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t raw = bulk::smem_address(smem_raw);
  unsigned char* const smem = smem_raw + ((kAtom - raw % kAtom) % kAtom);
  const uint32_t base = bulk::smem_address(smem);
  const RowTables<kGroup> tables(reinterpret_cast<int32_t*>(smem + L::kRowTables), a.rows);
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
  // The row tables and the first round's pages read only indices (row lengths, requests,
  // the page table), which no kernel of the chain writes: before the PDL wait, so that they
  // overlap the predecessor where one FFI call launches it (indexer_update_select's epilogue).
  const ItemRange range = cta_items<kLogitsThreads, kGroup>(a, tables);  // barriers inside
  const int32_t begin = range.begin, end = range.end;

  if (warp == kConsumerWarps) {
    // Producer. Round by round, lane L takes tile L % 4 of item round + L / 4: its page
    // (one lookup per lane, all in flight together), then, item by item, the lanes of that
    // item wait for the stage to be free and issue their copies. The next round's pages are
    // looked up before this round's copies wait for stages: their loads overlap the wait.
    const int tile = lane % kConsumerWarps;
    const int64_t page_bytes = static_cast<int64_t>(a.page.d) * kEntryBytes;
    int r = range.row;
    const auto look_up = [&](int32_t round) {
      const int32_t item = round + lane / kConsumerWarps;
      TileSource at{-1, 0};
      int row = r;
      if (item < end) at = tile_source(a, tables, item, tile, row);
      r = __reduce_max_sync(0xffffffffu, row);
      return at;
    };
    TileSource next = look_up(begin);
    pdl_wait();  // the K cache (the update's new entries)
    for (int32_t round = begin; round < end; round += kLookahead) {
      const TileSource at = next;
      if (round + kLookahead < end) next = look_up(round + kLookahead);
      const bool read = readable(a, at);
      for (int i = 0; i < kLookahead && round + i < end; ++i) {
        const int32_t k = round + i - begin;
        const int s = k % kRingStages;
        if (k >= kRingStages) bulk::wait(empty + 8 * s, (k / kRingStages - 1) & 1);
        if (lane / kConsumerWarps == i) {
          copied[s * kConsumerWarps + tile] = read;
          const uint32_t bar = full + 8 * s;
          bulk::arrive_expect(bar, read ? kTileBytes + kTileScaleBytes : 0);
          if (read) {
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
    // Consumers: one warpgroup, every item together; warp w finishes pools 16w.. of it,
    // for each row of the item's unit (score_unit where kGroup > 1) from the same stage: a
    // row's scores are computed as they would be alone (its own wgmma chain and head_sum),
    // so they do not depend on the unit.
    pdl_wait();  // the queries and weights
    const int g = lane >> 2, t = lane & 3;
    int r = range.row, row = -1, rows = 1;
    int32_t unit_n[kGroup];                // the unit's rows' written_pools
    float w0[kHeadTiles], w1[kHeadTiles];  // kGroup == 1: the row's weights, held
    float* const weights = reinterpret_cast<float*>(smem + L::kWeights);
    const uint32_t queries = base + L::kQueries;
    for (int32_t item = begin; item < end; ++item) {
      const int32_t k = item - begin;
      const int s = k % kRingStages;
      while (first_item[r + 1] <= item) ++r;
      if (r != row) {
        // The unit's queries into shared memory, swizzled: 16-byte chunk c of head h at
        // chunk c ^ (h % 8) of its 128-byte row; with kGroup > 1 its weights too. Every
        // consumer thread is past its last wgmma on the old ones (each waited for its group)
        // before any overwrites them. Asynchronous copies: a thread's are all in flight at
        // once, where a load into registers and its store cost a round trip each.
        if (row >= 0) bulk::named_sync(1, kConsumerWarps * kWarp);
        row = r;
        rows = tables.rows_of(r);
#pragma unroll
        for (int j = 0; j < kGroup; ++j) unit_n[j] = written_pools(a, tables, r, j, rows);
        for (int j = 0; j < rows; ++j) {
          const uint8_t* qrow = a.q + static_cast<int64_t>(r + j) * L::kPadded * kDim;
          for (int c = threadIdx.x; c < L::kPadded * (kDim / 16); c += kConsumerWarps * kWarp) {
            const int h = c / (kDim / 16), chunk = c % (kDim / 16);
            bulk::copy16(queries + j * L::kQueryBytes + h * kDim + ((chunk ^ (h % 8)) * 16),
                         qrow + 16 * c);
          }
          if constexpr (kGroup > 1) {
            const float* wr = a.w_out + static_cast<int64_t>(r + j) * L::kPadded;
            for (int c = threadIdx.x; c < L::kPadded; c += kConsumerWarps * kWarp)
              bulk::copy4(base + L::kWeights + 4 * (j * L::kPadded + c), wr + c);
          }
        }
        if constexpr (kGroup == 1) {
#pragma unroll
          for (int j = 0; j < kHeadTiles; ++j) {
            const float* wr = a.w_out + static_cast<int64_t>(r) * L::kPadded + 8 * j + 2 * t;
            w0[j] = __ldg(wr);
            w1[j] = __ldg(wr + 1);
          }
        }
        bulk::wait_copies();
        bulk::fence_proxy_async();  // the copies' writes, before wgmma reads them
        bulk::named_sync(1, kConsumerWarps * kWarp);
      }
      const int32_t first = (item - first_item[r]) * kItemPools;  // the item's first pool
      const int32_t p0 = first + warp * kWarpPools;
      bulk::wait(full + 8 * s, (k / kRingStages) & 1);
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
      if constexpr (kGroup > 1) {
        score_unit<kHeadTiles, kGroup>(a, unit_n, r, rows, first, p0 + g, t, have,
                                       base + L::kKeys + s * kConsumerWarps * kTileBytes,
                                       queries, weights, scale_lo, scale_hi, empty + 8 * s);
      } else {  // one row
        // A row with none in this item, or none to write: no wgmma (the same branch in the
        // whole warpgroup).
        const int32_t n = unit_n[0];
        float v[1] = {-INFINITY};
        if (first < n) {
          float d[4 * kHeadTiles];
#pragma unroll
          for (int i = 0; i < 4 * kHeadTiles; ++i) d[i] = 0.f;
          wgmma::fence();
          wgmma_item<L::kPadded>(d, base + L::kKeys + s * kConsumerWarps * kTileBytes, queries);
          wgmma::commit();
          wgmma::wait();
          bulk::arrive(empty + 8 * s);  // the stage's reads are done
          float sums[2];
          head_sum<kHeadTiles>(d, w0, w1, sums[0], sums[1]);
          quad_sum<2>(sums, t, v);  // lane t < 2: pool g + 8t
          v[0] = have ? v[0] * slot_scale(t, scale_lo, scale_hi) : -INFINITY;
        } else {
          bulk::arrive(empty + 8 * s);
        }
        write_batch<1>(a, r, {n}, p0 + g, t, v);
      }
    }
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
template <int kHeadTiles, int kGroup>
cudaError_t launch_logits_as(cudaStream_t stream, bool pdl, const LogitsArgs& args) {
  CUtensorMap map{};  // a cache of no pages is never read: no map to encode
  if (args.pages > 0)
    if (cudaError_t err = keys_tensor_map(args, &map); err != cudaSuccess) return err;
  const auto kernel = mqa_logits_kernel<kHeadTiles, kGroup>;
  using L = LogitsLayout<kHeadTiles, kGroup>;
  // The row tables beside the ring at the most rows (LOGITS_MAX_ROWS) still fit a CTA.
  static_assert(L::bytes(limits::kLogitsMaxRows) <= kOptinSmem);
  const size_t smem = L::bytes(args.rows);
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

// LOGITS_HEADS in tiles of 8 heads (the wgmma's N = the padded heads).
template <int kGroup>
cudaError_t launch_logits_grouped(cudaStream_t stream, bool pdl, const LogitsArgs& args,
                                  int32_t padded) {
  constexpr int kFew = limits::kLogitsHeads[0] / 8, kMany = limits::kLogitsHeads[1] / 8;
  return padded == limits::kLogitsHeads[1] ? launch_logits_as<kMany, kGroup>(stream, pdl, args)
                                           : launch_logits_as<kFew, kGroup>(stream, pdl, args);
}

// Units of args.group rows (2..LOGITS_GROUP_ROWS), each its own instantiation: score_unit
// issues a whole batch of chains, so a unit narrower than kGroup would pay for rows it has not.
template <int kGroup = limits::kLogitsGroupRows>
cudaError_t launch_logits_units(cudaStream_t stream, bool pdl, const LogitsArgs& args,
                                int32_t padded) {
  if constexpr (kGroup > 2)
    if (args.group < kGroup) return launch_logits_units<kGroup - 1>(stream, pdl, args, padded);
  return launch_logits_grouped<kGroup>(stream, pdl, args, padded);
}

// Units where the rows come as requests of group > 1 rows (args.group), else one row at a
// time.
cudaError_t launch_logits(cudaStream_t stream, bool pdl, const LogitsArgs& args,
                          int32_t padded) {
  return args.group > 1 ? launch_logits_units(stream, pdl, args, padded)
                        : launch_logits_grouped<1>(stream, pdl, args, padded);
}

}  // namespace
}  // namespace glm5
