// Pointwise kernels of the op library, forward and backward: RMSNorm (alone and fused with the
// residual addition), RoPE, SwiGLU,
// cross-entropy, the embedding's backward and the addition of two tensors. Every kernel is a template on the storage type T (float, double, bf16) exported
// as NAME_f32 / NAME_f64 / NAME_bf16; loads convert to Acc<T> (f32, f64 for double), all
// arithmetic and sums run there, stores round back to T. The formulas (and their evaluation
// order) follow the CPU kernels in src/ops/*.rs.
//
// Launch shapes (chosen by src/ops/cuda/pointwise.rs):
//   row kernels (rms_norm*, add_rms_norm_fwd, cross_entropy*): one block per row (rms_norm_bwd*:
//     per block of rows; the RMSNorm kernels move rows in 16-byte packs where aligned),
//     blockDim.x a multiple of 32 and at most 1024, any grid at least as large as needed;
//   element kernels (rope, swiglu*, add): any 1-D grid, grid-stride loops over 64-bit indices
//     (rope, swiglu* and add over 16-byte packs of elements where aligned, see Pack).
// Every reduction has a fixed shape (per-thread strided sums, then block_sum's fixed tree), so
// results are bitwise reproducible for a given input and launch shape.
#include "common.cuh"

// Element kernels move 16 bytes at a time (a Pack, common.cuh) when all their buffers are
// 16-byte aligned, then the elements past the last whole pack one at a time; an element's
// arithmetic is the same on either path. Launch them with one thread per pack.

// out[i] = f(a[i], b[i]) for i < n: by packs where all three are 16-byte aligned, then the rest
// one element at a time (any 1-D grid).
template <typename T, typename F>
__device__ void map2(const T* a, const T* b, T* out, u64 n, F f) {
  const u64 packs = aligned16(a, b, out) ? n / Pack<T>::N : 0;
  for (u64 k = global_id(); k < packs; k += grid_stride()) {
    const Pack<T> x = load_pack(a, k), y = load_pack(b, k);
    Pack<T> o;
    for (int e = 0; e < Pack<T>::N; ++e) o.set(e, f(x.get(e), y.get(e)));
    store_pack(out, k, o);
  }
  for (u64 i = packs * Pack<T>::N + global_id(); i < n; i += grid_stride()) out[i] = f(a[i], b[i]);
}

// ---------------------------------------------------------------------------------------------
// RMSNorm: y = x * r * w per row, r = 1 / sqrt(mean(x²) + eps).
//
// A row's elements go to the block's threads in packs of Pack<T>::N consecutive elements (the
// last may be short): pack k to thread k mod blockDim.x, which takes its packs in order and each
// pack's elements in order, so every sum has one order whatever the row's alignment. Where a
// row and its companions are 16-byte aligned (h a multiple of N), a pack is one 16-byte load or
// store, else N scalar ones: the same values either way. The forward keeps a thread's first
// ROW_PACKS packs of the row in registers between its two passes (wider rows read the rest
// again); the backward keeps the dweight partials of its first BWD_PACKS packs in registers
// across its rows (the rest in the partial row), and reads x and g again for dx, from cache:
// more registers would cut the kernel's occupancy.
#define ROW_PACKS 2
#define BWD_PACKS 1

// Elements of pack k of a row of h (at most Pack<T>::N), loaded into v as Acc<T>.
template <typename T>
__device__ __forceinline__ int load_row_pack(const T* row, int h, int k, bool vec,
                                             typename Acc<T>::type* v) {
  constexpr int N = Pack<T>::N;
  const int base = k * N, n = min(N, h - base);
  if (vec) {
    const Pack<T> p = load_pack(row, k);
#pragma unroll
    for (int e = 0; e < N; ++e) v[e] = to_acc(p.get(e));
  } else {
    for (int e = 0; e < N; ++e) if (e < n) v[e] = to_acc(row[base + e]);
  }
  return n;
}

// Stores the n elements of v (Acc<T>, rounded to T) as pack k of a row.
template <typename T>
__device__ __forceinline__ void store_row_pack(T* row, int k, int n, bool vec,
                                               const typename Acc<T>::type* v) {
  constexpr int N = Pack<T>::N;
  if (vec) {
    Pack<T> p;
#pragma unroll
    for (int e = 0; e < N; ++e) p.set(e, from_acc<T>(v[e]));
    store_pack(row, k, p);
  } else {
    for (int e = 0; e < N; ++e) if (e < n) row[k * N + e] = from_acc<T>(v[e]);
  }
}

