// Tensor-core (nvcuda::wmma, bf16 m16n16k16, f32 accumulators) variants of the GQA flash
// attention of attention.cu for its common case: bf16 storage, head dim D = 64 or 128, causal
// (sk = s) or unmasked over sk keys (a block of context-parallel ring attention). Same math,
// layouts, outputs and determinism; the backward reuses attention.cu's attn_bwd_delta_bf16.
// Launched by src/ops/cuda/attention_tc.rs, which mirrors TcCfg below.
//
// Layouts as in attention.cu: q, out, dout [b, s, hq, D]; k, v [b, sk, hkv, D] (bf16); lse and
// delta [b, hq, s] (f32); the backward writes the flat grads dq [b, s, hq, D] | dk | dv. Causal
// calls skip the tiles above the diagonal and mask key > query; unmasked calls visit every key
// tile and mask only the keys past sk in the last one.
//
// Blocks of 128 threads (4 warps). Tiles of BM = 64 rows, 16 per warp: the forward and dQ blocks
// own 64 query rows of one (b, query head); the dK/dV block owns 64 key rows of one (b, kv head)
// against the queries of one of its query heads.
// The warp's own 16 rows of Q (and dO), or K and V, stay in matrix_a fragments for the whole
// block; the other operand streams through shared memory in bf16 tiles (pitch D + 8). Matrix
// products run on wmma fragments; the scores, softmax, masking and dS are done by ordinary
// threads on f32 tiles staged in shared memory (the warp's 16 rows; lane l owns row l / 2 and
// one half of the columns), which write P / dS as bf16 tiles that are loaded back as matrix_a
// fragments. P and dS are written as two bf16 tiles, hi = bf16(x) and lo = bf16(x - hi), and
// both multiply the same B fragment (`split`): the products then carry about 2^-17 relative
// rounding of P / dS instead of bf16's 2^-9, so the results match the FMA kernels' accuracy
// (one bf16 P measured 2-5e-2 against the harness's 1e-2 bf16 tolerance), for 1.5x the tensor
// work of the P V, dS K, Pᵀ dO and dSᵀ Q products. The lo tiles overlay the warp's own f32
// score rows once every lane has read them. Fragments are only used through fill / load /
// store / mma (never indexed), and between a warp's fragment stores and its lanes' reads (and
// back) there is a __syncwarp().
//
//   attn_tc_fwd    block = (b, query head, 64 query rows), last query tiles first; key tiles of
//                  FKT keys (64 for D = 64, 32 for D = 128): S = Q Kᵀ, online softmax, O += P V
//                  (P V in passes of up to FKT columns through the S tile; O in registers).
//   attn_tc_dq     block = (b, query head, 64 query rows); key tiles of BT = 32:
//                  S = Q Kᵀ, dP = dO Vᵀ, dS = P ∘ (dP - delta), dQ += dS K (fragments).
//   attn_tc_dkv    block = (b, query head, 64 keys), first key tiles first; query tiles of
//                  BT = 32 at or after the block's first key (causal): Sᵀ = K Qᵀ, dPᵀ = V dOᵀ,
//                  dV += Pᵀ dO, dK += dSᵀ Q (fragments); unmasked, every query tile.
//                  Without GQA (hq = hkv) the block writes
//                  dK, dV; with GQA it writes its query head's f32 share to `part` and
//                  attn_tc_dkv_reduce sums the group's shares in head order. (One block per kv
//                  head looping over the group's heads, as before, ran 2x the ideal time on
//                  H100: a few blocks per SM with an 8x longer causal triangle per block.)
//   attn_tc_dkv_reduce  dK = scale · Σ_h part_dK[h], dV = Σ_h part_dV[h] over each group, in
//                  head order (deterministic), one thread per output element (grid-stride).
// No atomics: every output element has exactly one writer. Shared memory <= 46,368 bytes.
#include <mma.h>

#include "common.cuh"

