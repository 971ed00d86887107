// Emulation driver of kernels/attention.cu: attn_fwd, attn_bwd_delta, attn_bwd_dq and
// attn_bwd_dkv for f32, f64 and bf16 over head dims in every bucket (64, 128, 256), several
// lengths (one and several query/key tiles), batch sizes and GQA groups, causal and unmasked with
// other key counts (the blocks of context-parallel ring attention), with the launch shapes and
// argument order of src/ops/cuda/attention.rs, compared with a naive double-precision attention; plus the kernels' own launch checks (they must trap on a wrong block size or too
// little shared memory) and the tile geometry table that attention.rs's unit test pins. The
// tensor-core kernels of attention_tc.cu (bf16, d = 64 and 128; `tc` below), causal and unmasked,
// run through the same checks with the launch shapes of src/ops/cuda/attention_tc.rs. With
// `docs`, the scalar kernels take a document floor ([b, s], non-decreasing along each row): the
// reference lets row i see keys floor .. its causal or unmasked limit, and a row that sees none
// must get a zero output and a log-sum-exp of -inf.
#include "shim.h"
// The kernels under test, unchanged.
#include "../attention.cu"
#include "../attention_tc.cu"
#include "harness.h"

using namespace harness;

namespace {

// attention.rs: THREADS, `Geometry::new`, `kv_smem`, `qdo_smem` and `blocks`.
constexpr unsigned THREADS = 128;

struct Geometry {
  size_t dmax, rows, keys, tile, ld, acc;
  unsigned kv_smem() const { return (unsigned)(2 * tile * ld * acc); }
  unsigned qdo_smem() const { return (unsigned)((2 * tile * ld + 2 * tile) * acc); }
};

Geometry geometry(size_t d, size_t acc) {
  const size_t dmax = d <= 64 ? 64 : d <= 128 ? 128 : 256;  // d in 1..=256
  const size_t lanes = std::max<size_t>(dmax * acc / 64, 8);
  const size_t per_lane = dmax / lanes, groups = THREADS / lanes;
  const size_t ri = 128 / (per_lane * acc), rj = std::max<size_t>(ri / 2, 1);
  const size_t chunk = lanes * (16 / acc);
  return Geometry{dmax, groups * ri, groups * rj, 16384 / (dmax * acc), (d + chunk - 1) / chunk * chunk, acc};
}

size_t blocks(size_t units, size_t s, size_t per_block) { return units * ((s + per_block - 1) / per_block); }

// The kernel `<NAME>_d<dmax>_<dtype>` attention.rs picks for geometry bucket `dmax`.
#define BUCKET(T, NAME, DMAX)                                      \
  ((DMAX) == 64 ? KERNEL(T, NAME##_d64) : (DMAX) == 128 ? KERNEL(T, NAME##_d128) \
                                                        : KERNEL(T, NAME##_d256))

// The (d, acc, rows, keys, tile, ld) table of `geometry_matches_kernels` in attention.rs, against
// Cfg<A, DMAX> of the kernel file: with that Rust test (table == Geometry), Geometry == Cfg.
template <typename A, int DMAX> bool cfg_is(size_t d, size_t rows, size_t keys, size_t tile, size_t ld) {
  typedef Cfg<A, DMAX> C;
  return (size_t)(C::GROUPS * C::RI) == rows && (size_t)(C::GROUPS * C::RJ) == keys &&
         (size_t)C::TILE == tile && (size_t)round_up((int)d, C::CHUNK) == ld;
}
void check_geometry_table() {
  const bool ok = cfg_is<float, 64>(64, 64, 32, 64, 64) && cfg_is<float, 128>(128, 32, 16, 32, 128) &&
                  cfg_is<float, 128>(80, 32, 16, 32, 96) && cfg_is<float, 256>(256, 16, 8, 16, 256) &&
                  cfg_is<float, 256>(200, 16, 8, 16, 256) && cfg_is<double, 64>(64, 32, 16, 32, 64) &&
                  cfg_is<double, 64>(8, 32, 16, 32, 16) && cfg_is<double, 128>(128, 16, 8, 16, 128) &&
                  cfg_is<double, 256>(256, 8, 4, 8, 256);
  bool mirror = true;  // this driver's Geometry against Cfg, for every bucket and accumulator
  for (size_t d : {1, 8, 17, 40, 64, 65, 80, 128, 129, 200, 250, 256}) {
    const Geometry gf = geometry(d, 4), gd = geometry(d, 8);
    mirror = mirror && (gf.dmax == 64    ? cfg_is<float, 64>(d, gf.rows, gf.keys, gf.tile, gf.ld)
                        : gf.dmax == 128 ? cfg_is<float, 128>(d, gf.rows, gf.keys, gf.tile, gf.ld)
                                         : cfg_is<float, 256>(d, gf.rows, gf.keys, gf.tile, gf.ld));
    mirror = mirror && (gd.dmax == 64    ? cfg_is<double, 64>(d, gd.rows, gd.keys, gd.tile, gd.ld)
                        : gd.dmax == 128 ? cfg_is<double, 128>(d, gd.rows, gd.keys, gd.tile, gd.ld)
                                         : cfg_is<double, 256>(d, gd.rows, gd.keys, gd.tile, gd.ld));
  }
  expect(ok, "attention Cfg<A, DMAX> matches the table of attention.rs geometry_matches_kernels");
  expect(mirror, "attention Geometry (attention.rs) matches Cfg<A, DMAX> for d in 1..=256");
}

// attention_tc.rs: `TcGeometry` (64 rows per block; shared memory of the three kernels), and
// the table of its unit test `tc_geometry_matches_kernels` against TcCfg<D>.
constexpr size_t TC_ROWS = 64;
struct TcGeometry {
  unsigned fwd, dq, dkv;
};
TcGeometry tc_geometry(size_t d) {
  const size_t ldh = d + 8, fkt = d == 64 ? 64 : 32, bt = 32, rows = TC_ROWS;
  return TcGeometry{(unsigned)(32 + 2 * fkt * ldh * 2 + rows * (fkt + 4) * 4 + rows * (fkt + 8) * 2),
                    (unsigned)(32 + 2 * bt * ldh * 2 + 2 * rows * (bt + 4) * 4 + rows * (bt + 8) * 2),
                    (unsigned)(32 + 2 * bt * ldh * 2 + 2 * bt * 4 + 2 * rows * (bt + 4) * 4 +
                               2 * rows * (bt + 8) * 2)};
}
void check_tc_geometry() {
  typedef attn_tc::TcCfg<64> C64;
  typedef attn_tc::TcCfg<128> C128;
  const TcGeometry g64 = tc_geometry(64), g128 = tc_geometry(128);
  expect(C64::FWD_SMEM == 45088 && C64::DQ_SMEM == 32800 && C64::DKV_SMEM == 38176 &&
             C128::FWD_SMEM == 31776 && C128::DQ_SMEM == 40992 && C128::DKV_SMEM == 46368 &&
             C64::BM == (int)TC_ROWS && C128::BM == (int)TC_ROWS,
         "attention TcCfg<D> matches the table of attention_tc.rs tc_geometry_matches_kernels");
  expect(g64.fwd == C64::FWD_SMEM && g64.dq == C64::DQ_SMEM && g64.dkv == C64::DKV_SMEM &&
             g128.fwd == C128::FWD_SMEM && g128.dq == C128::DQ_SMEM && g128.dkv == C128::DKV_SMEM,
         "attention TcGeometry (attention_tc.rs) matches TcCfg<D>");
}

// `sk` = 0: causal (sk = s); otherwise unmasked over sk keys.
template <typename T>
void attention(size_t b, size_t s, size_t hq, size_t hkv, size_t d, uint64_t seed, bool launch_checks,
               bool tc = false, size_t sk = 0, bool docs = false) {
  typedef typename Acc<T>::type A;
  const bool causal = sk == 0;
  if (causal) sk = s;
  const int ski = (int)sk, ci = causal ? 1 : 0;
  const Geometry geo = geometry(d, sizeof(A));
  const TcGeometry tg = tc_geometry(d);
  const A sc = (A)(1.3 / std::sqrt((double)d));  // `T::acc(scale)`
  const double scale = (double)sc;
  const size_t nq = b * s * hq * d, nkv = b * sk * hkv * d, nl = b * hq * s, group = hq / hkv;
  const std::string tag = format("%s%s d=%zu (bucket %zu) b=%zu s=%zu sk=%zu %s%s hq=%zu hkv=%zu",
                                 tc ? "tc " : "", type_name<T>(), d, geo.dmax, b, s, sk,
                                 causal ? "causal" : "unmasked", docs ? " documents" : "", hq, hkv);
  const std::string kp = tc ? "attn_tc_" : "attn_";  // kernel name prefix
  Rng rng(seed);
  Buffer<T> q(nq, "q"), k(nkv, "k"), v(nkv, "v"), dout(nq, "dout");
  fill_normal(q, rng);
  fill_normal(k, rng);
  fill_normal(v, rng);
  fill_normal(dout, rng);
  // Document floors: causal rows start documents at random points (a row's floor is its
  // document's start); unmasked rows (a ring block) rise from 0 to sk, the last rows seeing no key.
  std::vector<unsigned> floors(docs ? b * s : 0);
  for (size_t bi = 0; docs && bi < b; ++bi) {
    size_t start = 0;
    for (size_t i = 0; i < s; ++i) {
      if (causal) {
        if (i > 0 && rng.next() % 5 == 0) start = i;
        floors[bi * s + i] = (unsigned)start;
      } else {
        floors[bi * s + i] = (unsigned)std::min(sk, (i * (sk + 2)) / s + (bi + rng.next() % 2) * (i > 0));
      }
    }
    for (size_t i = 1; i < s; ++i)  // non-decreasing, as the launcher requires
      floors[bi * s + i] = std::max(floors[bi * s + i], floors[bi * s + i - 1]);
  }
  Buffer<unsigned> floor_buf(docs ? b * s : 1, "floor");
  for (size_t i = 0; i < floors.size(); ++i) floor_buf[i] = floors[i];
  const unsigned* fl = docs ? floor_buf.data() : nullptr;

  // Reference, in double from the stored inputs: P = softmax(scale Q K^T) (masked) per row.
  // `at` reads a [b, s, heads, d] buffer (q, out, dout), `atk` a [b, sk, hkv, d] one (k, v).
  auto at = [&](const Buffer<T>& x, size_t heads, size_t bi, size_t p, size_t h, size_t c) {
    return tod(x[((bi * s + p) * heads + h) * d + c]);
  };
  auto atk = [&](const Buffer<T>& x, size_t bi, size_t p, size_t g, size_t c) {
    return tod(x[((bi * sk + p) * hkv + g) * d + c]);
  };
  auto seen = [&](size_t i) { return causal ? i + 1 : sk; };  // keys row i sees, up to
  size_t cur_b = 0;  // the batch of the row `first` is asked about
  auto first = [&](size_t i) { return docs ? std::min<size_t>(floors[cur_b * s + i], seen(i)) : 0; };
  auto probs = [&](size_t bi, size_t h, size_t i, std::vector<double>& p) -> double {  // lse
    cur_b = bi;
    const size_t g = h / group, n = seen(i), j0 = first(i);
    p.assign(n, 0.0);
    if (j0 == n) return -INFINITY;  // no key: p stays 0
    double mx = -INFINITY, sum = 0;
    for (size_t j = j0; j < n; ++j) {
      double a = 0;
      for (size_t c = 0; c < d; ++c) a += at(q, hq, bi, i, h, c) * atk(k, bi, j, g, c);
      p[j] = a * scale;
      mx = std::max(mx, p[j]);
    }
    for (size_t j = j0; j < n; ++j) sum += (p[j] = std::exp(p[j] - mx));
    for (size_t j = j0; j < n; ++j) p[j] /= sum;
    return mx + std::log(sum);
  };
  // Forward: out = P V, lse; `mag_out` = max |P| |V| (out's scale).
  std::vector<double> ro(nq), rl(nl), p;
  double mag_out = 0;
  for (size_t bi = 0; bi < b; ++bi)
    for (size_t h = 0; h < hq; ++h)
      for (size_t i = 0; i < s; ++i) {
        rl[(bi * hq + h) * s + i] = probs(bi, h, i, p);
        for (size_t c = 0; c < d; ++c) {
          double o = 0, a = 0;
          for (size_t j = 0; j < seen(i); ++j) {
            o += p[j] * atk(v, bi, j, h / group, c);
            a += p[j] * std::fabs(atk(v, bi, j, h / group, c));
          }
          ro[((bi * s + i) * hq + h) * d + c] = o;
          mag_out = std::max(mag_out, a);
        }
      }

  // attention.rs `fwd`: grid(blocks(b hq, s, rows), THREADS, kv_smem), kernel attn_fwd_d<dmax>.
  // attention_tc.rs: grid(blocks(b hq, s, 64), THREADS, fwd smem), kernel attn_tc_fwd_d<d>_bf16.
  const Shape fwd_shape = tc ? grid(blocks(b * hq, s, TC_ROWS), THREADS, tg.fwd)
                             : grid(blocks(b * hq, s, geo.rows), THREADS, geo.kv_smem());
  Buffer<T> out(nq, "out");
  Buffer<A> lse(nl, "lse");
  auto fwd = [&] {
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
      if (tc) {
        (d == 64 ? attn_tc_fwd_d64_bf16 : attn_tc_fwd_d128_bf16)(
            q.data(), k.data(), v.data(), out.data(), lse.data(), (int)b, (int)s, (int)hq, (int)hkv, (int)d,
            ski, ci, fl, sc);
        return;
      }
    }
    BUCKET(T, attn_fwd, geo.dmax)(q.data(), k.data(), v.data(), out.data(), lse.data(), (int)b,
                                  (int)s, (int)hq, (int)hkv, (int)d, ski, ci, fl, sc);
  };
  if (!run(format("%sfwd_d%zu_%s", kp.c_str(), tc ? d : geo.dmax, type_name<T>()), fwd_shape, fwd)) return;
  const double t = tol<T>();
  compare(kp + "fwd " + tag + " out", read(out), ro, t, mag_out);
  std::vector<double> got(lse.data(), lse.data() + nl);
  bool empty_rows_ok = true;  // -inf exactly where the reference row sees no key, then compared as 0
  for (size_t i = 0; i < nl; ++i) {
    empty_rows_ok = empty_rows_ok && (std::isinf(rl[i]) == std::isinf(got[i])) && !std::isnan(got[i]);
    if (std::isinf(rl[i])) rl[i] = got[i] = 0;
  }
  expect(empty_rows_ok, kp + "fwd " + tag + " lse is -inf exactly for rows that see no key");
  compare(kp + "fwd " + tag + " lse", got, rl, tol<A>());

  // attention.rs `bwd`: delta with grid(blocks(1, b s hq, THREADS / 32), THREADS, 0). The
  // backward's delta is by design sum_c dO O over the stored (for bf16: rounded) output, as in
  // FlashAttention; the reference uses the same, from the forward kernel's `out`.
  Buffer<A> delta(nl, "delta");
  if (!run(format("attn_bwd_delta_%s", type_name<T>()), grid(blocks(1, b * s * hq, THREADS / 32), THREADS, 0), [&] {
        KERNEL(T, attn_bwd_delta)(out.data(), dout.data(), delta.data(), (int)b, (int)s, (int)hq, (int)d);
      }))
    return;
  std::vector<double> rdelta(nl);
  double mag_delta = 0;
  for (size_t bi = 0; bi < b; ++bi)
    for (size_t pos = 0; pos < s; ++pos)
      for (size_t h = 0; h < hq; ++h) {
        double a = 0, m = 0;
        for (size_t c = 0; c < d; ++c) {
          a += at(dout, hq, bi, pos, h, c) * at(out, hq, bi, pos, h, c);
          m += std::fabs(at(dout, hq, bi, pos, h, c) * at(out, hq, bi, pos, h, c));
        }
        rdelta[(bi * hq + h) * s + pos] = a;
        mag_delta = std::max(mag_delta, m);
      }
  got.assign(delta.data(), delta.data() + nl);
  compare("attn_bwd_delta " + tag + " delta", got, rdelta, tol<A>(), mag_delta);

  // Backward reference: dP = dO V^T, dS = P (dP - delta) scale, dQ = dS K, dK = dS^T Q,
  // dV = P^T dO. The scales of dQ and dK: the largest sum over the terms of
  // P (|dP| + |delta|) scale |K| (resp. |Q|), which their rounding errors are proportional to.
  std::vector<double> rdq(nq, 0.0), rdk(nkv, 0.0), rdv(nkv, 0.0), adq(nq, 0.0), adk(nkv, 0.0), adv(nkv, 0.0);
  for (size_t bi = 0; bi < b; ++bi)
    for (size_t h = 0; h < hq; ++h) {
      const size_t g = h / group;
      for (size_t i = 0; i < s; ++i) {
        probs(bi, h, i, p);
        const double dl = rdelta[(bi * hq + h) * s + i];
        for (size_t j = 0; j < seen(i); ++j) {
          double dp = 0;
          for (size_t c = 0; c < d; ++c) dp += at(dout, hq, bi, i, h, c) * atk(v, bi, j, g, c);
          const double ds = p[j] * (dp - dl) * scale, as = p[j] * (std::fabs(dp) + std::fabs(dl)) * scale;
          for (size_t c = 0; c < d; ++c) {
            const size_t iq = ((bi * s + i) * hq + h) * d + c, ik = ((bi * sk + j) * hkv + g) * d + c;
            rdq[iq] += ds * atk(k, bi, j, g, c);
            adq[iq] += as * std::fabs(atk(k, bi, j, g, c));
            rdk[ik] += ds * at(q, hq, bi, i, h, c);
            adk[ik] += as * std::fabs(at(q, hq, bi, i, h, c));
            rdv[ik] += p[j] * at(dout, hq, bi, i, h, c);
            adv[ik] += p[j] * std::fabs(at(dout, hq, bi, i, h, c));
          }
        }
      }
    }
  auto max_of = [](const std::vector<double>& x) { return x.empty() ? 0.0 : *std::max_element(x.begin(), x.end()); };

  // dQ: grid(blocks(b hq, s, rows), THREADS, kv_smem); dK/dV: grid(blocks(b hkv, s, keys),
  // THREADS, qdo_smem), blocks over the sk keys; both write the flat [nq + 2 nkv] grads.
  Buffer<T> grads(nq + 2 * nkv, "grads");
  auto dq = [&] {
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
      if (tc) {
        (d == 64 ? attn_tc_dq_d64_bf16 : attn_tc_dq_d128_bf16)(
            q.data(), k.data(), v.data(), dout.data(), lse.data(), delta.data(), grads.data(), (int)b,
            (int)s, (int)hq, (int)hkv, (int)d, ski, ci, fl, sc);
        return;
      }
    }
    BUCKET(T, attn_bwd_dq, geo.dmax)(q.data(), k.data(), v.data(), dout.data(), lse.data(),
                                     delta.data(), grads.data(), (int)b, (int)s, (int)hq, (int)hkv,
                                     (int)d, ski, ci, fl, sc);
  };
  // The GQA shares [2, b, sk, hq, d] of the tensor-core dK/dV kernel (attention.rs allocates
  // them only for GQA).
  Buffer<float> part(group > 1 ? 2 * b * sk * hq * d : 1, "part");
  float* part_ptr = group > 1 ? part.data() : nullptr;
  auto dkv = [&] {
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
      if (tc) {
        (d == 64 ? attn_tc_dkv_d64_bf16 : attn_tc_dkv_d128_bf16)(
            q.data(), k.data(), v.data(), dout.data(), lse.data(), delta.data(), grads.data(),
            part_ptr, (int)b, (int)s, (int)hq, (int)hkv, (int)d, ski, ci, fl, sc);
        return;
      }
    }
    BUCKET(T, attn_bwd_dkv, geo.dmax)(q.data(), k.data(), v.data(), dout.data(), lse.data(),
                                      delta.data(), grads.data(), (int)b, (int)s, (int)hq,
                                      (int)hkv, (int)d, ski, ci, fl, sc);
  };
  // attention_tc.rs: dQ grid(blocks(b hq, s, 64), THREADS, dq smem); dK/dV grid(blocks(b hq,
  // s, 64), THREADS, dkv smem), then with GQA the reduction over 4 blocks (grid-stride).
  const Shape dq_shape = tc ? grid(blocks(b * hq, s, TC_ROWS), THREADS, tg.dq)
                            : grid(blocks(b * hq, s, geo.rows), THREADS, geo.kv_smem());
  const Shape dkv_shape = tc ? grid(blocks(b * hq, sk, TC_ROWS), THREADS, tg.dkv)
                             : grid(blocks(b * hkv, sk, geo.keys), THREADS, geo.qdo_smem());
  const std::string dqn = tc ? "attn_tc_dq" : "attn_bwd_dq", dkvn = tc ? "attn_tc_dkv" : "attn_bwd_dkv";
  if (!run(format("%s_d%zu_%s", dqn.c_str(), tc ? d : geo.dmax, type_name<T>()), dq_shape, dq)) return;
  if (!run(format("%s_d%zu_%s", dkvn.c_str(), tc ? d : geo.dmax, type_name<T>()), dkv_shape, dkv)) return;
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    if (tc && group > 1) {
      auto reduce = [&] {
        attn_tc_dkv_reduce_bf16(part.data(), grads.data(), (int)b, (int)s, (int)hq, (int)hkv,
                                (int)d, ski, sc);
      };
      if (!run("attn_tc_dkv_reduce_bf16", Shape{4, THREADS, 0}, reduce)) return;
    }
  }
  compare(dqn + " " + tag + " dq", read(grads, 0, nq), rdq, t, max_of(adq));
  compare(dkvn + " " + tag + " dk", read(grads, nq, nkv), rdk, t, max_of(adk));
  compare(dkvn + " " + tag + " dv", read(grads, nq + nkv, nkv), rdv, t, max_of(adv));

