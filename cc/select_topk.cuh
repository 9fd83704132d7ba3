// The select path's top-k (SPEC §5c): pool_topk_kernel, one CTA per row, and the device
// code the cluster kernel shares with it (select_topk_cluster.cuh: pool_topk_parts_kernel
// and the launch), for glm5_pool_topk, glm5_select_pools and glm5_select_slots
// (cc/select.cu).
//
// Top-k: one CTA per row (512 or 1024 threads by the logits width), or a cluster of 2-8
// CTAs per row at few rows of many pools and always past one CTA's registers (32,768
// pools); exact and deterministic by construction:
// order-preserving 32-bit keys in registers, a candidate bound that drops most of them, the
// kept ones gathered in id order, radix select of the threshold with 11-bit digits that
// start below the bits the bound and the row's largest key share, then one prefix sum of
// per-thread counts that places the selected pool ids in ascending id order (ties at the
// threshold by ascending id). No atomic decides an order; shared-memory atomics only count.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common.h"
#include "constants.h"
#include "remap.cuh"
#include "select.cuh"

namespace glm5 {
namespace {

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
  int32_t max_block;           // the max_block attribute (Remap::max_block)
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
// `cluster`: the CTAs of a cluster wrote the quads, after whose last barrier this reads them
// (their drops are not known here, so the row is always read).
template <int kThreads>
__device__ __forceinline__ void close_holes(const TopkArgs& a, int r, const RowOut& o,
                                            int32_t selected, TopkShared& sh,
                                            bool cluster = false) {
  // also orders the quads' stores before the reads
  if (!__syncthreads_or(o.dropped || cluster)) return;
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

// The end of row r's top-k (a.k pools selected) in the CTA that wrote it: its count, and
// for select_slots the holes closed (close_holes; `cluster` as there).
template <int kThreads>
__device__ __forceinline__ void finish_row(const TopkArgs& a, int r, const RowOut& o,
                                           TopkShared& sh, bool cluster = false) {
  finish_count(a, r, o);
  if (o.slots()) close_holes<kThreads>(a, r, o, a.k, sh, cluster);
}

// Gathering the keys left after the bound pays where it cuts the keys per thread at least
// 4-fold (launch_topk's 1024-thread shapes: 8-32 keys per thread become 2).
template <int kThreads, int kPer>
constexpr bool kCompact = kPer >= 4 * (kTopkCandidates / kThreads);

// Where radix_select_emit's keys live. CtaScope: one CTA's. ClusterScope
// (select_topk_cluster.cuh): every CTA of a cluster runs it on its own keys (a row wider
// than one CTA's registers): a digit's histogram is the sum of the CTAs' (each thread reads
// its bins in every CTA's shared memory after a cluster barrier, so every CTA finds the same
// digits), a CTA's ids come after the lower CTAs' (their counts, after one more barrier),
// and a last barrier keeps every CTA's shared memory alive until no CTA reads it. A CTA
// clears a histogram only after the next digit's barrier, which every reader of it has
// passed.
struct CtaScope {
  __device__ __forceinline__ void histograms_ready() const { __syncthreads(); }
  __device__ __forceinline__ uint32_t bin(uint32_t* h, int i) const { return h[i]; }
  __device__ __forceinline__ void add_lower_counts(uint32_t, uint32_t&, uint32_t&) const {}
  __device__ __forceinline__ void done() const {}
};


// Radix select of the k-th largest of the CTA's keys (a ClusterScope: the cluster's), then
// the selected ids written to `out` in ascending id order. key[i] (0: no key) has id
// id_of(i), and the ids ascend with (thread, i) across the CTA (with (CTA, thread, i) across
// the cluster); lo and hi are the smallest and largest nonzero keys of them all, and at
// least k keys are nonzero. hist[0] is zero and a barrier separates that from here.
//
// The keys are first taken relative to lo (key - lo + 1: the order and the ties kept, 0
// still "no key"), so the digits cover [lo, hi] linearly. Bit-aligned digits of the keys
// themselves start below the bits lo and hi share, which a range across a power of two
// (0.5 to 3.5: exponents 126 to 128) leaves at bit 31: the first 11-bit digit is then
// 8 exponent and 3 mantissa bits, ~1700 kept keys of a 2048-pool row pile into ~24 bins
// (shared atomics on the same address serialise), and three digits are needed. Relative
// keys spread over the bins, so the threshold's bin mostly holds every key still needed
// after one or two digits (numpy model: fewer digits at the widest rows). It times no
// faster: a digit's barriers and scan, not its atomics, are what it costs. The key array is
// rewritten in place.
//
// The digits (at most kTopkDigitBits each) start below the bits the relative lo and hi
// share. After each digit the selection is "keys whose bits above `shift` exceed the
// prefix, plus the first `remaining` (by id) of those equal to it"; it stops when every key
// equal to the prefix is selected, or at shift 0 (ties at the k-th key, taken by ascending
// id). Shared-memory atomics only count; the order of the output is fixed by one prefix sum
// of per-thread counts.
template <int kThreads, int kSlots, typename IdOf, typename Scope = CtaScope>
__device__ __forceinline__ void radix_select_emit(uint32_t (&key)[kSlots], IdOf id_of,
                                                  uint32_t lo, uint32_t hi, int32_t k,
                                                  const RowOut& out, TopkShared& sh,
                                                  const Scope& scope = Scope()) {
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
  // No digit (every key equal; the same in every thread): the emit's scan below then comes
  // right after the caller's, with no barrier of a digit's between them (block_scan).
  if (bits == 0) __syncthreads();
  while (bits > 0) {
    shift = bits > kTopkDigitBits ? bits - kTopkDigitBits : 0;
    const uint32_t digit_mask = (1u << (bits - shift)) - 1u;
    uint32_t* h = sh.hist[buffer];
#pragma unroll
    for (int i = 0; i < kSlots; ++i)
      if (key[i] != 0u && (bits == 32 || (key[i] >> bits) == (prefix >> bits)))
        atomicAdd(&h[(key[i] >> shift) & digit_mask], 1u);
    scope.histograms_ready();
    // Thread t owns kBinsPerThread bins, thread 0 the highest: the thread whose prefix
    // sum crosses `remaining` holds the digit.
    const int first_bin = kTopkBins - (threadIdx.x + 1) * kBinsPerThread;
    uint32_t mine[kBinsPerThread], sum = 0;
#pragma unroll
    for (int b = 0; b < kBinsPerThread; ++b) sum += mine[b] = scope.bin(h, first_bin + b);
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
  // (counts packed: above in the high half, equal in the low; each <= kTopkCtaPools: one
  // CTA's keys), after the lower CTAs' in a cluster.
  const uint32_t top = prefix >> shift;
  uint32_t gt = 0, eq = 0;
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    if (key[i] == 0u) continue;
    gt += (key[i] >> shift) > top;
    eq += (key[i] >> shift) == top;
  }
  const uint32_t packed = (gt << 16) | eq;
  const Scan scan = block_scan<kThreads>(packed, sh.warp_sums);
  const uint32_t before = scan.incl - packed;
  uint32_t gt_before = before >> 16, eq_before = before & 0xffffu;
  scope.add_lower_counts(scan.total, gt_before, eq_before);
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
  scope.done();
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
// descending (15 dependent shuffles).
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
// ~2000 of a widest row's normal logits (numpy model), the 16th largest per CTA ~1100.
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

// Hands the thread's nonzero keys (key[i] of pool first + i) with their ids to
// put(position, key, id), from position `at`, the thread's exclusive prefix of kept keys: in
// (thread, key) order, so the ids ascend. put stores them, in this CTA's shared memory or,
// by st.async, in CTA 0's (the cluster's gather).
template <int kPer, typename Put>
__device__ __forceinline__ void gather_keys(const uint32_t (&key)[kPer], int32_t first,
                                            uint32_t at, Put put) {
#pragma unroll
  for (int i = 0; i < kPer; ++i)
    if (key[i] != 0u) {
      put(at, key[i], first + i);
      ++at;  // after the call: in its argument the SASS grows
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
      gather_keys<kPer>(key, base, kept.incl - own, [&](uint32_t at, uint32_t v, int32_t id) {
        sh.cand_key[at] = v;
        sh.cand_id[at] = id;
      });
      __syncthreads();
      select_gathered<kThreads>(kept.total, lo, hi, k, out, sh);
      return;
    }
  }
  radix_select_emit<kThreads>(key, [&](int i) { return base + i; }, lo, hi, k, out, sh);
}

// select_slots: the selected pools of a row of n pools that its block table keeps, or -1
// where the table may drop some of a top-k (counted while emitting: RowOut::valid). The
// table keeps pools below table_pools (blocks ascend with the ids): all of a top-k from
// n <= table_pools pools; ids 0..min(n, table_pools)-1 of the causal fill.
__device__ __forceinline__ int64_t slots_kept(const TopkArgs& a, const RowOut& out, int32_t n) {
  const int64_t table_pools = a.slots.max_blocks * a.slots.block_size.d / kPool;
  return out.req < 0             ? 0
         : n <= a.k              ? (n < table_pools ? n : table_pools)
         : n <= table_pools      ? a.k
                                 : -1;
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
    const int64_t kept = slots_kept(a, out, n);
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
  finish_row<kThreads>(a, r, out, sh);
  pdl_launch_dependents();
}

template <int kThreads, int kPer>
cudaError_t launch_topk_as(cudaStream_t stream, bool pdl, const TopkArgs& args) {
  return launch(pool_topk_kernel<kThreads, kPer>, dim3(static_cast<unsigned>(args.rows)),
                dim3(kThreads), 0, stream, pdl, args);
}

}  // namespace
}  // namespace glm5