// y = x * r * w for a row x whose squares sum to ss (summed as described above). kept holds the
// thread's first ROW_PACKS packs of x.
template <typename T>
__device__ __forceinline__ void rms_norm_row_out(const T* xr, const T* w, T* yr, int h,
                                                 bool vec, typename Acc<T>::type r,
                                                 typename Acc<T>::type (*kept)[Pack<T>::N]) {
  typedef typename Acc<T>::type A;
  constexpr int N = Pack<T>::N;
  const int packs = (h + N - 1) / N;
#pragma unroll
  for (int i = 0; i < ROW_PACKS; ++i) {
    const int k = threadIdx.x + i * blockDim.x;
    if (k < packs) {
      A wv[N], o[N];
      const int n = load_row_pack(w, h, k, vec, wv);
      for (int e = 0; e < N; ++e) if (e < n) o[e] = kept[i][e] * r * wv[e];
      store_row_pack(yr, k, n, vec, o);
    }
  }
  #pragma unroll 1
  for (int k = threadIdx.x + ROW_PACKS * blockDim.x; k < packs; k += blockDim.x) {
    A v[N], wv[N], o[N];
    const int n = load_row_pack(xr, h, k, vec, v);
    load_row_pack(w, h, k, vec, wv);
    for (int e = 0; e < N; ++e) if (e < n) o[e] = v[e] * r * wv[e];
    store_row_pack(yr, k, n, vec, o);
  }
}

// x, y: [rows, h]; w: [h]. One block per row.
template <typename T>
__device__ void rms_norm_fwd_impl(const T* x, const T* w, T* y, int rows, int h, double eps) {
  typedef typename Acc<T>::type A;
  constexpr int N = Pack<T>::N;
  __shared__ A scratch[32];
  const int row = blockIdx.x;
  if (row >= rows) return;
  const T* xr = x + (size_t)row * h;
  T* yr = y + (size_t)row * h;
  const bool vec = h % N == 0 && aligned16(xr, w, yr);
  const int packs = (h + N - 1) / N;
  A kept[ROW_PACKS][N];
  A ss = 0;
#pragma unroll
  for (int i = 0; i < ROW_PACKS; ++i) {
    const int k = threadIdx.x + i * blockDim.x;
    if (k < packs) {
      const int n = load_row_pack(xr, h, k, vec, kept[i]);
      for (int e = 0; e < N; ++e) if (e < n) ss += kept[i][e] * kept[i][e];
    }
  }
  #pragma unroll 1
  for (int k = threadIdx.x + ROW_PACKS * blockDim.x; k < packs; k += blockDim.x) {
    A v[N];
    const int n = load_row_pack(xr, h, k, vec, v);
    for (int e = 0; e < N; ++e) if (e < n) ss += v[e] * v[e];
  }
  ss = block_sum(ss, scratch);
  const A r = (A)1 / sqrt_acc(ss / (A)h + (A)eps);
  rms_norm_row_out<T>(xr, w, yr, h, vec, r, kept);
}
EXPORT3(rms_norm_fwd, (const T* x, const T* w, T* y, int rows, int h, double eps),
        (x, w, y, rows, h, eps))

// The residual addition and RMSNorm in one pass: s = x + o, rounded to T as `add` stores it,
// then y = s * r * w with r from the stored s, as rms_norm_fwd computes it from s (the same
// packs, the same order). x, o, s, y: [rows, h]; w: [h]. One block per row; each thread reads
// back only the elements of s it wrote.
template <typename T>
__device__ void add_rms_norm_fwd_impl(const T* x, const T* o, const T* w, T* s, T* y, int rows,
                                      int h, double eps) {
  typedef typename Acc<T>::type A;
  constexpr int N = Pack<T>::N;
  __shared__ A scratch[32];
  const int row = blockIdx.x;
  if (row >= rows) return;
  const size_t off = (size_t)row * h;
  const bool vec = h % N == 0 && aligned16(x + off, o + off, w) && aligned16(s + off, y + off, w);
  const int packs = (h + N - 1) / N;
  A kept[ROW_PACKS][N];
  A ss = 0;
  // The sum of pack k into s, its values (as stored) into v.
  auto sum_pack = [&](int k, A* v) {
    A xv[N], ov[N];
    const int n = load_row_pack(x + off, h, k, vec, xv);
    load_row_pack(o + off, h, k, vec, ov);
    for (int e = 0; e < N; ++e) if (e < n) v[e] = to_acc(from_acc<T>(xv[e] + ov[e]));
    store_row_pack(s + off, k, n, vec, v);
    return n;
  };
#pragma unroll
  for (int i = 0; i < ROW_PACKS; ++i) {
    const int k = threadIdx.x + i * blockDim.x;
    if (k < packs) {
      const int n = sum_pack(k, kept[i]);
      for (int e = 0; e < N; ++e) if (e < n) ss += kept[i][e] * kept[i][e];
    }
  }
  #pragma unroll 1
  for (int k = threadIdx.x + ROW_PACKS * blockDim.x; k < packs; k += blockDim.x) {
    A v[N];
    const int n = sum_pack(k, v);
    for (int e = 0; e < N; ++e) if (e < n) ss += v[e] * v[e];
  }
  ss = block_sum(ss, scratch);
  const A r = (A)1 / sqrt_acc(ss / (A)h + (A)eps);
  rms_norm_row_out<T>(s + off, w, y + off, h, vec, r, kept);
}
EXPORT3(add_rms_norm_fwd,
        (const T* x, const T* o, const T* w, T* s, T* y, int rows, int h, double eps),
        (x, o, w, s, y, rows, h, eps))

