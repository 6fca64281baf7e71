// Feasibility probe for issue 22 (a measurement tool, not product code: rope-rs's kernels are
// written in Rust). Norm + rope + FP8 q and k/v cache over the token rows of one fused QKV buffer
// (32 q + 8 k + 8 v heads of 128 bf16, 12 KB per token), each row brought into shared memory by
// the bulk copy engine (cp.async.bulk completing on an mbarrier), STAGES deep, persistent grid;
// timed in the same process against a device-to-device copy of 3/4 of the rows' bytes (the
// bench's FP8 "own copy"). Results: docs/bench/2026-11-27-v39-probes.txt, docs/perf.md.
// Build and run on an sm_90 GPU: nvcc -arch=sm_90 -O3 -std=c++17 -o probe 2026-11-27-bulk-probe.cu
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
#include <cmath>

constexpr int H = 48, HQ = 32, HK = 8, D = 128;
constexpr int ROW = H * D * 2;  // 12288 bytes per token
constexpr int WARPS = 6;         // 4 q warps, 1 k, 1 v; 8 heads each

__device__ __forceinline__ uint32_t sa(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void expect_load(uint64_t* bar, void* dst, const void* src, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(sa(dst)),
               "l"(src), "r"(bytes), "r"(sa(bar))
               : "memory");
}

__device__ __forceinline__ void wait_parity(uint64_t* bar, uint32_t parity) {
  uint32_t ok = 0;
  while (!ok) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(ok)
        : "r"(sa(bar)), "r"(parity)
        : "memory");
  }
}

template <int STAGES, int TPS, bool MATH>
__global__ void __launch_bounds__(WARPS * 32) probe(const __nv_bfloat16* __restrict__ qkv, const float* __restrict__ cosT,
                                                    const float* __restrict__ sinT, const __nv_bfloat16* __restrict__ qw,
                                                    const __nv_bfloat16* __restrict__ kw, const float* __restrict__ scale,
                                                    uint8_t* __restrict__ qout, uint8_t* __restrict__ kc,
                                                    uint8_t* __restrict__ vc, int T, float eps) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t full[STAGES];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int first = blockIdx.x, step = gridDim.x;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(&full[s])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (tid == 0)
    for (int s = 0; s < STAGES; ++s) {
      int st = first + s * step;
      if (st < T / TPS) expect_load(&full[s], smem + s * TPS * ROW, qkv + (size_t)st * TPS * H * D, TPS * ROW);
    }
  const int kind = warp < 4 ? 0 : (warp == 4 ? 1 : 2);
  const float m = 1.0f / *scale;
  const __nv_bfloat16* wp = kind == 0 ? qw : kw;
  float w0 = 0, w1 = 0, w2 = 0, w3 = 0;
  if (kind < 2) {
    w0 = __bfloat162float(wp[2 * lane]);
    w1 = __bfloat162float(wp[2 * lane + 1]);
    w2 = __bfloat162float(wp[64 + 2 * lane]);
    w3 = __bfloat162float(wp[65 + 2 * lane]);
  }
  int iter = 0;
  for (int st = first; st < T / TPS; st += step, ++iter) {
    const int s = iter % STAGES;
    wait_parity(&full[s], (iter / STAGES) & 1);
    for (int tt = 0; tt < TPS; ++tt) {
    const int tok = st * TPS + tt;
    const __nv_bfloat162* row = reinterpret_cast<const __nv_bfloat162*>(smem + (s * TPS + tt) * ROW) + warp * 8 * 64;
    float2 c = make_float2(0, 0), sn = make_float2(0, 0);
    uint8_t* out;
    if (kind == 0) {
      c = *reinterpret_cast<const float2*>(cosT + (size_t)tok * 64 + 2 * lane);
      sn = *reinterpret_cast<const float2*>(sinT + (size_t)tok * 64 + 2 * lane);
      out = qout + (size_t)tok * HQ * D + warp * 8 * D;
    } else if (kind == 1) {
      c = *reinterpret_cast<const float2*>(cosT + (size_t)tok * 64 + 2 * lane);
      sn = *reinterpret_cast<const float2*>(sinT + (size_t)tok * 64 + 2 * lane);
      out = kc + (size_t)tok * HK * D;
    } else {
      out = vc + (size_t)tok * HK * D;
    }
#pragma unroll
    for (int h = 0; h < 8; ++h) {
      __nv_bfloat162 a = row[h * 64 + lane], b = row[h * 64 + 32 + lane];
      float x0 = __low2float(a), x1 = __high2float(a), y0 = __low2float(b), y1 = __high2float(b);
      float o0, o1, p0, p1;
      if (MATH && kind < 2) {
        float ss = x0 * x0;
        ss = fmaf(x1, x1, ss);
        ss = fmaf(y0, y0, ss);
        ss = fmaf(y1, y1, ss);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        float r = rsqrtf(fmaf(ss, 1.0f / 128, eps)) * m;
        x0 *= r * w0;  // r * w recomputed per head: as the product would
        x1 *= r * w1;
        y0 *= r * w2;
        y1 *= r * w3;
        o0 = fmaf(x0, c.x, -(y0 * sn.x));
        p0 = fmaf(y0, c.x, x0 * sn.x);
        o1 = fmaf(x1, c.y, -(y1 * sn.y));
        p1 = fmaf(y1, c.y, x1 * sn.y);
      } else {
        o0 = x0 * m;
        o1 = x1 * m;
        p0 = y0 * m;
        p1 = y1 * m;
      }
      __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(make_float2(o0, o1), __NV_SATFINITE, __NV_E4M3);
      __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(make_float2(p0, p1), __NV_SATFINITE, __NV_E4M3);
      *reinterpret_cast<__nv_fp8x2_storage_t*>(out + h * D + 2 * lane) = lo;
      *reinterpret_cast<__nv_fp8x2_storage_t*>(out + h * D + 64 + 2 * lane) = hi;
    }
    }
    __syncthreads();  // every warp is done with stage s
    if (tid == 0) {
      int next = st + STAGES * step;
      if (next < T / TPS) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        expect_load(&full[s], smem + s * TPS * ROW, qkv + (size_t)next * TPS * H * D, TPS * ROW);
      }
    }
  }
}