namespace attn_tc {
using namespace nvcuda;
typedef __nv_bfloat16 bf16;

// Geometry for head dim D; `TcGeometry` in src/ops/cuda/attention_tc.rs mirrors it.
template <int D> struct TcCfg {
  static_assert(D == 64 || D == 128, "tensor-core attention supports D = 64 and 128");
  static constexpr int THREADS = 128;           // 4 warps
  static constexpr int BM = 64;                 // query rows (fwd, dQ) or keys (dK/dV) per block
  static constexpr int FKT = D == 64 ? 64 : 32;  // keys per tile, forward
  static constexpr int BT = 32;                 // keys (dQ) or queries (dK/dV) per tile
  static constexpr int LDH = D + 8;             // pitch of bf16 [rows, D] tiles
  static constexpr int LDF = D + 4;             // pitch of the f32 [BM, D] output staging
  static constexpr unsigned ALIGN = 32;         // slack to align the dynamic shared memory to 32 B
  static constexpr unsigned FWD_SMEM =
      ALIGN + 2u * FKT * LDH * 2 + BM * (FKT + 4) * 4u + BM * (FKT + 8) * 2u;
  static constexpr unsigned DQ_SMEM =
      ALIGN + 2u * BT * LDH * 2 + 2u * BM * (BT + 4) * 4 + BM * (BT + 8) * 2u;
  static constexpr unsigned DKV_SMEM =
      ALIGN + 2u * BT * LDH * 2 + 2u * BT * 4 + 2u * BM * (BT + 4) * 4 + 2u * BM * (BT + 8) * 2;
  static_assert(BM * LDH <= 2 * FKT * LDH, "forward Q staging must fit the K/V tiles");
  static_assert(BM * LDF * 4u + ALIGN <= DQ_SMEM, "dQ output staging must fit");
  static_assert(2u * BM * LDH * 2 + ALIGN <= DKV_SMEM && BM * LDF * 4u + ALIGN <= DKV_SMEM,
                "dK/dV staging must fit");
  static_assert(FWD_SMEM <= 48 * 1024 && DQ_SMEM <= 48 * 1024 && DKV_SMEM <= 48 * 1024,
                "over the default shared memory limit");
};

DYNAMIC_SMEM(attn_tc_smem);

// The dynamic shared memory, aligned to 32 bytes (wmma pointers must be); traps unless the block
// has THREADS threads and at least `bytes` of dynamic shared memory and d == D.
template <int D> __device__ __forceinline__ unsigned char* smem_checked(unsigned bytes, int d) {
  if (blockDim.x != (unsigned)TcCfg<D>::THREADS || dyn_smem_bytes() < bytes || d != D) __trap();
  unsigned char* p = attn_tc_smem;
  return p + (32u - (unsigned)((uintptr_t)p % 32u)) % 32u;
}

// tile[r][c] (pitch D + 8) = src[p0 + r][c] for r < rows, c < D; zero where p0 + r >= s. Rows of
// src are `stride` elements apart; consecutive threads copy consecutive columns, 8 at a time in
// one 16-byte load where src and stride allow it (always for tensors allocated whole), else one
// at a time. The tile's rows ((D + 8) * 2 bytes) and the tiles' offsets are multiples of 16 bytes.
template <int D>
__device__ __forceinline__ void load_tile(bf16* tile, const bf16* src, size_t stride, int p0,
                                          int rows, int s) {
  constexpr int V = 8, NV = D / V;  // bf16 per 16-byte vector, vectors per row
  if (reinterpret_cast<uintptr_t>(src) % 16 == 0 && stride % V == 0) {
    float4 zero4;  // 16 bytes of zeros (bf16 zeros), carried as a float4
    zero4.x = zero4.y = zero4.z = zero4.w = 0.0f;
    for (int i = threadIdx.x; i < rows * NV; i += blockDim.x) {
      const int r = i / NV, c = i % NV * V, p = p0 + r;
      float4* dst = reinterpret_cast<float4*>(tile + r * (D + 8) + c);
      *dst = p < s ? *reinterpret_cast<const float4*>(src + (size_t)p * stride + c) : zero4;
    }
    return;
  }
  const bf16 zero = __float2bfloat16_rn(0.0f);
  for (int i = threadIdx.x; i < rows * D; i += blockDim.x) {
    const int r = i / D, c = i % D, p = p0 + r;
    tile[r * (D + 8) + c] = p < s ? src[(size_t)p * stride + c] : zero;
  }
}

// x as hi + lo, both bf16 (hi = bf16(x), lo = bf16(x - hi)): P and dS enter the products as two
// bf16 operands, so their rounding (2^-9 relative with one) drops to about 2^-17.
__device__ __forceinline__ void split(float x, bf16* hi, bf16* lo) {
  const bf16 h = __float2bfloat16_rn(x);
  *hi = h;
  *lo = __float2bfloat16_rn(x - __bfloat162float(h));
}

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> FragA;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> FragBr;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> FragBc;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> FragC;

// An output element: bf16 (rounded once) or f32.
__device__ __forceinline__ void store_out(bf16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void store_out(float* p, float x) { *p = x; }

// Writes a warp's 16 x D accumulators `acc` through its f32 staging rows `st` (pitch LDF) to
// rows p0 .. p0 + 16 (those below s) of dst (pitch `stride`, bf16 or f32), times `mul`.
template <int D, typename Out>
__device__ __forceinline__ void write_acc(float* st, const FragC* acc, Out* dst, size_t stride,
                                          int p0, int s, float mul) {
  constexpr int LDF = TcCfg<D>::LDF;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int c = 0; c < D / 16; ++c)
    wmma::store_matrix_sync(st + c * 16, acc[c], LDF, wmma::mem_row_major);
  __syncwarp();
  for (int i = lane; i < 16 * D; i += 32) {
    const int r = i / D, c = i % D;
    if (p0 + r < s) store_out(dst + (size_t)(p0 + r) * stride + c, st[r * LDF + c] * mul);
  }
  __syncwarp();
}

// ---------------------------------------------------------------------------------------------
template <int D>
__device__ __forceinline__ void fwd(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                    const bf16* __restrict__ v, bf16* __restrict__ out,
                                    float* __restrict__ lse, int b, int s, int hq, int hkv, int d,
                                    int sk, bool causal, float scale) {
  typedef TcCfg<D> C;
  constexpr int BM = C::BM, KT = C::FKT, LDH = C::LDH, LDS = KT + 4, LDP = KT + 8;
  constexpr int NC = D / 16, NK = KT / 16, CP = (KT < D ? KT : D) / 16;  // CP: chunks per pass
  unsigned char* base = smem_checked<D>(C::FWD_SMEM, d);
  bf16* ks = reinterpret_cast<bf16*>(base);    // [KT, LDH]
  bf16* vs = ks + KT * LDH;                    // [KT, LDH]
  float* ss = reinterpret_cast<float*>(vs + KT * LDH);  // [BM, LDS]: S, then P V passes
  bf16* ps = reinterpret_cast<bf16*>(ss + BM * LDS);    // [BM, LDP]: P
  bf16* qs = ks;                               // [BM, LDH] Q staging (before the key loop)

  const int bhs = b * hq, nqt = (s + BM - 1) / BM;
  const int bh = (int)(blockIdx.x % bhs), qt = nqt - 1 - (int)(blockIdx.x / bhs);
  const int bi = bh / hq, h = bh % hq, g = h / (hq / hkv);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, half = lane & 1;
  const size_t qrs = (size_t)hq * D, krs = (size_t)hkv * D;
  const bf16* qh = q + (size_t)bi * s * qrs + (size_t)h * D;
  const bf16* kh = k + (size_t)bi * sk * krs + (size_t)g * D;
  const bf16* vh = v + (size_t)bi * sk * krs + (size_t)g * D;
  const int q0 = qt * BM, w0 = q0 + 16 * warp, r = lane >> 1, row = w0 + r;
  const int last = causal ? row : sk - 1;  // the last key this lane's row sees
  float* sw = ss + 16 * warp * LDS;
  bf16* pw = ps + 16 * warp * LDP;

  load_tile<D>(qs, qh, qrs, q0, BM, s);
  __syncthreads();
  FragA qf[NC];
#pragma unroll
  for (int c = 0; c < NC; ++c) wmma::load_matrix_sync(qf[c], qs + 16 * warp * LDH + c * 16, LDH);

  float o[D / 2], m = neg_inf<float>(), l = 0.0f;
#pragma unroll
  for (int j = 0; j < D / 2; ++j) o[j] = 0.0f;

  const int kend = causal ? min(q0 + BM, s) : sk;
  for (int k0 = 0; k0 < kend; k0 += KT) {
    __syncthreads();  // the previous tile (or the Q staging) is no longer read
    load_tile<D>(ks, kh, krs, k0, KT, sk);
    load_tile<D>(vs, vh, krs, k0, KT, sk);
    __syncthreads();
    if (causal && k0 > w0 + 15) continue;  // every key after every row of this warp (uniform)
    // S = Q Kᵀ for this warp's 16 rows.
#pragma unroll
    for (int j = 0; j < NK; ++j) {
      FragC acc;
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        FragBc kf;
        wmma::load_matrix_sync(kf, ks + j * 16 * LDH + c * 16, LDH);
        wmma::mma_sync(acc, qf[c], kf, acc);
      }
      wmma::store_matrix_sync(sw + j * 16, acc, LDS, wmma::mem_row_major);
    }
    __syncwarp();
    // Online softmax over this lane's half of the row's keys; key 0 is in every row's first
    // tile, so m is finite from then on.
    {
      const float* sr = sw + r * LDS + half * (KT / 2);
      float sv[KT / 2], mx = m;
#pragma unroll
      for (int e = 0; e < KT / 2; ++e) {
        const int key = k0 + half * (KT / 2) + e;
        sv[e] = key <= last ? sr[e] * scale : neg_inf<float>();
        mx = sv[e] > mx ? sv[e] : mx;
      }
      __syncwarp();  // every lane has read its scores: the S rows now take P_lo
      const float mo = __shfl_xor_sync(0xffffffffu, mx, 1);
      mx = mo > mx ? mo : mx;
      const float alpha = exp_acc(m - mx);  // 0 on the first tile (m = -inf)
      m = mx;
      float sum = 0.0f;
      bf16* pr = pw + r * LDP + half * (KT / 2);
      bf16* plr = reinterpret_cast<bf16*>(sw) + r * LDP + half * (KT / 2);
#pragma unroll
      for (int e = 0; e < KT / 2; ++e) {
        const float p = exp_acc(sv[e] - mx);
        sum += p;
        split(p, pr + e, plr + e);
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      l = l * alpha + sum;
#pragma unroll
      for (int j = 0; j < D / 2; ++j) o[j] *= alpha;
    }
    __syncwarp();
    // O += P V, in passes of CP 16-column chunks staged through this warp's S rows.
    FragA pf[NK], pl[NK];
#pragma unroll
    for (int kk = 0; kk < NK; ++kk) {
      wmma::load_matrix_sync(pf[kk], pw + kk * 16, LDP);
      wmma::load_matrix_sync(pl[kk], reinterpret_cast<bf16*>(sw) + kk * 16, LDP);
    }
    __syncwarp();  // every lane has its P fragments before the S rows take the P V passes
#pragma unroll
    for (int c0 = 0; c0 < NC; c0 += CP) {
#pragma unroll
      for (int cc = 0; cc < CP; ++cc) {
        FragC acc;
        wmma::fill_fragment(acc, 0.0f);
#pragma unroll
        for (int kk = 0; kk < NK; ++kk) {
          FragBr vf;
          wmma::load_matrix_sync(vf, vs + kk * 16 * LDH + (c0 + cc) * 16, LDH);
          wmma::mma_sync(acc, pf[kk], vf, acc);
          wmma::mma_sync(acc, pl[kk], vf, acc);
        }
        wmma::store_matrix_sync(sw + cc * 16, acc, LDS, wmma::mem_row_major);
      }
      __syncwarp();
      const float* orow = sw + r * LDS + half * (CP * 8);
#pragma unroll
      for (int e = 0; e < CP * 8; ++e) o[c0 * 8 + e] += orow[e];
      __syncwarp();
    }
  }

  if (row < s) {
    const float inv = 1.0f / l;
    bf16* orow = out + (size_t)bi * s * qrs + (size_t)row * qrs + (size_t)h * D;
#pragma unroll
    for (int c0 = 0; c0 < NC; c0 += CP)
#pragma unroll
      for (int e = 0; e < CP * 8; ++e)
        orow[c0 * 16 + half * (CP * 8) + e] = __float2bfloat16_rn(o[c0 * 8 + e] * inv);
    if (half == 0) lse[(size_t)bh * s + row] = m + log_acc(l);
  }
}

// ---------------------------------------------------------------------------------------------
template <int D>
__device__ __forceinline__ void dq(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                   const bf16* __restrict__ v, const bf16* __restrict__ dout,
                                   const float* __restrict__ lse, const float* __restrict__ delta,
                                   bf16* __restrict__ grads, int b, int s, int hq, int hkv, int d,
                                   int sk, bool causal, float scale) {
  typedef TcCfg<D> C;
  constexpr int BM = C::BM, KT = C::BT, LDH = C::LDH, LDS = KT + 4, LDP = KT + 8;
  constexpr int NC = D / 16, NK = KT / 16;
  unsigned char* base = smem_checked<D>(C::DQ_SMEM, d);
  bf16* ks = reinterpret_cast<bf16*>(base);             // [KT, LDH]
  bf16* vs = ks + KT * LDH;                             // [KT, LDH]
  float* ss = reinterpret_cast<float*>(vs + KT * LDH);  // [BM, LDS]: S
  float* dps = ss + BM * LDS;                           // [BM, LDS]: dP
  bf16* dss = reinterpret_cast<bf16*>(dps + BM * LDS);  // [BM, LDP]: dS
  bf16* stage = reinterpret_cast<bf16*>(base);          // [BM, LDH] Q / dO staging

  const int bhs = b * hq, nqt = (s + BM - 1) / BM;
  const int bh = (int)(blockIdx.x % bhs), qt = nqt - 1 - (int)(blockIdx.x / bhs);
  const int bi = bh / hq, h = bh % hq, g = h / (hq / hkv);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, half = lane & 1;
  const size_t qrs = (size_t)hq * D, krs = (size_t)hkv * D;
  const size_t qoff = (size_t)bi * s * qrs + (size_t)h * D;
  const bf16* kh = k + (size_t)bi * sk * krs + (size_t)g * D;
  const bf16* vh = v + (size_t)bi * sk * krs + (size_t)g * D;
  const int q0 = qt * BM, w0 = q0 + 16 * warp, r = lane >> 1, row = w0 + r;
  const int last = causal ? row : sk - 1;  // the last key this lane's row sees
  float* sw = ss + 16 * warp * LDS;
  float* dpw = dps + 16 * warp * LDS;
  bf16* dsw = dss + 16 * warp * LDP;
  const float lse_r = row < s ? lse[(size_t)bh * s + row] : 0.0f;
  const float del_r = row < s ? delta[(size_t)bh * s + row] : 0.0f;

  FragA qf[NC], dof[NC];
  load_tile<D>(stage, q + qoff, qrs, q0, BM, s);
  __syncthreads();
#pragma unroll
  for (int c = 0; c < NC; ++c)
    wmma::load_matrix_sync(qf[c], stage + 16 * warp * LDH + c * 16, LDH);
  __syncthreads();
  load_tile<D>(stage, dout + qoff, qrs, q0, BM, s);
  __syncthreads();
#pragma unroll
  for (int c = 0; c < NC; ++c)
    wmma::load_matrix_sync(dof[c], stage + 16 * warp * LDH + c * 16, LDH);

  FragC acc[NC];
#pragma unroll
  for (int c = 0; c < NC; ++c) wmma::fill_fragment(acc[c], 0.0f);

  const int kend = causal ? min(q0 + BM, s) : sk;
  for (int k0 = 0; k0 < kend; k0 += KT) {
    __syncthreads();
    load_tile<D>(ks, kh, krs, k0, KT, sk);
    load_tile<D>(vs, vh, krs, k0, KT, sk);
    __syncthreads();
    if (causal && k0 > w0 + 15) continue;  // every key after every row of this warp
#pragma unroll
    for (int j = 0; j < NK; ++j) {
      FragC sa, pa;
      wmma::fill_fragment(sa, 0.0f);
      wmma::fill_fragment(pa, 0.0f);
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        FragBc kf, vf;
        wmma::load_matrix_sync(kf, ks + j * 16 * LDH + c * 16, LDH);
        wmma::mma_sync(sa, qf[c], kf, sa);
        wmma::load_matrix_sync(vf, vs + j * 16 * LDH + c * 16, LDH);
        wmma::mma_sync(pa, dof[c], vf, pa);
      }
      wmma::store_matrix_sync(sw + j * 16, sa, LDS, wmma::mem_row_major);
      wmma::store_matrix_sync(dpw + j * 16, pa, LDS, wmma::mem_row_major);
    }
    __syncwarp();
    bf16* dlw = reinterpret_cast<bf16*>(sw);  // dS_lo, over the S rows once they are read
    {
      const int c0 = half * (KT / 2);
      float sv[KT / 2], dpv[KT / 2];
#pragma unroll
      for (int e = 0; e < KT / 2; ++e) {
        sv[e] = sw[r * LDS + c0 + e];
        dpv[e] = dpw[r * LDS + c0 + e];
      }
      __syncwarp();
#pragma unroll
      for (int e = 0; e < KT / 2; ++e) {
        const int key = k0 + c0 + e;
        const float p = key <= last ? exp_acc(sv[e] * scale - lse_r) : 0.0f;
        split(p * (dpv[e] - del_r), dsw + r * LDP + c0 + e, dlw + r * LDP + c0 + e);
      }
    }
    __syncwarp();
#pragma unroll
    for (int kk = 0; kk < NK; ++kk) {
      FragA df, dl;
      wmma::load_matrix_sync(df, dsw + kk * 16, LDP);
      wmma::load_matrix_sync(dl, dlw + kk * 16, LDP);
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        FragBr kf;
        wmma::load_matrix_sync(kf, ks + kk * 16 * LDH + c * 16, LDH);
        wmma::mma_sync(acc[c], df, kf, acc[c]);
        wmma::mma_sync(acc[c], dl, kf, acc[c]);
      }
    }
  }

  __syncthreads();  // every warp is done with the tiles: reuse the memory as f32 staging
  float* st = reinterpret_cast<float*>(base) + 16 * warp * C::LDF;
  write_acc<D>(st, acc, grads + qoff, qrs, w0, s, scale);
}