// Pack k of a row, read as Acc<T> element by element: loaded whole (VEC: the row 16-byte
// aligned) or element by element where used. Only the loaded packs take registers, not their
// Acc<T> values.
template <typename T, bool VEC> struct PackIn {
  Pack<T> p;
  const T* at;
  __device__ __forceinline__ PackIn(const T* row, int k) : at(row + k * Pack<T>::N) {
    if (VEC) p = load_pack(row, k);
  }
  __device__ __forceinline__ typename Acc<T>::type operator[](int e) const {
    return to_acc(VEC ? p.get(e) : at[e]);
  }
};

// Backward, stage 1, over one block's rows with the row's alignment fixed (VEC) and with or
// without the residual gradient (RES): see rms_norm_bwd_rows.
template <typename T, bool VEC, bool RES>
__device__ __forceinline__ void rms_norm_bwd_row(const T* x, const T* w, const T* g, const T* res,
                                                 T* dx, typename Acc<T>::type* p,
                                                 typename Acc<T>::type (*dw)[Pack<T>::N],
                                                 int h, double eps,
                                                 typename Acc<T>::type* scratch) {
  typedef typename Acc<T>::type A;
  constexpr int N = Pack<T>::N;
  const int packs = (h + N - 1) / N;
  A ss = 0, a = 0;
#pragma unroll 1
  for (int k = threadIdx.x; k < packs; k += blockDim.x) {
    const PackIn<T, VEC> xv(x, k), gv(g, k), wv(w, k);
    const int n = min(N, h - k * N);
#pragma unroll
    for (int e = 0; e < N; ++e)
      if (e < n) {
        const A xe = xv[e];
        ss += xe * xe;
        a += gv[e] * wv[e] * xe;
      }
  }
  ss = block_sum(ss, scratch);
  a = block_sum(a, scratch);
  const A r = (A)1 / sqrt_acc(ss / (A)h + (A)eps);
  const A c = r * r * r * a / (A)h;
  // Pack k's dx (x and g read again, from cache), and its dweight terms into acc.
  auto out = [&](int k, A* acc) {
    const PackIn<T, VEC> xv(x, k), gv(g, k), wv(w, k);
    const int n = min(N, h - k * N);
    Pack<T> o;
#pragma unroll
    for (int e = 0; e < N; ++e)
      if (e < n) {
        const A xe = xv[e], ge = gv[e];
        A d = to_acc(from_acc<T>(r * ge * wv[e] - xe * c));
        if (RES) d = to_acc(res[k * N + e]) + d;
        if (VEC) o.set(e, from_acc<T>(d));
        else dx[k * N + e] = from_acc<T>(d);
        acc[e] += ge * xe * r;
      }
    if (VEC) store_pack(dx, k, o);
  };
#pragma unroll
  for (int i = 0; i < BWD_PACKS; ++i) {
    const int k = threadIdx.x + i * blockDim.x;
    if (k < packs) out(k, dw[i]);
  }
#pragma unroll 1
  for (int k = threadIdx.x + BWD_PACKS * blockDim.x; k < packs; k += blockDim.x) out(k, p + k * N);
}

