// expand_pools (SPEC §6) and the fused expand + sparse-MLA remap (SPEC §6 + §7).
//
// Both kernels see an output row as quads: columns [4q, 4q + 4), the last one partial when
// width % 4 != 0. A pool is four consecutive tokens 4*pid .. 4*pid + 3, so it fills exactly
// one quad, and since block_size % 4 == 0 its tokens share one KV block: a pool is valid or
// invalid as a whole. The layout of a row with G pool ids:
//   expand_pools, and expand_and_remap with compact=False:
//     quad q < G: pool q (token ids, or remapped slots, or -1 x 4);
//     quad G: the trailing incomplete pool (3 columns) and a -1; quads > G: -1 x 4.
//   expand_and_remap with compact=True (H = number of valid pools of the row):
//     quads < H: the valid pools in rank order; quad H: the tail; quads > H: -1 x 4.
// Every quad is written by exactly one thread with one 16-byte store (4 scalar stores when
// the row is not 16-byte aligned), so a row is written completely and without overlap.
//
// Integer arithmetic is int32 with wraparound, as in the reference (remap.cuh).
#include <algorithm>
#include <cstdint>
#include <string>

#include "common.h"
#include "constants.h"
#include "handlers.h"
#include "limits.h"
#include "remap.cuh"

namespace glm5 {
namespace {

constexpr int kExpandThreads = 128;   // expand_pools: quads per CTA
constexpr int kMaxGridY = 65535;      // CUDA's limit on gridDim.y
// expand_and_remap: one thread per pool in whole warps (the ballot), one CTA per row.
constexpr int kMinGroups = limits::kRemapGroups[0], kMaxGroups = limits::kRemapGroups[1];
static_assert(kMinGroups % kWarp == 0, "G is whole warps");

// ---------------------------------------------------------------------------------------
// expand_pools: grid (rows, ctas), thread q of a row's quad range writes quad q. Any G.

struct ExpandPoolsArgs {
  const int32_t* pool_ids;    // s32[rows, G]
  const int32_t* seq_lens;    // s32[rows]
  int32_t* out;               // s32[rows, width]
  int groups;                 // G
  int width;                  // >= 4 G + 3
  int32_t seq_offset;
};

template <bool kVector>
__global__ void __launch_bounds__(kExpandThreads) expand_pools_kernel(const ExpandPoolsArgs a) {
  // Inputs are read with __ldg (ld.global.nc, as for the restrict-qualified kernel parameters
  // they were): nvcc does not infer read-only for pointers held in an Args struct.
  const int groups = a.groups, width = a.width;
  const int32_t seq_offset = a.seq_offset;
  pdl_wait();
  pdl_launch_dependents();
  const int64_t row = blockIdx.x;
  const int quads = (width + kPool - 1) / kPool;   // > groups since width >= 4G + 3
  int32_t* row_out = a.out + row * width;
#pragma unroll 1
  for (int q = static_cast<int>(blockIdx.y * kExpandThreads + threadIdx.x); q < quads;
       q += static_cast<int>(gridDim.y * kExpandThreads)) {
    int4 v = none4();
    if (q < groups) {
      const int32_t pid = __ldg(a.pool_ids + row * groups + q);
      if (pid >= 0) v = run4(wrap_mul(pid, kPool));   // no upper bound; wraps like the reference
    } else if (q == groups) {
      const Tail tail = tail_of(__ldg(a.seq_lens + row), seq_offset);
      v = tail_quad(tail.start, tail.count);
    }
    store_quad<kVector>(row_out, q, width, v);
  }
}

// ---------------------------------------------------------------------------------------
// expand_and_remap.

struct ExpandAndRemapArgs {
  const int32_t* pool_ids;      // s32[expanded, G]
  const int32_t* positions;     // s32[expanded]
  const int32_t* req_ids;       // s32[rows]
  const int32_t* block_table;   // s32[requests, max_blocks]
  int32_t* out;                 // s32[rows, width]
  int32_t* counts;              // s32[rows]
  int expanded;                 // rows with pool ids
  int groups;                   // G
  int width;                    // >= 4 G + 3
  int64_t requests;             // block_table rows
  int64_t max_blocks;
  Divisor block_size;
  int32_t stride_rows;
  int32_t max_block;            // the max_block attribute (Remap::max_block)
  int32_t seq_offset;
};

// One CTA per output row, thread g owns pool g (blockDim = groups, groups % 32 == 0, so
// every warp is full for the ballot). Compaction: a valid pool's destination quad is the
// number of valid pools before it = valid pools in earlier warps (shared-memory totals)
// + valid lanes below it in its warp (ballot).
template <bool kCompact, bool kVector>
__global__ void __launch_bounds__(kMaxGroups) expand_and_remap_kernel(const ExpandAndRemapArgs a) {
  // Inputs are read with __ldg (ld.global.nc, as for the restrict-qualified kernel parameters
  // they were): nvcc does not infer read-only for pointers held in an Args struct.
  const int expanded = a.expanded, groups = a.groups, width = a.width;
  const int64_t requests = a.requests, max_blocks = a.max_blocks;
  const Divisor block_size = a.block_size;
  const int32_t stride_rows = a.stride_rows, seq_offset = a.seq_offset;
  __shared__ int warp_valid[kMaxGroups / kWarp];
  pdl_wait();
  pdl_launch_dependents();
  const int row = blockIdx.x;
  const int g = threadIdx.x;
  const int lane = g % kWarp, warp = g / kWarp;
  const int quads = (width + kPool - 1) / kPool;   // > groups since width >= 4G + 3
  int32_t* row_out = a.out + static_cast<int64_t>(row) * width;

  // The row's loads do not depend on each other (the request only gates their use).
  const bool expanded_row = row < expanded;
  const int32_t req = __ldg(a.req_ids + row);
  const int32_t pid =
      expanded_row ? __ldg(a.pool_ids + static_cast<int64_t>(row) * groups + g) : -1;
  const int32_t pos = g == 0 && expanded_row ? __ldg(a.positions + row) : 0;

  // Rows past `expanded` (no pool ids) and rows whose request is outside [0, R) hold no
  // indices: every pool and the tail are dropped, the row is all -1, its count 0.
  const bool has_ids = expanded_row && req >= 0 && req < requests;
  const Remap remap{a.block_table + (has_ids ? req * max_blocks : 0), max_blocks, block_size,
                    stride_rows, a.max_block};

  // pid < 0 is unused; 4 * pid may wrap to a negative token id, which is dropped too. A pool
  // whose table entry names no block is dropped as well (SPEC §12), so the ballot waits on
  // the entry's load; the tail's load is issued before it, the two overlap.
  const int32_t token = wrap_mul(pid, kPool);
  int32_t entry = 0;
  const bool live = has_ids && pid >= 0 && remap.load(token, &entry);
  // Thread 0 issues the tail's load too. The tail tokens start .. start + count - 1 share
  // start's block (start % 4 == 0), so they are kept or dropped together and their
  // compacted columns are their own columns.
  Tail tail_tokens{0, 0};
  int32_t tail_entry = 0;
  bool tail_kept = false;
  if (g == 0 && has_ids) {
    tail_tokens = tail_of(pos, seq_offset);
    tail_kept = tail_tokens.count > 0 && remap.load(tail_tokens.start, &tail_entry);
  }

  const unsigned ballot = __ballot_sync(0xffffffffu, live);
  if (lane == 0) warp_valid[warp] = __popc(ballot);
  __syncthreads();
  // Lane w reads warp w's total (groups / 32 <= 32 of them); two warp reductions give the
  // valid pools in earlier warps and in the whole row (not a loop of dependent shared loads).
  const int n = lane < groups / kWarp ? warp_valid[lane] : 0;
  const int prior = __reduce_add_sync(0xffffffffu, lane < warp ? n : 0);
  const int valid = __reduce_add_sync(0xffffffffu, n);

  // Quads [0, tail_at): pools; tail_at: the tail; (tail_at, quads): -1.
  const int tail_at = kCompact ? valid : groups;
  const int32_t first = live ? remap.place(entry, token) : 0;
  if constexpr (kCompact) {
    if (live) {
      const int below = __popc(ballot & ((1u << lane) - 1u));
      store_quad<kVector>(row_out, prior + below, width, run4(first));
    }
  } else {
    store_quad<kVector>(row_out, g, width, live ? run4(first) : none4());
  }
  if (g == 0) {
    const int4 tail = tail_kept ? tail_quad(remap.place(tail_entry, tail_tokens.start),
                                            tail_tokens.count)
                                : none4();
    store_quad<kVector>(row_out, tail_at, width, tail);
    a.counts[row] = kPool * valid + (tail_kept ? tail_tokens.count : 0);
  }
#pragma unroll 1
  for (int q = tail_at + 1 + g; q < quads; q += groups) {
    store_quad<kVector>(row_out, q, width, none4());
  }
}

// ---------------------------------------------------------------------------------------
// Handlers: shapes are checked again here (the primitive checks them at trace time); the
// launch configuration depends on shapes only (command-buffer contract).

ffi::Error ExpandPoolsImpl(cudaStream_t stream, ffi::BufferR2<ffi::S32> pool_ids,
                           ffi::BufferR1<ffi::S32> seq_lens, ffi::ResultBufferR2<ffi::S32> out,
                           int64_t seq_offset, bool pdl) {
  const Check check{targets::glm5_expand_pools};
  const int64_t rows = pool_ids.dimensions()[0], groups = pool_ids.dimensions()[1];
  const int64_t width = out->dimensions()[1];
  if (out->dimensions()[0] != rows) return check.fail("out rows != pool_ids rows");
  if (seq_lens.dimensions()[0] != rows) return check.fail("seq_lens length != pool_ids rows");
  if (width < groups * kPool + kPool - 1) return check.fail("out width < 4 * G + 3");
  if (!fits_i32(seq_offset)) return check.fail("seq_offset does not fit int32");
  if (rows == 0) return ffi::Error::Success();
  if (rows > kI32Max || width > kI32Max - kPool) return check.fail("rows or width too large");

  ExpandPoolsArgs args;
  args.pool_ids = pool_ids.typed_data();
  args.seq_lens = seq_lens.typed_data();
  args.out = out->typed_data();
  args.groups = static_cast<int>(groups);
  args.width = static_cast<int>(width);
  args.seq_offset = static_cast<int32_t>(seq_offset);

  const int64_t quads = (width + kPool - 1) / kPool;
  const int64_t ctas = std::min<int64_t>((quads + kExpandThreads - 1) / kExpandThreads, kMaxGridY);
  auto kernel = width % kPool == 0 && aligned(args.out, 16) ? expand_pools_kernel<true>
                                                            : expand_pools_kernel<false>;
  cudaError_t err = launch(kernel, dim3(static_cast<unsigned>(rows), static_cast<unsigned>(ctas)),
                           dim3(kExpandThreads), 0, stream, pdl, args);
  return check.cuda(err);
}

ffi::Error ExpandAndRemapImpl(cudaStream_t stream, ffi::BufferR2<ffi::S32> pool_ids,
                              ffi::BufferR1<ffi::S32> positions, ffi::BufferR1<ffi::S32> req_ids,
                              ffi::BufferR2<ffi::S32> block_table,
                              ffi::ResultBufferR2<ffi::S32> out,
                              ffi::ResultBufferR1<ffi::S32> counts, int64_t block_size,
                              int64_t stride_rows, int64_t max_block, int64_t seq_offset,
                              bool compact, bool pdl) {
  const Check check{targets::glm5_expand_and_remap};
  const int64_t expanded = pool_ids.dimensions()[0], groups = pool_ids.dimensions()[1];
  const int64_t rows = req_ids.dimensions()[0];
  const int64_t requests = block_table.dimensions()[0];
  const int64_t max_blocks = block_table.dimensions()[1];
  const int64_t width = out->dimensions()[1];
  if (positions.dimensions()[0] != expanded)
    return check.fail("positions length != pool_ids rows");
  if (out->dimensions()[0] != rows || counts->dimensions()[0] != rows)
    return check.fail("out/counts rows != req_ids length");
  // The op routes other G to the reference (its kernel_supports); this only validates.
  if (groups % kWarp != 0 || groups < kMinGroups || groups > kMaxGroups)
    return check.fail("pool_ids has G = " + std::to_string(groups) + " pools per row; the " +
                      "kernel needs G % " + std::to_string(kWarp) + " == 0 and " +
                      std::to_string(kMinGroups) + " <= G <= " + std::to_string(kMaxGroups));
  if (ffi::Error err = check_remap(check, requests, max_blocks, block_size, stride_rows,
                                   max_block, groups, width);
      err.failure())
    return err;
  if (!fits_i32(seq_offset)) return check.fail("seq_offset does not fit int32");
  if (rows == 0) return ffi::Error::Success();
  if (rows > kI32Max || expanded > kI32Max) return check.fail("rows too large");

  ExpandAndRemapArgs args;
  args.pool_ids = pool_ids.typed_data();
  args.positions = positions.typed_data();
  args.req_ids = req_ids.typed_data();
  args.block_table = block_table.typed_data();
  args.out = out->typed_data();
  args.counts = counts->typed_data();
  args.expanded = static_cast<int>(expanded);
  args.groups = static_cast<int>(groups);
  args.width = static_cast<int>(width);
  args.requests = requests;
  args.max_blocks = max_blocks;
  args.block_size = Divisor(static_cast<int32_t>(block_size));
  args.stride_rows = static_cast<int32_t>(stride_rows);
  args.max_block = static_cast<int32_t>(max_block);
  args.seq_offset = static_cast<int32_t>(seq_offset);

  const bool vector = width % kPool == 0 && aligned(args.out, 16);
  auto kernel = compact ? (vector ? expand_and_remap_kernel<true, true>
                                  : expand_and_remap_kernel<true, false>)
                        : (vector ? expand_and_remap_kernel<false, true>
                                  : expand_and_remap_kernel<false, false>);
  cudaError_t err = launch(kernel, dim3(static_cast<unsigned>(rows)),
                           dim3(static_cast<unsigned>(groups)), 0, stream, pdl, args);
  return check.cuda(err);
}

}  // namespace
}  // namespace glm5