// ---------------------------------------------------------------------------------------------
template <int D>
__device__ __forceinline__ void dkv(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                    const bf16* __restrict__ v, const bf16* __restrict__ dout,
                                    const float* __restrict__ lse, const float* __restrict__ delta,
                                    bf16* __restrict__ grads, float* __restrict__ part, int b, int s,
                                    int hq, int hkv, int d, int sk, bool causal, float scale) {
  typedef TcCfg<D> C;
  constexpr int BM = C::BM, QT = C::BT, LDH = C::LDH, LDS = QT + 4, LDP = QT + 8;
  constexpr int NC = D / 16, NQ = QT / 16;
  unsigned char* base = smem_checked<D>(C::DKV_SMEM, d);
  bf16* qs = reinterpret_cast<bf16*>(base);              // [QT, LDH]
  bf16* dos = qs + QT * LDH;                             // [QT, LDH]
  float* lses = reinterpret_cast<float*>(dos + QT * LDH);  // [QT]
  float* dels = lses + QT;                               // [QT]
  float* sts = dels + QT;                                // [BM, LDS]: Sᵀ
  float* dpts = sts + BM * LDS;                          // [BM, LDS]: dPᵀ
  bf16* pts = reinterpret_cast<bf16*>(dpts + BM * LDS);  // [BM, LDP]: Pᵀ
  bf16* dsts = pts + BM * LDP;                           // [BM, LDP]: dSᵀ

  const int bhq = b * hq, group = hq / hkv;
  const int bh0 = (int)(blockIdx.x % bhq), kt = (int)(blockIdx.x / bhq);
  const int bi = bh0 / hq, h0 = bh0 % hq, g = h0 / group;
  if (group > 1 && part == nullptr) __trap();  // GQA writes shares that attn_tc_dkv_reduce sums
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, half = lane & 1;
  const size_t qrs = (size_t)hq * D, krs = (size_t)hkv * D;
  const size_t koff = (size_t)bi * sk * krs + (size_t)g * D;
  const int k0 = kt * BM, w0 = k0 + 16 * warp, r = lane >> 1, key = w0 + r;
  float* stw = sts + 16 * warp * LDS;
  float* dptw = dpts + 16 * warp * LDS;
  bf16* ptw = pts + 16 * warp * LDP;
  bf16* dstw = dsts + 16 * warp * LDP;

  FragA kf[NC], vf[NC];
  {
    bf16* kst = reinterpret_cast<bf16*>(base);  // [BM, LDH] K, then [BM, LDH] V
    load_tile<D>(kst, k + koff, krs, k0, BM, sk);
    load_tile<D>(kst + BM * LDH, v + koff, krs, k0, BM, sk);
    __syncthreads();
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      wmma::load_matrix_sync(kf[c], kst + 16 * warp * LDH + c * 16, LDH);
      wmma::load_matrix_sync(vf[c], kst + (BM + 16 * warp) * LDH + c * 16, LDH);
    }
  }
  FragC dk[NC], dv[NC];
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    wmma::fill_fragment(dk[c], 0.0f);
    wmma::fill_fragment(dv[c], 0.0f);
  }

  {
    const int h = h0;
    const size_t bh = (size_t)bi * hq + h;
    const bf16* qh = q + (size_t)bi * s * qrs + (size_t)h * D;
    const bf16* doh = dout + (size_t)bi * s * qrs + (size_t)h * D;
    for (int m0 = causal ? k0 : 0; m0 < s; m0 += QT) {
      __syncthreads();
      load_tile<D>(qs, qh, qrs, m0, QT, s);
      load_tile<D>(dos, doh, qrs, m0, QT, s);
      for (int t = threadIdx.x; t < QT; t += blockDim.x) {
        const bool ok = m0 + t < s;
        lses[t] = ok ? lse[bh * s + m0 + t] : 0.0f;
        dels[t] = ok ? delta[bh * s + m0 + t] : 0.0f;
      }
      __syncthreads();
      if (causal && m0 + QT - 1 < w0) continue;  // every query before every key of this warp
      // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for this warp's 16 keys.
#pragma unroll
      for (int j = 0; j < NQ; ++j) {
        FragC sa, pa;
        wmma::fill_fragment(sa, 0.0f);
        wmma::fill_fragment(pa, 0.0f);
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          FragBc qb, ob;
          wmma::load_matrix_sync(qb, qs + j * 16 * LDH + c * 16, LDH);
          wmma::mma_sync(sa, kf[c], qb, sa);
          wmma::load_matrix_sync(ob, dos + j * 16 * LDH + c * 16, LDH);
          wmma::mma_sync(pa, vf[c], ob, pa);
        }
        wmma::store_matrix_sync(stw + j * 16, sa, LDS, wmma::mem_row_major);
        wmma::store_matrix_sync(dptw + j * 16, pa, LDS, wmma::mem_row_major);
      }
      __syncwarp();
      // Pᵀ_lo [16, LDP] and then dSᵀ_lo [16, QT] over this warp's Sᵀ rows once they are read
      // (dPᵀ is read while they are written).
      static_assert(16 * LDP * 2 + 16 * QT * 2 <= 16 * LDS * 4, "lo tiles must fit the Sᵀ rows");
      bf16* plw = reinterpret_cast<bf16*>(stw);
      bf16* dlw = plw + 16 * LDP;
      {
        const int c0 = half * (QT / 2);
        float p[QT / 2];
#pragma unroll
        for (int e = 0; e < QT / 2; ++e) {
          const int col = c0 + e, qpos = m0 + col;
          const bool seen = causal ? key <= qpos : key < sk;
          p[e] = seen && qpos < s ? exp_acc(stw[r * LDS + col] * scale - lses[col]) : 0.0f;
        }
        __syncwarp();  // every lane has read its Sᵀ values
#pragma unroll
        for (int e = 0; e < QT / 2; ++e) {
          const int col = c0 + e;
          split(p[e], ptw + r * LDP + col, plw + r * LDP + col);
          split(p[e] * (dptw[r * LDS + col] - dels[col]), dstw + r * LDP + col, dlw + r * QT + col);
        }
      }
      __syncwarp();
      // dV += Pᵀ dO, dK += dSᵀ Q (hi and lo parts).
#pragma unroll
      for (int kk = 0; kk < NQ; ++kk) {
        FragA hi, lo;
        wmma::load_matrix_sync(hi, ptw + kk * 16, LDP);
        wmma::load_matrix_sync(lo, plw + kk * 16, LDP);
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          FragBr ob;
          wmma::load_matrix_sync(ob, dos + kk * 16 * LDH + c * 16, LDH);
          wmma::mma_sync(dv[c], hi, ob, dv[c]);
          wmma::mma_sync(dv[c], lo, ob, dv[c]);
        }
        wmma::load_matrix_sync(hi, dstw + kk * 16, LDP);
        wmma::load_matrix_sync(lo, dlw + kk * 16, QT);
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          FragBr qb;
          wmma::load_matrix_sync(qb, qs + kk * 16 * LDH + c * 16, LDH);
          wmma::mma_sync(dk[c], hi, qb, dk[c]);
          wmma::mma_sync(dk[c], lo, qb, dk[c]);
        }
      }
    }
  }

  __syncthreads();  // every warp is done with the tiles: reuse the memory as f32 staging
  const size_t nq = (size_t)b * s * qrs, nkv = (size_t)b * sk * krs, np = (size_t)b * sk * qrs;
  float* st = reinterpret_cast<float*>(base) + 16 * warp * C::LDF;
  if (group == 1) {
    write_acc<D>(st, dk, grads + nq + koff, krs, w0, sk, scale);
    write_acc<D>(st, dv, grads + nq + nkv + koff, krs, w0, sk, 1.0f);
  } else {  // this query head's shares: part = [dK | dV], each [b, sk, hq, D] f32, unscaled
    const size_t poff = (size_t)bi * sk * qrs + (size_t)h0 * D;
    write_acc<D>(st, dk, part + poff, qrs, w0, sk, 1.0f);
    write_acc<D>(st, dv, part + np + poff, qrs, w0, sk, 1.0f);
  }
}

