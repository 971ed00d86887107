// Emulation driver of kernels/flat.cu: add_into (f32, f64 and bf16 sources; adding, or
// writing over the old values), cast_into (f32,
// f64 and bf16 destinations), adamw (f32 and bf16 moments; with and without bf16 parameters
// written) over two decay ranges, Muon's passes (muon_*) and the two-stage sum_squares
// (f32 and bf16), with the launch shapes and argument order of
// src/ops/cuda/flat.rs, compared with double-precision references (and adamw also bitwise with
// the CPU AdamWStep's f32 arithmetic, which the kernel promises to reproduce exactly).
#include "shim.h"
// The kernels under test, unchanged.
#include "../flat.cu"
#include "harness.h"

using namespace harness;

namespace {

// flat.rs: SUM_BLOCKS and SUM_THREADS.
constexpr size_t SUM_BLOCKS = 1024;
constexpr unsigned SUM_THREADS = 256;

// add_into: dst[i] += (f32) src[i], on a view at an offset inside a larger f32 buffer (flat.rs
// passes a slice of the buffer); the elements around the view must stay untouched.
template <typename T> void check_add_into(size_t n, uint64_t seed) {
  Rng rng(seed);
  const size_t off = 7, total = n + 20;
  Buffer<float> dst(total, "dst");
  Buffer<T> src(n, "src");
  fill_normal(dst, rng);
  fill_normal(src, rng);
  const std::vector<float> before(dst.data(), dst.data() + total);
  // flat.rs `add_into`: elementwise(n); also a small grid (the grid-stride loop takes any).
  // overwrite 1 (a step's first gradient) writes src over the old values: over NaN here.
  const Shape shapes[2] = {elementwise(n), grid(2, 64, 0)};
  for (int overwrite = 0; overwrite < 2; ++overwrite) {
    std::vector<float> start = before;
    for (size_t i = 0; i < n && overwrite; ++i) start[off + i] = NAN;
    std::vector<double> ref(n);
    // Written over: src rounded to f32 once; added: within f32's rounding of the sum.
    for (size_t i = 0; i < n; ++i)
      ref[i] = overwrite ? (double)(float)tod(src[i]) : (double)before[off + i] + tod(src[i]);
    for (const Shape& sh : shapes) {
      std::memcpy(dst.data(), start.data(), total * sizeof(float));
      if (!run(format("add_into_%s", type_name<T>()), sh,
               [&] { KERNEL(T, add_into)(dst.data() + off, src.data(), (u64)n, overwrite); }))
        continue;
      const std::string tag = format("add_into f32 %s %s n=%zu grid=%ux%u", overwrite ? "=" : "+=",
                                     type_name<T>(), n, sh.blocks, sh.threads);
      compare(tag, read(dst, off, n), ref, overwrite ? 0.0 : tol<float>());
      expect(same_bits(dst, before, 0, off) && same_bits(dst, before, off + n, total),
             tag + " leaves the rest of the buffer untouched");
    }
  }
}

// cast_into: dst[i] = src[i] rounded to T, on a view at an offset inside a larger buffer of T
// (the parameters' flat tensor); the reference rounds to bf16 by the bits (nearest even), not
// through the stand-in conversion under test.
template <typename T> void check_cast_into(size_t n, uint64_t seed) {
  Rng rng(seed);
  const size_t off = 5, total = n + 11;
  Buffer<T> dst(total, "dst");
  Buffer<float> src(n, "src");
  fill_normal(dst, rng);
  fill_normal(src, rng, 0.0, 100.0);
  src[0] = 1.0f + 1.0f / 256.0f;  // a tie: to even (1.0 in bf16)
  src[1] = 1.0f + 3.0f / 256.0f;  // a tie: to even (1 + 1/64)
  const std::vector<T> before(dst.data(), dst.data() + total);
  std::vector<double> ref(n);
  for (size_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, &src[i], 4);
    const uint32_t rounded = ((b + 0x7fffu + ((b >> 16) & 1u)) >> 16) << 16;
    float r;
    std::memcpy(&r, &rounded, 4);
    ref[i] = sizeof(T) == 2 ? (double)r : (double)src[i];
  }
  const Shape shapes[2] = {elementwise(n), grid(2, 64, 0)};
  for (const Shape& sh : shapes) {
    std::memcpy(dst.data(), before.data(), total * sizeof(T));
    if (!run(format("cast_into_%s", type_name<T>()), sh,
             [&] { KERNEL(T, cast_into)(dst.data() + off, src.data(), (u64)n); }))
      continue;
    const std::string tag =
        format("cast_into f32 -> %s n=%zu grid=%ux%u", type_name<T>(), n, sh.blocks, sh.threads);
    compare(tag, read(dst, off, n), ref, 0.0);
    expect(same_bits(dst, before, 0, off) && same_bits(dst, before, off + n, total),
           tag + " leaves the rest of the buffer untouched");
  }
}

