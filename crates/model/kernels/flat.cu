// Kernels over the optimizer's flat f32 buffers: gradient accumulation (add_into, or the first
// gradient written over the buffer's old values), the master
// weights written into the parameters' flat tensor in their dtype (cast_into), the AdamW
// update (adamw_f32, adamw_bf16: the moments' type; it also flags a non-finite stored value),
// Muon's element-wise passes (muon_*) and the sum of squares for the global gradient norm and
// Muon's finiteness check (sum_squares_*).
//
// add_into, cast_into and adamw are elementwise with grid-stride loops over 64-bit indices (any 1-D grid).
// adamw uses the explicitly rounded intrinsics (__fmul_rn, ...), which nvcc never contracts into
// FMAs, so it performs exactly the f32 operations of the CPU AdamWStep, in the same order, and
// gives bitwise identical results. sum_squares is a deterministic two-stage reduction in f64:
// a grid of fixed shape writes one partial per block (reading 16-byte packs), then a single
// block sums the partials.
#include "common.cuh"

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(double x) { return __double2float_rn(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

// dst[i] += (f32) src[i] for i < n, or with overwrite dst[i] = (f32) src[i] (a step's first
// gradient of a parameter, without zeroing the buffer first); dst: [n] f32, src: [n] of the
// storage type T.
template <typename T> __device__ void add_into_impl(float* dst, const T* src, u64 n, int overwrite) {
  for (u64 i = global_id(); i < n; i += grid_stride())
    dst[i] = overwrite ? to_f32(src[i]) : __fadd_rn(dst[i], to_f32(src[i]));
}
EXPORT3(add_into, (float* dst, const T* src, u64 n, int overwrite), (dst, src, n, overwrite))

// dst[i] = src[i] rounded to T (nearest even) for i < n; dst: [n] of the storage type T (the
// parameters' flat tensor), src: [n] f32 (the master weights).
template <typename T> __device__ __forceinline__ T from_f32(float x) { return (T)x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <typename T> __device__ void cast_into_impl(T* dst, const float* src, u64 n) {
  for (u64 i = global_id(); i < n; i += grid_stride()) dst[i] = from_f32<T>(src[i]);
}
EXPORT3(cast_into, (T* dst, const float* src, u64 n), (dst, src, n))

// One AdamW step over the elements [start, start + len) of one decay range.
// state: [n] f32 master, then the moments exp_avg [n] M and exp_avg_sq [n] M (M = f32 or bf16:
// 3 n floats, or n floats then 2 n bf16s); grad: [n] f32. Per element, in f32 as the CPU:
//   g = grad * gs; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g g;
//   p = p keep - step_size m / (sqrt(v) inv_sqrt_bc2 + eps);
// the moments are stored rounded to M (nearest even), the update uses their f32 values. Any
// stored value that is not finite sets *bad to 1 (the state's finiteness check, without a pass
// over the state; x - x is 0 exactly for finite x). With out (else null), the new master weight
// is also written there rounded to bf16 (nearest even): the parameters' flat tensor [n], made
// in the same pass instead of a second one (cast_into) re-reading the masters.
template <typename M>
__device__ void adamw_impl(float* state, const float* grad, u64 n, u64 start, u64 len, float b1,
                           float b2, float step_size, float inv_sqrt_bc2, float eps, float gs,
                           float keep, unsigned* bad, __nv_bfloat16* out) {
  float* master = state;
  M* exp_avg = (M*)(state + n);
  M* exp_avg_sq = exp_avg + n;
  const float c1 = __fsub_rn(1.0f, b1), c2 = __fsub_rn(1.0f, b2);
  for (u64 i = global_id(); i < len; i += grid_stride()) {
    const u64 k = start + i;
    const float g = __fmul_rn(grad[k], gs);
    const float m = __fadd_rn(__fmul_rn(b1, to_f32(exp_avg[k])), __fmul_rn(c1, g));
    const float v = __fadd_rn(__fmul_rn(b2, to_f32(exp_avg_sq[k])), __fmul_rn(__fmul_rn(c2, g), g));
    const M sm = from_acc<M>(m), sv = from_acc<M>(v);
    exp_avg[k] = sm;
    exp_avg_sq[k] = sv;
    const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(v), inv_sqrt_bc2), eps);
    const float p =
        __fsub_rn(__fmul_rn(master[k], keep), __fdiv_rn(__fmul_rn(step_size, m), denom));
    master[k] = p;
    if (out) out[k] = __float2bfloat16_rn(p);
    const float fm = to_f32(sm), fv = to_f32(sv);
    if (!(__fsub_rn(p, p) == 0.0f && __fsub_rn(fm, fm) == 0.0f && __fsub_rn(fv, fv) == 0.0f))
      *bad = 1u;
  }
}
#define ADAMW_PARAMS                                                                             \
  (float* state, const float* grad, u64 n, u64 start, u64 len, float b1, float b2,              \
   float step_size, float inv_sqrt_bc2, float eps, float gs, float keep, unsigned* bad,          \
   __nv_bfloat16* out)
#define ADAMW_ARGS \
  (state, grad, n, start, len, b1, b2, step_size, inv_sqrt_bc2, eps, gs, keep, bad, out)
EXPORT_ONE(adamw, f32, float, ADAMW_PARAMS, ADAMW_ARGS)
EXPORT_ONE(adamw, bf16, __nv_bfloat16, ADAMW_PARAMS, ADAMW_ARGS)

// Muon's element-wise passes over one run of len elements (src/optim/muon/fused.rs performs
// the same f32 operations on the CPU, in this order, with the same results bit for bit).
// lerp(s, e) is torch.lerp's two-sided form at a weight fixed on the host: low (|w| < 0.5):
// s + ((e - s) c + 0) with c = w, else e - ((e - s) c + 0) with c = 1 - w. The gradient is read
// as g gs + 0 when scaled (clipping), as g otherwise.
__device__ __forceinline__ float muon_grad(float g, int scaled, float gs) {
  return scaled ? __fadd_rn(__fmul_rn(g, gs), 0.0f) : g;
}
__device__ __forceinline__ float muon_lerp(float s, float e, int low, float c) {
  const float d = __fadd_rn(__fmul_rn(__fsub_rn(e, s), c), 0.0f);
  return low ? __fadd_rn(s, d) : __fsub_rn(e, d);
}

// One run of a Muon state [master | buf] of 2 k floats: its elements here..here + len, their
// gradients grad[g..g + len], their places in the rank's owned elements u[at..at + len].

// The momentum: buf[here + i] = lerp(buf[here + i], g'[g + i]) for i < len.
extern "C" __global__ void muon_momentum(float* state, const float* grad, u64 k, u64 here, u64 g,
                                         u64 len, int scaled, float gs, int low, float c) {
  float* buf = state + k + here;
  const float* gr = grad + g;
  for (u64 i = global_id(); i < len; i += grid_stride())
    buf[i] = muon_lerp(buf[i], muon_grad(gr[i], scaled, gs), low, c);
}

// The direction: u[at + i] = lerp(g'[g + i], buf[here + i]) with Nesterov, buf[here + i]
// without, for i < len.
extern "C" __global__ void muon_direction(float* u, const float* grad, const float* state, u64 k,
                                          u64 here, u64 g, u64 at, u64 len, int scaled, float gs,
                                          int nesterov, int low, float c) {
  const float* buf = state + k + here;
  const float* gr = grad + g;
  float* out = u + at;
  for (u64 i = global_id(); i < len; i += grid_stride())
    out[i] = nesterov ? muon_lerp(muon_grad(gr[i], scaled, gs), buf[i], low, c) : buf[i];
}

// The update: master[here + i] = (master[here + i] keep + 0) + o[at + i] for i < len.
extern "C" __global__ void muon_apply(float* state, const float* o, u64 here, u64 at, u64 len,
                                      float keep) {
  float* master = state + here;
  const float* up = o + at;
  for (u64 i = global_id(); i < len; i += grid_stride())
    master[i] = __fadd_rn(__fadd_rn(__fmul_rn(master[i], keep), 0.0f), up[i]);
}

// Stage 1 of Σ x²: block b writes partial[b] = Σ x[i]² (in f64) over the elements this grid
// assigns to it. x: [n] f32 or bf16 (the optimizer's bf16 moments); partial: [gridDim.x] f64.
// The elements are read a 16-byte Pack at a time, two packs in flight per thread (one scalar
// load per thread kept too few bytes in flight: about 1.1 TB/s on an H100): the packs from the
// first 16-byte aligned element on go to the grid's threads in turn (pack v to thread v mod the
// grid's threads, each thread summing its packs in order, alternately into two sums), and the
// elements before the first pack and after the last (fewer than a pack's each) to the first
// threads of block 0. The assignment depends on n, the launch shape and x's alignment only, so
// a buffer's sum is the same on every run.
template <typename T> __device__ __forceinline__ double pack_squares(const Pack<T>& p) {
  double s = 0.0;
  for (int e = 0; e < Pack<T>::N; ++e) {
    const double v = (double)to_f32(p.get(e));
    s += v * v;
  }
  return s;
}
template <typename T> __device__ void sum_squares_partial_impl(const T* x, u64 n, double* partial) {
  __shared__ double scratch[32];
  constexpr u64 N = Pack<T>::N;
  const u64 skew = ((u64)(size_t)x / sizeof(T)) % N;
  const u64 head = skew == 0 ? 0 : (N - skew < n ? N - skew : n);
  const u64 packs = (n - head) / N;
  const u64 tail = head + packs * N;  // the first element after the packs
  const T* px = x + head;
  const u64 id = global_id(), stride = grid_stride();
  double s0 = 0.0, s1 = 0.0;
  u64 k = id;
  for (; k + stride < packs; k += 2 * stride) {
    const Pack<T> a = load_pack(px, k), b = load_pack(px, k + stride);
    s0 += pack_squares(a);
    s1 += pack_squares(b);
  }
  if (k < packs) s0 += pack_squares(load_pack(px, k));
  if (id < head + (n - tail)) {
    const double v = (double)to_f32(x[id < head ? id : tail + (id - head)]);
    s0 += v * v;
  }
  const double s = block_sum(s0 + s1, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
EXPORT_ONE(sum_squares_partial, f32, float, (const T* x, u64 n, double* partial), (x, n, partial))
EXPORT_ONE(sum_squares_partial, bf16, __nv_bfloat16, (const T* x, u64 n, double* partial),
           (x, n, partial))

// Stage 2: out[0] = Σ partial[0..blocks), by one block of a fixed size.
extern "C" __global__ void sum_squares_final(const double* partial, int blocks, double* out) {
  __shared__ double scratch[32];
  double s = 0.0;
  for (int b = threadIdx.x; b < blocks; b += blockDim.x) s += partial[b];
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) out[0] = s;
}
