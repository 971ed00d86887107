//! Check 8 of `pretrain selftest`: attention on every backend the device has — the project's
//! kernels, and on CUDA cuDNN's fused attention — in bf16 against the project's kernels in f64
//! on the CPU: causal calls at the 1B recipes' head shapes (32 query and 4 KV heads of 64; 16 and
//! 8 of 128) and at the 7B recipes' (d 128, as many KV heads as query heads, 4096 positions), and
//! unmasked blocks of context-parallel ring attention with twice as many keys as queries (512 and
//! 4096 queries); the forward's output and log-sum-exp, the backward's dq, dk and dv (from the f64
//! reference's output and log-sum-exp, as the ring passes the merged ones); and both with
//! documents kept apart (a document floor: causal calls run on cuDNN as a ragged batch of the
//! documents, ring blocks on the project's kernels), documents from 1 to 400 positions and, at
//! the 7B shape, many short ones (a graph batch of 256), and long ones beside short ones (a
//! ragged backward past `RAGGED_DETERMINISTIC_WORKSPACE`: cuDNN's non-deterministic one). On
//! the CPU the shapes are scaled down and only the project's kernels run (a `cudnn` backend has
//! no CPU kernels).

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use model::{ops, AttentionBackend};

use super::{op_tolerance, randn, rel_error, Check};

/// One attention call: `q` `[b, s, hq, d]`, `k`, `v` `[b, sk, hkv, d]`.
struct Case {
    b: usize,
    s: usize,
    sk: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    causal: bool,
    /// Documents kept apart, of up to this many positions (0: none): see [`Case::floor`].
    documents: usize,
}

impl Case {
    fn name(&self) -> String {
        let mask = if self.causal { "causal" } else { "unmasked" };
        let docs = match self.documents {
            0 => String::new(),
            n => format!(" documents<={n}"),
        };
        format!(
            "attention {mask}{docs} b{} s{} sk{} h{}/{} d{}",
            self.b, self.s, self.sk, self.hq, self.hkv, self.d
        )
    }

    /// With documents: each query row's first key. Causal: documents of 1 to
    /// [`Case::documents`] positions (the `k`-th of row `r` has `1 + (37 k + 101 r) mod n`, the
    /// row's last cut short); unmasked (a ring block): floors rising through the keys and
    /// stopping short of the last, so every row sees a key.
    fn floor(&self) -> Option<Vec<u32>> {
        let n = self.documents;
        if n == 0 {
            return None;
        }
        let mut f = Vec::with_capacity(self.b * self.s);
        for bi in 0..self.b {
            let (mut start, mut k) = (0, 0);
            let mut len = 1 + bi * 101 % n;
            for i in 0..self.s {
                if self.causal {
                    if i >= start + len {
                        (start, k) = (i, k + 1);
                        len = 1 + (k * 37 + bi * 101) % n;
                    }
                    f.push(start as u32);
                } else {
                    f.push(((i * (self.sk - 1)) / self.s) as u32);
                }
            }
        }
        Some(f)
    }
}

fn cases(gpu: bool) -> Vec<Case> {
    let case = |b, s, sk, hq, hkv, d, causal| Case {
        b,
        s,
        sk,
        hq,
        hkv,
        d,
        causal,
        documents: 0,
    };
    let documents = |c: Case, n| Case { documents: n, ..c };
    if gpu {
        vec![
            case(2, 1024, 1024, 32, 4, 64, true),
            case(1, 1024, 1024, 16, 8, 128, true),
            case(1, 512, 1024, 32, 4, 64, false),
            // The 7B recipes' heads (d 128, one query head per KV head) at their 4096 positions.
            case(1, 4096, 4096, 4, 4, 128, true),
            // A context-parallel ring block at production size: 4096 queries after 8192 keys.
            case(1, 4096, 8192, 8, 2, 128, false),
            documents(case(2, 1024, 1024, 32, 4, 64, true), 400),
            // Many short documents at the 7B shape (about 200: a ragged graph of 256 on cuDNN).
            documents(case(1, 4096, 4096, 4, 4, 128, true), 40),
            documents(case(1, 512, 1024, 16, 8, 128, false), 400),
            // Documents of up to 371 positions: a ragged batch of 32 spanning 512, whose
            // deterministic backward would need 512 MiB of workspace (the non-deterministic one
            // runs).
            documents(case(2, 2048, 2048, 32, 4, 64, true), 1024),
        ]
    } else {
        vec![
            case(1, 96, 96, 8, 2, 64, true),
            case(1, 48, 96, 8, 2, 64, false),
            documents(case(2, 96, 96, 8, 2, 64, true), 400),
            documents(case(1, 96, 96, 4, 4, 64, true), 10),
            documents(case(1, 48, 96, 8, 2, 64, false), 400),
        ]
    }
}