  if (launch_checks) {  // check_launch: other than THREADS threads, or too little shared memory
    const std::string kt = format("d%zu_%s", tc ? d : geo.dmax, type_name<T>());
    expect_fault(kp + "fwd_" + kt + " with 64 threads", Shape{fwd_shape.blocks, 64, fwd_shape.smem}, fwd);
    expect_fault(kp + "fwd_" + kt + " with smem - 1 bytes", Shape{fwd_shape.blocks, THREADS, fwd_shape.smem - 1}, fwd);
    expect_fault(dqn + "_" + kt + " with smem - 1 bytes", Shape{dq_shape.blocks, THREADS, dq_shape.smem - 1}, dq);
    expect_fault(dkvn + "_" + kt + " with smem - 1 bytes", Shape{dkv_shape.blocks, THREADS, dkv_shape.smem - 1}, dkv);
  }
}

template <typename T> void all(uint64_t seed) {
  attention<T>(1, 1, 1, 1, 8, seed + 1, false);    // bucket 64, a single row
  attention<T>(2, 70, 4, 1, 40, seed + 2, true);   // bucket 64: several tiles and row blocks, GQA 4
  attention<T>(1, 23, 2, 2, 17, seed + 3, false);  // bucket 64, odd d (zero-padded pitch)
  attention<T>(1, 37, 2, 1, 80, seed + 4, false);  // bucket 128, a skipped last chunk
  attention<T>(2, 20, 4, 2, 250, seed + 5, false); // bucket 256, GQA 2 with 2 kv heads, b = 2
  // Unmasked blocks (ring attention): fewer keys than queries across tiles, more keys than
  // queries, a single key, every bucket.
  attention<T>(2, 70, 4, 1, 40, seed + 6, true, false, 35);
  attention<T>(1, 23, 2, 2, 17, seed + 7, false, false, 46);
  attention<T>(1, 5, 2, 1, 8, seed + 8, false, false, 1);
  attention<T>(1, 37, 2, 1, 80, seed + 9, false, false, 74);
  attention<T>(2, 20, 4, 2, 250, seed + 10, false, false, 10);
  // Documents kept apart: causal over several tiles and row blocks (GQA 4), odd d; ring blocks
  // whose last rows see no key, more keys than queries, every bucket.
  attention<T>(2, 70, 4, 1, 40, seed + 11, false, false, 0, true);
  attention<T>(1, 23, 2, 2, 17, seed + 12, false, false, 0, true);
  attention<T>(2, 37, 2, 1, 80, seed + 13, false, false, 0, true);
  attention<T>(2, 70, 4, 1, 40, seed + 14, false, false, 35, true);
  attention<T>(1, 23, 2, 2, 17, seed + 15, false, false, 46, true);
  attention<T>(2, 20, 4, 2, 250, seed + 16, false, false, 10, true);
}

