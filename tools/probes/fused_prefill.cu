// Probe: how fast a fused q/k RMS norm + NeoX RoPE launch can be at prefill, by thread mapping.
// Not product code (the product's kernels are Rust, rope-kernels/); it measures which mapping
// reaches the fused-kernel issue's target (90% of a device copy of the same bytes).
// Build and run on the GPU machine:
//   nvcc -O3 -arch=sm_90 -Xptxas -v -o /tmp/fused_prefill tools/probes/fused_prefill.cu && /tmp/fused_prefill
// Shape: 8192 tokens, 32 q + 8 k heads of 128 bf16, separate q and k tensors, in place, NeoX,
// bf16 weights per tensor, eps 1e-6, position = token, sin/cos from an f32 [8192, 64] table (or
// f64 sincos of position * inv_freq per item, as rope-rs's computed path).
// Each variant: a graph of 100 launches, median of 15 timed replays, per launch; variants are
// interleaved replay by replay. Every variant's output after one launch is compared with the
// first norm + rope variant's.
#include <cstdio>
#include <cstdint>
#include <cmath>
#include <vector>
#include <algorithm>
#include <functional>
#include <cuda_runtime.h>
#include <cuda_bf16.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

constexpr int T = 8192, HQ = 32, HK = 8, H = HQ + HK, D = 128, HALF = 64;
constexpr float EPS = 1e-6f;

__device__ __forceinline__ float lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ uint32_t pack(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}

// One thread's share of one head: N pairs (x[j..j+N], x[j+64..j+64+N]) as f32.
template <int N> struct Part { float a[N], b[N]; };

template <int N> __device__ __forceinline__ void load_raw(const __nv_bfloat16* head, int j, uint32_t (&ra)[N / 2], uint32_t (&rb)[N / 2]) {
  if constexpr (N == 4) {
    uint2 a = *reinterpret_cast<const uint2*>(head + j);
    uint2 b = *reinterpret_cast<const uint2*>(head + j + HALF);
    ra[0] = a.x; ra[1] = a.y; rb[0] = b.x; rb[1] = b.y;
  } else {
    uint4 a = *reinterpret_cast<const uint4*>(head + j);
    uint4 b = *reinterpret_cast<const uint4*>(head + j + HALF);
    ra[0] = a.x; ra[1] = a.y; ra[2] = a.z; ra[3] = a.w;
    rb[0] = b.x; rb[1] = b.y; rb[2] = b.z; rb[3] = b.w;
  }
}

template <int N> __device__ __forceinline__ Part<N> widen(const uint32_t (&ra)[N / 2], const uint32_t (&rb)[N / 2]) {
  Part<N> p;
#pragma unroll
  for (int i = 0; i < N / 2; i++) {
    p.a[2 * i] = lo(ra[i]); p.a[2 * i + 1] = hi(ra[i]);
    p.b[2 * i] = lo(rb[i]); p.b[2 * i + 1] = hi(rb[i]);
  }
  return p;
}

template <int N> __device__ __forceinline__ void store(__nv_bfloat16* head, int j, const Part<N>& y) {
  if constexpr (N == 4) {
    *reinterpret_cast<uint2*>(head + j) = make_uint2(pack(y.a[0], y.a[1]), pack(y.a[2], y.a[3]));
    *reinterpret_cast<uint2*>(head + j + HALF) = make_uint2(pack(y.b[0], y.b[1]), pack(y.b[2], y.b[3]));
  } else {
    *reinterpret_cast<uint4*>(head + j) = make_uint4(pack(y.a[0], y.a[1]), pack(y.a[2], y.a[3]), pack(y.a[4], y.a[5]), pack(y.a[6], y.a[7]));
    *reinterpret_cast<uint4*>(head + j + HALF) = make_uint4(pack(y.b[0], y.b[1]), pack(y.b[2], y.b[3]), pack(y.b[4], y.b[5]), pack(y.b[6], y.b[7]));
  }
}

// Sum over the W lanes of this thread's segment (butterfly, every lane gets the sum).
template <int W> __device__ __forceinline__ float seg_sum(float v) {
#pragma unroll
  for (int s = 1; s < W; s <<= 1) v += __shfl_xor_sync(0xffffffffu, v, s);
  return v;
}

