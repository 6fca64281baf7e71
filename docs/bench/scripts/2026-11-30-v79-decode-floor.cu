// Issue 53 evidence (log v79), not product code: how fast a RoPE decode step of rope-bench's
// decode shape (b64, 32 q + 8 k heads of 128 bf16, in place, NeoX, i64 ids) can run in a
// 100-launch CUDA graph. Minimal hand-written kernels (a copy on the same grid, a table and a
// computed rotation, the table one with rope-rs' parameter block or a compact one) next to the
// driver's copy of the same bytes and rope-rs' one-head kernels loaded from cubins (the
// variants that 2026-11-30-v79-one-head-variants.py writes, listed in ./variants.txt), each
// launch's outputs compared with the minimal table kernel's first.
// Build and run where the cubins are: nvcc -O3 -arch=sm_90 -std=c++17 THIS.cu -o df -lcuda;
// ./df busy (each graph timed behind an untimed one), ./df rb (rope-bench's order: 100 eager
// launches timed, then the graph from an idle stream), ./df (the graph from an idle stream).
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <functional>
#include <cmath>
#include <cstring>
#include <string>
#include <cuda.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

constexpr int B = 64, HQ = 32, HK = 8, D = 128, HALF = 64, L = 4, GROUPS = HALF / L;

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

__global__ void empty_kernel() {}

// Same grid as rope-rs' one-head kernel: x = tokens * groups / 128 blocks, y = heads.
template <bool PDL>
__global__ void __launch_bounds__(128) copy_inplace(__nv_bfloat16* q, __nv_bfloat16* k) {
  if (PDL) pdl_wait();
  unsigned idx = blockIdx.x * 128 + threadIdx.x;
  unsigned token = idx / GROUPS, group = idx % GROUPS;
  unsigned h = blockIdx.y;
  __nv_bfloat16* t = h < HQ ? q + (size_t(token) * HQ + h) * D : k + (size_t(token) * HK + h - HQ) * D;
  uint2* a = (uint2*)(t + group * L);
  uint2* b = (uint2*)(t + HALF + group * L);
  uint2 va = *a, vb = *b;
  va.x ^= 0x00010000u; vb.y ^= 0x00010000u;
  *a = va; *b = vb;
}

__device__ __forceinline__ void rot(__nv_bfloat16* t, unsigned group, const float* c, const float* s) {
  uint2* a = (uint2*)(t + group * L);
  uint2* b = (uint2*)(t + HALF + group * L);
  uint2 va = *a, vb = *b;
  __nv_bfloat16* x = (__nv_bfloat16*)&va;
  __nv_bfloat16* y = (__nv_bfloat16*)&vb;
  uint2 oa, ob;
  __nv_bfloat16* ox = (__nv_bfloat16*)&oa;
  __nv_bfloat16* oy = (__nv_bfloat16*)&ob;
#pragma unroll
  for (int i = 0; i < L; i++) {
    float x0 = __bfloat162float(x[i]), y0 = __bfloat162float(y[i]);
    ox[i] = __float2bfloat16(x0 * c[i] - y0 * s[i]);
    oy[i] = __float2bfloat16(y0 * c[i] + x0 * s[i]);
  }
  *a = oa; *b = ob;
}

// Minimal table kernel: position, then the table row's four cos and four sin (bf16, row of
// [cos 64 | sin 64]); the head's loads are independent of the position.
template <bool PDL>
__global__ void __launch_bounds__(128) rope_table(__nv_bfloat16* q, __nv_bfloat16* k, const long long* pos,
                                                  const __nv_bfloat16* table) {
  if (PDL) pdl_wait();
  unsigned idx = blockIdx.x * 128 + threadIdx.x;
  unsigned token = idx / GROUPS, group = idx % GROUPS;
  unsigned h = blockIdx.y;
  long long p = pos[token];
  __nv_bfloat16* t = h < HQ ? q + (size_t(token) * HQ + h) * D : k + (size_t(token) * HK + h - HQ) * D;
  uint2 cr = *(const uint2*)(table + p * D + group * L);
  uint2 sr = *(const uint2*)(table + p * D + HALF + group * L);
  float c[L], s[L];
  for (int i = 0; i < L; i++) {
    c[i] = __bfloat162float(((__nv_bfloat16*)&cr)[i]);
    s[i] = __bfloat162float(((__nv_bfloat16*)&sr)[i]);
  }
  rot(t, group, c, s);
}