// 16 lanes per head, 8 elements per lane (4 NeoX pairs), two heads per warp step.
template <int STAGES>
__global__ void __launch_bounds__(WARPS * 32) probe16(const __nv_bfloat16* __restrict__ qkv, const float* __restrict__ cosT,
                                                      const float* __restrict__ sinT, const __nv_bfloat16* __restrict__ qw,
                                                      const __nv_bfloat16* __restrict__ kw, const float* __restrict__ scale,
                                                      uint8_t* __restrict__ qout, uint8_t* __restrict__ kc,
                                                      uint8_t* __restrict__ vc, int T, float eps) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t full[STAGES];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, l16 = lane % 16, hsel = lane / 16;
  const int first = blockIdx.x, step = gridDim.x;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(&full[s])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (tid == 0)
    for (int s = 0; s < STAGES; ++s) {
      int tok = first + s * step;
      if (tok < T) expect_load(&full[s], smem + s * ROW, qkv + (size_t)tok * H * D, ROW);
    }
  const int kind = warp < 4 ? 0 : (warp == 4 ? 1 : 2);
  const float m = 1.0f / *scale;
  const __nv_bfloat16* wp = kind == 0 ? qw : kw;
  float w[8];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    w[e] = kind < 2 ? __bfloat162float(wp[4 * l16 + e]) : 0.f;
    w[4 + e] = kind < 2 ? __bfloat162float(wp[64 + 4 * l16 + e]) : 0.f;
  }
  int iter = 0;
  for (int tok = first; tok < T; tok += step, ++iter) {
    const int s = iter % STAGES;
    wait_parity(&full[s], (iter / STAGES) & 1);
    const uint8_t* base = smem + s * ROW + warp * 8 * D * 2;
    float4 c = make_float4(0, 0, 0, 0), sn = c;
    uint8_t* out;
    if (kind < 2) {
      c = *reinterpret_cast<const float4*>(cosT + (size_t)tok * 64 + 4 * l16);
      sn = *reinterpret_cast<const float4*>(sinT + (size_t)tok * 64 + 4 * l16);
    }
    out = kind == 0 ? qout + (size_t)tok * HQ * D + warp * 8 * D : (kind == 1 ? kc : vc) + (size_t)tok * HK * D;
    float cc[4] = {c.x, c.y, c.z, c.w}, ssn[4] = {sn.x, sn.y, sn.z, sn.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int h = 2 * i + hsel;
      uint2 ra = *reinterpret_cast<const uint2*>(base + h * D * 2 + 8 * l16);
      uint2 rb = *reinterpret_cast<const uint2*>(base + h * D * 2 + 128 + 8 * l16);
      float x[4] = {__uint_as_float(ra.x << 16), __uint_as_float(ra.x & 0xffff0000u), __uint_as_float(ra.y << 16),
                    __uint_as_float(ra.y & 0xffff0000u)};
      float y[4] = {__uint_as_float(rb.x << 16), __uint_as_float(rb.x & 0xffff0000u), __uint_as_float(rb.y << 16),
                    __uint_as_float(rb.y & 0xffff0000u)};
      float o[4], p[4];
      if (kind < 2) {
        float ss = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) ss = fmaf(y[e], y[e], fmaf(x[e], x[e], ss));
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
        float r = rsqrtf(fmaf(ss, 1.0f / 128, eps)) * m;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float a = x[e] * r * w[e], b = y[e] * r * w[4 + e];
          o[e] = fmaf(a, cc[e], -(b * ssn[e]));
          p[e] = fmaf(b, cc[e], a * ssn[e]);
        }
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          o[e] = x[e] * m;
          p[e] = y[e] * m;
        }
      }
      uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(o[0], o[1]), __NV_SATFINITE, __NV_E4M3) |
                    (uint32_t(__nv_cvt_float2_to_fp8x2(make_float2(o[2], o[3]), __NV_SATFINITE, __NV_E4M3)) << 16);
      uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(p[0], p[1]), __NV_SATFINITE, __NV_E4M3) |
                    (uint32_t(__nv_cvt_float2_to_fp8x2(make_float2(p[2], p[3]), __NV_SATFINITE, __NV_E4M3)) << 16);
      *reinterpret_cast<uint32_t*>(out + h * D + 4 * l16) = lo;
      *reinterpret_cast<uint32_t*>(out + h * D + 64 + 4 * l16) = hi;
    }
    __syncthreads();
    if (tid == 0) {
      int next = tok + STAGES * step;
      if (next < T) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        expect_load(&full[s], smem + s * ROW, qkv + (size_t)next * H * D, ROW);
      }
    }
  }
}