// dK, dV [b, sk, hkv, D] of `grads` (after its nq dQ elements) from the shares in `part`
// ([2, b, sk, hq, D]): each element the sum over its group's query heads in head order (dK times
// scale), rounded once.
__device__ __forceinline__ void dkv_reduce(const float* __restrict__ part, bf16* __restrict__ grads,
                                           int b, int s, int hq, int hkv, int d, int sk, float scale) {
  const int group = hq / hkv;
  const size_t nq = (size_t)b * s * hq * d, nkv = (size_t)b * sk * hkv * d, np = (size_t)b * sk * hq * d;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < 2 * nkv;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t which = i / nkv, e = i % nkv;  // 0: dK, 1: dV
    const size_t c = e % d, g = e / d % hkv, p = e / ((size_t)d * hkv);  // p = bi * sk + key
    const float* src = part + which * np + (p * hq + g * group) * d + c;
    float sum = 0.0f;
    for (int hh = 0; hh < group; ++hh) sum += src[(size_t)hh * d];
    grads[nq + i] = __float2bfloat16_rn(which == 0 ? sum * scale : sum);
  }
}

}  // namespace attn_tc

// ---------------------------------------------------------------------------------------------
// Exports: attn_tc_{fwd,dq,dkv}_d<D>_bf16, with the parameter lists of attention.cu's bf16
// attn_fwd / attn_bwd_dq / attn_bwd_dkv (d must equal D, or the kernel traps), except that the
// dK/dV kernel also takes `part`, 2·b·sk·hq·D floats for the GQA shares (null without GQA), and
// runs b·hq blocks per key tile. A causal launch with sk != s, or sk < 1, or with a document
// `floor` (the launchers run those on attention.cu's kernels), traps.
// bf16 wmma needs sm_80 or newer: compiled for an older architecture, the kernels only trap (the
// launchers pick them for bf16, which the project trains with on sm_80+ GPUs).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define TC_BODY(CALL) __trap();
#else
#define TC_BODY(CALL) \
  if ((causal && sk != s) || sk < 1 || floor != nullptr) __trap(); \
  CALL;