// Computed: frequencies loaded first, then the position, f32 sincos (accurate).
template <bool PDL>
__global__ void __launch_bounds__(128) rope_computed(__nv_bfloat16* q, __nv_bfloat16* k, const long long* pos,
                                                     const float* inv_freq) {
  if (PDL) pdl_wait();
  unsigned idx = blockIdx.x * 128 + threadIdx.x;
  unsigned token = idx / GROUPS, group = idx % GROUPS;
  unsigned h = blockIdx.y;
  float4 f = *(const float4*)(inv_freq + group * L);
  long long p = pos[token];
  __nv_bfloat16* t = h < HQ ? q + (size_t(token) * HQ + h) * D : k + (size_t(token) * HK + h - HQ) * D;
  float fr[4] = {f.x, f.y, f.z, f.w};
  float c[L], s[L];
  for (int i = 0; i < L; i++) sincosf(float(p) * fr[i], &s[i], &c[i]);
  rot(t, group, c, s);
}

// The table kernel with rope-rs' parameter block size (about 300 bytes) and strides, magic
// divisions and pointers read from it.
struct Big {
  __nv_bfloat16* x0; __nv_bfloat16* out0; unsigned heads0; unsigned long long xs0[3], os0[3];
  __nv_bfloat16* x1; __nv_bfloat16* out1; unsigned heads1; unsigned long long xs1[3], os1[3];
  unsigned long long tokens; unsigned seq, seq_magic, seq_shift, hpc, groups, groups_magic, groups_shift, rot_groups, half, rotary_dim, rotary_offset, lanes;
  const __nv_bfloat16* cos; const __nv_bfloat16* sin; unsigned long long table_stride, table_rows; unsigned table_elem;
  const double* inv_freq; unsigned angle_mode; float cs_scale; unsigned position_code; const long long* pos_ptr; const void* pos_aux; unsigned pos_count; long long pos_base;
  float sin_sign; unsigned read_ahead;
};

template <bool PDL>
__global__ void __launch_bounds__(128) rope_table_big(const __grid_constant__ Big a) {
  if (PDL) pdl_wait();
  unsigned idx = blockIdx.x * 128 + threadIdx.x;
  if (idx >= a.tokens * a.rot_groups) return;
  unsigned token = __umulhi(idx, a.groups_magic) >> a.groups_shift;
  unsigned group = idx - token * a.groups;
  unsigned b = __umulhi(token, a.seq_magic) >> a.seq_shift;
  unsigned s = token - b * a.seq;
  unsigned h = blockIdx.y;
  long long p = a.pos_ptr[b] + s;
  if (p < 0 || p >= (long long)a.table_rows) p = 0;
  __nv_bfloat16* t;
  if (h < a.heads0) t = a.x0 + (b * (unsigned)a.xs0[0] + s * (unsigned)a.xs0[1] + h * (unsigned)a.xs0[2]);
  else t = a.x1 + (b * (unsigned)a.xs1[0] + s * (unsigned)a.xs1[1] + (h - a.heads0) * (unsigned)a.xs1[2]);
  uint2 cr = *(const uint2*)(a.cos + p * a.table_stride + group * L);
  uint2 sr = *(const uint2*)(a.sin + p * a.table_stride + group * L);
  float c[L], s2[L];
  for (int i = 0; i < L; i++) {
    c[i] = __bfloat162float(((__nv_bfloat16*)&cr)[i]);
    s2[i] = a.sin_sign * __bfloat162float(((__nv_bfloat16*)&sr)[i]);
  }
  rot(t, group, c, s2);
}

struct Pad { unsigned long long w[34]; };

template <bool PDL>
__global__ void __launch_bounds__(128) rope_table_pad(__nv_bfloat16* q, __nv_bfloat16* k, const long long* pos,
                                                      const __nv_bfloat16* table, const __grid_constant__ Pad pad) {
  if (PDL) pdl_wait();
  unsigned idx = blockIdx.x * 128 + threadIdx.x;
  unsigned token = idx / GROUPS, group = idx % GROUPS;
  unsigned h = blockIdx.y;
  long long p = pos[token];
  __nv_bfloat16* t = h < HQ ? q + (size_t(token) * HQ + h) * D : k + (size_t(token) * HK + h - HQ) * D;
  uint2 cr = *(const uint2*)(table + p * D + group * L);
  uint2 sr = *(const uint2*)(table + p * D + HALF + group * L);
  float c[L], s[L];
  for (int i = 0; i < L; i++) {
    c[i] = __bfloat162float(((__nv_bfloat16*)&cr)[i]);
    s[i] = __bfloat162float(((__nv_bfloat16*)&sr)[i]);
  }
  rot(t, group, c, s);
}