// Backward, stage 1. x, g, dx: [rows, h]; w: [h]; partial: [gridDim.x, h] in Acc<T>.
// Block b handles rows [b * rows_per_block, (b + 1) * rows_per_block) in order. Per row, with
// a = Σ_k g_k w_k x_k: dx_j = r g_j w_j - x_j r³ a / h; the block's dweight partial
// partial[b, j] = Σ_rows g_j x_j r, added in row order by the thread owning column j's pack (in
// registers for its first BWD_PACKS packs, written once at the end; in the partial row for the
// rest). With a residual gradient res ([rows, h], RES), dx_j is rounded to T and added to res_j
// (as `add` would).
template <typename T, bool RES>
__device__ void rms_norm_bwd_rows(const T* x, const T* w, const T* g, const T* res, T* dx,
                                  typename Acc<T>::type* partial, int rows, int h,
                                  int rows_per_block, double eps) {
  typedef typename Acc<T>::type A;
  constexpr int N = Pack<T>::N;
  __shared__ A scratch[32];
  const long long first = (long long)blockIdx.x * rows_per_block;
  if (first >= rows) return;
  const int last = (int)min((long long)rows, first + rows_per_block);
  const int packs = (h + N - 1) / N;
  A* p = partial + (size_t)blockIdx.x * h;
#pragma unroll 1
  for (int k = threadIdx.x + BWD_PACKS * blockDim.x; k < packs; k += blockDim.x)
    for (int e = 0; e < min(N, h - k * N); ++e) p[k * N + e] = 0;
  A dw[BWD_PACKS][N];
#pragma unroll
  for (int i = 0; i < BWD_PACKS; ++i)
#pragma unroll
    for (int e = 0; e < N; ++e) dw[i][e] = 0;
  for (int row = (int)first; row < last; ++row) {
    const size_t off = (size_t)row * h;
    const T* rr = RES ? res + off : nullptr;
    const bool vec = h % N == 0 && aligned16(x + off, g + off, dx + off) &&
                     aligned16(w, RES ? rr : w, w);
    if (vec)
      rms_norm_bwd_row<T, true, RES>(x + off, w, g + off, rr, dx + off, p, dw, h, eps, scratch);
    else
      rms_norm_bwd_row<T, false, RES>(x + off, w, g + off, rr, dx + off, p, dw, h, eps, scratch);
  }
#pragma unroll
  for (int i = 0; i < BWD_PACKS; ++i) {
    const int k = threadIdx.x + i * blockDim.x;
    if (k < packs)
#pragma unroll
      for (int e = 0; e < N; ++e)
        if (e < h - k * N) p[k * N + e] = dw[i][e];
  }
}
template <typename T>
__device__ void rms_norm_bwd_impl(const T* x, const T* w, const T* g, T* dx,
                                  typename Acc<T>::type* partial, int rows, int h,
                                  int rows_per_block, double eps) {
  rms_norm_bwd_rows<T, false>(x, w, g, nullptr, dx, partial, rows, h, rows_per_block, eps);
}
// At least 4 blocks of ROW_THREADS (256) threads a multiprocessor: the packs' unrolled loads
// would otherwise take registers enough to leave 2, too few to hide a row's two reductions.
#define RMS_BWD_BOUNDS __launch_bounds__(256, 4)
EXPORT3_BOUNDED(rms_norm_bwd, RMS_BWD_BOUNDS,
        (const T* x, const T* w, const T* g, T* dx, Acc<T>::type* partial, int rows, int h,
         int rows_per_block, double eps),
        (x, w, g, dx, partial, rows, h, rows_per_block, eps))
template <typename T>
__device__ void rms_norm_bwd_add_impl(const T* x, const T* w, const T* g, const T* res, T* dx,
                                      typename Acc<T>::type* partial, int rows, int h,
                                      int rows_per_block, double eps) {
  rms_norm_bwd_rows<T, true>(x, w, g, res, dx, partial, rows, h, rows_per_block, eps);
}
EXPORT3_BOUNDED(rms_norm_bwd_add, RMS_BWD_BOUNDS,
        (const T* x, const T* w, const T* g, const T* res, T* dx, Acc<T>::type* partial,
         int rows, int h, int rows_per_block, double eps),
        (x, w, g, res, dx, partial, rows, h, rows_per_block, eps))