#endif
#define ATTN_TC_EXPORT(D)                                                                          \
  extern "C" __global__ void attn_tc_fwd_d##D##_bf16(                                              \
      const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out,  \
      float* lse, int b, int s, int hq, int hkv, int d, int sk, int causal, const unsigned* floor,  \
      float scale) {                                                                               \
    TC_BODY(attn_tc::fwd<D>(q, k, v, out, lse, b, s, hq, hkv, d, sk, causal != 0, scale))         \
  }                                                                                                \
  extern "C" __global__ void attn_tc_dq_d##D##_bf16(                                               \
      const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,                      \
      const __nv_bfloat16* dout, const float* lse, const float* delta, __nv_bfloat16* grads,       \
      int b, int s, int hq, int hkv, int d, int sk, int causal, const unsigned* floor,             \
      float scale) {                                                                               \
    TC_BODY(attn_tc::dq<D>(q, k, v, dout, lse, delta, grads, b, s, hq, hkv, d, sk, causal != 0,    \
                           scale))                                                                 \
  }                                                                                                \
  extern "C" __global__ void attn_tc_dkv_d##D##_bf16(                                              \
      const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,                      \
      const __nv_bfloat16* dout, const float* lse, const float* delta, __nv_bfloat16* grads,       \
      float* part, int b, int s, int hq, int hkv, int d, int sk, int causal,                       \
      const unsigned* floor, float scale) {                                                        \
    TC_BODY(attn_tc::dkv<D>(q, k, v, dout, lse, delta, grads, part, b, s, hq, hkv, d, sk,         \
                            causal != 0, scale))                                                   \
  }

ATTN_TC_EXPORT(64)
ATTN_TC_EXPORT(128)

// The GQA dK/dV shares of attn_tc_dkv_d<D>_bf16 summed into `grads` (any grid; grid-stride).
extern "C" __global__ void attn_tc_dkv_reduce_bf16(const float* part, __nv_bfloat16* grads, int b,
                                                   int s, int hq, int hkv, int d, int sk,
                                                   float scale) {
  attn_tc::dkv_reduce(part, grads, b, s, hq, hkv, d, sk, scale);
}
