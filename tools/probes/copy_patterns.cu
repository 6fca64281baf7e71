// Probe: which memory access pattern lets a copy kernel reach the driver's device-to-device
// copy on this GPU. Not product code (the product's kernels are Rust, rope-kernels/); it
// isolates the access pattern that every RoPE kernel shares. Build and run on the GPU machine:
//   nvcc -O3 -arch=sm_90 -o /tmp/copy_patterns tools/probes/copy_patterns.cu && /tmp/copy_patterns
// Output of one H200 run: docs/bench/2026-11-22-h200-v23-copy-patterns.txt
// Every number is the median of RUNS event-timed launches, each after a 256 MiB memset that
// evicts L2 (as rope-bench does), printed as percent of the same-run driver copy.
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <string>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

struct V { uint32_t a, b, c, d; };

// Load hints: 0 plain, 1 .nc L1::no_allocate, 2 L1::no_allocate L2::256B prefetch,
// 3 .cs (evict first), 4 L2::evict_first policy.
template <int H> __device__ __forceinline__ V ld(const V* p, uint64_t pol) {
  V v;
  if (H == 0) asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.a), "=r"(v.b), "=r"(v.c), "=r"(v.d) : "l"(p));
  if (H == 1) asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.a), "=r"(v.b), "=r"(v.c), "=r"(v.d) : "l"(p));
  if (H == 2) asm volatile("ld.global.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.a), "=r"(v.b), "=r"(v.c), "=r"(v.d) : "l"(p));
  if (H == 3) asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.a), "=r"(v.b), "=r"(v.c), "=r"(v.d) : "l"(p));
  if (H == 4) asm volatile("ld.global.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;" : "=r"(v.a), "=r"(v.b), "=r"(v.c), "=r"(v.d) : "l"(p), "l"(pol));
  return v;
}
// Store hints: 0 plain, 1 .cs, 2 L2::evict_first policy, 3 L1::no_allocate.
template <int H> __device__ __forceinline__ void st(V* p, V v, uint64_t pol) {
  if (H == 0) asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(v.a), "r"(v.b), "r"(v.c), "r"(v.d) : "memory");
  if (H == 1) asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(v.a), "r"(v.b), "r"(v.c), "r"(v.d) : "memory");
  if (H == 2) asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1,%2,%3,%4}, %5;" :: "l"(p), "r"(v.a), "r"(v.b), "r"(v.c), "r"(v.d), "l"(pol) : "memory");
  if (H == 3) asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(v.a), "r"(v.b), "r"(v.c), "r"(v.d) : "memory");
}
__device__ __forceinline__ uint64_t policy() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}

// Linear: block b, iteration i handles vectors [base, base + U * blockDim) with thread t
// taking base + u * blockDim + t; grid-stride when the grid is smaller than the work.
template <int U, int LH, int SH>
__global__ void linear(const V* __restrict__ src, V* dst, uint64_t n) {
  uint64_t pol = (LH == 4 || SH == 2) ? policy() : 0;
  uint64_t chunk = (uint64_t)blockDim.x * U;
  for (uint64_t base = blockIdx.x * chunk; base < n; base += (uint64_t)gridDim.x * chunk) {
    V v[U];
    uint64_t i0 = base + threadIdx.x;
    if (base + chunk <= n) {
#pragma unroll
      for (int u = 0; u < U; u++) v[u] = ld<LH>(src + i0 + u * blockDim.x, pol);
#pragma unroll
      for (int u = 0; u < U; u++) st<SH>(dst + i0 + u * blockDim.x, v[u], pol);
    } else {
      for (int u = 0; u < U; u++) {
        uint64_t i = i0 + u * blockDim.x;
        if (i < n) st<SH>(dst + i, ld<LH>(src + i, pol), pol);
      }
    }
  }
}

