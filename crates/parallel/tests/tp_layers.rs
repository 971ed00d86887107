//! Tensor-parallel layers equal the plain layer: outputs and the gradients of inputs and weights
//! on each rank equal the corresponding slices of the single-rank computation, for tp = 2 and 4,
//! with and without sequence parallelism. Tolerance 1e-5 (f32, partial sums in another order).

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Result, Tensor, Var};
use parallel::comm::local::run_local;
use parallel::tp::{
    vocab_parallel_cross_entropy, vocab_parallel_embedding, TensorParallel, TpGroup,
};
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

#[test]
fn column_then_row_parallel_equals_the_plain_layers() {
    let (y, dx, dw1, dw2) = plain_block();
    for n in [2, 4] {
        for sp in [false, true] {
            run_local(n, Duration::from_secs(30), |rank, comm| -> Result<_> {
                let tp = tp_of(comm, n, sp);
                let (f, s) = (F / n, S / n);
                // With sequence parallelism each rank starts from its sequence shard.
                let x_in = if sp {
                    rand(1, &[B, S, H]).narrow(1, rank * s, s)?
                } else {
                    rand(1, &[B, S, H])
                };
                let x = Var::from_tensor(&x_in)?;
                let w1 = Var::from_tensor(&rand(2, &[F, H]).narrow(0, rank * f, f)?)?; // column shard
                let w2 = Var::from_tensor(&rand(3, &[H, F]).narrow(1, rank * f, f)?)?; // row shard
                let out = tp.exit(&linear(&linear(&tp.enter(&x)?, &w1), &w2))?;
                let r = rand(4, &[B, S, H]);
                let (y_ref, r, dx_ref) = if sp {
                    (
                        y.narrow(1, rank * s, s)?,
                        r.narrow(1, rank * s, s)?,
                        dx.narrow(1, rank * s, s)?,
                    )
                } else {
                    (y.clone(), r, dx.clone())
                };
                close(&out, &y_ref, &format!("tp={n} sp={sp} rank {rank}: output"));
                let g = (&out * r)?.sum_all()?.backward()?;
                close(
                    g.get(x.as_tensor()).unwrap(),
                    &dx_ref,
                    &format!("tp={n} sp={sp} rank {rank}: dx"),
                );
                close(
                    g.get(w1.as_tensor()).unwrap(),
                    &dw1.narrow(0, rank * f, f)?,
                    "dW column",
                );
                close(
                    g.get(w2.as_tensor()).unwrap(),
                    &dw2.narrow(1, rank * f, f)?,
                    "dW row",
                );
                Ok(())
            })
            .unwrap();
        }
    }
}

#[test]
fn gather_and_scatter_are_conjugate() {
    for n in [2, 4] {
        run_local(n, Duration::from_secs(30), |rank, comm| -> Result<_> {
            let tp = TpGroup {
                comm,
                group: Group::new((0..n).collect()),
            };
            let full = rand(5, &[3, 4 * n]);
            let x = Var::from_tensor(&full)?;
            let local = parallel::tp::ops::scatter_to_tp(&x, &tp, 1)?;
            close(&local, &full.narrow(1, rank * 4, 4)?, "scatter output");
            let back = parallel::tp::ops::gather_from_tp(&local, &tp, 1)?;
            close(&back, &full, "gather output");
            let r = rand(6, &[3, 4 * n]);
            let g = (&back * &r)?.sum_all()?.backward()?;
            // d/dx Σ gather(scatter(x)) · r = r: each rank's chunk comes back through the all-gather.
            close(
                g.get(x.as_tensor()).unwrap(),
                &r,
                "gradient through scatter and gather",
            );
            Ok(())
        })
        .unwrap();
    }
}

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
    for n in [2, 4] {
        for sp in [false, true] {
            run_local(n, Duration::from_secs(30), |rank, comm| -> Result<_> {
                let tp = tp_of(comm, n, sp);
                let rows = v / n;
                let ws = Var::from_tensor(&rand(7, &[v, h]).narrow(0, rank * rows, rows)?)?;
                let out =
                    vocab_parallel_embedding(&ids, &ws, rank * rows, &tp, |w, i| w.embedding(i))?;
                let (e_ref, r_ref) = if sp {
                    let s = 4 / n;
                    (e.narrow(1, rank * s, s)?, r.narrow(1, rank * s, s)?)
                } else {
                    (e.clone(), r.clone())
                };
                close(&out, &e_ref, "embedding output");
                let g = (&out * r_ref)?.sum_all()?.backward()?;
                close(
                    g.get(ws.as_tensor()).unwrap(),
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
    for n in [2, 4] {
        run_local(n, Duration::from_secs(30), |rank, comm| -> Result<_> {
            let tp = TpGroup {
                comm,
                group: Group::new((0..n).collect()),
            };
            let cols = v / n;
            let local =
                Var::from_tensor(&(rand(9, &[n_rows, v]) * 4.0)?.narrow(1, rank * cols, cols)?)?;
            let out = vocab_parallel_cross_entropy(&local, &targets, rank * cols, &tp)?;
            close(&out, &loss, "cross-entropy losses");
            let g = (&out * &r)?.sum_all()?.backward()?;
            close(
                g.get(local.as_tensor()).unwrap(),
                &dl.narrow(1, rank * cols, cols)?,
                "cross-entropy dlogits",
            );
            assert_eq!(out.dtype(), DType::F32);
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn ids_outside_the_vocabulary_are_errors_not_zeros() {
    run_local(2, Duration::from_secs(30), |rank, comm| -> Result<_> {
        let tp = tp_of(comm.clone(), 2, false);
        let w = rand(11, &[4, 3]); // this rank's 4 of 8 rows
        let ids = Tensor::new(&[[1u32, 8]], &Device::Cpu)?;
        let e = vocab_parallel_embedding(&ids, &w, rank * 4, &tp, |w, i| w.embedding(i))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("token id 8") && e.contains("vocabulary of 8"),
            "{e}"
        );
        let logits = rand(12, &[2, 4]);
        let targets = Tensor::new(&[0u32, 9], &Device::Cpu)?;
        let e = vocab_parallel_cross_entropy(&logits, &targets, rank * 4, &tp.group)
            .unwrap_err()
            .to_string();
        assert!(e.contains("target 9"), "{e}");
        Ok(())
    })
    .unwrap();
}
