// Issue 53 evidence (log v79), not product code. Access-pattern floors: what a kernel that only moves the bytes of
// rope-bench's partial and strided rows reaches against the driver's copy of the same bytes,
// L2 flushed before each launch, median of 41 launches.
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <functional>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

constexpr int T = 8192, HQKV = 48, HROT = 40, D = 128;  // bf16 elements; 16-byte chunks of 8

// In place, the first `chunks` 16-byte chunks of each of the first 40 heads of a [T, 48, 128]
// buffer (partial rotary 64 of 128: 8 chunks of 16 at the head's start).
__global__ void __launch_bounds__(256) touch_heads(uint4* buf, int chunks) {
  size_t i = size_t(blockIdx.x) * 256 + threadIdx.x;
  size_t n = size_t(T) * HROT * chunks;
  if (i >= n) return;
  size_t c = i % chunks, h = (i / chunks) % HROT, t = i / (size_t(chunks) * HROT);
  uint4* p = buf + (t * HQKV + h) * (D / 8) + c;
  uint4 v = *p; v.x ^= 1u; *p = v;
}

// In place, n contiguous chunks.
__global__ void __launch_bounds__(256) touch_contig(uint4* buf, size_t n) {
  size_t i = size_t(blockIdx.x) * 256 + threadIdx.x;
  if (i >= n) return;
  uint4 v = buf[i]; v.x ^= 1u; buf[i] = v;
}

// Out of place: q's 32 heads and k's 8 heads read through views whose tokens are 48 heads apart
// (q) and 24 apart (k), written contiguously: rope-bench's strided row.
__global__ void __launch_bounds__(256) strided_copy(const uint4* q, const uint4* k, uint4* qo, uint4* ko) {
  size_t i = size_t(blockIdx.x) * 256 + threadIdx.x;
  constexpr size_t qn = size_t(T) * 32 * 16, kn = size_t(T) * 8 * 16;
  if (i < qn) {
    size_t c = i % (32 * 16), t = i / (32 * 16);
    qo[i] = q[t * 48 * 16 + c];
  } else if (i < qn + kn) {
    size_t j = i - qn, c = j % (8 * 16), t = j / (8 * 16);
    ko[j] = k[t * 24 * 16 + c];
  }
}

static float median(std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

int main() {
  uint4 *qkv, *a, *b, *flush, *q, *k, *qo, *ko;
  size_t qkv_bytes = size_t(T) * HQKV * D * 2;
  CK(cudaMalloc(&qkv, qkv_bytes)); CK(cudaMalloc(&a, qkv_bytes)); CK(cudaMalloc(&b, qkv_bytes));
  CK(cudaMalloc(&flush, 256 << 20));
  CK(cudaMalloc(&q, size_t(T) * 48 * D * 2)); CK(cudaMalloc(&k, size_t(T) * 24 * D * 2));
  CK(cudaMalloc(&qo, size_t(T) * 32 * D * 2)); CK(cudaMalloc(&ko, size_t(T) * 8 * D * 2));
  CK(cudaMemset(qkv, 0, qkv_bytes)); CK(cudaMemset(a, 0, qkv_bytes));
  cudaStream_t st; CK(cudaStreamCreate(&st));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  auto time = [&](std::function<void()> f) {
    std::vector<float> t;
    for (int r = 0; r < 42; r++) {
      CK(cudaMemsetAsync(flush, r, 256 << 20, st));
      CK(cudaEventRecord(e0, st)); f(); CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
      float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); if (r) t.push_back(ms * 1000.f);
    }
    return median(t);
  };
  auto blocks = [](size_t n) { return unsigned((n + 255) / 256); };
  for (int round = 0; round < 2; round++) {
    // partial: 64 of 128 elements of 40 heads in place: 8 chunks per head
    size_t pn = size_t(T) * HROT * 8;
    float half = time([&] { touch_heads<<<blocks(pn), 256, 0, st>>>(qkv, 8); });
    float full = time([&] { touch_heads<<<blocks(pn * 2), 256, 0, st>>>(qkv, 16); });
    float contig = time([&] { touch_contig<<<blocks(pn), 256, 0, st>>>(a, pn); });
    // the driver's copy of the bytes read plus written (read n, write n: a copy of n)
    float copy_half = time([&] { CK(cudaMemcpyAsync(b, a, pn * 16, cudaMemcpyDeviceToDevice, st)); });
    float copy_full = time([&] { CK(cudaMemcpyAsync(b, a, pn * 32, cudaMemcpyDeviceToDevice, st)); });
    printf("partial pattern: 64 of 128 elements of 40 heads in place: %.1f us; copy of the same bytes %.1f us: %.1f%% of copy\n", half, copy_half, 100 * copy_half / half);
    printf("full heads in place (same buffer): %.1f us; copy %.1f us: %.1f%% of copy\n", full, copy_full, 100 * copy_full / full);
    printf("contiguous in place, the partial row's bytes: %.1f us: %.1f%% of copy\n", contig, 100 * copy_half / contig);
    size_t sn = size_t(T) * 40 * 16;
    float strided = time([&] { strided_copy<<<blocks(sn), 256, 0, st>>>(q, k, qo, ko); });
    float copy_s = time([&] { CK(cudaMemcpyAsync(b, a, sn * 16, cudaMemcpyDeviceToDevice, st)); });
    // a copy of the same strided views by the driver (2-D copies, q then k)
    float copy2d = time([&] {
      CK(cudaMemcpy2DAsync(qo, 32 * D * 2, q, 48 * D * 2, 32 * D * 2, T, cudaMemcpyDeviceToDevice, st));
      CK(cudaMemcpy2DAsync(ko, 8 * D * 2, k, 24 * D * 2, 8 * D * 2, T, cudaMemcpyDeviceToDevice, st));
    });
    printf("strided views to contiguous outputs: %.1f us; contiguous copy of the bytes %.1f us: %.1f%%; driver 2-D copies of the views %.1f us: %.1f%%\n",
           strided, copy_s, 100 * copy_s / strided, copy2d, 100 * copy_s / copy2d);
  }
  return 0;
}