// BufferR<n> aliases: a comma inside <> would split the macro argument.
XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5ExpandPools, glm5::ExpandPoolsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::BufferR2<ffi::S32>>()     // pool_ids
                                  .Arg<ffi::BufferR1<ffi::S32>>()     // seq_lens
                                  .Ret<ffi::BufferR2<ffi::S32>>()     // out
                                  .Attr<int64_t>("seq_offset")        // seq_offset
                                  .Attr<bool>("pdl"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm5ExpandAndRemap, glm5::ExpandAndRemapImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::BufferR2<ffi::S32>>()     // pool_ids
                                  .Arg<ffi::BufferR1<ffi::S32>>()     // positions
                                  .Arg<ffi::BufferR1<ffi::S32>>()     // req_ids
                                  .Arg<ffi::BufferR2<ffi::S32>>()     // block_table
                                  .Ret<ffi::BufferR2<ffi::S32>>()     // out
                                  .Ret<ffi::BufferR1<ffi::S32>>()     // counts
                                  .Attr<int64_t>("block_size")        // block_size
                                  .Attr<int64_t>("stride_rows")       // stride_rows
                                  .Attr<int64_t>("max_block")         // max_block
                                  .Attr<int64_t>("seq_offset")        // seq_offset
                                  .Attr<bool>("compact")              // compact
                                  .Attr<bool>("pdl"),
                              {ffi::Traits::kCmdBufferCompatible});
