// Pointwise kernels of the op library, forward and backward: RMSNorm, RoPE, SwiGLU and
// cross-entropy. Every kernel is a template on the storage type T (float, double, bf16) exported
// as NAME_f32 / NAME_f64 / NAME_bf16; loads convert to Acc<T> (f32, f64 for double), all
// arithmetic and sums run there, stores round back to T. The formulas (and their evaluation
// order) follow the CPU kernels in src/ops/*.rs.
//
// Launch shapes (chosen by src/ops/cuda/pointwise.rs):
//   row kernels (rms_norm*, cross_entropy*): one block per row (rms_norm_bwd: per block of rows),
//     blockDim.x a multiple of 32 and at most 1024, any grid at least as large as needed;
//   element kernels (rope, swiglu*): any 1-D grid, grid-stride loops over 64-bit indices.
// Every reduction has a fixed shape (per-thread strided sums, then block_sum's fixed tree), so
// results are bitwise reproducible for a given input and launch shape.
#include "common.cuh"

typedef unsigned long long u64;

// Index of this thread in a 1-D grid, and the grid's stride.
__device__ __forceinline__ u64 global_id() { return (u64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ u64 grid_stride() { return (u64)gridDim.x * blockDim.x; }

// ---------------------------------------------------------------------------------------------
// RMSNorm: y = x * r * w per row, r = 1 / sqrt(mean(x²) + eps).

// x, y: [rows, h]; w: [h]. One block per row.
template <typename T>
__device__ void rms_norm_fwd_impl(const T* x, const T* w, T* y, int rows, int h, double eps) {
  typedef typename Acc<T>::type A;
  __shared__ A scratch[32];
  const int row = blockIdx.x;
  if (row >= rows) return;
  const T* xr = x + (size_t)row * h;
  T* yr = y + (size_t)row * h;
  A ss = 0;
  for (int j = threadIdx.x; j < h; j += blockDim.x) {
    const A v = to_acc(xr[j]);
    ss += v * v;
  }
  ss = block_sum(ss, scratch);
  const A r = (A)1 / sqrt_acc(ss / (A)h + (A)eps);
  for (int j = threadIdx.x; j < h; j += blockDim.x) {
    yr[j] = from_acc<T>(to_acc(xr[j]) * r * to_acc(w[j]));
  }
}
EXPORT3(rms_norm_fwd, (const T* x, const T* w, T* y, int rows, int h, double eps),
        (x, w, y, rows, h, eps))

// Backward, stage 1. x, g, dx: [rows, h]; w: [h]; partial: [gridDim.x, h] in Acc<T>.
// Block b handles rows [b * rows_per_block, (b + 1) * rows_per_block) in order. Per row, with
// a = Σ_k g_k w_k x_k: dx_j = r g_j w_j - x_j r³ a / h; the block's dweight partial
// partial[b, j] = Σ_rows g_j x_j r. Thread t owns columns j ≡ t (mod blockDim.x) of the partial
// row, so it accumulates them in global memory without races, in row order.
template <typename T>
__device__ void rms_norm_bwd_impl(const T* x, const T* w, const T* g, T* dx,
                                  typename Acc<T>::type* partial, int rows, int h,
                                  int rows_per_block, double eps) {
  typedef typename Acc<T>::type A;
  __shared__ A scratch[32];
  const long long first = (long long)blockIdx.x * rows_per_block;
  if (first >= rows) return;
  const int last = (int)min((long long)rows, first + rows_per_block);
  A* p = partial + (size_t)blockIdx.x * h;
  for (int j = threadIdx.x; j < h; j += blockDim.x) p[j] = 0;
  for (int row = (int)first; row < last; ++row) {
    const T* xr = x + (size_t)row * h;
    const T* gr = g + (size_t)row * h;
    T* dxr = dx + (size_t)row * h;
    A ss = 0, a = 0;
    for (int j = threadIdx.x; j < h; j += blockDim.x) {
      const A xv = to_acc(xr[j]);
      ss += xv * xv;
      a += to_acc(gr[j]) * to_acc(w[j]) * xv;
    }
    ss = block_sum(ss, scratch);
    a = block_sum(a, scratch);
    const A r = (A)1 / sqrt_acc(ss / (A)h + (A)eps);
    const A c = r * r * r * a / (A)h;
    for (int j = threadIdx.x; j < h; j += blockDim.x) {
      const A xv = to_acc(xr[j]), gv = to_acc(gr[j]);
      dxr[j] = from_acc<T>(r * gv * to_acc(w[j]) - xv * c);
      p[j] += gv * xv * r;
    }
  }
}
EXPORT3(rms_norm_bwd,
        (const T* x, const T* w, const T* g, T* dx, Acc<T>::type* partial, int rows, int h,
         int rows_per_block, double eps),
        (x, w, g, dx, partial, rows, h, rows_per_block, eps))

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

// x, y: [b, s, heads, 2 * half]; cos, sin: [s, half]; pairs = b * s * heads * half.
template <typename T>
__device__ void rope_impl(const T* x, const T* cos, const T* sin, T* y, u64 pairs, int seq,
                          int heads, int half, int inverse) {
  typedef typename Acc<T>::type A;
  for (u64 p = global_id(); p < pairs; p += grid_stride()) {
    const u64 j = p % (u64)half;
    const u64 t = p / (u64)half;  // (batch, position, head)
    const u64 pos = (t / (u64)heads) % (u64)seq;
    const u64 i1 = t * 2 * (u64)half + j, i2 = i1 + (u64)half;
    const A x1 = to_acc(x[i1]), x2 = to_acc(x[i2]);
    const A c = to_acc(cos[pos * half + j]);
    const A s = inverse ? -to_acc(sin[pos * half + j]) : to_acc(sin[pos * half + j]);
    y[i1] = from_acc<T>(x1 * c - x2 * s);
    y[i2] = from_acc<T>(x2 * c + x1 * s);
  }
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
  for (u64 i = global_id(); i < n; i += grid_stride()) {
    const A g = to_acc(gate[i]);
    y[i] = from_acc<T>(g * sigmoid_acc(g) * to_acc(up[i]));
  }
}
EXPORT3(swiglu_fwd, (const T* gate, const T* up, T* y, u64 n), (gate, up, y, n))

// gate, up, grad: [n]; out: [2, n] = [d gate, d up] with s = sigmoid(gate):
// d gate = grad * up * s * (1 + gate * (1 - s)), d up = grad * gate * s.
template <typename T>
__device__ void swiglu_bwd_impl(const T* gate, const T* up, const T* grad, T* out, u64 n) {
  typedef typename Acc<T>::type A;
  for (u64 i = global_id(); i < n; i += grid_stride()) {
    const A g = to_acc(gate[i]), u = to_acc(up[i]), gr = to_acc(grad[i]);
    const A s = sigmoid_acc(g);
    out[i] = from_acc<T>(gr * u * s * ((A)1 + g * ((A)1 - s)));
    out[n + i] = from_acc<T>(gr * g * s);
  }
}
EXPORT3(swiglu_bwd, (const T* gate, const T* up, const T* grad, T* out, u64 n),
        (gate, up, grad, out, n))

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
EXPORT3(cross_entropy_fwd,
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
EXPORT3(cross_entropy_bwd,
        (const T* logits, const unsigned* targets, const Acc<T>::type* loss_grad, T* d, int rows,
         int v),
        (logits, targets, loss_grad, d, rows, v))

// ---------------------------------------------------------------------------------------------
// Embedding backward: dw[id] = Σ_{i : ids[i] = id} grad[i], each row summed over its positions
// in position order (deterministic; the CPU's index_add order). Stage 1 (embedding_mark) sets
// used[id] = 1 for every id present, one thread per position (ids >= v are skipped; stores of
// the same value need no atomics). Stage 2 (embedding_bwd) runs one block per vocabulary row:
// an unused row is written as zeros; a used row scans the ids in order, each thread summing its
// columns of the matching gradient rows in Acc<T>. Unlike a scatter-add over positions, no two
// threads ever write the same element and the order never depends on scheduling.

// ids: [n]; used: [v], zeroed by the caller. Any 1-D grid.
extern "C" __global__ void embedding_mark(const unsigned* ids, unsigned* used, u64 n,
                                          unsigned v) {
  for (u64 i = global_id(); i < n; i += grid_stride()) {
    const unsigned t = ids[i];
    if (t < v) used[t] = 1u;
  }
}

// grad: [n, h]; ids: [n]; used: [v]; dw: [v, h]. One block per row id < v (grid v).
template <typename T>
__device__ void embedding_bwd_impl(const T* grad, const unsigned* ids, const unsigned* used,
                                   T* dw, u64 n, int h, int v) {
  typedef typename Acc<T>::type A;
  const int id = blockIdx.x;
  if (id >= v) return;
  T* out = dw + (size_t)id * h;
  if (!used[id]) {
    for (int j = threadIdx.x; j < h; j += blockDim.x) out[j] = from_acc<T>((A)0);
    return;
  }
  for (int j0 = 0; j0 < h; j0 += blockDim.x) {  // one pass over the ids per blockDim columns
    const int j = j0 + threadIdx.x;
    A s = 0;
    for (u64 i = 0; i < n; ++i)
      if (ids[i] == (unsigned)id && j < h) s += to_acc(grad[i * h + j]);
    if (j < h) out[j] = from_acc<T>(s);
  }
}
EXPORT3(embedding_bwd,
        (const T* grad, const unsigned* ids, const unsigned* used, T* dw, u64 n, int h, int v),
        (grad, ids, used, dw, n, h, v))