// adamw: one step over state [master | exp_avg | exp_avg_sq] (f32 words; moments of type M,
// bf16 ones packed two to a word) with gradients grad, two decay ranges [0, 250) and [250, 500)
// and the elements [500, n) outside every range.
template <typename M> void check_adamw(size_t n, uint64_t seed) {
  // AdamWStep::scalars and ::keep (src/optim/kernels/adamw.rs): computed in f64, rounded to f32.
  const double lr = 1e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, grad_scale = 0.7;
  const int step = 3;
  const double bc1 = 1.0 - std::pow(beta1, step), bc2 = 1.0 - std::pow(beta2, step);
  const float b1 = (float)beta1, b2 = (float)beta2, step_size = (float)(lr / bc1),
              inv_sqrt_bc2 = (float)(1.0 / std::sqrt(bc2)), epsf = (float)eps,
              gs = (float)grad_scale;
  struct Range {
    size_t start, len;
    float keep;
  };
  const std::vector<Range> ranges = {{0, 250, (float)(1.0 - lr * 0.1)}, {250, 250, (float)(1.0 - lr * 0.0)}};
  // State words: n master weights, then 2 n moments of sizeof(M) bytes.
  const size_t words = n + 2 * n * sizeof(M) / sizeof(float);

  Rng rng(seed);
  Buffer<float> grad(n, "grad");
  fill_normal(grad, rng);
  std::vector<float> init(words);
  M* init_m = (M*)(init.data() + n);
  for (size_t i = 0; i < n; ++i) {
    init[i] = (float)rng.normal();
    init_m[i] = fromd<M>(0.05 * rng.normal());
    const double v = 0.05 * rng.normal();
    init_m[n + i] = fromd<M>(v * v);
  }

  // The CPU AdamWStep (src/optim/kernels.rs, cpu_fwd), in f32, and a double reference.
  std::vector<float> cpu = init;
  M* cpu_m = (M*)(cpu.data() + n);
  std::vector<double> ref(3 * n);
  for (size_t i = 0; i < n; ++i) {
    ref[i] = init[i];
    ref[n + i] = tod(init_m[i]);
    ref[2 * n + i] = tod(init_m[n + i]);
  }
  for (const Range& r : ranges)
    for (size_t i = r.start; i < r.start + r.len; ++i) {
      float* p = &cpu[i];
      M* mm = &cpu_m[i];
      M* vv = &cpu_m[n + i];
      // One rounded operation per statement, in Rust's evaluation order (so that no compiler
      // contracts them into FMAs, which Rust never does).
      const float g = grad[i] * gs;
      const float bm = b1 * (float)tod(*mm), c1 = 1.0f - b1, c1g = c1 * g;
      const float m = bm + c1g;
      const float bv = b2 * (float)tod(*vv), c2 = 1.0f - b2, c2g = c2 * g, c2gg = c2g * g;
      const float v = bv + c2gg;
      *mm = fromd<M>(m);
      *vv = fromd<M>(v);
      const float sv = std::sqrt(v), svb = sv * inv_sqrt_bc2, denom = svb + epsf;
      const float pk = *p * r.keep, sm = step_size * m, upd = sm / denom;
      *p = pk - upd;

      const double gd = (double)grad[i] * gs;
      double& pd = ref[i];
      double& md = ref[n + i];
      double& vd = ref[2 * n + i];
      md = (double)b1 * md + (1.0 - (double)b1) * gd;
      vd = (double)b2 * vd + (1.0 - (double)b2) * gd * gd;
      pd = pd * r.keep - (double)step_size * md / (std::sqrt(vd) * inv_sqrt_bc2 + epsf);
    }

  // flat.rs `adamw`: adjacent ranges with equal keep merged (these differ), one launch per range
  // with elementwise(len); also small grids (grid-stride), which also write the new master
  // weights into bf16 parameters (`out`, prefilled so that untouched elements show).
  for (int small = 0; small < 2; ++small) {
    Buffer<float> state(words, "state");
    std::memcpy(state.data(), init.data(), words * sizeof(float));
    Buffer<unsigned> bad(1, "non-finite flag");
    bad[0] = 0;
    Buffer<__nv_bfloat16> out(n, "bf16 parameters");
    for (size_t i = 0; i < n; ++i) out[i] = __float2bfloat16_rn(-7.0f);
    __nv_bfloat16* out_ptr = small ? out.data() : nullptr;
    bool ok = true;
    for (const Range& r : ranges)
      ok = ok && run(format("adamw_%s", type_name<M>()), small ? grid(2, 64, 0) : elementwise(r.len), [&] {
             pick<M>(adamw_f32_ns::adamw_f32, adamw_f32_ns::adamw_f32, adamw_bf16_ns::adamw_bf16)(
                 state.data(), grad.data(), (u64)n, (u64)r.start, (u64)r.len, b1, b2, step_size,
                 inv_sqrt_bc2, epsf, gs, r.keep, bad.data(), out_ptr);
           });
    if (!ok) continue;
    if (small) {
      // The parameters: the new masters rounded to bf16 by the bits (nearest even) in the
      // ranges, the prefill outside them.
      size_t wrong = 0;
      const size_t end = ranges.back().start + ranges.back().len;
      for (size_t i = 0; i < n; ++i) {
        uint32_t b, got;
        std::memcpy(&b, &state[i], 4);
        const uint32_t want = i < end ? ((b + 0x7fffu + ((b >> 16) & 1u)) >> 16) : 0xc0e0u;
        uint16_t bits;
        std::memcpy(&bits, &out[i], 2);
        got = bits;
        wrong += got != want;
      }
      expect(wrong == 0, format("adamw %s: the bf16 parameters it writes are the new masters "
                                "rounded to nearest even, untouched outside the ranges (%zu differ)",
                                type_name<M>(), wrong));
    }
    expect(bad[0] == 0, format("adamw %s: a finite update leaves the non-finite flag clear",
                               type_name<M>()));
    const std::string tag =
        format("adamw %s moments n=%zu, ranges [0,250) keep %.4f, [250,500) keep 1, grid %s",
               type_name<M>(), n, ranges[0].keep, small ? "2x64" : "elementwise(len)");
    const size_t end = ranges.back().start + ranges.back().len;
    const char* names[3] = {"master", "exp_avg", "exp_avg_sq"};
    const M* got_m = (const M*)(state.data() + n);
    for (int part = 0; part < 3; ++part) {
      std::vector<double> got(end), want(end);
      for (size_t i = 0; i < end; ++i) {
        got[i] = part == 0 ? (double)state[i] : tod(got_m[(part - 1) * n + i]);
        want[i] = ref[part * n + i];
      }
      compare(tag + " " + names[part], got, want, part == 0 ? tol<float>() : tol<M>());
    }
    expect(same_bits(state, cpu, 0, words),
           tag + " bitwise equal to the CPU AdamWStep (untouched outside the ranges)");
  }

  // A gradient that overflows (an infinite second moment, a NaN master weight) sets the flag; as
  // does a huge one whose square alone overflows the moment.
  for (const float poison : {INFINITY, 3e30f}) {
    Buffer<float> state(words, "state");
    std::memcpy(state.data(), init.data(), words * sizeof(float));
    Buffer<float> g(n, "grad");
    for (size_t i = 0; i < n; ++i) g[i] = grad[i];
    g[137] = poison;
    Buffer<unsigned> bad(1, "non-finite flag");
    bad[0] = 0;
    const Range& r = ranges[0];
    if (run(format("adamw_%s", type_name<M>()), elementwise(r.len), [&] {
          pick<M>(adamw_f32_ns::adamw_f32, adamw_f32_ns::adamw_f32, adamw_bf16_ns::adamw_bf16)(
              state.data(), g.data(), (u64)n, (u64)r.start, (u64)r.len, b1, b2, step_size,
              inv_sqrt_bc2, epsf, gs, r.keep, bad.data(), nullptr);
        }))
      expect(bad[0] == 1u, format("adamw %s: a gradient of %g sets the non-finite flag",
                                  type_name<M>(), (double)poison));
  }
}