// Norm (optional) and rotation of one part, in place.
template <int N, int W, bool NORM> __device__ __forceinline__ void finish(Part<N>& p, const Part<N>& w, const float (&c)[N], const float (&s)[N]) {
  if (NORM) {
    float sq = 0.f;
#pragma unroll
    for (int i = 0; i < N; i++) { sq = fmaf(p.a[i], p.a[i], sq); sq = fmaf(p.b[i], p.b[i], sq); }
    float r = rsqrtf(fmaf(seg_sum<W>(sq), 1.0f / D, EPS));
#pragma unroll
    for (int i = 0; i < N; i++) { p.a[i] *= r * w.a[i]; p.b[i] *= r * w.b[i]; }
  }
#pragma unroll
  for (int i = 0; i < N; i++) {
    float a = p.a[i], b = p.b[i];
    p.a[i] = fmaf(a, c[i], -b * s[i]);
    p.b[i] = fmaf(b, c[i], a * s[i]);
  }
}

template <int N> __device__ __forceinline__ void load_cs(const float* cos_t, const float* sin_t, int t, int j, float (&c)[N], float (&s)[N]) {
#pragma unroll
  for (int i = 0; i < N; i += 4) {
    float4 cv = *reinterpret_cast<const float4*>(cos_t + (size_t)t * HALF + j + i);
    float4 sv = *reinterpret_cast<const float4*>(sin_t + (size_t)t * HALF + j + i);
    c[i] = cv.x; c[i + 1] = cv.y; c[i + 2] = cv.z; c[i + 3] = cv.w;
    s[i] = sv.x; s[i + 1] = sv.y; s[i + 2] = sv.z; s[i + 3] = sv.w;
  }
}

template <int N> __device__ __forceinline__ void compute_cs(const double* inv_freq, int t, int j, float (&c)[N], float (&s)[N]) {
#pragma unroll
  for (int i = 0; i < N; i++) {
    double sd, cd;
    sincos((double)t * inv_freq[j + i], &sd, &cd);
    c[i] = (float)cd; s[i] = (float)sd;
  }
}

template <int N> __device__ __forceinline__ Part<N> load_w(const __nv_bfloat16* w, int j) {
  uint32_t ra[N / 2], rb[N / 2];
  load_raw<N>(w, j, ra, rb);
  return widen<N>(ra, rb);
}

// Heads [h0, h1) of one tensor of `heads` heads per token, U at a time (loads first).
template <int N, int W, int U, bool NORM>
__device__ __forceinline__ void run_heads(__nv_bfloat16* tok, const Part<N>& w, int h0, int h1, int j, const float (&c)[N], const float (&s)[N]) {
  int h = h0;
  for (; h + U <= h1; h += U) {
    uint32_t ra[U][N / 2], rb[U][N / 2];
#pragma unroll
    for (int u = 0; u < U; u++) load_raw<N>(tok + (size_t)(h + u) * D, j, ra[u], rb[u]);
#pragma unroll
    for (int u = 0; u < U; u++) {
      Part<N> p = widen<N>(ra[u], rb[u]);
      finish<N, W, NORM>(p, w, c, s);
      store<N>(tok + (size_t)(h + u) * D, j, p);
    }
  }
  for (; h < h1; h++) {
    uint32_t ra[N / 2], rb[N / 2];
    load_raw<N>(tok + (size_t)h * D, j, ra, rb);
    Part<N> p = widen<N>(ra, rb);
    finish<N, W, NORM>(p, w, c, s);
    store<N>(tok + (size_t)h * D, j, p);
  }
}

