// Helpers shared by the emulation drivers (pointwise.cpp, flat.cpp, attention.cpp): storage-type
// traits, a seeded RNG, the launch shapes of src/ops/cuda/mod.rs, the error measure and the
// one-line-per-check report. Include after shim.h and the kernel file.
#pragma once
#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

#include "shim.h"
// The stand-in in this directory.
#include <cuda_bf16.h>

namespace harness {

typedef unsigned long long u64;
using emu::Buffer;

// ---------------------------------------------------------------------------------------------
// Storage types: f32, f64, bf16.
template <typename T> const char* type_name() {
  return std::is_same<T, float>::value ? "f32" : std::is_same<T, double>::value ? "f64" : "bf16";
}
inline double tod(float x) { return x; }
inline double tod(double x) { return x; }
inline double tod(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> T fromd(double x);
template <> inline float fromd<float>(double x) { return (float)x; }
template <> inline double fromd<double>(double x) { return x; }
template <> inline __nv_bfloat16 fromd<__nv_bfloat16>(double x) {
  return __float2bfloat16_rn((float)x);
}

// The exported kernel NAME_<dtype> for storage type T (each is declared in a namespace of its own
// by EXPORT_ONE in common.cuh).
template <typename T, typename F32, typename F64, typename BF16>
auto pick(F32 f32, F64 f64, BF16 bf16) {
  if constexpr (std::is_same<T, float>::value) return f32;
  else if constexpr (std::is_same<T, double>::value) return f64;
  else return bf16;
}
#define KERNEL(T, NAME) \
  harness::pick<T>(NAME##_f32_ns::NAME##_f32, NAME##_f64_ns::NAME##_f64, NAME##_bf16_ns::NAME##_bf16)

// ---------------------------------------------------------------------------------------------
// Deterministic random numbers (splitmix64, Box-Muller).
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed * 0x9e3779b97f4a7c15ull + 1) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return (double)(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double normal() {
    const double u = 1.0 - uniform(), v = uniform();
    return std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v);
  }

 private:
  uint64_t s_;
};

// Fills `b` with values of T drawn as mean + sd * N(0, 1).
template <typename T> void fill_normal(Buffer<T>& b, Rng& rng, double mean = 0, double sd = 1) {
  for (size_t i = 0; i < b.size(); ++i) b[i] = fromd<T>(mean + sd * rng.normal());
}

// ---------------------------------------------------------------------------------------------
// Launch shapes of src/ops/cuda/mod.rs.
struct Shape {
  unsigned blocks, threads, smem;
};
// `grid(blocks, threads, shared)`: grid_dim = blocks.max(1).
inline Shape grid(size_t blocks, unsigned threads, unsigned shared) {
  return Shape{(unsigned)std::max<size_t>(blocks, 1), threads, shared};
}
// `elementwise(n)`: grid(n.div_ceil(256).min(65_535 * 16), 256, 0).
inline Shape elementwise(size_t n) {
  return grid(std::min<size_t>((n + 255) / 256, 65535 * 16), 256, 0);
}

// ---------------------------------------------------------------------------------------------
// Report.
inline int checks = 0, failures = 0;

inline void report(bool ok, const std::string& line) {
  ++checks;
  if (!ok) ++failures;
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", line.c_str());
  std::fflush(stdout);
}

inline std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline std::string format(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

// Runs one launch of `kernel` with `shape`; a fault is a failed check (true when it ran).
template <typename F> bool run(const std::string& kernel, Shape shape, F&& body) {
  const emu::Launch l = emu::launch(kernel.c_str(), shape.blocks, shape.threads, shape.smem, body);
  if (!l.ok) report(false, "launch " + kernel + ": " + l.error);
  return l.ok;
}

// A launch that must fault (a kernel's own check of its launch); `what` describes it.
template <typename F> void expect_fault(const std::string& what, Shape shape, F&& body) {
  const emu::Launch l = emu::launch(what.c_str(), shape.blocks, shape.threads, shape.smem, body);
  std::string why = l.error;  // "<what>: <where and why>" or "<what> <why>"
  if (why.compare(0, what.size(), what) == 0) why = why.substr(std::min(why.size(), what.size() + 1));
  while (!why.empty() && why[0] == ' ') why.erase(0, 1);
  report(!l.ok, what + (l.ok ? ": launched without a fault" : ": faults (" + why + ")"));
}

// A pass/fail check with no error measure.
inline void expect(bool ok, const std::string& what) { report(ok, what); }

// Error of `got` against the reference `ref`: max_i |got_i - ref_i| / (|ref_i| + 1e-2 S), where
// S is the output's scale: max_j |ref_j|, or `scale` if larger. So elements far below the scale
// (where rounding noise is large relative to them) are measured against 1 % of it. Outputs that
// are sums with cancellation pass as `scale` the largest sum of the terms' absolute values,
// which is what their rounding error is proportional to. NaN counts as inf.
inline double rel_error(const std::vector<double>& got, const std::vector<double>& ref,
                        double scale = 0) {
  for (double r : ref) scale = std::max(scale, std::fabs(r));
  const double floor = std::max(1e-2 * scale, 1e-300);
  double e = got.size() == ref.size() ? 0.0 : INFINITY;
  for (size_t i = 0; i < got.size() && i < ref.size(); ++i) {
    const double d = std::fabs(got[i] - ref[i]);
    e = std::max(e, std::isnan(d) ? INFINITY : d / (std::fabs(ref[i]) + floor));
  }
  return e;
}

// `n` elements of a device buffer (from element `offset`) as doubles.
template <typename T> std::vector<double> read(const Buffer<T>& b, size_t offset, size_t n) {
  std::vector<double> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = tod(b[offset + i]);
  return v;
}
template <typename T> std::vector<double> read(const Buffer<T>& b) { return read(b, 0, b.size()); }

// The check line: "<what>  max rel err <e> (tol <tol>)".
inline void compare(const std::string& what, const std::vector<double>& got,
                    const std::vector<double>& ref, double tol, double scale = 0) {
  const double e = rel_error(got, ref, scale);
  report(e <= tol, format("%-58s max rel err %.2e (tol %.0e)", what.c_str(), e, tol));
}

// Tolerances of rel_error per storage (or accumulation) type: f64 and f32 compute in their own
// precision (observed errors stay below 1e-13 and 1e-5: about 100x and 10x margin), bf16 computes
// in f32 and rounds the result, which alone is up to 2^-9 = 3.9e-3 relative.
template <typename T> double tol() {
  return std::is_same<T, double>::value ? 1e-12 : std::is_same<T, float>::value ? 5e-5 : 1e-2;
}

// True when `a` and `b` hold bitwise equal elements in [from, to).
template <typename T> bool same_bits(const Buffer<T>& a, const std::vector<T>& b, size_t from,
                                     size_t to) {
  return std::memcmp(a.data() + from, b.data() + from, (to - from) * sizeof(T)) == 0;
}

}  // namespace harness
