// Grouped-query flash attention, causal or unmasked: forward and deterministic backward, never
// materialising the score matrix. Launched by src/ops/cuda/attention.rs.
//
// Masks: `causal` (sk == s; query row i sees keys 0 ..= i), or none (every query row sees all sk
// keys: a block of context-parallel ring attention whose keys all precede its queries). With a
// `floor` ([b, s] unsigned, or null), documents are kept apart: query row i of batch bi sees no
// key below floor[bi·s + i] (its document's first key among the call's keys). Floors never
// decrease along a row (the launcher checks), so a block of query rows starts its keys at its
// first row's floor, and the queries that see a block of keys end where the floors pass its last
// key. A row that sees no key gets a zero output and a log-sum-exp of -inf.
//
// Layouts (contiguous, row-major): q, out, dout [b, s, hq, d]; k, v [b, sk, hkv, d] in the storage
// type T (float, double, __nv_bfloat16); lse and delta [b, hq, s] in the accumulation type A
// (float, or double for double). Query head h reads kv head h / (hq / hkv). The backward writes
// one flat buffer `grads`: dq [b, s, hq, d], then dk and dv [b, sk, hkv, d].
//
// Work split ("row groups"): a block has 128 threads in groups of L consecutive lanes; a group
// owns a few rows (query rows, or key rows for dK/dV) and each lane owns DJ of the d columns of
// them, in registers: column q * CHUNK + tx * VW + e for chunk q and lane tx of the group. A dot
// product with another row is a per-lane partial sum plus a butterfly over the L lanes, after
// which every lane of the group holds the full value. The other operand streams through shared
// memory in tiles of TILE rows with pitch ld = round_up(d, CHUNK) (zero-padded), read as 16-byte
// vectors that all lanes of a group share (conflict-free broadcasts).
//
// Kernels (each exported for T = f32, f64, bf16 and head-dim buckets DMAX = 64, 128, 256 as
// <name>_d<DMAX>_<dtype>, except attn_bwd_delta_<dtype>):
//   attn_fwd        block = (b, query head, BM query rows); loops over key/value tiles up to the
//                   causal limit with an online softmax; writes out and lse = max + log(sum).
//   attn_bwd_delta  one warp per (b, row, head): delta = Σ_c dO · O.
//   attn_bwd_dq     block = (b, query head, BM query rows): P = exp(S - lse), dP = dO · Vᵀ,
//                   dS = P ∘ (dP - delta), dQ = scale · dS · K.
//   attn_bwd_dkv    block = (b, kv head, BK key rows): over the group's query heads and the
//                   queries at or after the keys, dV += Pᵀ · dO, dK += dSᵀ · Q · scale.
// No atomics: every output element has exactly one writer, so results are deterministic.
#include "common.cuh"

template <typename T> using acc_t = typename Acc<T>::type;

// Tile geometry for accumulation type A and head-dim bucket DMAX; `Geometry` in
// src/ops/cuda/attention.rs mirrors it (launch shape and shared memory size).
template <typename A, int DMAX> struct Cfg {
  static constexpr int THREADS = 128;
  static constexpr int SZ = (int)sizeof(A);
  static constexpr int VW = 16 / SZ;                               // elements per 16-byte vector
  static constexpr int L = DMAX * SZ / 64 > 8 ? DMAX * SZ / 64 : 8;  // lanes per row group
  static constexpr int DJ = DMAX / L;                              // columns per lane
  static constexpr int NQ = DJ / VW;                               // chunks per row
  static constexpr int CHUNK = L * VW;                             // columns per chunk
  static constexpr int GROUPS = THREADS / L;                       // row groups per block
  static constexpr int RI = 128 / (DJ * SZ);      // query rows per group (forward, dQ)
  static constexpr int RJ = RI / 2 > 1 ? RI / 2 : 1;  // key rows per group (dK/dV)
  static constexpr int TILE = 16384 / (DMAX * SZ);    // rows per shared-memory tile (<= 16 KiB)
  static constexpr int BS = 8;                        // keys per online-softmax step (forward)
  static_assert(NQ * VW == DJ && DJ * L == DMAX && GROUPS * L == THREADS, "bad geometry");
  static_assert(TILE % BS == 0 && L <= 32, "bad geometry");
};

DYNAMIC_SMEM(attn_smem);

