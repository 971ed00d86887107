// CPU emulation of the CUDA built-ins the project's kernels use, so that the real kernel sources
// (kernels/*.cu, #included unchanged by the drivers test_*.cpp in this directory) compile as
// C++17 and run on the host. Include this first, then the .cu file; shim.cpp is the runtime.
// main.cpp has the build command; crates/model/tests/cuda_emulation.rs runs it in `cargo test`.
//
// Execution model. A launch (emu::launch) runs its blocks one at a time, in a shuffled order.
// The threads of a block are fibers on the calling OS thread, switched only at __syncthreads()
// and warp shuffles. Blocks alternate between two randomised schedules (shim.cpp, `step`): a
// shuffled round robin, and strict priority among warps (one warp runs ahead as far as the
// barriers allow), so a missing barrier shows up as wrong data instead of passing by luck. Runs
// are reproducible (fixed seed; EMU_SEED=<n> picks other schedules).
//
// Reported as a failed launch (emu::Launch::ok == false, with the reason), like a kernel fault on
// a GPU: __trap(); a deadlock (threads waiting at different barriers: a divergent __syncthreads,
// a shuffle with an exited lane, ...); __syncthreads() after some threads of the block exited; a
// thread exiting while others wait for it; shuffle lanes that disagree on the offset or the type;
// a shuffle in a partial warp or with a partial mask; a misaligned 16-byte vector load (float4,
// double2); a block of more than 1024 threads or more than 48 KiB of dynamic shared memory (the
// launchers never opt in to more); writes past the dynamic shared memory or outside an
// emu::Buffer (guard zones, checked after every block / launch).
//
// __syncwarp() is a warp barrier like a shuffle (full mask only). mma.h in this directory adds the
// nvcuda::wmma subset of the tensor-core kernels as warp-collective operations (see there).
//
// Memory. __shared__ variables are static: one copy, which the running block owns since blocks
// never overlap. Dynamic shared memory (DYNAMIC_SMEM and dyn_smem_bytes() in common.cuh) is
// exactly the launch's size, 16- but not 32-byte aligned, and filled with 0xff bytes (NaN in every
// float type) before each block. emu::Buffer, the drivers' "device memory", starts as 0xff bytes
// too, so an output element a kernel forgets to write reads back as NaN.
#pragma once
#define PRETRAIN_CUDA_EMULATION 1

#include <math.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

// ---------------------------------------------------------------------------------------------
// Language extensions.
#define __host__
#define __device__
#define __global__
#define __launch_bounds__(...)
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

using std::fma;
using std::max;
using std::min;

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
// Set by emu::launch before it resumes a thread (only .x is used: 1-D grids and blocks).
inline dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace emu {
[[noreturn]] void fault(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void sync_block();
uint64_t shfl_exchange(uint64_t bits, int lane_mask, unsigned size);

// The 16-byte alignment a vector load needs on the GPU.
inline void check_vector_load(const void* p, const char* type) {
  if ((uintptr_t)p % 16 != 0) fault("misaligned %s load from %p", type, p);
}

// __shfl_xor_sync over a full warp: every lane gets lane ^ lane_mask's `v`.
template <typename V> V shfl_xor(V v, int lane_mask) {
  static_assert(sizeof(V) <= 8 && std::is_trivially_copyable<V>::value, "unsupported type");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof v);
  bits = shfl_exchange(bits, lane_mask, (unsigned)sizeof(V));
  V r;
  std::memcpy(&r, &bits, sizeof r);
  return r;
}
}  // namespace emu

// 16-byte vector types. Only read through reinterpret_cast'ed pointers; the copy checks the
// 16-byte alignment the GPU requires (deliberately not declared aligned, so the compiler cannot
// assume the check away). may_alias: they are loaded from float / double arrays.
struct __attribute__((may_alias)) float4 {
  float x, y, z, w;
  float4() = default;
  float4(const float4& o) : x(o.x), y(o.y), z(o.z), w(o.w) { emu::check_vector_load(&o, "float4"); }
  float4& operator=(const float4&) = default;
};
struct __attribute__((may_alias)) double2 {
  double x, y;
  double2() = default;
  double2(const double2& o) : x(o.x), y(o.y) { emu::check_vector_load(&o, "double2"); }
  double2& operator=(const double2&) = default;
};

