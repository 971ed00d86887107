// Host stand-in for CUDA's <cuda_fp8.h>, used only by the CPU emulation harness in this
// directory: the storage type and the one conversion the kernels use, f32 -> E4M3 or E5M2,
// rounding to nearest even with SATFINITE (beyond the largest finite value, infinities included,
// gives the largest finite value; NaN gives NaN). Written from the formats' definitions (scale
// to the value's quantum, round with nearbyint, saturate); test_fp8.cpp checks it against a
// search over every code.
#pragma once
#include <cfenv>
#include <cmath>
#include <cstdint>

typedef unsigned char __nv_fp8_storage_t;
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };

inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t sat,
                                                __nv_fp8_interpretation_t fmt) {
  const int mbits = fmt == __NV_E4M3 ? 3 : 2, bias = fmt == __NV_E4M3 ? 7 : 15;
  const double max = fmt == __NV_E4M3 ? 448.0 : 57344.0;
  const unsigned sign = std::signbit(x) ? 0x80u : 0u;
  if (std::isnan(x)) return (__nv_fp8_storage_t)(sign | 0x7fu);
  if (sat != __NV_SATFINITE) std::abort();  // the kernels saturate
  const double a = std::fmin(std::fabs((double)x), 2 * max);  // infinities saturate too
  const int emin = 1 - bias;
  int e = a == 0.0 ? emin : std::ilogb(a);
  if (e < emin) e = emin;
  const double quantum = std::ldexp(1.0, e - mbits);
  double q = std::nearbyint(a / quantum) * quantum;  // the default mode: to nearest even
  if (q > max) q = max;
  unsigned code;
  if (q < std::ldexp(1.0, emin)) {
    code = (unsigned)(q / std::ldexp(1.0, emin - mbits));  // subnormal (or zero)
  } else {
    const int qe = std::ilogb(q);  // rounding may carry into the next binade
    const unsigned m = (unsigned)(q / std::ldexp(1.0, qe - mbits)) - (1u << mbits);
    code = (unsigned)(qe + bias) << mbits | m;
  }
  return (__nv_fp8_storage_t)(sign | code);
}
