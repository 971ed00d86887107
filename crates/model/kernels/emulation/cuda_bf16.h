// Host stand-in for CUDA's <cuda_bf16.h>, used only by the CPU emulation harness in this
// directory (the real kernels include <cuda_bf16.h>; the harness puts this directory first on the
// include path). Provides the bf16 storage type and the two conversions the kernels use.
#pragma once
#include <cstdint>
#include <cstring>

// bfloat16: the upper 16 bits of an IEEE f32.
struct __nv_bfloat16 {
  uint16_t x;
};

inline float __bfloat162float(__nv_bfloat16 b) {
  const uint32_t u = (uint32_t)b.x << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// f32 -> bf16, round to nearest even; NaNs stay (quiet) NaNs.
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{(uint16_t)((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{(uint16_t)(u >> 16)};
}