// sum_squares: stage 1 writes one f64 partial per block, stage 2 sums them in one block. The
// buffer starts `skew` elements past a 256-byte boundary (a gradient run at any offset of the
// flat buffer): the first elements up to a 16-byte boundary, and those after the last whole
// 16-byte pack, are summed one by one.
template <typename T>
void check_sum_squares(size_t n, uint64_t seed, bool rust_shape, size_t skew = 0) {
  Rng rng(seed);
  Buffer<T> storage(n + skew, "x");
  fill_normal(storage, rng);
  const T* x = storage.data() + skew;
  // flat.rs `sum_squares`: blocks = n.div_ceil(SUM_THREADS).clamp(1, SUM_BLOCKS), stage 1
  // grid(blocks, SUM_THREADS, 0), stage 2 grid(1, SUM_THREADS, 0). Otherwise a small grid whose
  // threads stride over several packs.
  const size_t blocks =
      rust_shape ? std::min(std::max<size_t>((n + SUM_THREADS - 1) / SUM_THREADS, 1), SUM_BLOCKS) : 3;
  const unsigned threads = rust_shape ? SUM_THREADS : 64;
  // The kernel's assignment: packs of 16 bytes from the first aligned element, pack v to thread
  // v mod (blocks threads); the elements before and after the packs to threads 0, 1, ...
  const size_t per = 16 / sizeof(T), off = ((size_t)x / sizeof(T)) % per;
  const size_t head = off == 0 ? 0 : std::min(per - off, n);
  const size_t packs = (n - head) / per, tail = head + packs * per, all = blocks * threads;
  std::vector<long double> rpart(blocks, 0.0L);
  long double total = 0;
  for (size_t i = 0; i < n; ++i) {
    const long double v = (long double)tod(x[i]) * tod(x[i]);
    const size_t thread = i < head ? i : i >= tail ? head + (i - tail) : ((i - head) / per) % all;
    rpart[thread / threads] += v;
    total += v;
  }
  Buffer<double> partial(blocks, "partial"), out(1, "out");
  if (!run(format("sum_squares_partial_%s", type_name<T>()), grid(blocks, threads, 0), [&] {
        pick<T>(sum_squares_partial_f32_ns::sum_squares_partial_f32,
                sum_squares_partial_f32_ns::sum_squares_partial_f32,
                sum_squares_partial_bf16_ns::sum_squares_partial_bf16)(x, (u64)n,
                                                                       partial.data());
      }))
    return;
  if (!run("sum_squares_final", grid(1, threads, 0),
           [&] { sum_squares_final(partial.data(), (int)blocks, out.data()); }))
    return;
  const std::string tag = format("sum_squares %s n=%zu skew=%zu, %zu partials of %u threads",
                                 type_name<T>(), n, skew, blocks, threads);
  std::vector<double> got(partial.data(), partial.data() + blocks), want(rpart.begin(), rpart.end());
  compare(tag + " partials", got, want, tol<double>());
  compare(tag + " total", {out[0]}, {(double)total}, tol<double>());
}

