// Probe: what a decode-step RoPE launch can cost inside a CUDA graph, and what programmatic
// dependent launch (PDL) takes off it. Not product code (the product's kernels are Rust,
// rope-kernels/); it measures floors for the decode target of the performance issue.
// Build and run on the GPU machine:
//   nvcc -O3 -arch=sm_90 -o /tmp/decode_floor tools/probes/decode_floor.cu && /tmp/decode_floor
// Shape: batch 64, one token each, 32 q + 8 k heads of 128 bf16, in place, NeoX, i64 positions
// 1000..1063, sin/cos from a bf16 [4096, 64] table or computed from f32 frequencies.
// Each variant: a graph of 100 launches, median of 21 timed replays (after one), per launch.
// Variants are interleaved region by region so that clock drift hits all alike.
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#include <cuda_bf16.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

constexpr int B = 64, HQ = 32, HK = 8, D = 128, HALF = 64, H = HQ + HK;
constexpr int GROUPS = HALF / 4;             // 4 pairs (two 8-byte vectors) per thread and head
constexpr int ITEMS = B * H * GROUPS;        // 40960 threads, one head chunk each
constexpr int THREADS = 128;

__device__ __forceinline__ void pdl_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void pdl_launch() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

template <bool PDL> __global__ void empty_k() {
  if (PDL) { pdl_launch(); pdl_wait(); }
}

// In-place "copy": every thread reads and writes back its 16 bytes (volatile asm so nothing
// is elided), the access the RoPE kernels make in place.
template <bool PDL> __global__ void copy_k(uint4* x, int n) {
  if (PDL) { pdl_launch(); pdl_wait(); }
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(x + i));
  asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(x + i), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

__device__ __forceinline__ float lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ uint32_t pack(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}

// SRC 0: bf16 table rows [pos][64] of cos and of sin; 1: f32 sincosf of pos * inv_freq;
// 2: f64 sin/cos of pos * inv_freq (as accurate as rope-rs's computed path, slower math).
// Thread layout: i = ((token * H) + head) * GROUPS + group: consecutive threads, consecutive
// 8-byte vectors of one head half.
template <int SRC, bool PDL>
__global__ void rope_k(__nv_bfloat16* q, __nv_bfloat16* k, const int64_t* pos,
                       const __nv_bfloat16* cos_t, const __nv_bfloat16* sin_t,
                       const float* inv_freq) {
  if (PDL) pdl_launch();
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= ITEMS) return;
  int g = i % GROUPS, th = i / GROUPS, h = th % H, t = th / H;
  __nv_bfloat16* base = h < HQ ? q + ((size_t)t * HQ + h) * D : k + ((size_t)t * HK + (h - HQ)) * D;
  int j = g * 4;
  if (PDL) pdl_wait();
  uint2 a = *reinterpret_cast<const uint2*>(base + j);
  uint2 b = *reinterpret_cast<const uint2*>(base + j + HALF);
  int64_t p = pos[t];
  float c[4], s[4];
  if (SRC == 0) {
    uint2 cw = *reinterpret_cast<const uint2*>(cos_t + p * HALF + j);
    uint2 sw = *reinterpret_cast<const uint2*>(sin_t + p * HALF + j);
    c[0] = lo(cw.x); c[1] = hi(cw.x); c[2] = lo(cw.y); c[3] = hi(cw.y);
    s[0] = lo(sw.x); s[1] = hi(sw.x); s[2] = lo(sw.y); s[3] = hi(sw.y);
  } else if (SRC == 1) {
    for (int u = 0; u < 4; u++) sincosf((float)p * inv_freq[j + u], &s[u], &c[u]);
  } else {
    for (int u = 0; u < 4; u++) {
      double sd, cd;
      sincos((double)p * (double)inv_freq[j + u], &sd, &cd);
      s[u] = (float)sd; c[u] = (float)cd;
    }
  }
  float x0[4] = {lo(a.x), hi(a.x), lo(a.y), hi(a.y)};
  float x1[4] = {lo(b.x), hi(b.x), lo(b.y), hi(b.y)};
  float y0[4], y1[4];
  for (int u = 0; u < 4; u++) {
    y0[u] = x0[u] * c[u] - x1[u] * s[u];
    y1[u] = x1[u] * c[u] + x0[u] * s[u];
  }
  *reinterpret_cast<uint2*>(base + j) = make_uint2(pack(y0[0], y0[1]), pack(y0[2], y0[3]));
  *reinterpret_cast<uint2*>(base + j + HALF) = make_uint2(pack(y1[0], y1[1]), pack(y1[2], y1[3]));
}

struct Variant {
  const char* name;
  cudaGraphExec_t exec;
  std::vector<float> us;
};