static float fp8_to_float(uint8_t v) {
  __nv_fp8_e4m3 f;
  f.__x = v;
  return float(f);
}

#define CK(x)                                                                  \
  do {                                                                         \
    cudaError_t e = (x);                                                       \
    if (e != cudaSuccess) {                                                    \
      printf("%s failed: %s (line %d)\n", #x, cudaGetErrorString(e), __LINE__); \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

template <int STAGES, int TPS = 1, bool MATH = true>
static void run(int T, int sms, int per_sm_req, const __nv_bfloat16* qkv, const float* cosT, const float* sinT,
                const __nv_bfloat16* qw, const __nv_bfloat16* kw, const float* scale, uint8_t* qout, uint8_t* kc,
                uint8_t* vc, uint8_t* cpy_src, uint8_t* cpy_dst, float copy_us, std::vector<float>* check) {
  size_t smem = (size_t)STAGES * TPS * ROW;
  auto kern = probe<STAGES, TPS, MATH>;
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, WARPS * 32, smem));
  int use = per_sm_req > 0 ? (per_sm_req < per_sm ? per_sm_req : per_sm) : per_sm;
  int grid = sms * use;
  if (grid > T / TPS) grid = T / TPS;
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 5; ++i)
    kern<<<grid, WARPS * 32, smem>>>(qkv, cosT, sinT, qw, kw, scale, qout, kc, vc, T, 1e-6f);
  CK(cudaGetLastError());
  const int reps = 50;
  CK(cudaEventRecord(a));
  for (int i = 0; i < reps; ++i)
    kern<<<grid, WARPS * 32, smem>>>(qkv, cosT, sinT, qw, kw, scale, qout, kc, vc, T, 1e-6f);
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  float ms;
  CK(cudaEventElapsedTime(&ms, a, b));
  float us = ms * 1000 / reps;
  printf("tps %d math %d stages %d blocks/SM %d (max %d) grid %d: %.2f us, %.1f%% of copy\n", TPS, (int)MATH, STAGES, use, per_sm, grid, us,
         100 * copy_us / us);
  (void)check;
}