/// The inputs of `case` (f64 on the CPU): q, k, v and the output's upstream gradient.
fn inputs(case: &Case) -> Result<[Tensor; 4]> {
    let (q, kv) = (
        [case.b, case.s, case.hq, case.d],
        [case.b, case.sk, case.hkv, case.d],
    );
    Ok([
        randn(&q, 41)?,
        randn(&kv, 42)?,
        randn(&kv, 43)?,
        randn(&q, 44)?,
    ])
}

/// Output, log-sum-exp, dq, dk and dv of `case` on `backend`, the inputs in `dtype` on `device`;
/// the backward reads `merged` (output and log-sum-exp) when given, else the forward's own.
fn run(
    case: &Case,
    backend: AttentionBackend,
    (dtype, device): (DType, &Device),
    merged: Option<(&Tensor, &Tensor)>,
) -> Result<Vec<Tensor>> {
    let [q, k, v, dout] = inputs(case)?.map(|t| t.to_dtype(dtype)?.to_device(device));
    let (q, k, v, dout) = (q?, k?, v?, dout?);
    let kernels = ops::attention_kernels(backend);
    let (fwd, bwd) = (kernels.block, kernels.block_bwd);
    let scale = 1.0 / (case.d as f64).sqrt();
    let floor = case.floor();
    let (out, lse) = fwd(&q, &k, &v, scale, case.causal, floor.as_deref())?;
    let (o, l) = match merged {
        Some((o, l)) => (
            o.to_device(device)?,
            l.to_dtype(lse.dtype())?.to_device(device)?,
        ),
        None => (out.clone(), lse.clone()),
    };
    let (dq, dk, dv) = bwd(
        &q,
        &k,
        &v,
        &o,
        &dout,
        &l,
        scale,
        case.causal,
        floor.as_deref(),
    )?;
    Ok(vec![out, lse, dq, dk, dv])
}

/// Check 8 (see the module docs).
pub fn check_attention(device: &Device) -> Result<Vec<Check>> {
    let mut backends = vec![AttentionBackend::Own];
    if device.is_cuda() {
        crate::device::prepare_attention(AttentionBackend::Cudnn)?;
        backends.push(AttentionBackend::Cudnn);
    }
    let mut checks = Vec::new();
    for case in cases(device.is_cuda()) {
        let reference = run(
            &case,
            AttentionBackend::Own,
            (DType::F64, &Device::Cpu),
            None,
        )?;
        let merged = (&reference[0], &reference[1]);
        for &backend in &backends {
            let dtype = DType::BF16;
            let runs = ops::cudnn_runs();
            let got = run(&case, backend, (dtype, device), Some(merged))?;
            if backend == AttentionBackend::Cudnn {
                // Causal calls and unmasked ones without documents run on cuDNN (forward and
                // backward); a ring block with documents runs the project's kernels.
                let want = if case.causal || case.documents == 0 {
                    2
                } else {
                    0
                };
                let ran = ops::cudnn_runs() - runs;
                checks.push(Check {
                    name: format!("{} ran {ran} of {want} calls on cuDNN", case.name()),
                    error: ran.abs_diff(want) as f64,
                    tolerance: 0.0,
                });
            }
            for (what, (g, r)) in ["output", "lse", "dq", "dk", "dv"]
                .iter()
                .zip(got.iter().zip(&reference))
            {
                checks.push(Check {
                    name: format!("{} {what} {backend} {dtype:?}", case.name()),
                    error: rel_error(g, r)?,
                    tolerance: op_tolerance(dtype),
                });
            }
        }
    }
    Ok(checks)
}
