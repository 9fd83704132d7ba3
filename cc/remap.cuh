// The quads of expanded token ids and their block-table remap (SPEC §6, §7), shared by
// expand_pools / expand_and_remap (expand.cu) and select_slots' top-k (select.cu), which
// writes a selected pool's slots where select_pools writes its id.
//
// Integer arithmetic is int32 with wraparound, as in the reference (pid * 4 of a huge pool
// id, block_table * stride_rows): done on uint32 and converted back.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "common.h"
#include "constants.h"

namespace glm5 {

__host__ __device__ __forceinline__ int32_t wrap_add(int32_t a, int32_t b) {
  return static_cast<int32_t>(static_cast<uint32_t>(a) + static_cast<uint32_t>(b));
}

__host__ __device__ __forceinline__ int32_t wrap_mul(int32_t a, int32_t b) {
  return static_cast<int32_t>(static_cast<uint32_t>(a) * static_cast<uint32_t>(b));
}

__host__ __device__ __forceinline__ int4 none4() { return make_int4(-1, -1, -1, -1); }

// v, v + 1, v + 2, v + 3 (int32, wrapping).
__host__ __device__ __forceinline__ int4 run4(int32_t v) {
  return make_int4(v, wrap_add(v, 1), wrap_add(v, 2), wrap_add(v, 3));
}

// The trailing incomplete pool of a row: tokens start .. start + count - 1, count in [0, 3].
// n = pos + seq_offset (int32, wrapping); n <= 0 (padding) has no tail.
struct Tail {
  int32_t start;
  int32_t count;
};

__host__ __device__ __forceinline__ Tail tail_of(int32_t pos, int32_t seq_offset) {
  const int32_t n = wrap_add(pos, seq_offset);
  if (n <= 0) return {0, 0};
  const int32_t start = n & ~(kPool - 1);   // n // 4 * 4 for n > 0
  return {start, n - start};
}

// The tail quad: first + j for j < count, then -1 (its last column is always -1).
__host__ __device__ __forceinline__ int4 tail_quad(int32_t first, int32_t count) {
  return make_int4(count > 0 ? first : -1, count > 1 ? wrap_add(first, 1) : -1,
                   count > 2 ? wrap_add(first, 2) : -1, -1);
}

// Writes quad q of a row: one 16-byte store (kVector: width % 4 == 0, row 16-byte aligned,
// and callers keep q < width / 4) or the quad's in-bounds columns one by one.
template <bool kVector>
__host__ __device__ __forceinline__ void store_quad(int32_t* row_out, int q, int width, int4 v) {
  int32_t* p = row_out + static_cast<int64_t>(kPool) * q;
  if constexpr (kVector) {
    *reinterpret_cast<int4*>(p) = v;
  } else {
    const int c = kPool * q;
    if (c < width) p[0] = v.x;
    if (c + 1 < width) p[1] = v.y;
    if (c + 2 < width) p[2] = v.z;
    if (c + 3 < width) p[3] = v.w;
  }
}

// The block-table mapping of one request's tokens. `table` is the request's row; it is
// only dereferenced for 0 <= block < max_blocks.
struct Remap {
  const int32_t* table;
  int64_t max_blocks;
  Divisor block_size;
  int32_t stride_rows;
  int32_t max_block;  // the largest entry that names a block (the max_block attribute)

  // Physical slot of the first of the 4 tokens first_token .. first_token + 3
  // (first_token % 4 == 0, so all 4 share its block); false when they are dropped
  // (a negative token id, a block past the table, or an entry that names no block).
  __device__ __forceinline__ bool slot(int32_t first_token, int32_t* out) const {
    int32_t entry;
    if (!load(first_token, &entry)) return false;
    *out = place(entry, first_token);
    return true;
  }

  // slot() in two halves: load() reads the entry (false where slot() drops the tokens: no
  // load for a token outside the table, the loaded entry for one that names no block) and
  // place() makes the slot of the loaded entry.
  __device__ __forceinline__ bool load(int32_t first_token, int32_t* entry) const {
    if (first_token < 0) return false;
    const int32_t block = block_size.div(first_token);
    if (block >= max_blocks) return false;
    *entry = __ldg(table + block);
    // One unsigned compare: a negative entry is above max_block as uint32.
    return static_cast<uint32_t>(*entry) <= static_cast<uint32_t>(max_block);
  }
  __device__ __forceinline__ int32_t place(int32_t entry, int32_t first_token) const {
    return wrap_add(wrap_mul(entry, stride_rows), block_size.mod(first_token));
  }
};

// The handlers' checks of a remap (expand_and_remap, select_slots) of G = `groups` pool
// ids a row into rows of `width` slots (the ops check the same at trace time). max_block,
// the largest entry that names a block, is the ops' (max_block_id in
// glm5_jax/reference/expand.py, SPEC §12); here only what the kernels rely on: the slots of
// an entry in [0, max_block] fit int32.
inline ffi::Error check_remap(const Check& check, int64_t requests, int64_t max_blocks,
                              int64_t block_size, int64_t stride_rows, int64_t max_block,
                              int64_t groups, int64_t width) {
  if (width < groups * kPool + kPool - 1) return check.fail("out width < 4 * G + 3");
  if (width > kI32Max - kPool) return check.fail("width too large");
  if (requests <= 0 || max_blocks <= 0) return check.fail("block_table is empty");
  if (block_size <= 0 || block_size % kPool != 0 || block_size > kI32Max)
    return check.fail("block_size must be a positive multiple of 4 (int32)");
  if (stride_rows <= 0 || stride_rows > kI32Max)
    return check.fail("stride_rows must be in [1, 2^31)");
  if (max_block < 0 || max_block > kI32Max || max_block * stride_rows + block_size - 1 > kI32Max)
    return check.fail("max_block must name slots that fit int32");
  return ffi::Error::Success();
}

}  // namespace glm5
