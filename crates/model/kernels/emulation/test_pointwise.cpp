// Emulation driver of kernels/pointwise.cu: runs every exported kernel (rms_norm_fwd,
// rms_norm_bwd + rms_norm_dw, add_rms_norm_fwd and rms_norm_bwd_add against add with the unfused
// kernels, rope forward and inverse, swiglu_fwd, swiglu_bwd, swiglu_joined_fwd and
// swiglu_joined_bwd against them, add,
// cross_entropy_fwd, cross_entropy_bwd, embedding_count + embedding_offsets + embedding_order +
// embedding_bwd) for f32, f64 and bf16 with the launch shapes and argument order of
// src/ops/cuda/pointwise.rs and norm.rs, and compares the results with double-precision references.
#include "shim.h"
// The kernels under test, unchanged.
#include "../pointwise.cu"
#include "harness.h"

using namespace harness;

namespace {

// src/ops/cuda/pointwise.rs: ROW_THREADS and CE_THREADS; src/ops/cuda/norm.rs: RMS_DW_BLOCKS.
constexpr unsigned ROW_THREADS = 256;
constexpr unsigned CE_THREADS = 1024;
constexpr size_t RMS_DW_BLOCKS = 1024;

// ---------------------------------------------------------------------------------------------
// RMSNorm: y = x r w with r = 1 / sqrt(mean(x^2) + eps); backward (upstream g):
// dx_k = r g_k w_k - x_k r^3 / h * sum_j g_j w_j x_j, dw_j = sum_rows g_j x_j r.
// `forward` = false skips the forward kernel (the large-row case only exercises the partials).
template <typename T> void rms_norm(size_t rows, size_t h, bool forward, uint64_t seed) {
  typedef typename Acc<T>::type A;
  const double eps = 1e-5;
  const std::string tag = format("%s rows=%zu h=%zu", type_name<T>(), rows, h);
  Rng rng(seed);
  Buffer<T> x(rows * h, "x"), w(h, "weight"), g(rows * h, "grad");
  fill_normal(x, rng);
  fill_normal(w, rng, 1.0, 0.3);
  fill_normal(g, rng);

  // Launch shape of `rms_norm_bwd` in pointwise.rs: runs of rows_per_block rows per block.
  const size_t rpb = std::max<size_t>((rows + RMS_DW_BLOCKS - 1) / RMS_DW_BLOCKS, 1);
  const size_t blocks = (rows + rpb - 1) / rpb;

  std::vector<double> ry(rows * h), rdx(rows * h), rdw(h, 0.0), rpart(blocks * h, 0.0);
  for (size_t i = 0; i < rows; ++i) {
    double ss = 0, a = 0;
    for (size_t j = 0; j < h; ++j) {
      const double xv = tod(x[i * h + j]);
      ss += xv * xv;
      a += tod(g[i * h + j]) * tod(w[j]) * xv;
    }
    const double r = 1.0 / std::sqrt(ss / (double)h + eps);
    for (size_t j = 0; j < h; ++j) {
      const double xv = tod(x[i * h + j]), gv = tod(g[i * h + j]), wv = tod(w[j]);
      ry[i * h + j] = xv * r * wv;
      rdx[i * h + j] = r * gv * wv - xv * r * r * r * a / (double)h;
      rdw[j] += gv * xv * r;
      rpart[(i / rpb) * h + j] += gv * xv * r;
    }
  }

  if (forward) {
    // norm.rs `rms_norm_fwd`: grid(rows, ROW_THREADS, 0), launched only when rows > 0.
    Buffer<T> y(rows * h, "y");
    if (rows > 0 && !run(format("rms_norm_fwd_%s", type_name<T>()), grid(rows, ROW_THREADS, 0), [&] {
          KERNEL(T, rms_norm_fwd)(x.data(), w.data(), y.data(), (int)rows, (int)h, eps);
        }))
      return;
    compare("rms_norm_fwd " + tag + " y", read(y), ry, tol<T>());
  }

  // norm.rs `rms_norm_bwd`: stage 1 grid(blocks, ROW_THREADS, 0) (only when rows > 0)
  // writes dx into out[0, rows h) and the [blocks, h] partials; stage 2 elementwise(h) sums them
  // into out[rows h, rows h + h).
  Buffer<T> out(rows * h + h, "dx|dweight");
  Buffer<A> partial(blocks * h, "partial");
  if (rows > 0 && !run(format("rms_norm_bwd_%s", type_name<T>()), grid(blocks, ROW_THREADS, 0), [&] {
        KERNEL(T, rms_norm_bwd)(x.data(), w.data(), g.data(), out.data(), partial.data(),
                                (int)rows, (int)h, (int)rpb, eps);
      }))
    return;
  // norm.rs `rms_norm_bwd` stage 2: grid(⌈h / DW_COLS⌉, DW_THREADS, 0).
  const Shape dw_shape = grid((h + DW_COLS - 1) / DW_COLS, DW_THREADS, 0);
  if (!run(format("rms_norm_dw_%s", type_name<T>()), dw_shape, [&] {
        KERNEL(T, rms_norm_dw)(partial.data(), out.data() + rows * h, (int)blocks, (int)h);
      }))
    return;
  const double t = tol<T>();
  if (rows > 0) {
    compare("rms_norm_bwd " + tag + " dx", read(out, 0, rows * h), rdx, t);
    std::vector<double> part(blocks * h);
    for (size_t i = 0; i < blocks * h; ++i) part[i] = partial[i];
    compare(format("rms_norm_bwd %s dweight partials (%zu blocks of %zu rows)", tag.c_str(),
                   blocks, rpb),
            part, rpart, tol<A>());
  }
  compare("rms_norm_dw " + tag + " dweight", read(out, rows * h, h), rdw, t);
}

// ---------------------------------------------------------------------------------------------
// RoPE (rotate-half) on x [b, s, heads, d] with cos, sin [s, d / 2]: y1 = x1 c - x2 s,
// y2 = x2 c + x1 s; the inverse negates s.
template <typename T> void rope(size_t b, size_t s, size_t heads, size_t d, uint64_t seed) {
  const size_t half = d / 2, n = b * s * heads * d, pairs = n / 2;
  Rng rng(seed);
  Buffer<T> x(n, "x"), cs(s * half, "cos"), sn(s * half, "sin");
  fill_normal(x, rng);
  for (size_t p = 0; p < s; ++p)
    for (size_t j = 0; j < half; ++j) {
      const double ang = (double)p * std::pow(10000.0, -2.0 * (double)j / (double)d);
      cs[p * half + j] = fromd<T>(std::cos(ang));
      sn[p * half + j] = fromd<T>(std::sin(ang));
    }
  for (int inverse = 0; inverse < 2; ++inverse) {
    std::vector<double> ref(n);
    for (size_t t = 0; t < b * s * heads; ++t) {
      const size_t pos = (t / heads) % s;
      for (size_t j = 0; j < half; ++j) {
        const double x1 = tod(x[t * d + j]), x2 = tod(x[t * d + half + j]);
        const double c = tod(cs[pos * half + j]);
        const double sv = (inverse ? -1.0 : 1.0) * tod(sn[pos * half + j]);
        ref[t * d + j] = x1 * c - x2 * sv;
        ref[t * d + half + j] = x2 * c + x1 * sv;
      }
    }
    // pointwise.rs `rope`: elementwise(pairs); also a small grid, as the grid-stride loop
    // accepts any 1-D grid.
    const Shape shapes[2] = {elementwise(pairs), grid(3, 64, 0)};
    for (const Shape& sh : shapes) {
      Buffer<T> y(n, "y");
      if (!run(format("rope_%s", type_name<T>()), sh, [&] {
            KERNEL(T, rope)(x.data(), cs.data(), sn.data(), y.data(), (u64)pairs, (int)s,
                            (int)heads, (int)half, inverse);
          }))
        continue;
      compare(format("rope %s %s b=%zu s=%zu heads=%zu d=%zu grid=%ux%u", inverse ? "inverse" : "forward",
                     type_name<T>(), b, s, heads, d, sh.blocks, sh.threads),
              read(y), ref, tol<T>());
    }
    // x one element past a 16-byte boundary: the element-wise path where the aligned run
    // took packs (when half is a multiple of a pack), bit for bit the same outputs.
    Buffer<T> xs(n + 1, "x shifted"), ya(n, "y"), yb(n + 1, "y shifted");
    for (size_t i = 0; i < n; ++i) xs[i + 1] = x[i];
    const bool ok =
        run(format("rope_%s", type_name<T>()), elementwise(pairs), [&] {
          KERNEL(T, rope)(x.data(), cs.data(), sn.data(), ya.data(), (u64)pairs, (int)s,
                          (int)heads, (int)half, inverse);
        }) &&
        run(format("rope_%s", type_name<T>()), elementwise(pairs), [&] {
          KERNEL(T, rope)(xs.data() + 1, cs.data(), sn.data(), yb.data() + 1, (u64)pairs, (int)s,
                          (int)heads, (int)half, inverse);
        });
    if (ok)
      compare(format("rope %s %s d=%zu: packs and elements alike", inverse ? "inverse" : "forward",
                     type_name<T>(), d),
              read(yb, 1, n), read(ya), 0.0);
  }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU: y = g sigmoid(g) u; backward with upstream e: d gate = e u s (1 + g (1 - s)),
// d up = e g s, s = sigmoid(g).
// The launch of the packed element kernels (pointwise.rs `packs`): one thread per 16 bytes.
template <typename T> Shape packed(size_t n) {
  return elementwise((n + 16 / sizeof(T) - 1) / (16 / sizeof(T)));
}

// SwiGLU over the n elements at offset `skip` of its buffers (skip = 1 makes every buffer
// misaligned for 16-byte packs: the element path then covers everything).
template <typename T> void swiglu(size_t n, size_t skip, uint64_t seed) {
  Rng rng(seed);
  Buffer<T> gate(n + skip, "gate"), up(n + skip, "up"), grad(n + skip, "grad");
  fill_normal(gate, rng, 0.0, 3.0);
  fill_normal(up, rng);
  fill_normal(grad, rng);
  std::vector<double> ry(n), rd(2 * n);
  for (size_t i = 0; i < n; ++i) {
    const double g = tod(gate[skip + i]), u = tod(up[skip + i]), e = tod(grad[skip + i]);
    const double s = 1.0 / (1.0 + std::exp(-g));
    ry[i] = g * s * u;
    rd[i] = e * u * s * (1.0 + g * (1.0 - s));
    rd[n + i] = e * g * s;
  }
  // pointwise.rs `swiglu_fwd` / `swiglu_bwd`: packed(n); also a small grid (grid-stride).
  const Shape shapes[2] = {packed<T>(n), grid(2, 96, 0)};
  for (const Shape& sh : shapes) {
    const std::string tag =
        format("%s n=%zu skip=%zu grid=%ux%u", type_name<T>(), n, skip, sh.blocks, sh.threads);
    Buffer<T> y(n + skip, "y"), d(2 * n + skip, "d gate|d up");
    if (run(format("swiglu_fwd_%s", type_name<T>()), sh, [&] {
          KERNEL(T, swiglu_fwd)(gate.data() + skip, up.data() + skip, y.data() + skip, (u64)n);
        }))
      compare("swiglu_fwd " + tag, read(y, skip, n), ry, tol<T>());
    if (run(format("swiglu_bwd_%s", type_name<T>()), sh, [&] {
          KERNEL(T, swiglu_bwd)(gate.data() + skip, up.data() + skip, grad.data() + skip,
                                d.data() + skip, (u64)n);
        }))
      compare("swiglu_bwd " + tag + " [d gate, d up]", read(d, skip, 2 * n), rd, tol<T>());
  }
}

// Joined SwiGLU on gu [rows, 2f] against swiglu_fwd / swiglu_bwd on its two halves, bit for
// bit (pointwise.rs `swiglu_joined_*`: elementwise(rows·f); also a small grid).
template <typename T> void swiglu_joined(size_t rows, size_t f, uint64_t seed) {
  Rng rng(seed);
  const size_t n = rows * f;
  Buffer<T> gu(2 * n, "gate|up"), gate(n, "gate"), up(n, "up"), grad(n, "grad");
  fill_normal(gu, rng, 0.0, 3.0);
  fill_normal(grad, rng);
  for (size_t r = 0; r < rows; ++r)
    for (size_t j = 0; j < f; ++j) {
      gate[r * f + j] = gu[2 * f * r + j];
      up[r * f + j] = gu[2 * f * r + f + j];
    }
  Buffer<T> ry(n, "y"), rd(2 * n, "d gate|d up");
  if (!run(format("swiglu_fwd_%s", type_name<T>()), packed<T>(n), [&] {
        KERNEL(T, swiglu_fwd)(gate.data(), up.data(), ry.data(), (u64)n);
      }))
    return;
  if (!run(format("swiglu_bwd_%s", type_name<T>()), packed<T>(n), [&] {
        KERNEL(T, swiglu_bwd)(gate.data(), up.data(), grad.data(), rd.data(), (u64)n);
      }))
    return;
  std::vector<double> want_y(n), want_d(2 * n);
  for (size_t r = 0; r < rows; ++r)
    for (size_t j = 0; j < f; ++j) {
      want_y[r * f + j] = tod(ry[r * f + j]);
      want_d[2 * f * r + j] = tod(rd[r * f + j]);
      want_d[2 * f * r + f + j] = tod(rd[n + r * f + j]);
    }
  const Shape shapes[2] = {elementwise(n), grid(2, 96, 0)};
  for (const Shape& sh : shapes) {
    const std::string tag =
        format("%s rows=%zu f=%zu grid=%ux%u", type_name<T>(), rows, f, sh.blocks, sh.threads);
    Buffer<T> y(n, "y"), d(2 * n, "d gate|d up");
    if (run(format("swiglu_joined_fwd_%s", type_name<T>()), sh, [&] {
          KERNEL(T, swiglu_joined_fwd)(gu.data(), y.data(), (u64)rows, (u64)f);
        }))
      compare("swiglu_joined_fwd " + tag, read(y, 0, n), want_y, 0.0);
    if (run(format("swiglu_joined_bwd_%s", type_name<T>()), sh, [&] {
          KERNEL(T, swiglu_joined_bwd)(gu.data(), grad.data(), d.data(), (u64)rows, (u64)f);
        }))
      compare("swiglu_joined_bwd " + tag, read(d, 0, 2 * n), want_d, 0.0);
  }
}

// Addition over the n elements at offset `skip`, against the sum of the stored values rounded
// once to T (the kernel must give exactly that on either path).
template <typename T> void add(size_t n, size_t skip, uint64_t seed) {
  Rng rng(seed);
  Buffer<T> a(n + skip, "a"), b(n + skip, "b");
  fill_normal(a, rng);
  fill_normal(b, rng, 0.0, 1e-2);
  std::vector<double> want(n);
  for (size_t i = 0; i < n; ++i)
    want[i] = tod(from_acc<T>(to_acc(a[skip + i]) + to_acc(b[skip + i])));
  const Shape shapes[2] = {packed<T>(n), grid(2, 96, 0)};
  for (const Shape& sh : shapes) {
    const std::string tag =
        format("add %s n=%zu skip=%zu grid=%ux%u", type_name<T>(), n, skip, sh.blocks, sh.threads);
    Buffer<T> out(n + skip, "out");
    if (run(format("add_%s", type_name<T>()), sh, [&] {
          KERNEL(T, add)(a.data() + skip, b.data() + skip, out.data() + skip, (u64)n);
        }))
      compare(tag, read(out, skip, n), want, 0.0);
  }
}

// ---------------------------------------------------------------------------------------------
// The residual addition fused with RMSNorm, forward (add_rms_norm_fwd: s = x + o, y = norm(s))
// and backward (rms_norm_bwd_add: dx = res + the norm's dx), bit for bit the unfused kernels:
// `add` then rms_norm_fwd, rms_norm_bwd then `add`, with the launch shapes of pointwise.rs.
template <typename T> void add_rms_norm(size_t rows, size_t h, uint64_t seed) {
  typedef typename Acc<T>::type A;
  const double eps = 1e-5;
  const std::string tag = format("%s rows=%zu h=%zu", type_name<T>(), rows, h);
  const size_t n = rows * h;
  const int rows_i = (int)rows, h_i = (int)h;
  Rng rng(seed);
  Buffer<T> x(n, "x"), o(n, "o"), w(h, "weight"), g(n, "grad"), res(n, "residual");
  fill_normal(x, rng);
  fill_normal(o, rng);
  fill_normal(w, rng, 1.0, 0.3);
  fill_normal(g, rng);
  fill_normal(res, rng);
  const Shape rows_shape = grid(rows, ROW_THREADS, 0);

  // Unfused: add (as pointwise.rs launches it), then rms_norm_fwd on the sum.
  Buffer<T> s(n, "s"), y(n, "y");
  if (!run(format("add_%s", type_name<T>()), packed<T>(n), [&] {
        KERNEL(T, add)(x.data(), o.data(), s.data(), (u64)n);
      }) ||
      !run(format("rms_norm_fwd_%s", type_name<T>()), rows_shape, [&] {
        KERNEL(T, rms_norm_fwd)(s.data(), w.data(), y.data(), rows_i, h_i, eps);
      }))
    return;
  // Fused: norm.rs `add_rms_norm_fwd` (s and y here the two halves of one buffer).
  Buffer<T> both(2 * n, "s|y");
  if (!run(format("add_rms_norm_fwd_%s", type_name<T>()), rows_shape, [&] {
        KERNEL(T, add_rms_norm_fwd)(x.data(), o.data(), w.data(), both.data(), both.data() + n,
                                    rows_i, h_i, eps);
      }))
    return;
  compare("add_rms_norm_fwd " + tag + " s", read(both, 0, n), read(s), 0.0);
  compare("add_rms_norm_fwd " + tag + " y", read(both, n, n), read(y), 0.0);

  // Backward: rms_norm_bwd's dx then add(res, dx), against rms_norm_bwd_add.
  const size_t rpb = std::max<size_t>((rows + RMS_DW_BLOCKS - 1) / RMS_DW_BLOCKS, 1);
  const size_t blocks = (rows + rpb - 1) / rpb;
  const Shape bwd_shape = grid(blocks, ROW_THREADS, 0);
  Buffer<T> dx(n, "dx"), sum(n, "res + dx"), fused(n, "fused dx");
  Buffer<A> partial(blocks * h, "partial"), fused_partial(blocks * h, "fused partial");
  if (!run(format("rms_norm_bwd_%s", type_name<T>()), bwd_shape, [&] {
        KERNEL(T, rms_norm_bwd)(s.data(), w.data(), g.data(), dx.data(), partial.data(), rows_i,
                                h_i, (int)rpb, eps);
      }) ||
      !run(format("add_%s", type_name<T>()), packed<T>(n), [&] {
        KERNEL(T, add)(res.data(), dx.data(), sum.data(), (u64)n);
      }) ||
      !run(format("rms_norm_bwd_add_%s", type_name<T>()), bwd_shape, [&] {
        KERNEL(T, rms_norm_bwd_add)(s.data(), w.data(), g.data(), res.data(), fused.data(),
                                    fused_partial.data(), rows_i, h_i, (int)rpb, eps);
      }))
    return;
  compare("rms_norm_bwd_add " + tag + " dx", read(fused), read(sum), 0.0);
  std::vector<double> a(blocks * h), b(blocks * h);
  for (size_t i = 0; i < blocks * h; ++i) {
    a[i] = fused_partial[i];
    b[i] = partial[i];
  }
  compare("rms_norm_bwd_add " + tag + " dweight partials", a, b, 0.0);
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy of logits [rows, v] against targets [rows]: loss = logsumexp(row) - row[t];
// backward with upstream e: d = (softmax(row) - onehot(t)) e. `bad` lists rows whose target is
// made out of range (>= v): the kernels must make those rows' outputs NaN (written over a zero
// fill), the other rows being computed as usual.
template <typename T>
void cross_entropy(size_t rows, size_t v, const std::vector<size_t>& bad, uint64_t seed) {
  typedef typename Acc<T>::type A;
  Rng rng(seed);
  Buffer<T> logits(rows * v, "logits");
  Buffer<unsigned> targets(rows, "targets");
  fill_normal(logits, rng, 0.0, 2.0);
  std::vector<bool> is_bad(rows, false);
  for (size_t r = 0; r < rows; ++r) targets[r] = (unsigned)(rng.next() % v);
  for (size_t k = 0; k < bad.size(); ++k) {
    is_bad[bad[k]] = true;
    targets[bad[k]] = (unsigned)(v + 5 * k);  // v, v + 5, ...
  }
  std::vector<double> up(rows);
  for (size_t r = 0; r < rows; ++r) up[r] = (double)(A)rng.normal();  // as stored in loss_grad
  const std::string tag = format("%s rows=%zu v=%zu", type_name<T>(), rows, v);

  // References over the rows with a valid target.
  std::vector<double> rloss, rd;
  for (size_t r = 0; r < rows; ++r) {
    if (is_bad[r]) continue;
    double m = -INFINITY, s = 0;
    for (size_t j = 0; j < v; ++j) m = std::max(m, tod(logits[r * v + j]));
    for (size_t j = 0; j < v; ++j) s += std::exp(tod(logits[r * v + j]) - m);
    const double lse = m + std::log(s);
    rloss.push_back(lse - tod(logits[r * v + targets[r]]));
    for (size_t j = 0; j < v; ++j)
      rd.push_back((std::exp(tod(logits[r * v + j]) - lse) - (j == targets[r] ? 1.0 : 0.0)) * up[r]);
  }
  // pointwise.rs `cross_entropy_fwd`: grid(n, CE_THREADS, 0).
  Buffer<A> loss(rows, "loss");
  for (size_t r = 0; r < rows; ++r) loss[r] = (A)0;
  if (!run(format("cross_entropy_fwd_%s", type_name<T>()), grid(rows, CE_THREADS, 0), [&] {
        KERNEL(T, cross_entropy_fwd)(logits.data(), targets.data(), loss.data(), (int)rows,
                                     (int)v);
      }))
    return;
  std::vector<double> got;
  bool poisoned = true;
  for (size_t r = 0; r < rows; ++r) {
    if (!is_bad[r]) got.push_back(loss[r]);
    else poisoned = poisoned && std::isnan(loss[r]);
  }
  compare("cross_entropy_fwd " + tag + " loss", got, rloss, tol<A>());
  if (!bad.empty()) expect(poisoned, "cross_entropy_fwd " + tag + " makes bad rows NaN");

  // pointwise.rs `cross_entropy_bwd`: grid(n, CE_THREADS, 0); loss_grad [n, 2] in Acc<T> holds
  // the forward losses and the upstream gradients.
  Buffer<A> loss_grad(2 * rows, "loss_grad");
  for (size_t r = 0; r < rows; ++r) {
    loss_grad[2 * r] = is_bad[r] ? (A)0 : loss[r];
    loss_grad[2 * r + 1] = (A)up[r];
  }
  Buffer<T> d(rows * v, "dlogits");
  for (size_t i = 0; i < rows * v; ++i) d[i] = fromd<T>(0.0);
  if (!run(format("cross_entropy_bwd_%s", type_name<T>()), grid(rows, CE_THREADS, 0), [&] {
        KERNEL(T, cross_entropy_bwd)(logits.data(), targets.data(), loss_grad.data(), d.data(),
                                     (int)rows, (int)v);
      }))
    return;
  got.clear();
  poisoned = true;
  for (size_t r = 0; r < rows; ++r)
    for (size_t j = 0; j < v; ++j) {
      if (!is_bad[r]) got.push_back(tod(d[r * v + j]));
      else poisoned = poisoned && std::isnan(tod(d[r * v + j]));
    }
  compare("cross_entropy_bwd " + tag + " dlogits", got, rd, tol<T>());
  if (!bad.empty()) expect(poisoned, "cross_entropy_bwd " + tag + " makes bad rows NaN");
}

// ---------------------------------------------------------------------------------------------
// Embedding backward: dw[id] = Σ_{i : ids[i] = id} grad[i] over a [v, h] table; ids repeat, one
// is out of range (skipped), most rows are unused (zeros, written over a NaN fill).
template <typename T> void embedding(size_t n, size_t v, size_t h, uint64_t seed) {
  Rng rng(seed);
  Buffer<T> grad(n * h, "grad");
  fill_normal(grad, rng);
  Buffer<unsigned> ids(n, "ids");
  for (size_t i = 0; i < n; ++i) ids[i] = (unsigned)(rng.next() % (v / 3 + 1));  // repeats
  ids[n / 2] = (unsigned)(v + 3);                                                  // skipped
  std::vector<double> rdw(v * h, 0.0);
  for (size_t i = 0; i < n; ++i)
    if (ids[i] < v)
      for (size_t j = 0; j < h; ++j) rdw[ids[i] * h + j] += tod(grad[i * h + j]);
  const std::string tag = format("%s n=%zu v=%zu h=%zu", type_name<T>(), n, v, h);
  // pointwise.rs `embedding_bwd`: counts = zeros(v); embedding_count on elementwise(n);
  // embedding_offsets on one block of min(1024, v rounded up to 32) threads; embedding_order on
  // grid(ceil(n / 256), 256, 0); embedding_bwd on grid(v, min(1024, h rounded up to 32), 0).
  Buffer<unsigned> counts(v, "counts"), offsets(v + 1, "offsets"), order(n, "order");
  for (size_t i = 0; i < v; ++i) counts[i] = 0;
  if (!run("embedding_count", elementwise(n),
           [&] { embedding_count(ids.data(), counts.data(), (u64)n, (unsigned)v); }))
    return;
  const unsigned scan = (unsigned)std::min<size_t>(1024, (v + 31) / 32 * 32);
  if (!run("embedding_offsets", grid(1, scan, 0),
           [&] { embedding_offsets(counts.data(), offsets.data(), (unsigned)v); }))
    return;
  if (!run("embedding_order", grid((n + 255) / 256, 256, 0),
           [&] { embedding_order(ids.data(), offsets.data(), order.data(), (u64)n, (unsigned)v); }))
    return;
  // The order is each id's positions, ascending, ids ascending (the skipped id has no slot).
  std::vector<double> want_order, got_order;
  for (unsigned id = 0; id < v; ++id)
    for (size_t i = 0; i < n; ++i)
      if (ids[i] == id) want_order.push_back((double)i);
  for (size_t k = 0; k < want_order.size(); ++k) got_order.push_back((double)order[k]);
  compare("embedding_order " + tag + " order", got_order, want_order, 0.0);
  Buffer<T> dw(v * h, "dw");
  const unsigned threads = (unsigned)std::min<size_t>(1024, (h + 31) / 32 * 32);
  if (!run(format("embedding_bwd_%s", type_name<T>()), grid(v, threads, 0), [&] {
        KERNEL(T, embedding_bwd)(grad.data(), order.data(), offsets.data(), dw.data(), (int)h,
                                 (int)v);
      }))
    return;
  compare("embedding_bwd " + tag + " dw", read(dw), rdw, tol<T>());
}

template <typename T> void all(uint64_t seed) {
  rms_norm<T>(3, 300, true, seed + 1);     // h > ROW_THREADS: strided columns
  rms_norm<T>(5, 64, true, seed + 2);      // h < ROW_THREADS: idle threads
  rms_norm<T>(1025, 4, false, seed + 3);   // > RMS_DW_BLOCKS rows: 2 rows per block, 513 partials
  rms_norm<T>(0, 5, true, seed + 4);       // no rows: dweight = 0 (stage 2 only)
  rms_norm<T>(2100, 70, false, seed + 9); // 700 partials over 8 slices, h not a multiple of 32
  add_rms_norm<T>(3, 300, seed + 10);      // h > ROW_THREADS: strided columns
  add_rms_norm<T>(1030, 36, seed + 11);    // > RMS_DW_BLOCKS rows, a short row
  // Rows wider than the packs a thread keeps in registers (ROW_PACKS · ROW_THREADS packs),
  // whole packs (16-byte loads) and a short last pack (element loads).
  rms_norm<T>(3, 4200, true, seed + 12);
  rms_norm<T>(4, 4203, true, seed + 13);
  add_rms_norm<T>(3, 4200, seed + 14);
  add_rms_norm<T>(2, 4203, seed + 15);
  rms_norm<T>(1030, 2100, false, seed + 16);  // wide rows, 2 a block: partials kept and in memory
  rope<T>(2, 5, 3, 12, seed + 5);
  rope<T>(2, 5, 3, 64, seed + 17);  // half a multiple of every pack: 16-byte loads
  rope<T>(1, 7, 2, 16, seed + 18);
  swiglu<T>(1000, 0, seed + 6);  // whole packs
  swiglu<T>(1003, 0, seed + 14); // whole packs and a tail of 3 (bf16), 3 (f32), 1 (f64)
  swiglu<T>(1000, 1, seed + 15); // misaligned: elements only
  swiglu_joined<T>(7, 33, seed + 18);  // rows of an odd width
  swiglu_joined<T>(3, 400, seed + 19); // f wider than a block's threads
  add<T>(4099, 0, seed + 16);
  add<T>(4099, 1, seed + 17);
  cross_entropy<T>(3, 1500, {}, seed + 7);      // v > CE_THREADS: strided
  cross_entropy<T>(5, 37, {1, 3}, seed + 8);    // v < CE_THREADS, two bad targets
  embedding<T>(50, 37, 300, seed + 10);         // one column pass per id
  embedding<T>(20, 9, 1500, seed + 11);         // h > 1024: two passes
  embedding<T>(700, 2100, 40, seed + 12);       // n > 256: three order blocks; v > 1024: runs of 3
  embedding<T>(600, 5, 33, seed + 13);          // few ids, long runs of positions each
}

}  // namespace

void pointwise_checks() {
  all<float>(100);
  all<double>(200);
  all<__nv_bfloat16>(300);
}