// Backward, stage 2: dw[j] = Σ_b partial[b, j]. partial: [blocks, h]; dw: [h]. Each block of
// DW_THREADS threads owns DW_COLS consecutive columns: thread t handles column t % DW_COLS and
// sums the partial rows b ≡ t / DW_COLS (mod DW_SLICES) in order; the DW_SLICES slice sums are
// then added in slice order. A fixed order (bitwise reproducible), and ceil(h / 32) blocks
// instead of one thread per column serially summing every partial (8 blocks at h = 2048).
#define DW_COLS 32
#define DW_SLICES 8
#define DW_THREADS (DW_COLS * DW_SLICES)
template <typename T>
__device__ void rms_norm_dw_impl(const typename Acc<T>::type* partial, T* dw, int blocks, int h) {
  typedef typename Acc<T>::type A;
  __shared__ A sums[DW_SLICES][DW_COLS];
  const int col = threadIdx.x % DW_COLS, slice = threadIdx.x / DW_COLS;
  const long long j = (long long)blockIdx.x * DW_COLS + col;
  A s = 0;
  if (j < h)
    for (int b = slice; b < blocks; b += DW_SLICES) s += partial[(size_t)b * h + j];
  sums[slice][col] = s;
  __syncthreads();
  if (slice == 0 && j < h) {
    A t = 0;
    for (int k = 0; k < DW_SLICES; ++k) t += sums[k][col];
    dw[j] = from_acc<T>(t);
  }
}
EXPORT3(rms_norm_dw, (const Acc<T>::type* partial, T* dw, int blocks, int h),
        (partial, dw, blocks, h))

// ---------------------------------------------------------------------------------------------
// RoPE (rotate-half): y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin on the halves of each head
// vector; `inverse` != 0 negates sin (the backward pass).

// x, y: [b, s, heads, 2 * half]; cos, sin: [s, half]; pairs = b * s * heads * half. The pair
// index and the divisions that locate it run in I: 32-bit unsigned arithmetic (a few
// instructions a division, against tens for 64-bit) whenever the indices fit, as they do for
// every activation candle's 32-bit kernels can make; 64-bit otherwise. Where half is a multiple
// of a Pack and every buffer is 16-byte aligned, each step takes a Pack of consecutive pairs
// (their first halves, second halves, cos and sin each one 16-byte load): the same arithmetic
// per element, a Pack's worth of indexing.
template <typename T, typename I>
__device__ void rope_pairs(const T* x, const T* cos, const T* sin, T* y, I pairs, I seq, I heads,
                           I half, int inverse) {
  typedef typename Acc<T>::type A;
  constexpr int N = Pack<T>::N;
  const I stride = (I)grid_stride();
  if (half % N == 0 && aligned16(x, cos, sin) && aligned16(y, y, y)) {
    for (I u = (I)global_id(); u < pairs / N; u += stride) {
      const I p = u * N;  // the first of N pairs of one head vector
      const I j = p % half;
      const I t = p / half;  // (batch, position, head)
      const I pos = (t / heads) % seq;
      const I i1 = t * 2 * half + j, i2 = i1 + half, ct = pos * half + j;
      const Pack<T> x1 = load_pack(x, i1 / N), x2 = load_pack(x, i2 / N);
      const Pack<T> cp = load_pack(cos, ct / N), sp = load_pack(sin, ct / N);
      Pack<T> y1, y2;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const A a1 = to_acc(x1.get(e)), a2 = to_acc(x2.get(e)), c = to_acc(cp.get(e));
        const A s = inverse ? -to_acc(sp.get(e)) : to_acc(sp.get(e));
        y1.set(e, from_acc<T>(a1 * c - a2 * s));
        y2.set(e, from_acc<T>(a2 * c + a1 * s));
      }
      store_pack(y, i1 / N, y1);
      store_pack(y, i2 / N, y2);
    }
    return;
  }
  for (I p = (I)global_id(); p < pairs; p += stride) {
    const I j = p % half;
    const I t = p / half;  // (batch, position, head)
    const I pos = (t / heads) % seq;
    const I i1 = t * 2 * half + j, i2 = i1 + half;
    const A x1 = to_acc(x[i1]), x2 = to_acc(x[i2]);
    const A c = to_acc(cos[pos * half + j]);
    const A s = inverse ? -to_acc(sin[pos * half + j]) : to_acc(sin[pos * half + j]);
    y[i1] = from_acc<T>(x1 * c - x2 * s);
    y[i2] = from_acc<T>(x2 * c + x1 * s);
  }
}
template <typename T>
__device__ void rope_impl(const T* x, const T* cos, const T* sin, T* y, u64 pairs, int seq,
                          int heads, int half, int inverse) {
  // 32-bit when every element index (below 2 · pairs) plus a grid stride stays below 2^32.
  if (2 * pairs + grid_stride() <= 0xffffffffull)
    rope_pairs<T, unsigned>(x, cos, sin, y, (unsigned)pairs, (unsigned)seq, (unsigned)heads,
                            (unsigned)half, inverse);
  else
    rope_pairs<T, u64>(x, cos, sin, y, pairs, (u64)seq, (u64)heads, (u64)half, inverse);
}
EXPORT3(rope,
        (const T* x, const T* cos, const T* sin, T* y, u64 pairs, int seq, int heads, int half,
         int inverse),
        (x, cos, sin, y, pairs, seq, heads, half, inverse))

