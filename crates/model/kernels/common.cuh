// Shared device helpers of the project's kernels: grid-stride indices, the accumulation type of
// each storage type, conversions, warp/block reductions and the macro that exports a template
// once per dtype.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

typedef unsigned long long u64;

// A thread's index in a 1-D grid and the grid's thread count, for grid-stride loops over
// 64-bit element indices (any 1-D grid).
__device__ __forceinline__ u64 global_id() { return (u64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ u64 grid_stride() { return (u64)gridDim.x * blockDim.x; }

// Accumulation (compute) type of a storage type: f32 for f32 and bf16, f64 for f64.
template <typename T> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };

template <typename A> __device__ __forceinline__ A load(const float* p) { return (A)*p; }
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_acc(float x);
template <> __device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <typename T> __device__ __forceinline__ T from_acc(double x);
template <> __device__ __forceinline__ double from_acc<double>(double x) { return x; }

__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }
__device__ __forceinline__ float sqrt_acc(float x) { return sqrtf(x); }
__device__ __forceinline__ double sqrt_acc(double x) { return sqrt(x); }

// The block's dynamic shared memory: DYNAMIC_SMEM(name) declares it as the 16-byte aligned byte
// array `name`; dyn_smem_bytes() is its size as launched. Under PRETRAIN_CUDA_EMULATION (the CPU
// test harness, kernels/emulation/shim.h) both come from the emulated launch instead.
#ifdef PRETRAIN_CUDA_EMULATION
#define DYNAMIC_SMEM(NAME) static unsigned char* const& NAME = emu::dyn_smem
__device__ __forceinline__ unsigned dyn_smem_bytes() { return emu::dyn_smem_size; }
#else
#define DYNAMIC_SMEM(NAME) extern __shared__ __align__(16) unsigned char NAME[]
__device__ __forceinline__ unsigned dyn_smem_bytes() {
  unsigned bytes;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
  return bytes;
}
#endif

template <typename A> __device__ __forceinline__ A neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return -INFINITY; }
template <> __device__ __forceinline__ double neg_inf<double>() { return -INFINITY; }

template <typename A> __device__ __forceinline__ A warp_sum(A v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename A> __device__ __forceinline__ A warp_max(A v) {
  for (int o = 16; o > 0; o >>= 1) {
    A w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  return v;
}

// Sum of `v` over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the
// result. `scratch` holds at least 32 values; the call contains __syncthreads().
template <typename A> __device__ A block_sum(A v, A* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  A t = lane < warps ? scratch[lane] : (A)0;
  return warp_sum(t);
}

// Maximum of `v` over the block; same contract as block_sum.
template <typename A> __device__ A block_max(A v, A* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  A t = lane < warps ? scratch[lane] : neg_inf<A>();
  return warp_max(t);
}

// 16 bytes of elements (8 bf16, 4 f32 or 2 f64), loaded and stored at once where a buffer is
// 16-byte aligned: more bytes in flight per thread than element-wise loads.
template <typename T> struct Pack {
  static constexpr int N = 16 / sizeof(T);
  float4 raw;  // the 16 bytes, carried as a float4
  __device__ __forceinline__ T get(int e) const { return reinterpret_cast<const T*>(&raw)[e]; }
  __device__ __forceinline__ void set(int e, T v) { reinterpret_cast<T*>(&raw)[e] = v; }
};
template <typename T> __device__ __forceinline__ Pack<T> load_pack(const T* p, u64 k) {
  return Pack<T>{reinterpret_cast<const float4*>(p)[k]};
}
template <typename T> __device__ __forceinline__ void store_pack(T* p, u64 k, const Pack<T>& v) {
  reinterpret_cast<float4*>(p)[k] = v.raw;
}
__device__ __forceinline__ bool aligned16(const void* a, const void* b, const void* c) {
  return (((size_t)a | (size_t)b | (size_t)c) & 15) == 0;
}

// Exports a `template <typename T> __device__ void NAME##_impl(...)` body as kernels:
// EXPORT3(NAME, PARAMS, ARGS) defines extern "C" NAME_f32 / NAME_f64 / NAME_bf16 whose parameter
// list PARAMS may use `T` (bound to the storage type in a namespace of its own) and which call
// NAME##_impl<T> ARGS. EXPORT3_BOUNDED(NAME, THREADS, ...) also declares the most threads a
// block is launched with, so the compiler keeps the registers a block of that size can have
// (without it a kernel whose register count grows past 64 fails to launch with 1,024 threads).
#define EXPORT_ONE_BOUNDED(NAME, SUFFIX, TY, BOUNDS, PARAMS, ARGS)                   \
  namespace NAME##_##SUFFIX##_ns {                                                  \
  typedef TY T;                                                                     \
  extern "C" __global__ void BOUNDS NAME##_##SUFFIX PARAMS { NAME##_impl<T> ARGS; }  \
  }
#define NO_BOUNDS
#define EXPORT_ONE(NAME, SUFFIX, TY, PARAMS, ARGS) \
  EXPORT_ONE_BOUNDED(NAME, SUFFIX, TY, NO_BOUNDS, PARAMS, ARGS)
#define EXPORT3_BOUNDED(NAME, BOUNDS, PARAMS, ARGS)                \
  EXPORT_ONE_BOUNDED(NAME, f32, float, BOUNDS, PARAMS, ARGS)       \
  EXPORT_ONE_BOUNDED(NAME, f64, double, BOUNDS, PARAMS, ARGS)      \
  EXPORT_ONE_BOUNDED(NAME, bf16, __nv_bfloat16, BOUNDS, PARAMS, ARGS)
#define EXPORT3(NAME, PARAMS, ARGS) EXPORT3_BOUNDED(NAME, NO_BOUNDS, PARAMS, ARGS)
