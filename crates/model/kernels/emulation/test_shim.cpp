// Self-test of the emulation itself (shim.h, shim.cpp): the reductions of common.cuh work under
// it, and each of its detectors reports the misuse it exists for, so that the kernel checks cannot
// pass because a detector silently stopped working.
#include "shim.h"
// The helpers under test (block_sum, block_max, DYNAMIC_SMEM), unchanged.
#include "../common.cuh"
#include "harness.h"
#include "mma.h"

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
  {  // wmma (mma.h): a 16x16x16 bf16 product with a col_major B and a row_major C store; a
     // fragment load after lanes' plain stores needs a __syncwarp() first; wmma operations are
     // warp-collective and check alignment.
    using namespace nvcuda;
    typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> FA;
    typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> FB;
    typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> FC;
    Buffer<float> c(256, "c");
    Buffer<int> stale(4 * 32, "stale");
    if (run("wmma", grid(4, 32, 4096), [&] {
          __nv_bfloat16* a = reinterpret_cast<__nv_bfloat16*>(selftest_smem + 16);  // 32-byte aligned
          __nv_bfloat16* b = a + 256;
          for (int i = threadIdx.x; i < 256; i += 32) {
            a[i] = __float2bfloat16_rn((float)(i % 7) - 3.0f);  // a[r][k], row-major
            b[i] = __float2bfloat16_rn((float)(i % 5) - 2.0f);  // b[k][n] at b[n * 16 + k]
          }
          FA fa;
          FB fb;
          FC fc;
          wmma::load_matrix_sync(fa, a, 16);  // no __syncwarp: may miss other lanes' stores
          __syncwarp();
          wmma::load_matrix_sync(fb, b, 16);
          wmma::fill_fragment(fc, 1.0f);
          FA fa2;
          wmma::load_matrix_sync(fa2, a, 16);
          wmma::mma_sync(fc, fa2, fb, fc);
          if (blockIdx.x == 0) wmma::store_matrix_sync(c.data(), fc, 16, wmma::mem_row_major);
          // A stale load shows as a NaN (0xff-filled memory) in the product of fa.
          FC probe;
          wmma::fill_fragment(probe, 0.0f);
          wmma::mma_sync(probe, fa, fb, probe);
          float* st = reinterpret_cast<float*>(selftest_smem + 1040);  // 32-byte aligned
          wmma::store_matrix_sync(st, probe, 16, wmma::mem_row_major);
          bool nan = false;
          for (int i = 0; i < 256; ++i) nan = nan || std::isnan(st[i]);
          stale[blockIdx.x * 32 + threadIdx.x] = nan;
        })) {
      double err = 0;
      for (int r = 0; r < 16; ++r)
        for (int n = 0; n < 16; ++n) {
          double ref = 1.0;
          for (int k = 0; k < 16; ++k) ref += ((r * 16 + k) % 7 - 3.0) * ((n * 16 + k) % 5 - 2.0);
          err = std::max(err, std::fabs(c[r * 16 + n] - ref));
        }
      expect(err == 0, "shim: wmma bf16 load / mma / store (row_major A, col_major B) is exact");
      int n = 0;
      for (size_t i = 0; i < stale.size(); ++i) n += stale[i];
      expect(n > 0, format("shim: a wmma load without __syncwarp after lanes' stores is visible (%d of 128)", n));
    }
  }
  expect_fault("shim: a wmma load some lanes skip", grid(1, 32, 1024), [&] {
    nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __nv_bfloat16, nvcuda::wmma::row_major> f;
    if (threadIdx.x < 16) nvcuda::wmma::load_matrix_sync(f, reinterpret_cast<__nv_bfloat16*>(selftest_smem + 16), 16);
  });
  expect_fault("shim: lanes at different wmma operations", grid(1, 32, 1024), [&] {
    using namespace nvcuda;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> f;
    float* p = reinterpret_cast<float*>(selftest_smem + 16);
    if (threadIdx.x < 16) wmma::load_matrix_sync(f, p, 16, wmma::mem_row_major);
    else wmma::store_matrix_sync(p, f, 16, wmma::mem_row_major);
  });
  expect_fault("shim: a wmma load from a pointer not 32-byte aligned", grid(1, 32, 1024), [&] {
    nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __nv_bfloat16, nvcuda::wmma::row_major> f;
    nvcuda::wmma::load_matrix_sync(f, reinterpret_cast<__nv_bfloat16*>(selftest_smem + 32), 16);
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
