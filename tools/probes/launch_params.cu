// Probe: the host cost of one cuLaunchKernel against the size of the kernel's parameter list.
// Not product code (the product's kernels are Rust, rope-kernels/); it tells whether a fused
// kernel's long parameter list (FlashInfer's forms: 109 parameters, 640 bytes; a plain
// rotation: 284 bytes) costs host time at each launch.
// Build and run on the GPU machine:
//   nvcc -O3 -arch=sm_90 -o /tmp/launch_params tools/probes/launch_params.cu -lcuda && /tmp/launch_params
// Each kernel takes one struct of N bytes by value (passed as one buffer through
// CU_LAUNCH_PARAM_BUFFER_POINTER, as rope-host launches) and returns at once; a grid of 40
// blocks of 128 threads. Per size: 20 rounds of 500 launches on one stream, the fastest round,
// sizes interleaved round by round.
#include <cstdio>
#include <cstdint>
#include <chrono>
#include <algorithm>
#include <cuda.h>
#include <cuda_runtime.h>

#define CK(x) do { CUresult e = (x); if (e != CUDA_SUCCESS) { \
  const char* s; cuGetErrorString(e, &s); fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, s); exit(1);} } while (0)

template <int N> struct Params { uint64_t v[N / 8]; };

template <int N> __global__ void k(Params<N> p) {
  if (p.v[0] == 1 && threadIdx.x == 1234) printf("%llu\n", (unsigned long long)p.v[N / 8 - 1]);
}

template <int N> double rounds(CUstream s, int round, double* best) {
  Params<N> p{};
  size_t len = sizeof(p);
  void* extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, &p, CU_LAUNCH_PARAM_BUFFER_SIZE, &len, CU_LAUNCH_PARAM_END};
  cudaFunction_t rf;
  cudaGetFuncBySymbol(&rf, (const void*)k<N>);
  CUfunction f = (CUfunction)rf;
  const int calls = 500;  // below the launch queue's depth: the host never waits for the GPU
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) CK(cuLaunchKernel(f, 40, 1, 1, 128, 1, 1, 0, s, nullptr, extra));
  auto t1 = std::chrono::steady_clock::now();
  cudaStreamSynchronize((cudaStream_t)s);
  double us = std::chrono::duration<double, std::micro>(t1 - t0).count() / calls;
  *best = round == 0 ? us : std::min(*best, us);
  return us;
}

int main() {
  cudaFree(0);
  CUstream s;
  CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  double b[6];
  for (int r = 0; r < 21; ++r) {  // round 0 warms up and is overwritten
    rounds<64>(s, r == 0 ? 0 : 1, &b[0]);
    rounds<288>(s, r == 0 ? 0 : 1, &b[1]);
    rounds<640>(s, r == 0 ? 0 : 1, &b[2]);
    rounds<1024>(s, r == 0 ? 0 : 1, &b[3]);
    rounds<2048>(s, r == 0 ? 0 : 1, &b[4]);
    rounds<4096 - 64>(s, r == 0 ? 0 : 1, &b[5]);
    if (r == 0) for (double& x : b) x = 1e9;
  }
  const int sizes[] = {64, 288, 640, 1024, 2048, 4032};
  printf("cuLaunchKernel host µs per launch (fastest of 20 rounds of 500)\n");
  for (int i = 0; i < 6; ++i) printf("param bytes %5d: %.3f\n", sizes[i], b[i]);
  return 0;
}
