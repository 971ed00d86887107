// Host stand-in for CUDA's <mma.h>: the nvcuda::wmma subset the tensor-core kernels use
// (kernels/attention_tc.cu), for the CPU emulation harness in this directory (which puts this
// directory first on the include path). 16x16x16 tiles only; matrix_a / matrix_b fragments of
// __nv_bfloat16 (held as the exact f32 values) and float accumulators.
//
// Model: every lane holds the whole 16x16 tile of a fragment (fragments have no `x` member, so a
// kernel that indexes fragment elements does not compile here). load_matrix_sync,
// store_matrix_sync and mma_sync are warp-collective: all 32 lanes of the warp must reach the
// same operation (a shuffle-style barrier tagged with the operation; a lane at another operation,
// a missing lane or an exited lane is reported like a divergent shuffle / deadlock). A load reads
// memory when its lane arrives, before the barrier, and a store writes after it, so a missing
// __syncwarp() between lanes' ordinary shared-memory writes and a fragment load reads stale
// data. Pointers must be 32-byte aligned and ldm a multiple of 16 bytes, as on the GPU.
// fill_fragment is per lane (no barrier), as on the GPU.
#pragma once
#include <cuda_bf16.h>

#include "shim.h"

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void> class fragment {
  static_assert(M == 16 && N == 16 && K == 16, "only m16n16k16 is emulated");
  static_assert(std::is_same<T, float>::value || std::is_same<T, __nv_bfloat16>::value,
                "only bf16 and float fragments are emulated");

 public:
  float tile_[16][16];  // [row][col]; emulation only (real fragments expose `x`, not this)
};

namespace detail {
// A warp-collective point: all 32 lanes must arrive with the same `op`.
inline void collective(unsigned op) { emu::shfl_exchange(0, 0, 1000 + op); }

inline float value(float x) { return x; }
inline float value(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> void check(const T* p, unsigned ldm, const char* what) {
  if ((uintptr_t)p % 32 != 0) emu::fault("wmma %s: pointer %p is not 32-byte aligned", what, (const void*)p);
  if (ldm * sizeof(T) % 16 != 0 || ldm < 16)
    emu::fault("wmma %s: ldm %u is not a multiple of 16 bytes (or < 16)", what, ldm);
}
}  // namespace detail

template <typename Use, typename T, typename Layout, typename V>
inline void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, V v) {
  const float x = detail::value(v);
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) f.tile_[i][j] = x;
}

// matrix_a / matrix_b: element (i, j) at p[i * ldm + j] (row_major) or p[j * ldm + i] (col_major).
template <typename Use, typename T, typename Layout>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm) {
  static_assert(std::is_same<Layout, row_major>::value || std::is_same<Layout, col_major>::value,
                "matrix fragments need a layout");
  detail::check(p, ldm, "load_matrix_sync");
  const bool row = std::is_same<Layout, row_major>::value;
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) f.tile_[i][j] = detail::value(row ? p[i * ldm + j] : p[j * ldm + i]);
  detail::collective(1);
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p,
                             unsigned ldm, layout_t layout) {
  detail::check(p, ldm, "load_matrix_sync");
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) f.tile_[i][j] = layout == mem_row_major ? p[i * ldm + j] : p[j * ldm + i];
  detail::collective(2);
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f,
                              unsigned ldm, layout_t layout) {
  detail::check(p, ldm, "store_matrix_sync");
  detail::collective(3);
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) (layout == mem_row_major ? p[i * ldm + j] : p[j * ldm + i]) = f.tile_[i][j];
}

// d = a b + c in f32 (the bf16 products are exact in f32).
template <typename LA, typename LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
                     const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LA>& a,
                     const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LB>& b,
                     const fragment<accumulator, 16, 16, 16, float>& c) {
  float r[16][16];
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) {
      float s = c.tile_[i][j];
      for (int k = 0; k < 16; ++k) s += a.tile_[i][k] * b.tile_[k][j];
      r[i][j] = s;
    }
  std::memcpy(d.tile_, r, sizeof r);
  detail::collective(4);
}

}  // namespace wmma
}  // namespace nvcuda
