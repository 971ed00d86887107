// Emulation driver of kernels/fp8.cu: the stand-in conversion of cuda_fp8.h against a search
// over every code (nearest finite value, ties to the even code, saturating), then fp8_amax,
// fp8_cast (codes, transposed codes, values) and fp8_inv_scales for f32, f64 and bf16 storage, both formats and the four block shapes of
// src/ops/fp8.rs, with the launch shapes of src/ops/cuda/fp8.rs, compared bit for bit with a
// reference that finds each element's block by its coordinates and its scale by halving.
#include "shim.h"
// The kernels under test, unchanged.
#include "../fp8.cu"
#include "harness.h"

using namespace harness;

namespace {

// fp8.rs: AMAX_THREADS and SPLIT_ELEMS.
constexpr unsigned AMAX_THREADS = 256;
constexpr size_t SPLIT_ELEMS = 4096;

// The value of a code by the format's definition: (-1)^s 2^(e - bias) (1 + m / 2^mbits), or
// 2^(1 - bias) m / 2^mbits for e = 0.
double ref_decode(unsigned c, int fmt) {
  const int mbits = fmt == 0 ? 3 : 2, bias = fmt == 0 ? 7 : 15;
  const int e = (int)((c & 0x7f) >> mbits), m = (int)(c & ((1u << mbits) - 1));
  const double s = (c & 0x80) ? -1.0 : 1.0;
  if (e == 0) return s * std::ldexp((double)m, 1 - bias - mbits);
  return s * std::ldexp(1.0 + m / (double)(1 << mbits), e - bias);
}

bool finite_code(unsigned c, int fmt) {
  return fmt == 0 ? (c & 0x7f) != 0x7f : ((c & 0x7f) >> 2) != 31;
}

// The code of x by search over the finite non-negative codes (anything beyond twice the largest,
// infinities included, is nearest the largest).
unsigned ref_encode(float x, int fmt) {
  const double a = std::fmin(std::fabs((double)x), fmt == 0 ? 896.0 : 114688.0);
  unsigned best = 0;
  for (unsigned c = 1; c < 0x80; ++c) {
    if (!finite_code(c, fmt)) continue;
    const double d = std::fabs(a - ref_decode(c, fmt)), db = std::fabs(a - ref_decode(best, fmt));
    if (d < db || (d == db && (c & 1) == 0)) best = c;
  }
  return best | (std::signbit(x) ? 0x80u : 0u);
}

void check_conversion() {
  for (int fmt = 0; fmt < 2; ++fmt) {
    std::vector<float> xs;
    for (unsigned c = 0; c < 0x80; ++c) {
      if (!finite_code(c, fmt)) continue;
      const double v = ref_decode(c, fmt);
      xs.push_back((float)v);
      if (c + 1 < 0x80 && finite_code(c + 1, fmt)) {
        const float mid = (float)((v + ref_decode(c + 1, fmt)) / 2);  // the ties
        xs.push_back(mid);
        xs.push_back(std::nextafter(mid, 0.0f));
        xs.push_back(std::nextafter(mid, INFINITY));
      }
    }
    const float max = fmt == 0 ? 448.0f : 57344.0f;
    for (float x : {max * 1.03f, max * 1.2f, max * 9.0f, (float)INFINITY, 1e-30f}) xs.push_back(x);
    Rng rng(40 + fmt);
    for (int i = 0; i < 20000; ++i)
      xs.push_back((float)std::ldexp(1.0 + rng.uniform(), (int)(rng.next() % 40) - 24));
    int wrong = 0;
    for (float x : xs)
      for (float v : {x, -x}) {
        const unsigned got = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, fmt == 0 ? __NV_E4M3 : __NV_E5M2);
        wrong += got != ref_encode(v, fmt);
      }
    expect(wrong == 0, format("cuda_fp8.h stand-in %s: %zu values, %d codes differ from the search",
                              fmt == 0 ? "E4M3" : "E5M2", 2 * xs.size(), wrong));
    int bad = 0;
    for (unsigned c = 0; c < 256; ++c)
      if (finite_code(c, fmt)) bad += (double)fp8_decode(c, fmt) != ref_decode(c, fmt);
    expect(bad == 0, format("fp8_decode %s: every finite code", fmt == 0 ? "E4M3" : "E5M2"));
  }
}

struct Blocks {
  const char* name;
  size_t br, bc;  // 0: the whole dimension
};

