//! Tensor-parallel layers equal the plain layer: outputs, and the gradients of inputs and weights
//! from the region entries' and exits' gradient functions, on each rank equal the corresponding
//! slices of the single-rank computation differentiated by autograd, for tp = 1, 2 and 4, with
//! and without sequence parallelism. Tolerance 1e-5 (f32, partial sums in another order).

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Result, Tensor, Var, D};
use parallel::comm::local::run_local;
use parallel::tp::{EmbeddingKernels, LossKernels, TensorParallel, TpGroup};
use parallel::{Comm, Group};

/// Deterministic pseudo-random values in [-1, 1).
fn rand(seed: u64, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let v: Vec<f32> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn linear(x: &Tensor, w: &Tensor) -> Tensor {
    x.broadcast_matmul(&w.t().unwrap()).unwrap()
}

fn close(a: &Tensor, b: &Tensor, what: &str) {
    let d = (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(d < 1e-5, "{what}: max difference {d}");
}

fn tp_of(comm: Arc<dyn Comm>, n: usize, sp: bool) -> TensorParallel {
    TensorParallel {
        group: TpGroup {
            comm,
            group: Group::new((0..n).collect()),
        },
        sequence_parallel: sp,
    }
}

const B: usize = 2;
const S: usize = 8;
const H: usize = 8;
const F: usize = 16;

/// The plain column → row block: `y = (x · W1ᵀ) · W2ᵀ`, loss `Σ y · r`; returns (y, dx, dW1, dW2).
fn plain_block() -> (Tensor, Tensor, Tensor, Tensor) {
    let x = Var::from_tensor(&rand(1, &[B, S, H])).unwrap();
    let w1 = Var::from_tensor(&rand(2, &[F, H])).unwrap();
    let w2 = Var::from_tensor(&rand(3, &[H, F])).unwrap();
    let y = linear(&linear(&x, &w1), &w2);
    let g = (&y * rand(4, &[B, S, H]))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let grad = |v: &Var| g.get(v.as_tensor()).unwrap().clone();
    (y, grad(&x), grad(&w1), grad(&w2))
}

/// `Σ_rows x · Wᵀ` contracted over every leading dimension: the weight gradient `gᵀ · x` of
/// `linear(x, W)` for the output gradient `g`.
fn weight_grad(g: &Tensor, x: &Tensor) -> Tensor {
    let (gd, xd) = (g.dim(D::Minus1).unwrap(), x.dim(D::Minus1).unwrap());
    let g = g.reshape(((), gd)).unwrap();
    let x = x.reshape(((), xd)).unwrap();
    g.t().unwrap().matmul(&x).unwrap()
}

#[test]
fn column_then_row_parallel_equals_the_plain_layers() {
    let (y, dx, dw1, dw2) = plain_block();
    for n in [1, 2, 4] {
        for sp in [false, true] {
            run_local(n, Duration::from_secs(30), |rank, comm| -> Result<_> {
                let tp = tp_of(comm, n, sp);
                let f = F / n;
                // With sequence parallelism each rank starts from its share of the tokens.
                let x = tp.token_share(&rand(1, &[B, S, H]))?;
                let w1 = rand(2, &[F, H]).narrow(0, rank * f, f)?; // column shard
                let w2 = rand(3, &[H, F]).narrow(1, rank * f, f)?; // row shard
                let h = tp.enter(&x)?; // [b, s, h]
                let a = linear(&h, &w1); // [b, s, f/tp]
                let out = tp.exit(&linear(&a, &w2))?;
                let r = rand(4, &[B, S, H]);
                let (y_ref, r, dx_ref) = (
                    tp.token_share(&y)?,
                    tp.token_share(&r)?,
                    tp.token_share(&dx)?,
                );
                let what = |t: &str| format!("tp={n} sp={sp} rank {rank}: {t}");
                close(&out, &y_ref, &what("output"));
                // The backward of `Σ out · r`, through the conjugate collectives.
                let dout = tp.exit_grad(&r)?; // [b, s, h]
                let da = dout.broadcast_matmul(&w2)?; // [b, s, f/tp]
                let dh = da.broadcast_matmul(&w1)?; // [b, s, h] partial
                close(&tp.enter_grad(&dh)?, &dx_ref, &what("dx"));
                close(
                    &weight_grad(&da, &h),
                    &dw1.narrow(0, rank * f, f)?,
                    &what("dW column"),
                );
                close(
                    &weight_grad(&dout, &a),
                    &dw2.narrow(1, rank * f, f)?,
                    &what("dW row"),
                );
                Ok(())
            })
            .unwrap();
        }
    }
}

/// The plain row gather and its gradient, as the model's kernels.
const LOOKUP: EmbeddingKernels = EmbeddingKernels {
    lookup: |w, ids| w.embedding(ids),
    lookup_bwd: |g, ids, v, dtype| {
        Tensor::zeros((v, g.dim(1)?), dtype, g.device())?.index_add(ids, &g.to_dtype(dtype)?, 0)
    },
};

#[test]
fn vocab_parallel_embedding_equals_the_plain_lookup() {
    let (v, h) = (16, 6);
    let ids = Tensor::new(&[[0u32, 5, 15, 7], [8, 8, 3, 12]], &Device::Cpu).unwrap();
    let w = Var::from_tensor(&rand(7, &[v, h])).unwrap();
    let e = w
        .embedding(&ids.flatten_all().unwrap())
        .unwrap()
        .reshape((2, 4, h))
        .unwrap();
    let r = rand(8, &[2, 4, h]);
    let dw = (&e * &r)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap()
        .get(w.as_tensor())
        .unwrap()
        .clone();
    for n in [1, 2, 4] {
        for sp in [false, true] {
            run_local(n, Duration::from_secs(30), |rank, comm| -> Result<_> {
                let tp = tp_of(comm, n, sp);
                let rows = v / n;
                let ws = rand(7, &[v, h]).narrow(0, rank * rows, rows)?;
                let (out, saved) = tp.embedding(&ids, &ws, rank * rows, LOOKUP)?;
                let (e_ref, r_ref) = (tp.token_share(&e)?, tp.token_share(&r)?);
                close(&out, &e_ref, "embedding output");
                close(
                    &tp.embedding_bwd(&saved, &r_ref, LOOKUP)?,
                    &dw.narrow(0, rank * rows, rows)?,
                    "embedding dW",
                );
                Ok(())
            })
            .unwrap();
        }
    }
}

#[test]
fn vocab_parallel_cross_entropy_equals_the_plain_loss() {
    let (n_rows, v) = (6, 16);
    let targets = Tensor::new(&[0u32, 15, 4, 9, 9, 12], &Device::Cpu).unwrap();
    let logits = Var::from_tensor(&(rand(9, &[n_rows, v]) * 4.0).unwrap()).unwrap();
    // Plain: log-softmax gathered at the target.
    let lse = logits.exp().unwrap().sum_keepdim(1).unwrap().log().unwrap();
    let picked = logits.gather(&targets.unsqueeze(1).unwrap(), 1).unwrap();
    let loss = (lse - picked).unwrap().squeeze(1).unwrap();
    let r = rand(10, &[n_rows]);
    let dl = (&loss * &r)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap()
        .get(logits.as_tensor())
        .unwrap()
        .clone();
    for n in [1, 2, 4] {
        run_local(n, Duration::from_secs(30), |rank, comm| -> Result<_> {
            let tp = tp_of(comm, n, false);
            let cols = v / n;
            let local = (rand(9, &[n_rows, v]) * 4.0)?.narrow(1, rank * cols, cols)?;
            let (out, saved) = tp.cross_entropy(&local, &targets, rank * cols, PLAIN_LOSS)?;
            close(&out, &loss, "cross-entropy losses");
            close(
                &tp.cross_entropy_bwd(&saved, &targets, &r, PLAIN_LOSS)?,
                &dl.narrow(1, rank * cols, cols)?,
                "cross-entropy dlogits",
            );
            assert_eq!(out.dtype(), DType::F32);
            Ok(())
        })
        .unwrap();
    }
}

/// The plain single-rank loss and its gradient, as the model's fused kernels:
/// `logsumexp(l) − l[target]` and `(softmax − onehot) · dloss`.
const PLAIN_LOSS: LossKernels = LossKernels {
    fwd: |logits, targets| {
        let lse = logits.exp()?.sum_keepdim(1)?.log()?;
        let picked = logits.gather(&targets.unsqueeze(1)?, 1)?;
        (lse - picked)?.squeeze(1)
    },
    bwd: |logits, targets, _losses, dlosses| {
        let e = logits.exp()?;
        let softmax = e.broadcast_div(&e.sum_keepdim(1)?)?;
        let ones = Tensor::ones((logits.dim(0)?, 1), logits.dtype(), logits.device())?;
        let onehot = logits
            .zeros_like()?
            .scatter_add(&targets.unsqueeze(1)?, &ones, 1)?;
        (softmax - onehot)?.broadcast_mul(&dlosses.unsqueeze(1)?)
    },
};

#[test]
fn ids_outside_the_vocabulary_are_errors_not_zeros() {
    run_local(2, Duration::from_secs(30), |rank, comm| -> Result<_> {
        let tp = tp_of(comm.clone(), 2, false);
        let w = rand(11, &[4, 3]); // this rank's 4 of 8 rows
        let ids = Tensor::new(&[[1u32, 8]], &Device::Cpu)?;
        let e = match tp.embedding(&ids, &w, rank * 4, LOOKUP) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("an id outside the vocabulary was looked up"),
        };
        assert!(
            e.contains("token id 8") && e.contains("vocabulary of 8"),
            "{e}"
        );
        let logits = rand(12, &[2, 4]);
        let targets = Tensor::new(&[0u32, 9], &Device::Cpu)?;
        let e = match tp.cross_entropy(&logits, &targets, rank * 4, PLAIN_LOSS) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("a target outside the vocabulary was scored"),
        };
        assert!(e.contains("target 9"), "{e}");
        Ok(())
    })
    .unwrap();
}
