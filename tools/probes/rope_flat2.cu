// Probe, second round: one-vector-per-thread RoPE prototypes with cheap index math (32-bit,
// multiply-high division), sin/cos from a table read directly or staged in shared memory per
// block, or computed per thread or once per block into shared memory; U vectors per thread at
// stride blockDim. bf16, d = 128, positions = token index. Not product code.
//   nvcc -O3 -arch=sm_90 -o /tmp/rope_flat2 tools/probes/rope_flat2.cu && /tmp/rope_flat2
// Output of one H200 run: docs/bench/2026-11-22-h200-v23-rope-flat-prototypes.txt
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cmath>
#include <cuda_runtime.h>
#include <cuda_bf16.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

constexpr int D = 128, HALF = 64, HV = 16;
struct alignas(16) V8 { __nv_bfloat162 p[4]; };

__device__ __forceinline__ void cos_sin(long pos, double f, float& c, float& s) {
  double a = (double)pos * f;
  const double M = 6755399441055744.0;
  double sh = fma(a, 0.63661977236758134308, M);
  double k = sh - M;
  unsigned q = (unsigned)__double2loint(sh) & 3;
  double r = fma(-k, 6.123233995736766e-17, fma(-k, 1.5707963267948966, a));
  double z = r * r;
  double ss = -1.0 / 39916800.0; ss = fma(ss, z, 1.0 / 362880.0); ss = fma(ss, z, -1.0 / 5040.0);
  ss = fma(ss, z, 1.0 / 120.0); ss = fma(ss, z, -1.0 / 6.0);
  double sn = fma(r * z, ss, r);
  double cc = -1.0 / 3628800.0; cc = fma(cc, z, 1.0 / 40320.0); cc = fma(cc, z, -1.0 / 720.0);
  cc = fma(cc, z, 1.0 / 24.0); cc = fma(cc, z, -0.5);
  double cs = fma(z, cc, 1.0);
  float fs = (float)sn, fc = (float)cs;
  float C = (q & 1) ? fs : fc, S = (q & 1) ? fc : fs;
  c = __int_as_float(__float_as_int(C) ^ (((q + 1) & 2) << 30));
  s = __int_as_float(__float_as_int(S) ^ ((q & 2) << 30));
}

struct Div { uint32_t d, magic, shift; };
__device__ __forceinline__ uint32_t divu(uint32_t n, Div d) { return __umulhi(n, d.magic) >> d.shift; }
static Div make_div(uint32_t d) {
  uint32_t s = 0; while ((1ull << s) < d) s++;
  uint64_t m = ((1ull << 32) * ((1ull << s) - d)) / d + 1;
  return {d, (uint32_t)m, s == 0 ? 0 : s - 1};
}
// n / d = (umulhi(n, m) + n) >> s for this magic (round-up method, 33-bit); keep it simple:
__device__ __forceinline__ uint32_t divu2(uint32_t n, Div d) {
  uint32_t t = __umulhi(n, d.magic); return (t + ((n - t) >> 1)) >> d.shift;
}

enum Src { TAB = 0, TAB_SMEM = 1, COMP = 2, COMP_SMEM = 3, NONE = 4 };

// U vectors per thread (stride blockDim); NEOX pairs through a shuffle with lane ^ 8.
template <bool NEOX, int SRC, int U>
__global__ void __launch_bounds__(256) rope(const V8* x, V8* out, uint32_t n, Div per_tok,
    const __nv_bfloat16* ct, const __nv_bfloat16* st, const double* inv) {
  __shared__ float2 cs[4 * HALF];
  uint32_t first = blockIdx.x * blockDim.x * U;
  V8 a[U];
#pragma unroll
  for (int u = 0; u < U; u++) { uint32_t i = first + u * blockDim.x + threadIdx.x; if (i < n) a[u] = x[i]; }
  uint32_t t0 = divu2(first, per_tok);
  if (SRC == TAB_SMEM || SRC == COMP_SMEM) {
    uint32_t last = min(first + blockDim.x * U, n) - 1;
    uint32_t ntok = divu2(last, per_tok) - t0 + 1;
    for (uint32_t e = threadIdx.x; e < ntok * HALF; e += blockDim.x) {
      float c, s;
      if (SRC == TAB_SMEM) { c = __bfloat162float(ct[t0 * HALF + e]); s = __bfloat162float(st[t0 * HALF + e]); }
      else cos_sin(t0 + e / HALF, inv[e % HALF], c, s);
      cs[e] = make_float2(c, s);
    }
    __syncthreads();
  }
#pragma unroll
  for (int u = 0; u < U; u++) {
    uint32_t i = first + u * blockDim.x + threadIdx.x;
    uint32_t v = i % HV, tok = divu2(i, per_tok);
    uint32_t j0 = NEOX ? (v & 7) * 8 : v * 4;
    bool hi = NEOX && v >= 8;
    V8 o;
#pragma unroll
    for (int k = 0; k < 4; k++) {
      float2 xm = __bfloat1622float2(a[u].p[k]);
      float c0, s0, c1, s1;
      uint32_t p0 = NEOX ? j0 + 2 * k : j0 + k, p1 = NEOX ? p0 + 1 : p0;
      if (SRC == TAB) {
        c0 = __bfloat162float(__ldg(ct + tok * HALF + p0)); s0 = __bfloat162float(__ldg(st + tok * HALF + p0));
        c1 = __bfloat162float(__ldg(ct + tok * HALF + p1)); s1 = __bfloat162float(__ldg(st + tok * HALF + p1));
      } else if (SRC == COMP) {
        cos_sin(tok, inv[p0], c0, s0); if (NEOX) cos_sin(tok, inv[p1], c1, s1); else { c1 = c0; s1 = s0; }
      } else if (SRC == NONE) { c0 = c1 = 1.f; s0 = s1 = 0.f; }
      else { float2 q0 = cs[(tok - t0) * HALF + p0], q1 = cs[(tok - t0) * HALF + p1]; c0 = q0.x; s0 = q0.y; c1 = q1.x; s1 = q1.y; }
      if (NEOX) {
        uint32_t mine = *(uint32_t*)&a[u].p[k];
        uint32_t other = __shfl_xor_sync(0xffffffff, mine, 8);
        float2 xo = __bfloat1622float2(*(__nv_bfloat162*)&other);
        float sg = hi ? 1.f : -1.f;
        o.p[k] = __floats2bfloat162_rn(xm.x * c0 + sg * xo.x * s0, xm.y * c1 + sg * xo.y * s1);
      } else {
        o.p[k] = __floats2bfloat162_rn(xm.x * c0 - xm.y * s0, xm.y * c0 + xm.x * s0);
      }
    }
    if (i < n) out[i] = o;
  }
}