// Muon's passes (ops/cuda/muon.rs; src/optim/muon/fused.rs on the CPU): three runs of a state
// [master | buf] of k = 30 over 40 gradients and a direction of n = 50 owned elements, bitwise
// against the f32 operations of fused.rs written out here (torch.lerp's two-sided form, each
// product rounded, candle's `+ 0`), for both branches of the lerp, with and without Nesterov and
// clipping's scale, on values that include signed zeros; nothing outside the runs is written.
void check_muon(uint64_t seed) {
  struct Run {
    size_t g, here, at, len;
  };
  const Run runs[3] = {{2, 0, 1, 10}, {15, 10, 20, 12}, {30, 22, 40, 8}};
  const size_t k = 30, n = 50, ng = 40;
  struct Case {
    double mu;
    int nesterov, scaled;
    float gs;
  };
  const Case cases[3] = {{0.95, 1, 0, 1.0f}, {0.3, 1, 1, 0.37f}, {0.6, 0, 1, 2.0f}};
  // fused.rs `Lerp::new(weight)`: w = weight as f32; |w| < 0.5 keeps w, else 1 - w in f32.
  auto lerp_of = [](double weight, int& low, float& c) {
    const float w = (float)weight;
    low = std::fabs(w) < 0.5f;
    c = low ? w : 1.0f - w;
  };
  auto lerp = [](float s, float e, int low, float c) {
    const float d = (e - s) * c + 0.0f;
    return low ? s + d : e - d;
  };
  for (const Case& cs : cases) {
    Rng rng(seed);
    Buffer<float> grad(ng, "grad"), state(2 * k, "state"), u(n, "u"), o(n, "o");
    fill_normal(grad, rng);
    fill_normal(state, rng);
    fill_normal(o, rng);
    grad[2] = 0.0f;
    grad[16] = -0.0f;
    state[k + 3] = -0.0f;
    for (size_t i = 0; i < n; ++i) u[i] = 0.0f;
    int blow, ulow;
    float bc, uc;
    lerp_of(1.0 - cs.mu, blow, bc);
    lerp_of(cs.mu, ulow, uc);
    const float keep = (float)(1.0 - 0.01 * 0.1);
    // The reference.
    std::vector<float> st(state.data(), state.data() + 2 * k), ud(n, 0.0f);
    auto rd = [&](float g) { return cs.scaled ? g * cs.gs + 0.0f : g; };
    for (const Run& r : runs)
      for (size_t i = 0; i < r.len; ++i) {
        float& b = st[k + r.here + i];
        const float g = rd(grad[r.g + i]);
        b = lerp(b, g, blow, bc);
        ud[r.at + i] = cs.nesterov ? lerp(g, b, ulow, uc) : b;
        float& w = st[r.here + i];
        w = (w * keep + 0.0f) + o[r.at + i];
      }
    // The kernels, one launch per run (muon.rs), elementwise(len) and a small grid.
    bool ok = true;
    for (const Run& r : runs)
      ok = ok && run("muon_momentum", elementwise(r.len), [&] {
             muon_momentum(state.data(), grad.data(), (u64)k, (u64)r.here, (u64)r.g, (u64)r.len,
                           cs.scaled, cs.gs, blow, bc);
           });
    for (const Run& r : runs)
      ok = ok && run("muon_direction", grid(2, 64, 0), [&] {
             muon_direction(u.data(), grad.data(), state.data(), (u64)k, (u64)r.here, (u64)r.g,
                            (u64)r.at, (u64)r.len, cs.scaled, cs.gs, cs.nesterov, ulow, uc);
           });
    for (const Run& r : runs)
      ok = ok && run("muon_apply", elementwise(r.len), [&] {
             muon_apply(state.data(), o.data(), (u64)r.here, (u64)r.at, (u64)r.len, keep);
           });
    if (!ok) continue;
    const std::string tag = format("muon mu=%.2f nesterov=%d scaled=%d", cs.mu, cs.nesterov,
                                   cs.scaled);
    expect(same_bits(state, st, 0, 2 * k), tag + ": master and momentum bitwise as fused.rs");
    expect(same_bits(u, ud, 0, n), tag + ": the direction bitwise, zero outside the runs");
  }
}

}  // namespace

void flat_checks() {
  check_add_into<float>(1000, 1);
  check_add_into<double>(1000, 2);
  check_add_into<__nv_bfloat16>(1000, 3);
  check_cast_into<float>(1000, 11);
  check_cast_into<double>(1000, 12);
  check_cast_into<__nv_bfloat16>(1000, 13);
  check_adamw<float>(600, 4);
  check_adamw<__nv_bfloat16>(600, 9);
  check_sum_squares<float>(0, 5, true);
  check_sum_squares<float>(1000, 6, true);
  check_sum_squares<float>(70000, 7, true);  // 274 partials: stage 2's threads stride
  check_sum_squares<float>(1000, 8, false);
  check_sum_squares<__nv_bfloat16>(2000, 10, true);  // the optimizer's packed bf16 moments
  // Runs that start off a 16-byte boundary, several packs per thread, and shorter than a pack.
  check_sum_squares<float>(70001, 11, true, 1);
  check_sum_squares<float>(1003, 12, false, 3);
  check_sum_squares<float>(2, 13, false, 1);
  check_sum_squares<__nv_bfloat16>(5003, 14, false, 5);
  check_sum_squares<__nv_bfloat16>(6, 15, true, 7);
  check_muon(11);
}