// ---------------------------------------------------------------------------------------------
// SwiGLU: y = gate * sigmoid(gate) * up.

template <typename A> __device__ __forceinline__ A sigmoid_acc(A x) {
  return (A)1 / ((A)1 + exp_acc(-x));
}

// gate, up, y: [n].
template <typename T>
__device__ void swiglu_fwd_impl(const T* gate, const T* up, T* y, u64 n) {
  typedef typename Acc<T>::type A;
  const auto one = [](T g, T u) {
    const A a = to_acc(g);
    return from_acc<T>(a * sigmoid_acc(a) * to_acc(u));
  };
  map2(gate, up, y, n, one);
}
EXPORT3(swiglu_fwd, (const T* gate, const T* up, T* y, u64 n), (gate, up, y, n))

// gate, up, grad: [n]; out: [2, n] = [d gate, d up] with s = sigmoid(gate):
// d gate = grad * up * s * (1 + gate * (1 - s)), d up = grad * gate * s.
template <typename T>
__device__ void swiglu_bwd_impl(const T* gate, const T* up, const T* grad, T* out, u64 n) {
  typedef typename Acc<T>::type A;
  const auto one = [](T gt, T ut, T dt, T* dg, T* du) {
    const A g = to_acc(gt), u = to_acc(ut), gr = to_acc(dt);
    const A s = sigmoid_acc(g);
    *dg = from_acc<T>(gr * u * s * ((A)1 + g * ((A)1 - s)));
    *du = from_acc<T>(gr * g * s);
  };
  T* const dup = out + n;
  const u64 packs = aligned16(gate, up, grad) && aligned16(out, dup, out) ? n / Pack<T>::N : 0;
  for (u64 k = global_id(); k < packs; k += grid_stride()) {
    const Pack<T> g = load_pack(gate, k), u = load_pack(up, k), d = load_pack(grad, k);
    Pack<T> dg, du;
    for (int e = 0; e < Pack<T>::N; ++e) {
      T a, b;
      one(g.get(e), u.get(e), d.get(e), &a, &b);
      dg.set(e, a);
      du.set(e, b);
    }
    store_pack(out, k, dg);
    store_pack(dup, k, du);
  }
  for (u64 i = packs * Pack<T>::N + global_id(); i < n; i += grid_stride())
    one(gate[i], up[i], grad[i], &out[i], &dup[i]);
}
EXPORT3(swiglu_bwd, (const T* gate, const T* up, const T* grad, T* out, u64 n),
        (gate, up, grad, out, n))

// Joined: gu [rows, 2f] holds each row's gate, then its up (the fused gate/up GEMM's output);
// y [rows, f]. The same arithmetic as swiglu_fwd, element for element.
template <typename T>
__device__ void swiglu_joined_fwd_impl(const T* gu, T* y, u64 rows, u64 f) {
  typedef typename Acc<T>::type A;
  const u64 n = rows * f;
  for (u64 i = global_id(); i < n; i += grid_stride()) {
    const u64 r = i / f, at = 2 * f * r + (i - r * f);
    const A a = to_acc(gu[at]);
    y[i] = from_acc<T>(a * sigmoid_acc(a) * to_acc(gu[at + f]));
  }
}
EXPORT3(swiglu_joined_fwd, (const T* gu, T* y, u64 rows, u64 f), (gu, y, rows, f))

// gu [rows, 2f] as above, grad [rows, f]; out [rows, 2f]: each row's d gate, then its d up (the
// layout the fused input-gradient GEMM reads). The arithmetic of swiglu_bwd.
template <typename T>
__device__ void swiglu_joined_bwd_impl(const T* gu, const T* grad, T* out, u64 rows, u64 f) {
  typedef typename Acc<T>::type A;
  const u64 n = rows * f;
  for (u64 i = global_id(); i < n; i += grid_stride()) {
    const u64 r = i / f, at = 2 * f * r + (i - r * f);
    const A g = to_acc(gu[at]), u = to_acc(gu[at + f]), gr = to_acc(grad[i]);
    const A s = sigmoid_acc(g);
    out[at] = from_acc<T>(gr * u * s * ((A)1 + g * ((A)1 - s)));
    out[at + f] = from_acc<T>(gr * g * s);
  }
}
EXPORT3(swiglu_joined_bwd, (const T* gu, const T* grad, T* out, u64 rows, u64 f),
        (gu, grad, out, rows, f))