// The tensor-core kernels: d = 64 and 128, lengths below, at and past the tiles, GQA 1 / 2 / 4 / 8,
// batch 2.
void all_tc(uint64_t seed) {
  check_tc_geometry();
  for (size_t d : {64, 128}) {
    attention<__nv_bfloat16>(2, 1, 2, 2, d, seed + d + 1, false, true);    // a single row, GQA 1
    attention<__nv_bfloat16>(2, 17, 4, 2, d, seed + d + 2, false, true);   // partial tile, GQA 2
    attention<__nv_bfloat16>(1, 64, 4, 1, d, seed + d + 3, false, true);   // one full tile, GQA 4
    attention<__nv_bfloat16>(2, 100, 4, 1, d, seed + d + 4, true, true);   // GQA 4, partial tiles
    attention<__nv_bfloat16>(2, 130, 2, 1, d, seed + d + 5, false, true);  // 3 row blocks, GQA 2
    attention<__nv_bfloat16>(1, 70, 8, 1, d, seed + d + 6, false, true);   // GQA 8 (the 1B recipes)
    // Unmasked blocks (ring attention): fewer keys than queries across tiles, more keys than
    // queries (partial last key tile), a single key, as many keys as queries, GQA 1 / 2 / 8.
    attention<__nv_bfloat16>(2, 100, 4, 1, d, seed + d + 7, false, true, 37);
    attention<__nv_bfloat16>(1, 30, 2, 2, d, seed + d + 8, false, true, 97);
    attention<__nv_bfloat16>(2, 17, 4, 2, d, seed + d + 9, false, true, 1);
    attention<__nv_bfloat16>(1, 64, 8, 1, d, seed + d + 10, false, true, 64);
    // A causal launch with other than s keys traps.
    const size_t n = 2 * 8 * 2 * d;
    Buffer<__nv_bfloat16> x(n, "x"), o(n, "o");
    Buffer<float> l(2 * 2 * 8, "l");
    expect_fault(format("attn_tc_fwd_d%zu_bf16 causal with sk != s", d),
                 grid(blocks(2 * 2, 8, TC_ROWS), THREADS, tc_geometry(d).fwd), [&] {
                   (d == 64 ? attn_tc_fwd_d64_bf16 : attn_tc_fwd_d128_bf16)(
                       x.data(), x.data(), x.data(), o.data(), l.data(), 2, 8, 2, 2, (int)d, 4, 1, nullptr,
                       1.0f);
                 });
    // So does a launch with a document floor (the launchers run those on attention.cu's kernels).
    Buffer<unsigned> f(2 * 8, "f");
    expect_fault(format("attn_tc_fwd_d%zu_bf16 with a document floor", d),
                 grid(blocks(2 * 2, 8, TC_ROWS), THREADS, tc_geometry(d).fwd), [&] {
                   (d == 64 ? attn_tc_fwd_d64_bf16 : attn_tc_fwd_d128_bf16)(
                       x.data(), x.data(), x.data(), o.data(), l.data(), 2, 8, 2, 2, (int)d, 8, 1, f.data(),
                       1.0f);
                 });
  }
}

}  // namespace

void attention_checks() {
  check_geometry_table();
  all<float>(10);
  all<double>(20);
  all<__nv_bfloat16>(30);
  all_tc(40);
}
