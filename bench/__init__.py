"""Benchmark every glm5_jax op at GLM-5.3-Flash decode shapes on one GPU.

  python -m bench --out BENCHMARKS.json --md BENCHMARKS.md [--quick] [--ops a,b]
  python -m bench --quick --out /tmp/b.json --md /tmp/b.md   # CPU: --cpu-smoke sizes
  python -m bench --render BENCHMARKS.json                   # report + plot from rows

Run from the repository root (it imports glm5_jax from the checkout, or the installed
package). Variants per shape: "reference" = the public op with GLM5_JAX_KERNELS=0
(pure JAX under jit), "kernel" = the public op with its CUDA kernel for every op in
glm5_jax.KERNEL_TARGETS (GPU with the CUDA module only), plus the stock op order
as Triton kernels and other ways to write an op (bench/variants.py, bench/stock.py).

Method (bench/harness.py). One jitted function holds an unrolled chain of N calls of
the op, written out one after the other (one executable, one command buffer), cycling
R input sets: W_cat and logits rotated past the 60 MB L2, caches >= 1 GB donated and
threaded through the calls, stateless calls ordered by optimization barriers on the
previous call's outputs (or with --data-dep by a run-time-zero scalar). There is no
device loop: XLA runs a `while` (lax.fori_loop) on the host, about 12 µs per iteration
on the H200, which is what made small ops (an empty FFI call 1.5-1.75 µs) read high in
the numbers taken before this method. N grows from R until a run takes >= run_s, and
runs are dispatched back to back with one queued, so the host dispatch hides behind
the device (each row records R, N and the host time per dispatch). device_us = median
over reps runs of the interval between run completions / N, nothing subtracted (the
calibration rows give the copy bandwidth and the per-call cost of an empty XLA op,
Pallas kernel and FFI call). floor_us = max(minimum bytes / measured copy bandwidth,
FLOPs / 790 TFLOP/s) (bench/workloads.py). Each variant is first checked bit for bit
against the reference (`exact`). Whole jitted steps (e.g. 11 layers) are timed by
harness.time_step. Compilations go to a persistent cache (--cache-dir).

Layout: sizes (constants, run sizes, inputs), workloads (per-op workloads and their
floors), harness (timing), variants + stock + pallas_ops (ways to run an op), driver
(checks and times a workload in each variant), groups (what a run measures:
calibration, per_op, sweep; add a group there), report (markdown + plot), __main__.
"""
