// Per-node cost of a CUDA graph: an empty kernel as a kernel node (what XLA records for its
// own fusions) against the same kernel captured into a child graph (what XLA records for
// an FFI call inside a command buffer: CustomCallCmd traces the handler by stream capture
// and adds the result as a cloned child-graph node). Chains of N nodes, replayed; prints
// microseconds per node. Also: the same kernel launched with the PDL attribute inside the
// capture, to see whether PDL changes anything within a graph.
//
//   nvcc -O2 -arch=sm_90a -o /tmp/graph_node_cost scripts/graph_node_cost.cu
//   /tmp/graph_node_cost [N=1000] [replays=20]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                                    \
  do {                                                                                 \
    cudaError_t e_ = (call);                                                           \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call,                \
                   cudaGetErrorString(e_));                                            \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

__global__ void add_one(float* x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  if (threadIdx.x < 8) x[threadIdx.x] += 1.0f;
}

// One empty-ish kernel launch on `stream`, with or without the PDL attribute.
static void launch(cudaStream_t stream, float* x, bool pdl) {
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(1);
  config.blockDim = dim3(32);
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = pdl ? 1 : 0;
  CHECK(cudaLaunchKernelEx(&config, add_one, x));
}

// A graph holding one launch, made by stream capture (as XLA traces an FFI handler).
static cudaGraph_t captured(cudaStream_t stream, float* x, int launches, bool pdl) {
  cudaGraph_t graph;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < launches; ++i) launch(stream, x, pdl);
  CHECK(cudaStreamEndCapture(stream, &graph));
  return graph;
}

// N child-graph nodes in a chain, each a clone of `child`.
static cudaGraph_t chain_of_children(cudaGraph_t child, int n) {
  cudaGraph_t graph;
  CHECK(cudaGraphCreate(&graph, 0));
  cudaGraphNode_t prev = nullptr;
  for (int i = 0; i < n; ++i) {
    cudaGraphNode_t node;
    CHECK(cudaGraphAddChildGraphNode(&node, graph, prev ? &prev : nullptr, prev ? 1 : 0, child));
    prev = node;
  }
  return graph;
}

// Microseconds per node: the median replay of `graph` over `replays`, divided by n.
static double per_node_us(cudaGraph_t graph, cudaStream_t stream, int n, int replays) {
  cudaGraphExec_t exec;
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, end;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&end));
  for (int i = 0; i < 3; ++i) CHECK(cudaGraphLaunch(exec, stream));
  std::vector<float> ms;
  for (int i = 0; i < replays; ++i) {
    CHECK(cudaEventRecord(start, stream));
    CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaEventRecord(end, stream));
    CHECK(cudaEventSynchronize(end));
    float t;
    CHECK(cudaEventElapsedTime(&t, start, end));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(end));
  return 1e3 * ms[ms.size() / 2] / n;
}

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 1000;
  const int replays = argc > 2 ? std::atoi(argv[2]) : 20;
  float* x;
  CHECK(cudaMalloc(&x, 32 * sizeof(float)));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  struct Row {
    const char* name;
    cudaGraph_t graph;
  };
  cudaGraph_t one = captured(stream, x, 1, false);
  cudaGraph_t one_pdl = captured(stream, x, 1, true);
  const Row rows[] = {
      {"kernel nodes (one capture of N launches)", captured(stream, x, n, false)},
      {"kernel nodes with PDL (one capture)", captured(stream, x, n, true)},
      {"child-graph nodes, one kernel each (XLA's FFI call)", chain_of_children(one, n)},
      {"child-graph nodes, one PDL kernel each", chain_of_children(one_pdl, n)},
  };
  std::printf("N = %d nodes, median of %d replays\n", n, replays);
  for (const Row& row : rows)
    std::printf("%-55s %.3f us per node\n", row.name, per_node_us(row.graph, stream, n, replays));
  CHECK(cudaStreamSynchronize(stream));
  float host[8];
  CHECK(cudaMemcpy(host, x, sizeof(host), cudaMemcpyDeviceToHost));
  std::printf("x[0] = %.0f (every node ran: expect %d)\n", host[0],
              (3 + replays) * 4 * n);
  return 0;
}