template <int STAGES>
static void run16(int T, int sms, const __nv_bfloat16* qkv, const float* cosT, const float* sinT,
                  const __nv_bfloat16* qw, const __nv_bfloat16* kw, const float* scale, uint8_t* qout, uint8_t* kc,
                  uint8_t* vc, float copy_us) {
  size_t smem = (size_t)STAGES * ROW;
  auto kern = probe16<STAGES>;
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, WARPS * 32, smem));
  int grid = sms * per_sm;
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 5; ++i) kern<<<grid, WARPS * 32, smem>>>(qkv, cosT, sinT, qw, kw, scale, qout, kc, vc, T, 1e-6f);
  CK(cudaGetLastError());
  CK(cudaEventRecord(a));
  for (int i = 0; i < 50; ++i) kern<<<grid, WARPS * 32, smem>>>(qkv, cosT, sinT, qw, kw, scale, qout, kc, vc, T, 1e-6f);
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  float ms;
  CK(cudaEventElapsedTime(&ms, a, b));
  float us = ms * 1000 / 50;
  printf("16 lanes per head, stages %d blocks/SM %d: %.2f us, %.1f%% of copy\n", STAGES, per_sm, us, 100 * copy_us / us);
}

int main() {
  const int T = 8192;
  int dev = 0, sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  printf("%s, %d SMs\n", prop.name, sms);
  std::vector<__nv_bfloat16> hq((size_t)T * H * D);
  srand(1);
  for (auto& v : hq) v = __float2bfloat16((rand() / (float)RAND_MAX - 0.5f) * 4);
  std::vector<float> hc((size_t)T * 64), hs((size_t)T * 64);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < 64; ++j) {
      double ang = t * pow(10000.0, -2.0 * j / 128);
      hc[t * 64 + j] = (float)cos(ang);
      hs[t * 64 + j] = (float)sin(ang);
    }
  std::vector<__nv_bfloat16> hqw(D), hkw(D);
  for (int e = 0; e < D; ++e) {
    hqw[e] = __float2bfloat16(0.5f + e / 128.0f);
    hkw[e] = __float2bfloat16(1.5f - e / 256.0f);
  }
  float hscale = 0.05f;
  __nv_bfloat16 *qkv, *qw, *kw;
  float *cosT, *sinT, *scale;
  uint8_t *qout, *kc, *vc, *cs, *cd;
  CK(cudaMalloc(&qkv, hq.size() * 2));
  CK(cudaMalloc(&cosT, hc.size() * 4));
  CK(cudaMalloc(&sinT, hs.size() * 4));
  CK(cudaMalloc(&qw, D * 2));
  CK(cudaMalloc(&kw, D * 2));
  CK(cudaMalloc(&scale, 4));
  CK(cudaMalloc(&qout, (size_t)T * HQ * D));
  CK(cudaMalloc(&kc, (size_t)T * HK * D));
  CK(cudaMalloc(&vc, (size_t)T * HK * D));
  size_t cbytes = (size_t)T * ROW * 3 / 4;
  CK(cudaMalloc(&cs, cbytes));
  CK(cudaMalloc(&cd, cbytes));
  CK(cudaMemcpy(qkv, hq.data(), hq.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(cosT, hc.data(), hc.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(sinT, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(qw, hqw.data(), D * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(kw, hkw.data(), D * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(scale, &hscale, 4, cudaMemcpyHostToDevice));
  // The copy of the same bytes, timed the same way.
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 5; ++i) CK(cudaMemcpyAsync(cd, cs, cbytes, cudaMemcpyDeviceToDevice));
  CK(cudaEventRecord(a));
  for (int i = 0; i < 50; ++i) CK(cudaMemcpyAsync(cd, cs, cbytes, cudaMemcpyDeviceToDevice));
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  float ms;
  CK(cudaEventElapsedTime(&ms, a, b));
  float copy_us = ms * 1000 / 50;
  printf("copy of %zu bytes: %.2f us (%.0f GB/s)\n", cbytes, copy_us, 2.0 * cbytes / copy_us / 1e3);
  for (int rep = 0; rep < 2; ++rep) {
    run<1, 1, true>(T, sms, 0, qkv, cosT, sinT, qw, kw, scale, qout, kc, vc, cs, cd, copy_us, nullptr);
    run<1, 1, false>(T, sms, 0, qkv, cosT, sinT, qw, kw, scale, qout, kc, vc, cs, cd, copy_us, nullptr);
    run16<2>(T, sms, qkv, cosT, sinT, qw, kw, scale, qout, kc, vc, copy_us);
    run16<1>(T, sms, qkv, cosT, sinT, qw, kw, scale, qout, kc, vc, copy_us);
  }
  // Check the last run's q, k and v against a host reference (float math).
  std::vector<uint8_t> gq((size_t)T * HQ * D), gk((size_t)T * HK * D), gv((size_t)T * HK * D);
  CK(cudaMemcpy(gq.data(), qout, gq.size(), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(gk.data(), kc, gk.size(), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(gv.data(), vc, gv.size(), cudaMemcpyDeviceToHost));
  double worst = 0;
  long bad = 0, n = 0;
  for (int t = 0; t < T; t += 97)
    for (int h = 0; h < H; ++h) {
      const __nv_bfloat16* x = &hq[((size_t)t * H + h) * D];
      double ss = 0;
      for (int e = 0; e < D; ++e) ss += double(__bfloat162float(x[e])) * __bfloat162float(x[e]);
      double r = 1 / sqrt(ss / D + 1e-6);
      for (int e = 0; e < D; ++e) {
        double want;
        uint8_t got;
        if (h < HQ + HK) {
          const __nv_bfloat16* w = h < HQ ? hqw.data() : hkw.data();
          int j = e % 64;
          double a0 = __bfloat162float(x[j]) * r * __bfloat162float(w[j]);
          double b0 = __bfloat162float(x[j + 64]) * r * __bfloat162float(w[j + 64]);
          double cc = hc[t * 64 + j], sss = hs[t * 64 + j];
          want = e < 64 ? a0 * cc - b0 * sss : b0 * cc + a0 * sss;
          got = h < HQ ? gq[((size_t)t * HQ + h) * D + e] : gk[((size_t)t * HK + h - HQ) * D + e];
        } else {
          want = __bfloat162float(x[e]);
          got = gv[((size_t)t * HK + h - HQ - HK) * D + e];
        }
        want /= hscale;
        if (want > 448) want = 448;
        if (want < -448) want = -448;
        double g = fp8_to_float(got);
        double err = fabs(g - want) / (fabs(want) * 0.0625 + 0.002);  // in units of about one E4M3 ulp
        if (err > worst) worst = err;
        if (err > 1.0) ++bad;
        ++n;
      }
    }
  printf("check: %ld values, %ld beyond one E4M3 step, worst %.2f steps\n", n, bad, worst);
  return 0;
}