// Item loop: thread = (token, group of N pairs); block row blockIdx.y takes heads
// [y * chunk, (y + 1) * chunk) of q's then k's; q's part, then k's, each with its weights held.
template <int N, int U, bool NORM, bool COMPUTED>
__global__ void __launch_bounds__(128) item_k(__nv_bfloat16* q, __nv_bfloat16* k, const __nv_bfloat16* wq, const __nv_bfloat16* wk,
                       const float* cos_t, const float* sin_t, const double* inv_freq, int chunk) {
  constexpr int W = HALF / N;
  int idx = blockIdx.x * blockDim.x + threadIdx.x;
  int t = idx / W, j = (idx % W) * N;
  if (t >= T) return;
  int h0 = blockIdx.y * chunk, h1 = min(h0 + chunk, H);
  float c[N], s[N];
  if (COMPUTED) compute_cs<N>(inv_freq, t, j, c, s); else load_cs<N>(cos_t, sin_t, t, j, c, s);
  if (h0 < HQ) {
    Part<N> w = NORM ? load_w<N>(wq, j) : Part<N>{};
    run_heads<N, W, U, NORM>(q + (size_t)t * HQ * D, w, h0, min(h1, HQ), j, c, s);
  }
  if (h1 > HQ) {
    Part<N> w = NORM ? load_w<N>(wk, j) : Part<N>{};
    run_heads<N, W, U, NORM>(k + (size_t)t * HK * D, w, max(h0, HQ) - HQ, h1 - HQ, j, c, s);
  }
}

// Item loop with the next pair of heads' loads issued before the current pair is finished.
template <int N, bool NORM>
__device__ __forceinline__ void run_heads_pipe(__nv_bfloat16* tok, const Part<N>& w, int h0, int h1, int j, const float (&c)[N], const float (&s)[N]) {
  constexpr int W = HALF / N;
  if (h0 >= h1) return;
  uint32_t ra[2][N / 2], rb[2][N / 2];
  load_raw<N>(tok + (size_t)h0 * D, j, ra[0], rb[0]);
  if (h0 + 1 < h1) load_raw<N>(tok + (size_t)(h0 + 1) * D, j, ra[1], rb[1]);
  for (int h = h0; h < h1; h += 2) {
    Part<N> p0 = widen<N>(ra[0], rb[0]);
    Part<N> p1 = widen<N>(ra[1], rb[1]);
    if (h + 2 < h1) load_raw<N>(tok + (size_t)(h + 2) * D, j, ra[0], rb[0]);
    if (h + 3 < h1) load_raw<N>(tok + (size_t)(h + 3) * D, j, ra[1], rb[1]);
    finish<N, W, NORM>(p0, w, c, s);
    store<N>(tok + (size_t)h * D, j, p0);
    if (h + 1 < h1) {
      finish<N, W, NORM>(p1, w, c, s);
      store<N>(tok + (size_t)(h + 1) * D, j, p1);
    }
  }
}

template <int N, bool NORM>
__global__ void __launch_bounds__(128) pipe_k(__nv_bfloat16* q, __nv_bfloat16* k, const __nv_bfloat16* wq, const __nv_bfloat16* wk,
                       const float* cos_t, const float* sin_t, int chunk) {
  constexpr int W = HALF / N;
  int idx = blockIdx.x * blockDim.x + threadIdx.x;
  int t = idx / W, j = (idx % W) * N;
  if (t >= T) return;
  int h0 = blockIdx.y * chunk, h1 = min(h0 + chunk, H);
  float c[N], s[N];
  load_cs<N>(cos_t, sin_t, t, j, c, s);
  if (h0 < HQ) {
    Part<N> w = NORM ? load_w<N>(wq, j) : Part<N>{};
    run_heads_pipe<N, NORM>(q + (size_t)t * HQ * D, w, h0, min(h1, HQ), j, c, s);
  }
  if (h1 > HQ) {
    Part<N> w = NORM ? load_w<N>(wk, j) : Part<N>{};
    run_heads_pipe<N, NORM>(k + (size_t)t * HK * D, w, max(h0, HQ) - HQ, h1 - HQ, j, c, s);
  }
}