template <typename F>
static Variant capture(const char* name, cudaStream_t st, F launch) {
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  for (int r = 0; r < 100; r++) launch();
  CK(cudaStreamEndCapture(st, &g));
  Variant v{name, nullptr, {}};
  CK(cudaGraphInstantiate(&v.exec, g, 0));
  return v;
}

template <typename K, typename... A>
static void launch(K kernel, bool pdl, int blocks, cudaStream_t st, A... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(THREADS);
  cfg.stream = st;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = pdl ? 1 : 0;
  CK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

int main() {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("device: %s\n", prop.name);
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  size_t qn = (size_t)B * HQ * D, kn = (size_t)B * HK * D, bytes = (qn + kn) * 2;
  __nv_bfloat16 *qk, *dst, *cos_t, *sin_t;
  int64_t* pos;
  float* inv_freq;
  CK(cudaMalloc(&qk, bytes));
  CK(cudaMalloc(&dst, bytes));
  CK(cudaMalloc(&cos_t, 4096 * HALF * 2));
  CK(cudaMalloc(&sin_t, 4096 * HALF * 2));
  CK(cudaMalloc(&pos, B * 8));
  CK(cudaMalloc(&inv_freq, HALF * 4));
  std::vector<int64_t> hp(B);
  for (int b = 0; b < B; b++) hp[b] = 1000 + b;
  std::vector<float> hf(HALF);
  for (int j = 0; j < HALF; j++) hf[j] = powf(500000.0f, -2.0f * j / D);
  std::vector<__nv_bfloat16> tab(4096 * HALF, __float2bfloat16(0.5f));
  CK(cudaMemcpy(pos, hp.data(), B * 8, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(inv_freq, hf.data(), HALF * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(cos_t, tab.data(), tab.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(sin_t, tab.data(), tab.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemset(qk, 0, bytes));
  __nv_bfloat16* q = qk;
  __nv_bfloat16* k = qk + qn;
  int rope_blocks = (ITEMS + THREADS - 1) / THREADS;
  int vecs = (int)(bytes / 16), copy_blocks = (vecs + THREADS - 1) / THREADS;

  std::vector<Variant> vs;
  vs.push_back(capture("memcpy DtoD (driver)", st, [&] { CK(cudaMemcpyAsync(dst, qk, bytes, cudaMemcpyDeviceToDevice, st)); }));
  for (int pdl = 0; pdl < 2; pdl++) {
    const char* sfx = pdl ? " +PDL" : "";
    static char names[16][64];
    static int n = 0;
    auto nm = [&](const char* s) { snprintf(names[n], 64, "%s%s", s, sfx); return names[n++]; };
    vs.push_back(capture(nm("empty kernel, same grid"), st, [&] { launch(pdl ? empty_k<true> : empty_k<false>, pdl, rope_blocks, st); }));
    vs.push_back(capture(nm("in-place copy kernel, 16 B/thread"), st, [&] { launch(pdl ? copy_k<true> : copy_k<false>, pdl, copy_blocks, st, (uint4*)qk, vecs); }));
    vs.push_back(capture(nm("rope table (bf16)"), st, [&] { launch(pdl ? rope_k<0, true> : rope_k<0, false>, pdl, rope_blocks, st, q, k, (const int64_t*)pos, (const __nv_bfloat16*)cos_t, (const __nv_bfloat16*)sin_t, (const float*)inv_freq); }));
    vs.push_back(capture(nm("rope computed, f32 sincosf"), st, [&] { launch(pdl ? rope_k<1, true> : rope_k<1, false>, pdl, rope_blocks, st, q, k, (const int64_t*)pos, (const __nv_bfloat16*)cos_t, (const __nv_bfloat16*)sin_t, (const float*)inv_freq); }));
    vs.push_back(capture(nm("rope computed, f64 sincos"), st, [&] { launch(pdl ? rope_k<2, true> : rope_k<2, false>, pdl, rope_blocks, st, q, k, (const int64_t*)pos, (const __nv_bfloat16*)cos_t, (const __nv_bfloat16*)sin_t, (const float*)inv_freq); }));
  }
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (auto& v : vs) CK(cudaGraphLaunch(v.exec, st));
  CK(cudaStreamSynchronize(st));
  for (int r = 0; r < 21; r++) {
    for (auto& v : vs) {
      CK(cudaEventRecord(e0, st));
      CK(cudaGraphLaunch(v.exec, st));
      CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      v.us.push_back(ms * 1000.0f / 100.0f);
    }
  }
  printf("%-44s %10s\n", "variant (graph of 100 launches)", "us/launch");
  for (auto& v : vs) {
    std::sort(v.us.begin(), v.us.end());
    printf("%-44s %10.3f\n", v.name, v.us[v.us.size() / 2]);
  }
  return 0;
}