// ---------------------------------------------------------------------------------------------
// Addition of two tensors of one shape (the residual stream and the gradients that meet where a
// tensor feeds several operations): out = a + b, each sum rounded once to T.

// a, b, out: [n].
template <typename T> __device__ void add_impl(const T* a, const T* b, T* out, u64 n) {
  const auto one = [](T x, T y) { return from_acc<T>(to_acc(x) + to_acc(y)); };
  map2(a, b, out, n, one);
}
EXPORT3(add, (const T* a, const T* b, T* out, u64 n), (a, b, out, n))

// ---------------------------------------------------------------------------------------------
// Cross-entropy: loss = logsumexp(row) - row[target]. A target >= v makes that row's outputs
// NaN (its loss, or its whole gradient row): the host never reads anything back after a launch
// (a read per micro-batch would stall the queue), the targets were checked against the
// vocabulary when the data was opened, and a NaN loss stops or skips the step in the trainer's
// guard instead of training on a wrong label.

// logits: [rows, v]; targets: [rows]; loss: [rows] in Acc<T>. One block per row: the maximum,
// then Σ exp(x - max), each over the block.
template <typename T>
__device__ void cross_entropy_fwd_impl(const T* logits, const unsigned* targets,
                                       typename Acc<T>::type* loss, int rows, int v) {
  typedef typename Acc<T>::type A;
  __shared__ A scratch[32];
  const int row = blockIdx.x;
  if (row >= rows) return;
  const unsigned t = targets[row];
  if (t >= (unsigned)v) {  // the same for the whole block: it leaves together
    if (threadIdx.x == 0) loss[row] = (A)NAN;
    return;
  }
  const T* lr = logits + (size_t)row * v;
  A m = neg_inf<A>();
  for (int j = threadIdx.x; j < v; j += blockDim.x) {
    const A xv = to_acc(lr[j]);
    m = xv > m ? xv : m;  // NaNs are skipped, as on the CPU
  }
  m = block_max(m, scratch);
  A s = 0;
  for (int j = threadIdx.x; j < v; j += blockDim.x) s += exp_acc(to_acc(lr[j]) - m);
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) loss[row] = m + log_acc(s) - to_acc(lr[t]);
}
// Launched with blocks of 1,024 threads (CE_THREADS in src/ops/cuda/pointwise.rs).
EXPORT3_BOUNDED(cross_entropy_fwd, __launch_bounds__(1024),
        (const T* logits, const unsigned* targets, Acc<T>::type* loss, int rows, int v),
        (logits, targets, loss, rows, v))

// logits, d: [rows, v]; targets: [rows]; loss_grad: [rows, 2] in Acc<T> (the forward loss and
// its upstream gradient). d[i] = (exp(x - lse) - onehot(t)) * grad with lse = loss + x[t].
// One block per row; a bad target's row is NaN, as in the forward kernel.
template <typename T>
__device__ void cross_entropy_bwd_impl(const T* logits, const unsigned* targets,
                                       const typename Acc<T>::type* loss_grad, T* d, int rows,
                                       int v) {
  typedef typename Acc<T>::type A;
  const int row = blockIdx.x;
  if (row >= rows) return;
  const unsigned t = targets[row];
  T* dr = d + (size_t)row * v;
  if (t >= (unsigned)v) {
    for (int j = threadIdx.x; j < v; j += blockDim.x) dr[j] = from_acc<T>((A)NAN);
    return;
  }
  const T* lr = logits + (size_t)row * v;
  const A g = loss_grad[2 * (size_t)row + 1];
  const A lse = loss_grad[2 * (size_t)row] + to_acc(lr[t]);
  for (int j = threadIdx.x; j < v; j += blockDim.x) {
    A dj = exp_acc(to_acc(lr[j]) - lse) * g;
    if ((unsigned)j == t) dj -= g;
    dr[j] = from_acc<T>(dj);
  }
}
EXPORT3_BOUNDED(cross_entropy_bwd, __launch_bounds__(1024),
        (const T* logits, const unsigned* targets, const Acc<T>::type* loss_grad, T* d, int rows,
         int v),
        (logits, targets, loss_grad, d, rows, v))