// Flat: thread = (token, head block of U heads, group of N pairs), no loop; sin/cos and
// weights read per thread (cache hits).
template <int N, int U>
__global__ void __launch_bounds__(128) flat_k(__nv_bfloat16* q, __nv_bfloat16* k, const __nv_bfloat16* wq, const __nv_bfloat16* wk,
                       const float* cos_t, const float* sin_t) {
  constexpr int W = HALF / N;
  int idx = blockIdx.x * blockDim.x + threadIdx.x;
  int g = idx % W, r = idx / W, hb = r % (H / U), t = r / (H / U);
  if (t >= T) return;
  int h = hb * U, j = g * N;
  __nv_bfloat16* tok = h < HQ ? q + ((size_t)t * HQ + h) * D : k + ((size_t)t * HK + h - HQ) * D;
  uint32_t ra[U][N / 2], rb[U][N / 2];
#pragma unroll
  for (int u = 0; u < U; u++) load_raw<N>(tok + (size_t)u * D, j, ra[u], rb[u]);
  Part<N> w = load_w<N>(h < HQ ? wq : wk, j);
  float c[N], s[N];
  load_cs<N>(cos_t, sin_t, t, j, c, s);
#pragma unroll
  for (int u = 0; u < U; u++) {
    Part<N> p = widen<N>(ra[u], rb[u]);
    finish<N, W, true>(p, w, c, s);
    store<N>(tok + (size_t)u * D, j, p);
  }
}


// Flat, one token per block row: grid (tokens, ceil(H * W / 128)); thread = (head, group) of
// token blockIdx.x. Computed sin/cos: the block's threads compute the token's pairs once into
// shared memory (after issuing their loads), then read their own.
template <int N, int SRC>
__global__ void __launch_bounds__(128) tok_k(__nv_bfloat16* q, __nv_bfloat16* k, const __nv_bfloat16* wq, const __nv_bfloat16* wk,
                       const float* cos_t, const float* sin_t, const double* inv_freq) {
  constexpr int W = HALF / N;
  __shared__ float cs_sh[2 * HALF];
  int t = blockIdx.x, unit = blockIdx.y * 128 + threadIdx.x;
  int h = unit / W, g = unit % W, j = g * N;
  bool live = h < H;
  __nv_bfloat16* tok = h < HQ ? q + ((size_t)t * HQ + h) * D : k + ((size_t)t * HK + h - HQ) * D;
  uint32_t ra[N / 2] = {}, rb[N / 2] = {};
  if (live) load_raw<N>(tok, j, ra, rb);
  float c[N], s[N];
  if (SRC == 0) {
    load_cs<N>(cos_t, sin_t, t, j, c, s);
  } else if (SRC == 1) {
    if (threadIdx.x < HALF) {
      double sd, cd;
      sincos((double)t * inv_freq[threadIdx.x], &sd, &cd);
      cs_sh[threadIdx.x] = (float)cd; cs_sh[HALF + threadIdx.x] = (float)sd;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < N; i++) { c[i] = cs_sh[j + i]; s[i] = cs_sh[HALF + j + i]; }
  } else {
    compute_cs<N>(inv_freq, t, j, c, s);
  }
  Part<N> w = live ? load_w<N>(h < HQ ? wq : wk, j) : Part<N>{};
  Part<N> p = widen<N>(ra, rb);
  finish<N, W, true>(p, w, c, s);
  if (live) store<N>(tok, j, p);
}

__global__ void copy_k(uint4* dst, const uint4* src, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = src[i];
}

struct Variant {
  const char* name;
  double bytes_share;  // of the q, k copy
  cudaGraphExec_t exec;
  std::vector<float> us;
};

template <typename F>
static Variant capture(const char* name, cudaStream_t st, F launch) {
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  for (int r = 0; r < 100; r++) launch();
  CK(cudaStreamEndCapture(st, &g));
  Variant v{name, 1.0, nullptr, {}};
  CK(cudaGraphInstantiate(&v.exec, g, 0));
  return v;
}

static float bf(__nv_bfloat16 x) { return __bfloat162float(x); }