// Thread-contiguous: thread handles U adjacent vectors (64 B for U = 4), like a thread that
// walks one head's vectors.
template <int U, int LH, int SH>
__global__ void thread_contig(const V* __restrict__ src, V* dst, uint64_t n) {
  uint64_t pol = (LH == 4 || SH == 2) ? policy() : 0;
  uint64_t chunk = (uint64_t)blockDim.x * U;
  for (uint64_t base = blockIdx.x * chunk; base < n; base += (uint64_t)gridDim.x * chunk) {
    uint64_t i0 = base + (uint64_t)threadIdx.x * U;
    V v[U];
    if (base + chunk <= n) {
#pragma unroll
      for (int u = 0; u < U; u++) v[u] = ld<LH>(src + i0 + u, pol);
#pragma unroll
      for (int u = 0; u < U; u++) st<SH>(dst + i0 + u, v[u], pol);
    }
  }
}

// Rope-like: rows of `heads` heads of `hv` vectors (hv = 16 for 128 bf16); item = (row, vector
// in head); a thread loops over the heads of its item, U heads loaded before their stores.
template <int U, int LH, int SH>
__global__ void heads_loop(const V* __restrict__ src, V* dst, uint64_t rows, uint32_t heads, uint32_t hv) {
  uint64_t pol = (LH == 4 || SH == 2) ? policy() : 0;
  uint64_t items = rows * hv;
  for (uint64_t it = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; it < items; it += (uint64_t)gridDim.x * blockDim.x) {
    uint64_t row = it / hv, g = it % hv;
    const V* s = src + row * heads * hv + g;
    V* d = dst + row * heads * hv + g;
    uint32_t h = 0;
    for (; h + U <= heads; h += U) {
      V v[U];
#pragma unroll
      for (int u = 0; u < U; u++) v[u] = ld<LH>(s + (h + u) * hv, pol);
#pragma unroll
      for (int u = 0; u < U; u++) st<SH>(d + (h + u) * hv, v[u], pol);
    }
    for (; h < heads; h++) st<SH>(d + h * hv, ld<LH>(s + h * hv, pol), pol);
  }
}

static int RUNS = 40;
static void* flushbuf;
static const size_t FLUSH = 256u << 20;

template <class F> float median_ms(F launch) {
  cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; i++) launch();
  std::vector<float> t;
  for (int i = 0; i < RUNS; i++) {
    CK(cudaMemsetAsync(flushbuf, i & 0xff, FLUSH));
    CK(cudaEventRecord(a)); launch(); CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b)); CK(cudaGetLastError());
    float ms; CK(cudaEventElapsedTime(&ms, a, b)); t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  CK(cudaEventDestroy(a)); CK(cudaEventDestroy(b));
  return t[t.size() / 2];
}

int main(int argc, char** argv) {
  int dev = 0; CK(cudaSetDevice(dev));
  cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, dev));
  int sms = prop.multiProcessorCount;
  printf("device %s, %d SMs, L2 %d MiB\n", prop.name, sms, prop.l2CacheSize >> 20);
  CK(cudaMalloc(&flushbuf, FLUSH));
  // sizes: prefill (8192 tokens x 40 heads x 128 bf16) and training (4 x 4096 x 64 x 128 bf16)
  size_t sizes[] = {8192ull * 40 * 256, 4ull * 4096 * 64 * 256};
  for (size_t bytes : sizes) {
    V *src, *dst; CK(cudaMalloc(&src, bytes)); CK(cudaMalloc(&dst, bytes));
    CK(cudaMemset(src, 0x3c, bytes)); CK(cudaMemset(dst, 0, bytes));
    uint64_t n = bytes / 16;
    float base = median_ms([&] { CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); });
    float base2 = median_ms([&] { CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); });
    printf("\n== %.1f MB: driver copy %.4f ms (%.0f GB/s), again %.4f ms\n", bytes / 1e6, base,
           2.0 * bytes / base / 1e6, base2);
    std::vector<std::pair<std::string, float>> res;
    auto run = [&](const char* name, auto launch) {
      float ms = median_ms(launch);
      float inplace = 0;
      res.push_back({name, ms});
      printf("%-44s %.4f ms  %6.1f%% of copy\n", name, ms, 100.0 * base / ms);
      (void)inplace;
    };
#define LIN(U, LH, SH, T, BPS) run("linear U" #U " ld" #LH " st" #SH " t" #T " grid " #BPS, [&] { \
      uint64_t blocks = (n + (uint64_t)T * U - 1) / ((uint64_t)T * U); \
      if (BPS > 0) blocks = std::min<uint64_t>(blocks, (uint64_t)sms * BPS); \
      linear<U, LH, SH><<<blocks, T>>>(src, dst, n); });