// Big's logic from a compact block: 32-bit strides and counts, pointers first.
struct Compact {
  __nv_bfloat16* x0; __nv_bfloat16* x1; const long long* pos_ptr; const __nv_bfloat16* cos; const __nv_bfloat16* sin;
  unsigned xs0[3], xs1[3]; unsigned heads0, tokens_groups, seq, seq_magic, seq_shift, groups, groups_magic, groups_shift, table_stride, table_rows;
  float sin_sign;
};

template <bool PDL>
__global__ void __launch_bounds__(128) rope_table_compact(const __grid_constant__ Compact a) {
  if (PDL) pdl_wait();
  unsigned idx = blockIdx.x * 128 + threadIdx.x;
  if (idx >= a.tokens_groups) return;
  unsigned token = __umulhi(idx, a.groups_magic) >> a.groups_shift;
  unsigned group = idx - token * a.groups;
  unsigned b = __umulhi(token, a.seq_magic) >> a.seq_shift;
  unsigned s = token - b * a.seq;
  unsigned h = blockIdx.y;
  long long p = a.pos_ptr[b] + s;
  if (p < 0 || p >= (long long)a.table_rows) p = 0;
  __nv_bfloat16* t;
  if (h < a.heads0) t = a.x0 + (b * a.xs0[0] + s * a.xs0[1] + h * a.xs0[2]);
  else t = a.x1 + (b * a.xs1[0] + s * a.xs1[1] + (h - a.heads0) * a.xs1[2]);
  uint2 cr = *(const uint2*)(a.cos + p * a.table_stride + group * L);
  uint2 sr = *(const uint2*)(a.sin + p * a.table_stride + group * L);
  float c[L], s2[L];
  for (int i = 0; i < L; i++) {
    c[i] = __bfloat162float(((__nv_bfloat16*)&cr)[i]);
    s2[i] = a.sin_sign * __bfloat162float(((__nv_bfloat16*)&sr)[i]);
  }
  rot(t, group, c, s2);
}

