// Self-test of the emulation itself (shim.h, shim.cpp): the reductions of common.cuh work under
// it, and each of its detectors reports the misuse it exists for, so that the kernel checks cannot
// pass because a detector silently stopped working.
#include "shim.h"
// The helpers under test (block_sum, block_max, DYNAMIC_SMEM), unchanged.
#include "../common.cuh"
#include "harness.h"

using namespace harness;

DYNAMIC_SMEM(selftest_smem);

void shim_checks() {
  {  // Block reductions: every thread of the block gets the sum / the maximum.
    Buffer<double> out(2 * 256, "out");
    if (run("block_sum/block_max", grid(1, 256, 0), [&] {
          __shared__ double scratch[32];
          const double v = threadIdx.x + 1.0;
          out[threadIdx.x] = block_sum(v, scratch);
          out[256 + threadIdx.x] = block_max(v, scratch);
        })) {
      bool ok = true;
      for (unsigned t = 0; t < 256; ++t) ok = ok && out[t] == 256 * 257 / 2 && out[256 + t] == 256;
      expect(ok, "shim: block_sum and block_max (common.cuh) give every thread the result");
    }
  }
  {  // A read of shared memory that another thread writes, with no barrier in between, sees the
     // old value under some schedule (run a few blocks: both scheduling policies).
    Buffer<int> seen(4 * 64, "seen");
    if (run("missing barrier", grid(4, 64, 0), [&] {
          __shared__ int x;
          if (threadIdx.x == 0) x = 0;
          __syncthreads();
          if (threadIdx.x == 0) x = 1;
          seen[blockIdx.x * 64 + threadIdx.x] = x;  // needs a __syncthreads() first
        })) {
      int stale = 0;
      for (size_t i = 0; i < seen.size(); ++i) stale += seen[i] == 0;
      expect(stale > 0, format("shim: a missing barrier is visible (%d of 256 reads stale)", stale));
    }
  }
  expect_fault("shim: a shuffle some lanes skip deadlocks", grid(1, 64, 0), [&] {
    if (threadIdx.x < 16) (void)__shfl_xor_sync(0xffffffffu, 1.0f, 1);
    else __syncthreads();
  });
  expect_fault("shim: lanes shuffling with different offsets", grid(1, 32, 0),
               [&] { (void)__shfl_xor_sync(0xffffffffu, 1.0, threadIdx.x < 16 ? 1 : 2); });
  expect_fault("shim: __syncthreads() that exited threads skip", grid(1, 64, 0), [&] {
    if (threadIdx.x >= 32) return;
    __syncthreads();
  });
  expect_fault("shim: a shuffle in a partial warp", grid(1, 48, 0),
               [&] { (void)__shfl_xor_sync(0xffffffffu, 1, 1); });
  {
    Buffer<float> buf(100, "buf");
    expect_fault("shim: a write past the end of a Buffer", grid(1, 32, 0),
                 [&] { buf.data()[buf.size() + threadIdx.x] = 0.0f; });
  }
  expect_fault("shim: a misaligned float4 load", grid(1, 32, 64), [&] {
    const float4 v = *reinterpret_cast<const float4*>(reinterpret_cast<float*>(selftest_smem) + 1);
    (void)v;
  });
  expect_fault("shim: a write past the dynamic shared memory", grid(1, 32, 64),
               [&] { selftest_smem[64 + threadIdx.x] = 0; });
  expect_fault("shim: more than 48 KiB of dynamic shared memory", grid(1, 32, 48 * 1024 + 16), [&] {});
  expect_fault("shim: __trap()", grid(2, 64, 0), [&] {
    if (blockIdx.x == 1 && threadIdx.x == 5) __trap();
  });
  {  // dyn_smem_bytes() is the launch's size, and the memory starts as 0xff bytes.
    Buffer<unsigned> got(2, "got");
    if (run("dyn_smem_bytes", grid(1, 32, 96), [&] {
          if (threadIdx.x == 0) {
            got[0] = dyn_smem_bytes();
            got[1] = selftest_smem[95] == 0xff && (uintptr_t)selftest_smem % 16 == 0;
          }
        }))
      expect(got[0] == 96 && got[1] == 1,
             "shim: dyn_smem_bytes() is the launch's size; the memory is 16-byte aligned, 0xff-filled");
  }
}
