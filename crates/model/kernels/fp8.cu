// FP8 rounding by block (the conventions are src/ops/fp8.rs's): a tensor read as [rows, cols]
// is cut into blocks of br x bc elements (edge blocks cut short); fp8_amax writes each block's
// largest magnitude, fp8_cast each element's code fp8(x s) (as laid out, or transposed) and/or
// its value code / s in the storage type, s the block's power-of-two scale, and fp8_inv_scales
// each block's 1 / s. Formats: 0 is E4M3, 1 is E5M2, converted by
// cuda_fp8.h round-to-nearest-even with SATFINITE (hardware on sm_89 and newer). Every product
// by s or 1 / s is exact, so the values equal the CPU's bit for bit.
#include "common.cuh"
#include <cuda_fp8.h>

__device__ __forceinline__ float fp8_in(float x) { return x; }
__device__ __forceinline__ float fp8_in(double x) { return __double2float_rn(x); }
__device__ __forceinline__ float fp8_in(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T fp8_out(float x);
template <> __device__ __forceinline__ float fp8_out<float>(float x) { return x; }
template <> __device__ __forceinline__ double fp8_out<double>(float x) { return (double)x; }
template <> __device__ __forceinline__ __nv_bfloat16 fp8_out<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float fp8_max(int fmt) { return fmt == 0 ? 448.0f : 57344.0f; }

__device__ __forceinline__ unsigned char fp8_encode(float v, int fmt) {
  return (unsigned char)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, fmt == 0 ? __NV_E4M3 : __NV_E5M2);
}

// The value of code c: sign, exponent field e, mantissa m; e = 0 is subnormal. E4M3's only
// non-finite codes are NaN (S.1111.111); E5M2 has infinities and NaNs at e = 31.
__device__ __forceinline__ float fp8_decode(unsigned c, int fmt) {
  const int mbits = fmt == 0 ? 3 : 2, bias = fmt == 0 ? 7 : 15;
  const int e = (int)((c & 0x7fu) >> mbits), m = (int)(c & ((1u << mbits) - 1));
  const float sign = (c & 0x80u) ? -1.0f : 1.0f;
  if (fmt == 0 && (c & 0x7fu) == 0x7fu) return nanf("");
  if (fmt == 1 && e == 31) return m != 0 ? nanf("") : sign * INFINITY;
  const float mag = e == 0 ? ldexpf((float)m, 1 - bias - mbits)
                           : ldexpf((float)(m | (1 << mbits)), e - bias - mbits);
  return sign * mag;
}

// The scale of a block whose amax has the bits `amax_bits`: the largest power of two s with
// amax s <= max (max / amax rounded, its mantissa cleared) within [2^-126, 2^127]; 1 for a zero
// or infinite amax.
__device__ __forceinline__ float fp8_block_scale(unsigned amax_bits, float max) {
  const float amax = __uint_as_float(amax_bits);
  if (!(amax > 0.0f) || amax_bits >= 0x7f800000u) return 1.0f;
  const float r = __fdiv_rn(max, amax);
  if (r >= 0x1p127f) return 0x1p127f;
  if (r < 0x1p-126f) return 0x1p-126f;
  return __uint_as_float(__float_as_uint(r) & 0x7f800000u);
}

// amax[b] = the largest |x| of block b, as the bits of a non-negative float (whose order is the
// unsigned order of the bits); NaN is skipped; the caller zeroes amax. CUDA block k takes share
// k % splits of block k / splits: each thread folds a strided part, the block reduces, and one
// atomicMax publishes (max is order-free, so the result does not depend on the schedule).
// Launched with blocks x splits CUDA blocks of blockDim.x (a multiple of 32) threads.
template <typename T>
__device__ void fp8_amax_impl(const T* x, unsigned* amax, u64 rows, u64 cols, u64 br, u64 bc,
                              unsigned splits) {
  __shared__ float scratch[32];
  const u64 nbc = (cols + bc - 1) / bc;
  const u64 b = blockIdx.x / splits, share = blockIdx.x % splits;
  const u64 r0 = b / nbc * br, c0 = b % nbc * bc;
  const u64 h = min(br, rows - r0), w = min(bc, cols - c0), n = h * w;
  float m = 0.0f;
  for (u64 k = share * blockDim.x + threadIdx.x; k < n; k += (u64)splits * blockDim.x) {
    const float v = fabsf(fp8_in(x[(r0 + k / w) * cols + c0 + k % w]));
    if (v > m) m = v;  // false for NaN: skipped
  }
  m = block_max(m, scratch);
  if (threadIdx.x == 0 && m > 0.0f) atomicMax(amax + b, __float_as_uint(m));
}
EXPORT3(fp8_amax,
        (const T* x, unsigned* amax, u64 rows, u64 cols, u64 br, u64 bc, unsigned splits),
        (x, amax, rows, cols, br, bc, splits))

// codes[i] = fp8(x[i] s) (row-major [rows, cols]), codes_t the same codes transposed
// ([cols, rows]: an FP8 GEMM's operand whose contraction runs along the rows), and y[i] =
// value(codes[i]) / s in the storage type, s the scale of element i's block (from amax); any
// output may be null. Grid-stride over 64-bit indices.
template <typename T>
__device__ void fp8_cast_impl(const T* x, const unsigned* amax, unsigned char* codes,
                              unsigned char* codes_t, T* y, u64 rows, u64 cols, u64 br, u64 bc,
                              int fmt) {
  const u64 n = rows * cols, nbc = (cols + bc - 1) / bc;
  const float max = fp8_max(fmt);
  for (u64 i = global_id(); i < n; i += grid_stride()) {
    const u64 r = i / cols, c = i % cols;
    const float s = fp8_block_scale(amax[r / br * nbc + c / bc], max);
    const unsigned char q = fp8_encode(__fmul_rn(fp8_in(x[i]), s), fmt);
    if (codes) codes[i] = q;
    if (codes_t) codes_t[c * rows + r] = q;
    if (y) y[i] = fp8_out<T>(__fmul_rn(fp8_decode(q, fmt), __fdiv_rn(1.0f, s)));
  }
}
EXPORT3(fp8_cast,
        (const T* x, const unsigned* amax, unsigned char* codes, unsigned char* codes_t, T* y,
         u64 rows, u64 cols, u64 br, u64 bc, int fmt),
        (x, amax, codes, codes_t, y, rows, cols, br, bc, fmt))

// 1 / s for each block's scale s (from amax) of an nbr x nbc grid of blocks: the dequantization
// factor an FP8 GEMM multiplies its product by (cuBLASLt's A_SCALE / B_SCALE), exact (s is a
// power of two). Written line by line, ld floats a line: the grid's rows (row-major, amax's
// order), or its columns when colmajor (block (i, j) at j * ld + i: the order cuBLASLt reads
// 1 x 128 scales of a K-major operand); a line's entries past the grid's width are zeros.
extern "C" __global__ void fp8_inv_scales(const unsigned* amax, float* inv, u64 nbr, u64 nbc,
                                          int colmajor, u64 ld, int fmt) {
  const float max = fp8_max(fmt);
  const u64 inner = colmajor ? nbr : nbc, lines = colmajor ? nbc : nbr;
  for (u64 p = global_id(); p < lines * ld; p += grid_stride()) {
    const u64 line = p / ld, k = p % ld;
    const u64 b = colmajor ? k * nbc + line : line * nbc + k;
    inv[p] = k < inner ? __fdiv_rn(1.0f, fp8_block_scale(amax[b], max)) : 0.0f;
  }
}