static float median(std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

int main(int argc, char** argv) {
  bool busy = argc > 1 && std::string(argv[1]) == "busy";
  bool rb = argc > 1 && std::string(argv[1]) == "rb";
  size_t qn = size_t(B) * HQ * D, kn = size_t(B) * HK * D;
  __nv_bfloat16 *q, *k, *src, *dst, *table;
  long long* pos; float* inv; double* invd;
  CK(cudaMalloc(&q, qn * 2)); CK(cudaMalloc(&k, kn * 2));
  CK(cudaMalloc(&src, (qn + kn) * 2)); CK(cudaMalloc(&dst, (qn + kn) * 2));
  CK(cudaMalloc(&table, 2048 * D * 2)); CK(cudaMalloc(&pos, B * 8)); CK(cudaMalloc(&inv, HALF * 4)); CK(cudaMalloc(&invd, HALF * 8));
  CK(cudaMemset(q, 0, qn * 2)); CK(cudaMemset(k, 0, kn * 2)); CK(cudaMemset(src, 0, (qn + kn) * 2)); { std::vector<uint16_t> ht(2048 * D); for (size_t i = 0; i < ht.size(); i++) { float f = sinf(i * 0.013f); uint32_t u; memcpy(&u, &f, 4); ht[i] = u >> 16; }
    CK(cudaMemcpy(table, ht.data(), ht.size() * 2, cudaMemcpyHostToDevice)); }
  std::vector<long long> hp(B); for (int i = 0; i < B; i++) hp[i] = 1000 + i;
  CK(cudaMemcpy(pos, hp.data(), B * 8, cudaMemcpyHostToDevice));
  std::vector<float> hf(HALF); for (int i = 0; i < HALF; i++) hf[i] = powf(500000.f, -2.f * i / D);
  CK(cudaMemcpy(inv, hf.data(), HALF * 4, cudaMemcpyHostToDevice));
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  dim3 grid(B * GROUPS / 128, HQ + HK), block(128);
  Big big{};
  big.x0 = q; big.out0 = q; big.heads0 = HQ; big.xs0[0] = HQ * D; big.xs0[1] = HQ * D; big.xs0[2] = D;
  big.x1 = k; big.out1 = k; big.heads1 = HK; big.xs1[0] = HK * D; big.xs1[1] = HK * D; big.xs1[2] = D;
  big.tokens = B; big.seq = 1; big.seq_magic = 0; big.seq_shift = 0; big.groups = GROUPS; big.groups_magic = 0x10000000u; big.groups_shift = 0;  // idx / 16 as umulhi(idx, 2^28); b = 0, s = token: pos[0] + s big.rot_groups = GROUPS;
  big.cos = table; big.sin = table + HALF; big.table_stride = D; big.table_rows = 2048; big.pos_ptr = pos; big.sin_sign = 1.f;
  Pad pad{};
  Compact cp{};
  cp.x0 = q; cp.x1 = k; cp.pos_ptr = pos; cp.cos = table; cp.sin = table + HALF;
  cp.xs0[0] = HQ * D; cp.xs0[1] = HQ * D; cp.xs0[2] = D; cp.xs1[0] = HK * D; cp.xs1[1] = HK * D; cp.xs1[2] = D;
  cp.heads0 = HQ; cp.tokens_groups = B * GROUPS; cp.seq = 1; cp.seq_magic = 0; cp.seq_shift = 0; cp.groups = GROUPS; cp.groups_magic = 0x10000000u; cp.groups_shift = 0;
  cp.table_stride = D; cp.table_rows = 2048; cp.sin_sign = 1.f;
  printf("sizeof(Compact) = %zu bytes, sizeof(Pad) = %zu\n", sizeof(Compact), sizeof(Pad));
  printf("sizeof(Big) = %zu bytes\n", sizeof(Big));

  auto launch_pdl = [&](auto kern, auto... args) {
    cudaLaunchConfig_t cfg{}; cfg.gridDim = grid; cfg.blockDim = block; cfg.stream = st;
    cudaLaunchAttribute at[1]; at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization; at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at; cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, kern, args...));
  };
  struct V { const char* name; std::function<void()> f; };
  std::vector<V> vs = {
    {"driver copy of the same bytes", [&] { CK(cudaMemcpyAsync(dst, src, (qn + kn) * 2, cudaMemcpyDeviceToDevice, st)); }},
    {"empty kernel, 1 thread", [&] { empty_kernel<<<1, 1, 0, st>>>(); }},
    {"in-place copy on the rope grid", [&] { copy_inplace<false><<<grid, block, 0, st>>>(q, k); }},
    {"in-place copy on the rope grid, PDL", [&] { launch_pdl(copy_inplace<true>, q, k); }},
    {"minimal table rope", [&] { rope_table<false><<<grid, block, 0, st>>>(q, k, pos, table); }},
    {"minimal table rope, PDL", [&] { launch_pdl(rope_table<true>, q, k, (const long long*)pos, (const __nv_bfloat16*)table); }},
    {"minimal computed rope (f32 sincosf)", [&] { rope_computed<false><<<grid, block, 0, st>>>(q, k, pos, inv); }},
    {"minimal computed rope, PDL", [&] { launch_pdl(rope_computed<true>, q, k, (const long long*)pos, (const float*)inv); }},
    {"minimal table rope + 272-byte unused pad", [&] { rope_table_pad<false><<<grid, block, 0, st>>>(q, k, pos, table, pad); }},
    {"minimal table rope + pad, PDL", [&] { launch_pdl(rope_table_pad<true>, q, k, (const long long*)pos, (const __nv_bfloat16*)table, pad); }},
    {"table rope, compact params", [&] { rope_table_compact<false><<<grid, block, 0, st>>>(cp); }},
    {"table rope, compact params, PDL", [&] { launch_pdl(rope_table_compact<true>, cp); }},
    {"table rope, 312-byte params", [&] { rope_table_big<false><<<grid, block, 0, st>>>(big); }},
    {"table rope, 312-byte params, PDL", [&] { launch_pdl(rope_table_big<true>, big); }},
  };
  // rope-rs' one-head kernels from their cubins, with the parameters the host encodes for this
  // launch (ids per row, i64; the combined bf16 table).
  struct Ours { std::string label; CUfunction f; bool table; };
  std::vector<Ours> ours_list;
  {
    FILE* fl = fopen("variants.txt", "r"); char line[512];
    while (fl && fgets(line, sizeof line, fl)) {
      std::string l(line); if (!l.empty() && l.back() == '\n') l.pop_back(); if (l.empty()) continue;
      size_t a = l.find(':'), b = l.find(':', a + 1), c = l.find(':', b + 1);
      std::string label = l.substr(0, a), file = l.substr(a + 1, b - a - 1), fn = l.substr(b + 1, c - b - 1), tag = l.substr(c + 1);
      CUmodule m; CUfunction f;
      if (cuModuleLoad(&m, file.c_str()) != CUDA_SUCCESS || cuModuleGetFunction(&f, m, fn.c_str()) != CUDA_SUCCESS) { printf("load %s\n", file.c_str()); return 1; }
      ours_list.push_back({label, f, tag == "table"});
    }
  }
  for (int i = 0; i < HALF; i++) { double f = pow(500000.0, -2.0 * i / D); CK(cudaMemcpy(invd + i, &f, 8, cudaMemcpyHostToDevice)); }
  struct P { void* x0; void* out0; unsigned heads0; unsigned long long xs0[3], os0[3]; void* x1; void* out1; unsigned heads1; unsigned long long xs1[3], os1[3];
    unsigned long long tokens; unsigned seq, seq_magic, seq_shift, hpc, groups, groups_magic, groups_shift, rot_groups, half, rotary_dim, rotary_offset, lanes;
    void* cos; void* sin; unsigned long long table_stride, table_rows; unsigned table_elem; void* inv_freq; unsigned angle_mode; float cs_scale; unsigned position_code;
    void* pos_ptr; void* pos_aux; unsigned pos_count; long long pos_base; float sin_sign; unsigned read_ahead; };
  auto mk = [&](bool table) {
    P p{}; p.x0 = q; p.out0 = q; p.heads0 = HQ; p.xs0[0] = p.os0[0] = HQ * D; p.xs0[1] = p.os0[1] = HQ * D; p.xs0[2] = p.os0[2] = D;
    p.x1 = k; p.out1 = k; p.heads1 = HK; p.xs1[0] = p.os1[0] = HK * D; p.xs1[1] = p.os1[1] = HK * D; p.xs1[2] = p.os1[2] = D;
    p.tokens = B; p.seq = 1;
    p.hpc = 1; p.groups = GROUPS; p.rot_groups = GROUPS; p.half = HALF; p.rotary_dim = D; p.rotary_offset = 0; p.lanes = L;
    // Divisor::new(d): shift = 32 - clz(d - 1), magic = ceil(2^(32+shift) / d) - 2^32.
    auto div = [](unsigned d, unsigned& magic, unsigned& shift) { shift = d == 1 ? 0 : 32 - __builtin_clz(d - 1);
      unsigned __int128 m = (((unsigned __int128)1 << (32 + shift)) + d - 1) / d; magic = (unsigned)(m - ((unsigned __int128)1 << 32)); };
    div(1, p.seq_magic, p.seq_shift); div(GROUPS, p.groups_magic, p.groups_shift);
    p.table_stride = D; p.table_rows = 2048; p.table_elem = 0; p.cs_scale = 1.f; p.angle_mode = 0;
    p.position_code = 6; p.pos_ptr = pos; p.pos_count = 0; p.pos_base = 0; p.sin_sign = 1.f; p.read_ahead = 0;
    return p;
  };
  P pt = mk(true), pc = mk(false);
  pt.cos = table; pt.sin = table + HALF; pc.inv_freq = invd;
  auto args = [](P& p, std::vector<void*>& v) {
    v = {&p.x0, &p.out0, &p.heads0, &p.xs0[0], &p.xs0[1], &p.xs0[2], &p.os0[0], &p.os0[1], &p.os0[2], &p.x1, &p.out1, &p.heads1,
         &p.xs1[0], &p.xs1[1], &p.xs1[2], &p.os1[0], &p.os1[1], &p.os1[2], &p.tokens, &p.seq, &p.seq_magic, &p.seq_shift, &p.hpc,
         &p.groups, &p.groups_magic, &p.groups_shift, &p.rot_groups, &p.half, &p.rotary_dim, &p.rotary_offset, &p.lanes, &p.cos, &p.sin,
         &p.table_stride, &p.table_rows, &p.table_elem, &p.inv_freq, &p.angle_mode, &p.cs_scale, &p.position_code, &p.pos_ptr,
         &p.pos_aux, &p.pos_count, &p.pos_base, &p.sin_sign, &p.read_ahead}; };
  std::vector<void*> at_, ac_; args(pt, at_); args(pc, ac_);
  auto ours = [&](CUfunction f, std::vector<void*>& a, bool pdl) {
    CUlaunchConfig c{}; c.gridDimX = grid.x; c.gridDimY = grid.y; c.gridDimZ = 1; c.blockDimX = 128; c.blockDimY = 1; c.blockDimZ = 1; c.hStream = st;
    CUlaunchAttribute at[1]; at[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION; at[0].value.programmaticStreamSerializationAllowed = 1;
    c.attrs = at; c.numAttrs = pdl ? 1 : 0;
    CUresult r = cuLaunchKernelEx(&c, f, a.data(), nullptr); if (r != CUDA_SUCCESS) { printf("launch %d\n", r); exit(1); } };
  __nv_bfloat16* pool_src; __nv_bfloat16* pool_dst;
  CK(cudaMallocAsync(&pool_src, (qn + kn) * 2, st)); CK(cudaMallocAsync(&pool_dst, (qn + kn) * 2, st)); CK(cudaStreamSynchronize(st));
  vs.push_back({"driver copy, stream-ordered allocations", [&] { CK(cudaMemcpyAsync(pool_dst, pool_src, (qn + kn) * 2, cudaMemcpyDeviceToDevice, st)); }});
  for (auto& o : ours_list) {
    auto* a = o.table ? &at_ : &ac_;
    CUfunction f = o.f;
    vs.push_back({strdup(("rope-rs " + o.label).c_str()), [&ours, f, a] { ours(f, *a, false); }});
    if (o.label.find("nowait") == std::string::npos)
      vs.push_back({strdup(("rope-rs " + o.label + ", PDL").c_str()), [&ours, f, a] { ours(f, *a, true); }});
  }
  std::vector<cudaGraphExec_t> gs;
  for (auto& v : vs) {
    v.f(); CK(cudaStreamSynchronize(st));
    cudaGraph_t g; CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < 100; i++) v.f();
    CK(cudaStreamEndCapture(st, &g));
    cudaGraphExec_t ge; CK(cudaGraphInstantiate(&ge, g, 0)); gs.push_back(ge);
  }
  {
    // ours against the minimal table kernel on the same input, one launch each
    std::vector<uint16_t> h(qn); for (size_t i = 0; i < qn; i++) { float f = sinf(i * 0.37f); uint32_t u; memcpy(&u, &f, 4); h[i] = u >> 16; }
    std::vector<uint16_t> r1(qn), r2(qn);
    CK(cudaMemcpy(q, h.data(), qn * 2, cudaMemcpyHostToDevice)); CK(cudaDeviceSynchronize()); rope_table<false><<<grid, block, 0, st>>>(q, k, pos, table); CK(cudaStreamSynchronize(st));
    CK(cudaMemcpy(r1.data(), q, qn * 2, cudaMemcpyDeviceToHost));
    std::vector<uint16_t> first[2];
    for (auto& o : ours_list) {
      CK(cudaMemcpy(q, h.data(), qn * 2, cudaMemcpyHostToDevice)); CK(cudaDeviceSynchronize()); ours(o.f, o.table ? at_ : ac_, false); CK(cudaStreamSynchronize(st));
      CK(cudaMemcpy(r2.data(), q, qn * 2, cudaMemcpyDeviceToHost));
      auto& f0 = first[o.table]; if (f0.empty()) f0 = r2;
      size_t d0 = 0, d1 = 0; for (size_t i = 0; i < qn; i++) { d0 += r2[i] != f0[i]; d1 += r2[i] != r1[i]; }
      printf("%-32s differs from the first of its kind in %zu, from the minimal table kernel in %zu of %zu\n", o.label.c_str(), d0, d1, qn);
    }
  }
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  std::vector<std::vector<float>> t(vs.size());
  for (int r = 0; r <= 21; r++)
    for (size_t jj = 0; jj < vs.size(); jj++) {
      size_t j = (jj + r) % vs.size();
      if (rb) {
        CK(cudaEventRecord(e0, st)); for (int i = 0; i < 100; i++) vs[j].f(); CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
      }
      if (busy) CK(cudaGraphLaunch(gs[j], st)); else CK(cudaStreamSynchronize(st));
      CK(cudaEventRecord(e0, st)); CK(cudaGraphLaunch(gs[j], st)); CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
      if (r > 0) t[j].push_back(ms * 1000.f / 100.f);
    }
  printf("timed %s\n", busy ? "behind an untimed graph" : rb ? "from an idle stream after 100 eager launches (rope-bench's order)" : "from an idle stream");
  for (size_t j = 0; j < vs.size(); j++) printf("%-40s %.3f us per launch\n", vs[j].name, median(t[j]));
  return 0;
}