#define LINIP(U, LH, SH, T, BPS) run("inplace linear U" #U " ld" #LH " st" #SH " t" #T " grid " #BPS, [&] { \
      uint64_t blocks = (n + (uint64_t)T * U - 1) / ((uint64_t)T * U); \
      if (BPS > 0) blocks = std::min<uint64_t>(blocks, (uint64_t)sms * BPS); \
      linear<U, LH, SH><<<blocks, T>>>(src, src, n); });
    // One-shot grids (BPS 0) and persistent grids (BPS blocks per SM).
    LIN(1, 0, 0, 256, 0) LIN(2, 0, 0, 256, 0) LIN(4, 0, 0, 256, 0) LIN(8, 0, 0, 256, 0)
    LIN(1, 0, 0, 128, 0) LIN(4, 0, 0, 128, 0) LIN(4, 0, 0, 512, 0) LIN(4, 0, 0, 1024, 0)
    LIN(1, 0, 0, 256, 8) LIN(4, 0, 0, 256, 8) LIN(4, 0, 0, 256, 4) LIN(8, 0, 0, 256, 4)
    LIN(4, 0, 0, 1024, 2) LIN(8, 0, 0, 512, 4) LIN(2, 0, 0, 1024, 2)
    // Cache hints on the U4 one-shot grid.
    LIN(4, 1, 0, 256, 0) LIN(4, 2, 0, 256, 0) LIN(4, 3, 0, 256, 0) LIN(4, 4, 0, 256, 0)
    LIN(4, 0, 1, 256, 0) LIN(4, 0, 2, 256, 0) LIN(4, 0, 3, 256, 0) LIN(4, 3, 1, 256, 0)
    LIN(4, 4, 2, 256, 0) LIN(4, 1, 1, 256, 0) LIN(4, 2, 1, 256, 0)
    LIN(1, 3, 1, 256, 0) LIN(8, 3, 1, 256, 0) LIN(8, 2, 0, 256, 0)
    // In place (read and write the same lines).
    LINIP(1, 0, 0, 256, 0) LINIP(4, 0, 0, 256, 0) LINIP(8, 0, 0, 256, 0) LINIP(4, 3, 1, 256, 0)
    LINIP(4, 2, 0, 256, 0) LINIP(4, 0, 0, 256, 8)
#define TC(U, LH, SH, T) run("thread-contig U" #U " ld" #LH " st" #SH " t" #T, [&] { \
      uint64_t blocks = (n + (uint64_t)T * U - 1) / ((uint64_t)T * U); \
      thread_contig<U, LH, SH><<<blocks, T>>>(src, dst, n); });
    TC(2, 0, 0, 256) TC(4, 0, 0, 256) TC(4, 3, 1, 256)
    // Rope-like: 40 heads of 16 vectors per row, items grid-stride with 128-thread blocks.
    uint64_t rows = n / (40 * 16);
#define HL(U, LH, SH, T, BPS, IP) run("heads-loop U" #U " ld" #LH " st" #SH " t" #T " grid " #BPS " ip" #IP, [&] { \
      uint64_t blocks = (rows * 16 + T - 1) / T; \
      if (BPS > 0) blocks = std::min<uint64_t>(blocks, (uint64_t)sms * BPS); \
      heads_loop<U, LH, SH><<<blocks, T>>>(src, IP ? src : dst, rows, 40, 16); });
    HL(1, 0, 0, 128, 0, 0) HL(2, 0, 0, 128, 0, 0) HL(4, 0, 0, 128, 0, 0) HL(8, 0, 0, 128, 0, 0)
    HL(4, 3, 1, 128, 0, 0) HL(4, 2, 0, 128, 0, 0) HL(4, 0, 0, 256, 0, 0)
    HL(4, 0, 0, 128, 0, 1) HL(8, 0, 0, 128, 0, 1) HL(4, 2, 0, 128, 0, 1)
    float again = median_ms([&] { CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); });
    printf("driver copy at the end: %.4f ms (%.1f%% of the first)\n", again, 100.0 * base / again);
    CK(cudaFree(src)); CK(cudaFree(dst));
  }
  return 0;
}