// Traps unless the block has `threads` threads and at least `bytes` of dynamic shared memory, so
// a launch that disagrees with the kernel's geometry fails loudly instead of corrupting memory.
__device__ __forceinline__ void check_launch(unsigned threads, unsigned bytes) {
  const unsigned have = dyn_smem_bytes();
  if (blockDim.x != threads || have < bytes) __trap();
}

__device__ __forceinline__ int round_up(int x, int m) { return (x + m - 1) / m * m; }

// Sum of `v` over the L consecutive lanes of a row group (L a power of two <= 32); every lane of
// the group gets the same value (the butterfly adds the same pairs in every lane).
template <int L, typename A> __device__ __forceinline__ A group_sum(A v) {
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// One 16-byte shared-memory load into o[0 .. 16 / sizeof(A)].
__device__ __forceinline__ void lds16(float* o, const float* p) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  o[0] = v.x;
  o[1] = v.y;
  o[2] = v.z;
  o[3] = v.w;
}
__device__ __forceinline__ void lds16(double* o, const double* p) {
  const double2 v = *reinterpret_cast<const double2*>(p);
  o[0] = v.x;
  o[1] = v.y;
}

// tile[r][c] (pitch ld) = mul · src[p0 + r][c] for r < rows, c < ld; zero where p0 + r >= s or
// c >= d. Rows of src are `stride` elements apart. One warp per row, lanes along it (coalesced).
template <typename T, typename A>
__device__ __forceinline__ void load_tile(A* tile, const T* src, size_t stride, int p0, int rows,
                                          int s, int d, int ld, A mul) {
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int r = threadIdx.x >> 5; r < rows; r += warps) {
    const int p = p0 + r;
    A* dst = tile + r * ld;
    if (p < s) {
      const T* row = src + (size_t)p * stride;
      for (int c = lane; c < ld; c += 32) dst[c] = c < d ? to_acc(row[c]) * mul : (A)0;
    } else {
      for (int c = lane; c < ld; c += 32) dst[c] = (A)0;
    }
  }
}

// dst[j] = mul · row[column j of lane tx] for the DJ columns lane tx owns; zero past d, or
// everywhere when `row` is null (a row past the sequence).
template <typename C, typename T, typename A>
__device__ __forceinline__ void load_row(A* dst, const T* row, int d, int tx, A mul) {
#pragma unroll
  for (int qq = 0; qq < C::NQ; ++qq) {
#pragma unroll
    for (int e = 0; e < C::VW; ++e) {
      const int c = qq * C::CHUNK + tx * C::VW + e;
      dst[qq * C::VW + e] = row != nullptr && c < d ? to_acc(row[c]) * mul : (A)0;
    }
  }
}