template <typename T> void check_cast(size_t rows, size_t cols, Blocks bl, int fmt, uint64_t seed) {
  const size_t n = rows * cols;
  const size_t br = bl.br ? bl.br : rows, bc = bl.bc ? bl.bc : cols;
  const size_t nbr = (rows + br - 1) / br, nbc = (cols + bc - 1) / bc, nb = nbr * nbc;
  Rng rng(seed);
  Buffer<T> x(n, "x");
  // Magnitudes that differ by region, exact zeros, and outliers.
  for (size_t i = 0; i < n; ++i) {
    const double scale = 1.0 + (double)((i / 3000) % 7) * 40.0;
    x[i] = fromd<T>(i % 211 == 0 ? 0.0 : scale * rng.normal() * (i % 997 == 5 ? 500.0 : 1.0));
  }
  // The reference: each block's amax over its elements, its scale by halving from 2^127.
  std::vector<float> amax(nb, 0.0f);
  for (size_t i = 0; i < n; ++i) {
    float& a = amax[(i / cols) / br * nbc + (i % cols) / bc];
    a = std::max(a, std::fabs((float)tod(x[i])));
  }
  const float max = fmt == 0 ? 448.0f : 57344.0f;
  std::vector<unsigned> codes_ref(n);
  std::vector<T> y_ref(n);
  for (size_t i = 0; i < n; ++i) {
    const float a = amax[(i / cols) / br * nbc + (i % cols) / bc];
    double s = 1.0;
    if (a > 0) {
      s = std::ldexp(1.0, 127);
      while ((double)a * s > max && s > std::ldexp(1.0, -126)) s /= 2;
    }
    const unsigned c = ref_encode((float)((float)tod(x[i]) * s), fmt);
    codes_ref[i] = c;
    y_ref[i] = fromd<T>((double)(float)(ref_decode(c, fmt) / s));
  }
  // fp8.rs `fp8_round`: amax with splits = ceil(block elements / SPLIT_ELEMS) (at most 1024),
  // AMAX_THREADS threads; cast elementwise(n).
  const unsigned splits = (unsigned)std::min<size_t>((br * bc + SPLIT_ELEMS - 1) / SPLIT_ELEMS, 1024);
  Buffer<unsigned> am(nb, "amax");
  for (size_t b = 0; b < nb; ++b) am[b] = 0;
  Buffer<unsigned char> codes(n, "codes"), codes_t(n, "codes_t");
  Buffer<T> y(n, "y");
  // Column-major lines padded to a multiple of 4 (cuBLASLt's scale strides).
  const size_t ld_cm = (nbr + 3) / 4 * 4;
  Buffer<float> inv(nb, "inv"), inv_cm(ld_cm * nbc, "inv_colmajor");
  const std::string tag = format("fp8 %s %s %zux%zu blocks %s", type_name<T>(),
                                 fmt == 0 ? "E4M3" : "E5M2", rows, cols, bl.name);
  bool ok = run(format("fp8_amax_%s", type_name<T>()), grid(nb * splits, AMAX_THREADS, 0), [&] {
    KERNEL(T, fp8_amax)(x.data(), am.data(), (u64)rows, (u64)cols, (u64)br, (u64)bc, splits);
  });
  ok = ok && run(format("fp8_cast_%s", type_name<T>()), elementwise(n), [&] {
         KERNEL(T, fp8_cast)(x.data(), am.data(), codes.data(), codes_t.data(), y.data(),
                             (u64)rows, (u64)cols, (u64)br, (u64)bc, fmt);
       });
  ok = ok && run("fp8_inv_scales", elementwise(nb), [&] {
         fp8_inv_scales(am.data(), inv.data(), (u64)nbr, (u64)nbc, 0, (u64)nbc, fmt);
       });
  ok = ok && run("fp8_inv_scales colmajor", elementwise(ld_cm * nbc), [&] {
         fp8_inv_scales(am.data(), inv_cm.data(), (u64)nbr, (u64)nbc, 1, (u64)ld_cm, fmt);
       });
  if (!ok) return;
  bool amax_same = true, codes_same = true, inv_same = true;
  for (size_t b = 0; b < nb; ++b) {
    amax_same = amax_same && __uint_as_float(am[b]) == amax[b];
    // The reference scale by halving, inverted: a power of two, so exactly.
    double s = 1.0;
    if (amax[b] > 0) {
      s = std::ldexp(1.0, 127);
      while ((double)amax[b] * s > max && s > std::ldexp(1.0, -126)) s /= 2;
    }
    inv_same = inv_same && (double)inv[b] == 1.0 / s &&
               (double)inv_cm[b % nbc * ld_cm + b / nbc] == 1.0 / s;
  }
  for (size_t j = 0; j < nbc; ++j)
    for (size_t k = nbr; k < ld_cm; ++k) inv_same = inv_same && inv_cm[j * ld_cm + k] == 0.0f;
  for (size_t i = 0; i < n; ++i)
    codes_same = codes_same && codes[i] == codes_ref[i] &&
                 codes_t[(i % cols) * rows + i / cols] == codes_ref[i];
  expect(amax_same && inv_same,
         tag + ": every block's amax and inverse scale (row-major, and column-major padded)");
  expect(codes_same && std::memcmp(y.data(), y_ref.data(), n * sizeof(T)) == 0,
         tag + ": codes (as laid out and transposed) and values bitwise as the reference");
}

template <typename T> void check_casts(uint64_t seed) {
  const Blocks blocks[] = {{"tensor", 0, 0}, {"1x128", 1, 128}, {"128x1", 128, 1}, {"128x128", 128, 128}};
  for (const Blocks& b : blocks)
    for (int fmt = 0; fmt < 2; ++fmt) check_cast<T>(300, 260, b, fmt, seed++);
}

}  // namespace

void fp8_checks() {
  check_conversion();
  check_casts<float>(1);
  check_casts<__nv_bfloat16>(20);
  check_casts<double>(40);
  // A tensor of several splits per block, and one of a single row.
  check_cast<float>(64, 200, {"tensor", 0, 0}, 0, 60);
  check_cast<__nv_bfloat16>(1, 5, {"128x128", 128, 128}, 1, 61);
}