int main() {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("device: %s\n", prop.name);
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  size_t qn = (size_t)T * HQ * D, kn = (size_t)T * HK * D, n = qn + kn, bytes = n * 2;
  __nv_bfloat16 *qk, *init, *dst, *ref, *wq, *wk;
  float *cos_t, *sin_t;
  double* inv_freq;
  CK(cudaMalloc(&qk, bytes));
  CK(cudaMalloc(&init, bytes));
  CK(cudaMalloc(&dst, bytes));
  CK(cudaMalloc(&ref, bytes));
  CK(cudaMalloc(&wq, D * 2));
  CK(cudaMalloc(&wk, D * 2));
  CK(cudaMalloc(&cos_t, (size_t)T * HALF * 4));
  CK(cudaMalloc(&sin_t, (size_t)T * HALF * 4));
  CK(cudaMalloc(&inv_freq, HALF * 8));
  std::vector<__nv_bfloat16> hx(n), hw(D);
  uint32_t rng = 12345;
  for (auto& x : hx) { rng = rng * 1664525u + 1013904223u; x = __float2bfloat16(((rng >> 8) & 0xffff) / 32768.0f - 1.0f); }
  for (int e = 0; e < D; e++) hw[e] = __float2bfloat16(0.8f + 0.003f * e);
  std::vector<double> hf(HALF);
  for (int j = 0; j < HALF; j++) hf[j] = pow(1000000.0, -2.0 * j / D);
  std::vector<float> hc((size_t)T * HALF), hs((size_t)T * HALF);
  for (int t = 0; t < T; t++)
    for (int j = 0; j < HALF; j++) { hc[(size_t)t * HALF + j] = (float)cos(t * hf[j]); hs[(size_t)t * HALF + j] = (float)sin(t * hf[j]); }
  CK(cudaMemcpy(init, hx.data(), bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(wq, hw.data(), D * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(wk, hw.data(), D * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(cos_t, hc.data(), hc.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(sin_t, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(inv_freq, hf.data(), HALF * 8, cudaMemcpyHostToDevice));
  __nv_bfloat16* q = qk;
  __nv_bfloat16* k = qk + qn;

  struct Launch { const char* name; bool norm; std::function<void()> f; };
  std::vector<Launch> ls;
  auto item = [&](auto kern, int N, int chunk) {
    int items = T * (HALF / N);
    dim3 grid((items + 127) / 128, (H + chunk - 1) / chunk);
    return [=] { kern<<<grid, 128, 0, st>>>(q, k, wq, wk, cos_t, sin_t, inv_freq, chunk); };
  };
  auto pipe = [&](auto kern, int N, int chunk) {
    int items = T * (HALF / N);
    dim3 grid((items + 127) / 128, (H + chunk - 1) / chunk);
    return [=] { kern<<<grid, 128, 0, st>>>(q, k, wq, wk, cos_t, sin_t, chunk); };
  };
  auto flat = [&](auto kern, int N, int U) {
    int threads = T * (H / U) * (HALF / N);
    int grid = (threads + 127) / 128;
    return [=] { kern<<<grid, 128, 0, st>>>(q, k, wq, wk, cos_t, sin_t); };
  };
  ls.push_back({"item N4 U2 chunk20 (rope-rs shape)", true, item(item_k<4, 2, true, false>, 4, 20)});
  ls.push_back({"item N4 U2 chunk20, rope only", false, item(item_k<4, 2, false, false>, 4, 20)});
  ls.push_back({"item N4 U2 chunk40", true, item(item_k<4, 2, true, false>, 4, 40)});
  ls.push_back({"item N4 U2 chunk10", true, item(item_k<4, 2, true, false>, 4, 10)});
  ls.push_back({"item N4 U4 chunk20", true, item(item_k<4, 4, true, false>, 4, 20)});
  ls.push_back({"item N4 U2 chunk20, f64 sincos", true, item(item_k<4, 2, true, true>, 4, 20)});
  ls.push_back({"item N8 U1 chunk20", true, item(item_k<8, 1, true, false>, 8, 20)});
  ls.push_back({"item N8 U2 chunk20", true, item(item_k<8, 2, true, false>, 8, 20)});
  ls.push_back({"pipe N4 chunk20", true, pipe(pipe_k<4, true>, 4, 20)});
  ls.push_back({"pipe N4 chunk40", true, pipe(pipe_k<4, true>, 4, 40)});
  auto tok = [&](auto kern, int N) {
    dim3 grid(T, (H * (HALF / N) + 127) / 128);
    return [=] { kern<<<grid, 128, 0, st>>>(q, k, wq, wk, cos_t, sin_t, inv_freq); };
  };
  ls.push_back({"token rows N4, table", true, tok(tok_k<4, 0>, 4)});
  ls.push_back({"token rows N4, f64 sincos in shared", true, tok(tok_k<4, 1>, 4)});
  ls.push_back({"token rows N4, f64 sincos per thread", true, tok(tok_k<4, 2>, 4)});
  ls.push_back({"token rows N8, f64 sincos in shared", true, tok(tok_k<8, 1>, 8)});
  ls.push_back({"flat N4 U1", true, flat(flat_k<4, 1>, 4, 1)});
  ls.push_back({"flat N4 U2", true, flat(flat_k<4, 2>, 4, 2)});
  ls.push_back({"flat N8 U1", true, flat(flat_k<8, 1>, 8, 1)});
  ls.push_back({"flat N8 U2", true, flat(flat_k<8, 2>, 8, 2)});

  // Correctness: one launch of each from the same input against the first.
  std::vector<__nv_bfloat16> a(n), b(n);
  for (size_t i = 0; i < ls.size(); i++) {
    CK(cudaMemcpy(qk, init, bytes, cudaMemcpyDeviceToDevice));
    ls[i].f();
    CK(cudaStreamSynchronize(st));
    CK(cudaGetLastError());
    if (i == 0) {
      CK(cudaMemcpy(a.data(), qk, bytes, cudaMemcpyDeviceToHost));
      // CPU reference for a few tokens.
      double worst = 0;
      for (int t : {0, 1, 777, 8191}) for (int h = 0; h < H; h++) {
        size_t base = h < HQ ? ((size_t)t * HQ + h) * D : qn + ((size_t)t * HK + h - HQ) * D;
        double ss = 0;
        for (int e = 0; e < D; e++) ss += (double)bf(hx[base + e]) * bf(hx[base + e]);
        double r = 1.0 / sqrt(ss / D + EPS);
        for (int jj = 0; jj < HALF; jj++) {
          double x0 = bf(hx[base + jj]) * r * bf(hw[jj]), x1 = bf(hx[base + jj + HALF]) * r * bf(hw[jj + HALF]);
          double c = cos(t * hf[jj]), s = sin(t * hf[jj]);
          double y0 = x0 * c - x1 * s, y1 = x1 * c + x0 * s;
          worst = std::max(worst, fabs(y0 - bf(a[base + jj])) / (fabs(y0) * 0.0079 + 1e-3));
          worst = std::max(worst, fabs(y1 - bf(a[base + jj + HALF])) / (fabs(y1) * 0.0079 + 1e-3));
        }
      }
      printf("reference check of the first variant: worst error / (bf16 step + 1e-3) = %.3f\n", worst);
    } else if (ls[i].norm) {
      CK(cudaMemcpy(b.data(), qk, bytes, cudaMemcpyDeviceToHost));
      double md = 0;
      for (size_t e = 0; e < n; e++) md = std::max(md, (double)fabs(bf(a[e]) - bf(b[e])));
      printf("%-40s max |diff| vs first: %.4g\n", ls[i].name, md);
    }
  }
  CK(cudaMemcpy(qk, init, bytes, cudaMemcpyDeviceToDevice));

  std::vector<Variant> vs;
  int vecs = (int)(bytes / 16);
  vs.push_back(capture("memcpy DtoD of q, k (driver)", st, [&] { CK(cudaMemcpyAsync(dst, qk, bytes, cudaMemcpyDeviceToDevice, st)); }));
  vs.push_back(capture("copy kernel 16 B/thread", st, [&] { copy_k<<<(vecs + 255) / 256, 256, 0, st>>>((uint4*)dst, (const uint4*)qk, vecs); }));
  for (auto& l : ls) vs.push_back(capture(l.name, st, l.f));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (auto& v : vs) CK(cudaGraphLaunch(v.exec, st));
  CK(cudaStreamSynchronize(st));
  for (int r = 0; r < 15; r++) {
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
  float copy_us = 0;
  printf("%-44s %10s %8s %8s\n", "variant (graph of 100 launches)", "us/launch", "GB/s", "% copy");
  for (auto& v : vs) {
    std::sort(v.us.begin(), v.us.end());
    float us = v.us[v.us.size() / 2];
    if (copy_us == 0) copy_us = us;
    printf("%-44s %10.2f %8.0f %8.1f\n", v.name, us, 2.0 * bytes / us / 1e3, 100.0 * copy_us / us);
  }
  return 0;
}