// row[column j of lane tx] = mul · src[j] for the columns below d.
template <typename C, typename T, typename A>
__device__ __forceinline__ void store_row(T* row, const A* src, int d, int tx, A mul) {
#pragma unroll
  for (int qq = 0; qq < C::NQ; ++qq) {
#pragma unroll
    for (int e = 0; e < C::VW; ++e) {
      const int c = qq * C::CHUNK + tx * C::VW + e;
      if (c < d) row[c] = from_acc<T>(src[qq * C::VW + e] * mul);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Forward. Block: (b, query head) x BM query rows, the last query tiles (most keys) first. Each
// group holds its RI query rows (pre-scaled) and output accumulators in registers; K and V tiles
// stream through shared memory, BS keys per online-softmax step.
template <typename T, int DMAX>
__device__ __forceinline__ void attn_fwd(const T* __restrict__ q, const T* __restrict__ k,
                                         const T* __restrict__ v, T* __restrict__ out,
                                         acc_t<T>* __restrict__ lse, int b, int s, int hq, int hkv,
                                         int d, int sk, int causal,
                                         const unsigned* __restrict__ floor, acc_t<T> scale) {
  typedef acc_t<T> A;
  typedef Cfg<A, DMAX> C;
  constexpr int BM = C::GROUPS * C::RI, RI = C::RI, DJ = C::DJ, VW = C::VW, BS = C::BS;
  const int ld = round_up(d, C::CHUNK);
  check_launch(C::THREADS, 2u * C::TILE * ld * sizeof(A));
  A* ks = reinterpret_cast<A*>(attn_smem);  // [TILE, ld]
  A* vs = ks + C::TILE * ld;                // [TILE, ld]

  const int bhs = b * hq, nqt = (s + BM - 1) / BM;
  const int bh = (int)(blockIdx.x % bhs), qt = nqt - 1 - (int)(blockIdx.x / bhs);
  const int bi = bh / hq, h = bh % hq, g = h / (hq / hkv);
  const int tx = threadIdx.x % C::L, ty = threadIdx.x / C::L;
  const size_t qrs = (size_t)hq * d, krs = (size_t)hkv * d;  // row strides
  const T* qh = q + (size_t)bi * s * qrs + (size_t)h * d;     // [s, d], pitch qrs
  const T* kh = k + (size_t)bi * sk * krs + (size_t)g * d;    // [sk, d], pitch krs
  const T* vh = v + (size_t)bi * sk * krs + (size_t)g * d;    // [sk, d], pitch krs
  const int q0 = qt * BM, r0 = q0 + ty * RI;                  // rows r0 .. r0 + RI

  const unsigned* fl = floor != nullptr ? floor + (size_t)bi * s : nullptr;  // [s]
  A qr[RI][DJ], o[RI][DJ], m[RI], l[RI];
  int lo[RI];  // each row's first key
#pragma unroll
  for (int i = 0; i < RI; ++i) {
    load_row<C>(qr[i], r0 + i < s ? qh + (size_t)(r0 + i) * qrs : nullptr, d, tx, scale);
#pragma unroll
    for (int j = 0; j < DJ; ++j) o[i][j] = (A)0;
    m[i] = neg_inf<A>();
    l[i] = (A)0;
    lo[i] = fl != nullptr && r0 + i < s ? (int)fl[r0 + i] : 0;
  }

  const int kend = causal ? min(q0 + BM, s) : sk;    // keys kbeg .. kend
  const int kbeg = fl != nullptr ? (int)fl[q0] : 0;  // the block's lowest floor
  for (int k0 = kbeg; k0 < kend; k0 += C::TILE) {
    __syncthreads();
    load_tile(ks, kh, krs, k0, C::TILE, sk, d, ld, (A)1);
    load_tile(vs, vh, krs, k0, C::TILE, sk, d, ld, (A)1);
    __syncthreads();
    const int nend = min(C::TILE, kend - k0);
    for (int n0 = 0; n0 < nend; n0 += BS) {
      // Scores of keys k0 + n0 .. + BS (already scaled), -inf where masked.
      A sc[RI][BS];
#pragma unroll
      for (int jn = 0; jn < BS; ++jn) {
        const A* krow = ks + (n0 + jn) * ld + tx * VW;
        A part[RI];
#pragma unroll
        for (int i = 0; i < RI; ++i) part[i] = (A)0;
#pragma unroll
        for (int qq = 0; qq < C::NQ; ++qq) {
          if (qq * C::CHUNK < d) {
            A kv[VW];
            lds16(kv, krow + qq * C::CHUNK);
#pragma unroll
            for (int i = 0; i < RI; ++i)
#pragma unroll
              for (int e = 0; e < VW; ++e) part[i] = fma(qr[i][qq * VW + e], kv[e], part[i]);
          }
        }
        const int key = k0 + n0 + jn;
#pragma unroll
        for (int i = 0; i < RI; ++i) {
          const A sv = group_sum<C::L>(part[i]);
          const bool seen = key < kend && (!causal || key <= r0 + i) && key >= lo[i];
          sc[i][jn] = seen ? sv : neg_inf<A>();
        }
      }
      // Online softmax. Until a row has seen a key (only below its floor) m stays -inf and the
      // step changes nothing; alpha is 0 on its first seen step (m = -inf).
#pragma unroll
      for (int i = 0; i < RI; ++i) {
        A mx = m[i];
#pragma unroll
        for (int jn = 0; jn < BS; ++jn) mx = sc[i][jn] > mx ? sc[i][jn] : mx;
        const bool none = mx == neg_inf<A>();
        const A alpha = none ? (A)1 : exp_acc(m[i] - mx);
        m[i] = mx;
        l[i] *= alpha;
#pragma unroll
        for (int j = 0; j < DJ; ++j) o[i][j] *= alpha;
#pragma unroll
        for (int jn = 0; jn < BS; ++jn) {
          sc[i][jn] = none ? (A)0 : exp_acc(sc[i][jn] - mx);
          l[i] += sc[i][jn];
        }
      }
      // O += P · V for these keys.
#pragma unroll
      for (int jn = 0; jn < BS; ++jn) {
        const A* vrow = vs + (n0 + jn) * ld + tx * VW;
#pragma unroll
        for (int qq = 0; qq < C::NQ; ++qq) {
          if (qq * C::CHUNK < d) {
            A vv[VW];
            lds16(vv, vrow + qq * C::CHUNK);
#pragma unroll
            for (int i = 0; i < RI; ++i)
#pragma unroll
              for (int e = 0; e < VW; ++e)
                o[i][qq * VW + e] = fma(sc[i][jn], vv[e], o[i][qq * VW + e]);
          }
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < RI; ++i) {
    const int row = r0 + i;
    if (row < s) {
      const bool seen = l[i] > (A)0;  // false only for a row that sees no key
      store_row<C>(out + (size_t)bi * s * qrs + (size_t)row * qrs + (size_t)h * d, o[i], d, tx,
                   seen ? (A)1 / l[i] : (A)0);
      if (tx == 0) lse[(size_t)bh * s + row] = seen ? m[i] + log_acc(l[i]) : neg_inf<A>();
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward, step 1: delta[b, h, p] = Σ_c dout[b, p, h, c] · out[b, p, h, c]; one warp per row.
template <typename T>
__device__ __forceinline__ void attn_bwd_delta_impl(const T* __restrict__ out,
                                                    const T* __restrict__ dout,
                                                    acc_t<T>* __restrict__ delta, int b, int s,
                                                    int hq, int d) {
  typedef acc_t<T> A;
  const long long rows = (long long)b * s * hq;
  const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= rows) return;  // uniform over the warp
  const int lane = threadIdx.x & 31;
  const T* o = out + row * d;
  const T* g = dout + row * d;
  A acc = (A)0;
  for (int c = lane; c < d; c += 32) acc = fma(to_acc(g[c]), to_acc(o[c]), acc);
  acc = warp_sum(acc);
  if (lane == 0) {
    const long long h = row % hq, bp = row / hq;  // row = (bi * s + p) * hq + h
    const long long p = bp % s, bi = bp / s;
    delta[(bi * hq + h) * s + p] = acc;
  }
}

// ---------------------------------------------------------------------------------------------
// Backward, step 2: dQ. Block: (b, query head) x BM query rows. Each group holds its RI query rows
// (pre-scaled), their dO rows and dQ accumulators in registers; K and V tiles stream through
// shared memory up to the causal limit (all sk keys unmasked), one key at a time.
template <typename T, int DMAX>
__device__ __forceinline__ void attn_bwd_dq(const T* __restrict__ q, const T* __restrict__ k,
                                            const T* __restrict__ v, const T* __restrict__ dout,
                                            const acc_t<T>* __restrict__ lse,
                                            const acc_t<T>* __restrict__ delta,
                                            T* __restrict__ grads, int b, int s, int hq, int hkv,
                                            int d, int sk, int causal,
                                            const unsigned* __restrict__ floor, acc_t<T> scale) {
  typedef acc_t<T> A;
  typedef Cfg<A, DMAX> C;
  constexpr int BM = C::GROUPS * C::RI, RI = C::RI, DJ = C::DJ, VW = C::VW;
  const int ld = round_up(d, C::CHUNK);
  check_launch(C::THREADS, 2u * C::TILE * ld * sizeof(A));
  A* ks = reinterpret_cast<A*>(attn_smem);  // [TILE, ld]
  A* vs = ks + C::TILE * ld;                // [TILE, ld]

  const int bhs = b * hq, nqt = (s + BM - 1) / BM;
  const int bh = (int)(blockIdx.x % bhs), qt = nqt - 1 - (int)(blockIdx.x / bhs);
  const int bi = bh / hq, h = bh % hq, g = h / (hq / hkv);
  const int tx = threadIdx.x % C::L, ty = threadIdx.x / C::L;
  const size_t qrs = (size_t)hq * d, krs = (size_t)hkv * d;
  const size_t qoff = (size_t)bi * s * qrs + (size_t)h * d;  // head h of batch bi, [s, d]
  const T* kh = k + (size_t)bi * sk * krs + (size_t)g * d;
  const T* vh = v + (size_t)bi * sk * krs + (size_t)g * d;
  const int q0 = qt * BM, r0 = q0 + ty * RI;

  const unsigned* fl = floor != nullptr ? floor + (size_t)bi * s : nullptr;  // [s]
  A qr[RI][DJ], dor[RI][DJ], acc[RI][DJ], lse_r[RI], del_r[RI];
  int lo[RI];
#pragma unroll
  for (int i = 0; i < RI; ++i) {
    const int row = r0 + i;
    const bool ok = row < s;
    lo[i] = fl != nullptr && ok ? (int)fl[row] : 0;
    load_row<C>(qr[i], ok ? q + qoff + (size_t)row * qrs : nullptr, d, tx, scale);
    load_row<C>(dor[i], ok ? dout + qoff + (size_t)row * qrs : nullptr, d, tx, (A)1);
#pragma unroll
    for (int j = 0; j < DJ; ++j) acc[i][j] = (A)0;
    lse_r[i] = ok ? lse[(size_t)bh * s + row] : (A)0;
    del_r[i] = ok ? delta[(size_t)bh * s + row] : (A)0;
  }

  const int kend = causal ? min(q0 + BM, s) : sk;
  const int kbeg = fl != nullptr ? (int)fl[q0] : 0;  // the block's lowest floor
  for (int k0 = kbeg; k0 < kend; k0 += C::TILE) {
    __syncthreads();
    load_tile(ks, kh, krs, k0, C::TILE, sk, d, ld, (A)1);
    load_tile(vs, vh, krs, k0, C::TILE, sk, d, ld, (A)1);
    __syncthreads();
    const int nend = min(C::TILE, kend - k0);
    for (int n = 0; n < nend; ++n) {
      const A* krow = ks + n * ld + tx * VW;
      const A* vrow = vs + n * ld + tx * VW;
      A kr[DJ], sp[RI], dp[RI];
#pragma unroll
      for (int i = 0; i < RI; ++i) sp[i] = dp[i] = (A)0;
#pragma unroll
      for (int qq = 0; qq < C::NQ; ++qq) {
        if (qq * C::CHUNK < d) {
          A vv[VW];
          lds16(kr + qq * VW, krow + qq * C::CHUNK);
          lds16(vv, vrow + qq * C::CHUNK);
#pragma unroll
          for (int i = 0; i < RI; ++i)
#pragma unroll
            for (int e = 0; e < VW; ++e) {
              sp[i] = fma(qr[i][qq * VW + e], kr[qq * VW + e], sp[i]);
              dp[i] = fma(dor[i][qq * VW + e], vv[e], dp[i]);
            }
        }
      }
      const int key = k0 + n;
#pragma unroll
      for (int i = 0; i < RI; ++i) {
        const A sv = group_sum<C::L>(sp[i]), dpv = group_sum<C::L>(dp[i]);
        const bool seen = (!causal || key <= r0 + i) && key >= lo[i];
        const A p = seen ? exp_acc(sv - lse_r[i]) : (A)0;
        const A ds = p * (dpv - del_r[i]);
#pragma unroll
        for (int qq = 0; qq < C::NQ; ++qq) {
          if (qq * C::CHUNK < d) {
#pragma unroll
            for (int e = 0; e < VW; ++e)
              acc[i][qq * VW + e] = fma(ds, kr[qq * VW + e], acc[i][qq * VW + e]);
          }
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < RI; ++i) {
    const int row = r0 + i;
    if (row < s) store_row<C>(grads + qoff + (size_t)row * qrs, acc[i], d, tx, scale);
  }
}

// ---------------------------------------------------------------------------------------------
// Backward, step 3: dK and dV. Block: (b, kv head) x BK key rows, the first key tiles (most
// queries) first. Each group holds its RJ key rows, value rows and dK/dV accumulators in
// registers; for every query head of the kv head's group, tiles of queries at or after the block's
// first key (all queries unmasked; pre-scaled Q, dO, lse, delta) stream through shared memory,
// one query at a time.
template <typename T, int DMAX>
__device__ __forceinline__ void attn_bwd_dkv(const T* __restrict__ q, const T* __restrict__ k,
                                             const T* __restrict__ v, const T* __restrict__ dout,
                                             const acc_t<T>* __restrict__ lse,
                                             const acc_t<T>* __restrict__ delta,
                                             T* __restrict__ grads, int b, int s, int hq, int hkv,
                                             int d, int sk, int causal,
                                             const unsigned* __restrict__ floor, acc_t<T> scale) {
  typedef acc_t<T> A;
  typedef Cfg<A, DMAX> C;
  constexpr int BK = C::GROUPS * C::RJ, RJ = C::RJ, DJ = C::DJ, VW = C::VW, TILE = C::TILE;
  const int ld = round_up(d, C::CHUNK);
  check_launch(C::THREADS, (2u * TILE * ld + 2u * TILE) * sizeof(A));
  A* qs = reinterpret_cast<A*>(attn_smem);  // [TILE, ld], pre-scaled
  A* dos = qs + TILE * ld;                  // [TILE, ld]
  A* lses = dos + TILE * ld;                // [TILE]
  A* dels = lses + TILE;                    // [TILE]

  const int bkv = b * hkv, group = hq / hkv;
  const int kvh = (int)(blockIdx.x % bkv), kt = (int)(blockIdx.x / bkv);
  const int bi = kvh / hkv, g = kvh % hkv;
  const int tx = threadIdx.x % C::L, ty = threadIdx.x / C::L;
  const size_t qrs = (size_t)hq * d, krs = (size_t)hkv * d;
  const size_t koff = (size_t)bi * sk * krs + (size_t)g * d;  // kv head g of batch bi, [sk, d]
  const int k0 = kt * BK, n0 = k0 + ty * RJ;                  // keys n0 .. n0 + RJ

  A kr[RJ][DJ], vr[RJ][DJ], dk[RJ][DJ], dv[RJ][DJ];
#pragma unroll
  for (int j = 0; j < RJ; ++j) {
    const bool ok = n0 + j < sk;
    load_row<C>(kr[j], ok ? k + koff + (size_t)(n0 + j) * krs : nullptr, d, tx, (A)1);
    load_row<C>(vr[j], ok ? v + koff + (size_t)(n0 + j) * krs : nullptr, d, tx, (A)1);
#pragma unroll
    for (int c = 0; c < DJ; ++c) dk[j][c] = dv[j][c] = (A)0;
  }

  // The queries that see any of keys k0 .. k0 + BK: from the first key on (causal), up to the
  // first query whose floor passes the block's last key (floors never decrease).
  const unsigned* fl = floor != nullptr ? floor + (size_t)bi * s : nullptr;  // [s]
  int qend = s;
  if (fl != nullptr) {
    int lo = causal ? k0 : 0, hi = s;  // the first query in [lo, s) with floor > k0 + BK - 1
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if ((int)fl[mid] > k0 + BK - 1) hi = mid; else lo = mid + 1;
    }
    qend = lo;
  }
  for (int hh = 0; hh < group; ++hh) {
    const int h = g * group + hh;
    const size_t bh = (size_t)bi * hq + h;
    const T* qh = q + (size_t)bi * s * qrs + (size_t)h * d;
    const T* doh = dout + (size_t)bi * s * qrs + (size_t)h * d;
    for (int m0 = causal ? k0 : 0; m0 < qend; m0 += TILE) {
      __syncthreads();
      load_tile(qs, qh, qrs, m0, TILE, s, d, ld, scale);
      load_tile(dos, doh, qrs, m0, TILE, s, d, ld, (A)1);
      for (int t = threadIdx.x; t < TILE; t += blockDim.x) {
        const bool ok = m0 + t < s;
        lses[t] = ok ? lse[bh * s + m0 + t] : (A)0;
        dels[t] = ok ? delta[bh * s + m0 + t] : (A)0;
      }
      __syncthreads();
      const int mend = min(TILE, qend - m0);
      for (int mm = 0; mm < mend; ++mm) {
        const int qpos = m0 + mm;
        const int qlo = fl != nullptr ? (int)fl[qpos] : 0;  // this query's first key
        const A* qrow = qs + mm * ld + tx * VW;
        const A* dorow = dos + mm * ld + tx * VW;
        A qv[DJ], dov[DJ], sp[RJ], dp[RJ];
#pragma unroll
        for (int j = 0; j < RJ; ++j) sp[j] = dp[j] = (A)0;
#pragma unroll
        for (int qq = 0; qq < C::NQ; ++qq) {
          if (qq * C::CHUNK < d) {
            lds16(qv + qq * VW, qrow + qq * C::CHUNK);
            lds16(dov + qq * VW, dorow + qq * C::CHUNK);
#pragma unroll
            for (int j = 0; j < RJ; ++j)
#pragma unroll
              for (int e = 0; e < VW; ++e) {
                sp[j] = fma(qv[qq * VW + e], kr[j][qq * VW + e], sp[j]);
                dp[j] = fma(dov[qq * VW + e], vr[j][qq * VW + e], dp[j]);
              }
          }
        }
        const A lse_m = lses[mm], del_m = dels[mm];
#pragma unroll
        for (int j = 0; j < RJ; ++j) {
          const A sv = group_sum<C::L>(sp[j]), dpv = group_sum<C::L>(dp[j]);
          const bool seen = (!causal || n0 + j <= qpos) && n0 + j >= qlo;
          const A p = seen ? exp_acc(sv - lse_m) : (A)0;
          const A ds = p * (dpv - del_m);
#pragma unroll
          for (int qq = 0; qq < C::NQ; ++qq) {
            if (qq * C::CHUNK < d) {
#pragma unroll
              for (int e = 0; e < VW; ++e) {
                const int c = qq * VW + e;
                dv[j][c] = fma(p, dov[c], dv[j][c]);
                dk[j][c] = fma(ds, qv[c], dk[j][c]);
              }
            }
          }
        }
      }
    }
  }

  const size_t nq = (size_t)b * s * qrs, nkv = (size_t)b * sk * krs;
#pragma unroll
  for (int j = 0; j < RJ; ++j) {
    const int key = n0 + j;
    if (key < sk) {
      store_row<C>(grads + nq + koff + (size_t)key * krs, dk[j], d, tx, (A)1);
      store_row<C>(grads + nq + nkv + koff + (size_t)key * krs, dv[j], d, tx, (A)1);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Exports: <name>_d<DMAX>_<f32|f64|bf16>.
#define ATTN_EXPORT(NAME, D, PARAMS, ARGS)                                           \
  template <typename T> __device__ __forceinline__ void NAME##_d##D##_impl PARAMS {  \
    NAME<T, D> ARGS;                                                                 \
  }                                                                                  \
  EXPORT3(NAME##_d##D, PARAMS, ARGS)
#define ATTN_EXPORT_ALL(NAME, PARAMS, ARGS) \
  ATTN_EXPORT(NAME, 64, PARAMS, ARGS)       \
  ATTN_EXPORT(NAME, 128, PARAMS, ARGS)      \
  ATTN_EXPORT(NAME, 256, PARAMS, ARGS)

ATTN_EXPORT_ALL(attn_fwd,
                (const T* q, const T* k, const T* v, T* out, acc_t<T>* lse, int b, int s, int hq,
                 int hkv, int d, int sk, int causal, const unsigned* floor, acc_t<T> scale),
                (q, k, v, out, lse, b, s, hq, hkv, d, sk, causal, floor, scale))

EXPORT3(attn_bwd_delta, (const T* out, const T* dout, acc_t<T>* delta, int b, int s, int hq, int d),
        (out, dout, delta, b, s, hq, d))

ATTN_EXPORT_ALL(attn_bwd_dq,
                (const T* q, const T* k, const T* v, const T* dout, const acc_t<T>* lse,
                 const acc_t<T>* delta, T* grads, int b, int s, int hq, int hkv, int d, int sk,
                 int causal, const unsigned* floor, acc_t<T> scale),
                (q, k, v, dout, lse, delta, grads, b, s, hq, hkv, d, sk, causal, floor, scale))

ATTN_EXPORT_ALL(attn_bwd_dkv,
                (const T* q, const T* k, const T* v, const T* dout, const acc_t<T>* lse,
                 const acc_t<T>* delta, T* grads, int b, int s, int hq, int hkv, int d, int sk,
                 int causal, const unsigned* floor, acc_t<T> scale),
                (q, k, v, dout, lse, delta, grads, b, s, hq, hkv, d, sk, causal, floor, scale))