template <int U> __global__ void copyk(const V8* x, V8* out, uint32_t n) {
  uint32_t first = blockIdx.x * blockDim.x * U;
  V8 a[U];
#pragma unroll
  for (int u = 0; u < U; u++) { uint32_t i = first + u * blockDim.x + threadIdx.x; if (i < n) a[u] = x[i]; }
#pragma unroll
  for (int u = 0; u < U; u++) { uint32_t i = first + u * blockDim.x + threadIdx.x; if (i < n) out[i] = a[u]; }
}

static void* flushbuf; static const size_t FLUSH = 256u << 20;
template <class F> float median_ms(F launch, int runs = 40) {
  cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; i++) launch();
  std::vector<float> t;
  for (int i = 0; i < runs; i++) {
    CK(cudaMemsetAsync(flushbuf, i & 0xff, FLUSH));
    CK(cudaEventRecord(a)); launch(); CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b)); CK(cudaGetLastError());
    float ms; CK(cudaEventElapsedTime(&ms, a, b)); t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main() {
  CK(cudaMalloc(&flushbuf, FLUSH));
  cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0)); printf("device %s\n", prop.name);
  { Div d = make_div(640); for (uint32_t n : {0u, 639u, 640u, 5242879u, 4000000000u}) {
      uint64_t t = ((uint64_t)n * d.magic) >> 32; uint32_t q = (uint32_t)((t + ((n - t) >> 1)) >> d.shift);
      if (q != n / 640) { printf("bad magic %u: %u vs %u\n", n, q, n / 640); return 1; } } }
  struct Shape { const char* name; uint32_t tokens, heads; bool inplace; };
  Shape shapes[] = {{"prefill 8192x40 in place", 8192, 40, true},
                    {"training 16384x64 out of place", 16384, 64, false},
                    {"decode 64x40 in place", 64, 40, true}};
  for (auto sh : shapes) {
    uint32_t n = sh.tokens * sh.heads * HV; size_t bytes = (size_t)n * 16;
    V8 *x, *y; CK(cudaMalloc(&x, bytes)); CK(cudaMalloc(&y, bytes));
    std::vector<uint16_t> hx((size_t)n * 8);
    for (size_t i = 0; i < hx.size(); i++) hx[i] = 0x3f80 + (i * 2654435761u >> 20) % 255;
    CK(cudaMemcpy(x, hx.data(), bytes, cudaMemcpyHostToDevice));
    __nv_bfloat16 *ct, *st; double* inv;
    CK(cudaMalloc(&ct, sh.tokens * HALF * 2)); CK(cudaMalloc(&st, sh.tokens * HALF * 2));
    CK(cudaMemset(ct, 0x3f, sh.tokens * HALF * 2)); CK(cudaMemset(st, 0x3e, sh.tokens * HALF * 2));
    std::vector<double> hinv(HALF); for (int i = 0; i < HALF; i++) hinv[i] = pow(500000.0, -2.0 * i / D);
    CK(cudaMalloc(&inv, HALF * 8)); CK(cudaMemcpy(inv, hinv.data(), HALF * 8, cudaMemcpyHostToDevice));
    V8* o = sh.inplace ? x : y;
    Div pt = make_div(sh.heads * HV);
    float copy = median_ms([&] { CK(cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice)); });
    printf("\n== %s: %.1f MB, driver copy %.2f us\n", sh.name, bytes / 1e6, copy * 1e3);
    auto row = [&](const char* name, auto f) { float ms = median_ms(f);
      printf("%-34s %8.2f us %6.1f%%\n", name, ms * 1e3, 100.0 * copy / ms); };
#define R(NX, S, U) row(#NX " src" #S " U" #U, [&] { \
      rope<NX, S, U><<<(n + 256 * U - 1) / (256 * U), 256>>>(x, o, n, pt, ct, st, inv); });
    for (int rep = 0; rep < 2; rep++) {
      row("copy kernel U1", [&] { copyk<1><<<(n + 255) / 256, 256>>>(x, o, n); });
      row("copy kernel U2", [&] { copyk<2><<<(n + 511) / 512, 256>>>(x, o, n); });
      R(false, 4, 1) R(false, 0, 1) R(false, 1, 1) R(false, 2, 1) R(false, 3, 1)
      R(false, 0, 2) R(false, 1, 2) R(false, 3, 2) R(false, 3, 4)
      R(true, 4, 1) R(true, 0, 1) R(true, 1, 1) R(true, 3, 1) R(true, 1, 2) R(true, 3, 2)
    }
    CK(cudaFree(x)); CK(cudaFree(y)); CK(cudaFree(ct)); CK(cudaFree(st)); CK(cudaFree(inv));
  }
}