// ---------------------------------------------------------------------------------------------
// Intrinsics. The *_rn arithmetic is plain IEEE f32 arithmetic, one rounding per call (build with
// -std=c++17, not gnu++17, so GCC does not contract them into FMAs).
inline float __double2float_rn(double x) { return (float)x; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }

inline void __trap() { emu::fault("__trap()"); }
inline void __syncthreads() { emu::sync_block(); }

template <typename V> inline V __shfl_xor_sync(unsigned mask, V v, int lane_mask, int width = 32) {
  if (mask != 0xffffffffu || width != 32)
    emu::fault("__shfl_xor_sync with mask %#x, width %d: only full warps are emulated", mask,
               width);
  return emu::shfl_xor(v, lane_mask);
}

// A warp barrier (full mask only): all 32 lanes must arrive; a shuffle-style exchange.
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  if (mask != 0xffffffffu) emu::fault("__syncwarp with mask %#x: only full warps are emulated", mask);
  emu::shfl_exchange(0, 0, 999);
}

// Threads never run concurrently (fibers), so a plain read-modify-write is atomic.
inline unsigned atomicCAS(unsigned* p, unsigned compare, unsigned val) {
  const unsigned old = *p;
  if (old == compare) *p = val;
  return old;
}
inline unsigned atomicAdd(unsigned* p, unsigned val) {
  const unsigned old = *p;
  *p = old + val;
  return old;
}
inline unsigned atomicMax(unsigned* p, unsigned val) {
  const unsigned old = *p;
  *p = old > val ? old : val;
  return old;
}
inline unsigned __float_as_uint(float x) {
  unsigned u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// ---------------------------------------------------------------------------------------------
// Runtime (shim.cpp).
namespace emu {

// Dynamic shared memory of the running block (read by DYNAMIC_SMEM / dyn_smem_bytes()).
inline unsigned char* dyn_smem = nullptr;
inline unsigned dyn_smem_size = 0;

// The seed of the schedules: EMU_SEED, else 1.
uint64_t seed();
// How threads are switched: "registers" (x86-64 / aarch64) or "ucontext" (elsewhere, or under
// x86 shadow stacks).
const char* switch_kind();

// Device memory: n elements of T between two guard zones, all bytes 0xff at first. A launch
// fails if it wrote into the guard zone of any live Buffer.
void track_buffer(unsigned char* base, size_t bytes, const char* name);
void untrack_buffer(unsigned char* base);
constexpr size_t GUARD_BYTES = 4096;

template <typename T> class Buffer {
 public:
  explicit Buffer(size_t n, const char* name = "buffer") : n_(n) {
    static_assert(std::is_trivially_copyable<T>::value, "device types are trivially copyable");
    const size_t total = (n * sizeof(T) + 2 * GUARD_BYTES + 255) / 256 * 256;
    raw_ = static_cast<unsigned char*>(std::aligned_alloc(256, total));
    if (raw_ == nullptr) {
      std::fprintf(stderr, "emulation: out of memory\n");
      std::exit(2);
    }
    std::memset(raw_, 0xff, total);
    track_buffer(raw_, n * sizeof(T), name);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    untrack_buffer(raw_);
    std::free(raw_);
  }
  T* data() { return reinterpret_cast<T*>(raw_ + GUARD_BYTES); }
  const T* data() const { return reinterpret_cast<const T*>(raw_ + GUARD_BYTES); }
  size_t size() const { return n_; }
  T& operator[](size_t i) { return data()[i]; }
  const T& operator[](size_t i) const { return data()[i]; }

 private:
  size_t n_;
  unsigned char* raw_;
};

struct Launch {
  bool ok;
  std::string error;  // why not, when !ok
};

Launch launch_impl(const char* kernel, unsigned grid, unsigned block, unsigned smem,
                   void (*call)(void*), void* ctx);

// Runs `body` (a call of one kernel) as a grid of `grid` blocks of `block` threads with `smem`
// bytes of dynamic shared memory; `kernel` names it in errors.
template <typename F>
Launch launch(const char* kernel, unsigned grid, unsigned block, unsigned smem, F&& body) {
  typedef typename std::remove_reference<F>::type Body;
  return launch_impl(
      kernel, grid, block, smem, [](void* c) { (*static_cast<Body*>(c))(); },
      const_cast<void*>(static_cast<const void*>(&body)));
}

}  // namespace emu