// ---------------------------------------------------------------------------------------------
// Embedding backward: dw[id] = Σ_{i : ids[i] = id} grad[i], each row summed over its positions
// in position order (deterministic; the CPU's index_add order). The positions are first sorted
// by id, stably, into `order` (a counting sort: embedding_count, embedding_offsets,
// embedding_order), so that embedding_bwd's block for row id reads exactly its own positions:
// O(n² / threads) integer work for the sort and O(n h + v h) for the sums, where scanning every
// position for every row cost O(v n h / threads). No two threads write the same element of dw
// and the summation order never depends on scheduling. Ids >= v are skipped.

// ids: [n]; counts: [v], zeroed by the caller. Any 1-D grid. Integer atomics: the final counts
// do not depend on their order.
extern "C" __global__ void embedding_count(const unsigned* ids, unsigned* counts, u64 n,
                                           unsigned v) {
  for (u64 i = global_id(); i < n; i += grid_stride()) {
    const unsigned t = ids[i];
    if (t < v) atomicAdd(&counts[t], 1u);
  }
}

// counts: [v]; offsets: [v + 1], offsets[id] = Σ_{k < id} counts[k]. One block of any width up
// to EMB_SCAN_THREADS: thread t sums its run of ids, thread 0 scans the runs' sums, then every
// thread writes its run's offsets.
#define EMB_SCAN_THREADS 1024
extern "C" __global__ void embedding_offsets(const unsigned* counts, unsigned* offsets,
                                             unsigned v) {
  __shared__ unsigned run_start[EMB_SCAN_THREADS + 1];
  const unsigned threads = blockDim.x, t = threadIdx.x;
  const unsigned per = (v + threads - 1) / threads;
  const unsigned lo = min(v, t * per), hi = min(v, lo + per);
  unsigned sum = 0;
  for (unsigned k = lo; k < hi; ++k) sum += counts[k];
  run_start[t + 1] = sum;
  __syncthreads();
  if (t == 0) {
    run_start[0] = 0;
    for (unsigned k = 1; k <= threads; ++k) run_start[k] += run_start[k - 1];
  }
  __syncthreads();
  unsigned at = run_start[t];
  for (unsigned k = lo; k < hi; ++k) {
    offsets[k] = at;
    at += counts[k];
  }
  if (t == threads - 1) offsets[v] = run_start[threads];
}

// ids: [n]; offsets: [v + 1]; order: [offsets[v]]. Position i goes to slot offsets[ids[i]] + the
// number of earlier positions with the same id, so each id's positions stay in position order.
// Blocks of EMB_ORDER_THREADS threads, one position per thread, grid ceil(n / threads): the ids
// before a block's last position pass through shared memory in tiles of the block's width.
#define EMB_ORDER_THREADS 256
extern "C" __global__ void embedding_order(const unsigned* ids, const unsigned* offsets,
                                           unsigned* order, u64 n, unsigned v) {
  __shared__ unsigned tile[EMB_ORDER_THREADS];
  const u64 first = (u64)blockIdx.x * blockDim.x;
  const u64 i = first + threadIdx.x;
  const unsigned id = i < n ? ids[i] : v;
  unsigned rank = 0;
  for (u64 base = 0; base < first + blockDim.x && base < n; base += blockDim.x) {
    const u64 j = base + threadIdx.x;
    tile[threadIdx.x] = j < n ? ids[j] : v;
    __syncthreads();
    const u64 end = min((u64)blockDim.x, i > base ? i - base : 0);  // only positions j < i
    for (u64 k = 0; k < end; ++k) rank += tile[k] == id;
    __syncthreads();
  }
  if (i < n && id < v) order[offsets[id] + rank] = (unsigned)i;
}

// grad: [n, h]; order, offsets as above; dw: [v, h]. One block per row id < v (grid v): the sum
// of the gradient rows of its positions, in position order, each thread its columns.
template <typename T>
__device__ void embedding_bwd_impl(const T* grad, const unsigned* order, const unsigned* offsets,
                                   T* dw, int h, int v) {
  typedef typename Acc<T>::type A;
  const int id = blockIdx.x;
  if (id >= v) return;
  T* out = dw + (size_t)id * h;
  const unsigned lo = offsets[id], hi = offsets[id + 1];
  for (int j = threadIdx.x; j < h; j += blockDim.x) {
    A s = 0;
    for (unsigned k = lo; k < hi; ++k) s += to_acc(grad[(size_t)order[k] * h + j]);
    out[j] = from_acc<T>(s);
  }
}
EXPORT3(embedding_bwd,
        (const T* grad, const unsigned* order, const unsigned* offsets, T* dw, int h, int v),
        (grad, order, offsets, dw, h, v))
