//! `cross_entropy`: per-row softmax cross-entropy of `[n, v]` logits against `[n]` u32 targets,
//! and its backward kernel. The backward recovers each row's log-sum-exp from the forward result
//! (`lse_i = loss_i + logits[i, t_i]`), so nothing is stashed and the logits are read twice in all.
//! On CUDA, bf16 logits are read directly and the op's loss is f32 (the accumulation dtype), so
//! that recovered log-sum-exp keeps full precision; the wrapper converts it to bf16.
//!
//! A target outside `0..v` is an error on the CPU (the targets are in host memory). On CUDA it
//! makes that row's loss and gradient NaN instead: checking would read a flag back after every
//! launch and stall the GPU's queue, the data loader has checked every id against the
//! vocabulary when it opened the data, and a NaN loss stops or skips the step in the trainer.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::common::{kernel_dtype, max, prepare, same_device, simd, slice, sum_exp, Float};

const OP: &str = "cross_entropy";

/// Errors unless every target is a valid class index `< v`.
fn check_targets(targets: &[u32], v: usize) -> Result<()> {
    if let Some((i, &t)) = targets.iter().enumerate().find(|(_, &t)| t as usize >= v) {
        bail!("{OP}: target {t} of row {i} is out of range for {v} classes")
    }
    Ok(())
}

/// Forward: `loss_i = logsumexp(logits[i]) - logits[i, t_i]`.
struct CrossEntropy;

impl CrossEntropy {
    fn fwd<T: Float>(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<CpuStorage> {
        let logits = slice::<T>(OP, "logits", s1, l1)?; // [n, v]
        let targets = slice::<u32>(OP, "targets", s2, l2)?; // [n]
        let v = l1.dims()[1];
        check_targets(targets, v)?;
        let mut loss = vec![T::zero(); targets.len()]; // [n]
        if v == 0 {
            return Ok(T::to_cpu_storage_owned(loss));
        }
        loss.par_iter_mut()
            .zip(logits.par_chunks(v).zip(targets.par_iter()))
            .for_each(|(loss, (row, &t))| {
                simd(
                    #[inline(always)]
                    || {
                        let row_max = max(row);
                        let row_sum = sum_exp(row, row_max);
                        *loss = row_max + row_sum.ln() - row[t as usize];
                    },
                )
            });
        Ok(T::to_cpu_storage_owned(loss))
    }
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = match s1 {
            CpuStorage::F32(_) => self.fwd::<f32>(s1, l1, s2, l2)?,
            CpuStorage::F64(_) => self.fwd::<f64>(s1, l1, s2, l2)?,
            s => bail!("{OP}: unsupported dtype {:?}", s.dtype()),
        };
        Ok((out, l2.shape().clone()))
    }

    /// The loss is in the accumulation dtype (f32 for bf16 logits, see the module docs).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::pointwise::cross_entropy_fwd(s1, l1, s2, l2)?;
        Ok((out, l2.shape().clone()))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        loss: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // [n, 2]: the forward loss and its upstream gradient per row.
        let loss_grad = Tensor::stack(&[loss, &grad.to_dtype(loss.dtype())?], 1)?;
        let dlogits = logits.apply_op3_no_bwd(targets, &loss_grad, &CrossEntropyBwd)?;
        Ok((Some(dlogits), None))
    }
}

/// Backward kernel on `(logits [n, v], targets [n], [loss, grad] [n, 2])`:
/// `dlogits[i] = (softmax(logits[i]) - onehot(t_i)) * grad_i`, with `lse_i = loss_i + logits[i, t_i]`.
struct CrossEntropyBwd;

impl CrossEntropyBwd {
    #[allow(clippy::too_many_arguments)]
    fn bwd<T: Float>(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<CpuStorage> {
        let logits = slice::<T>(OP, "logits", s1, l1)?; // [n, v]
        let targets = slice::<u32>(OP, "targets", s2, l2)?; // [n]
        let loss_grad = slice::<T>(OP, "loss/grad", s3, l3)?; // [n, 2]
        let v = l1.dims()[1];
        check_targets(targets, v)?;
        let mut d = vec![T::zero(); logits.len()]; // [n, v]
        if v == 0 {
            return Ok(T::to_cpu_storage_owned(d));
        }
        d.par_chunks_mut(v)
            .zip(logits.par_chunks(v))
            .zip(targets.par_iter().zip(loss_grad.par_chunks(2)))
            .for_each(|((d, row), (&t, lg))| {
                let t = t as usize;
                let (loss, g) = (lg[0], lg[1]);
                let lse = loss + row[t];
                simd(
                    #[inline(always)]
                    || {
                        for (d, &x) in d.iter_mut().zip(row.iter()) {
                            *d = (x - lse).fast_exp() * g;
                        }
                    },
                );
                d[t] -= g;
            });
        Ok(T::to_cpu_storage_owned(d))
    }
}

impl CustomOp3 for CrossEntropyBwd {
    fn name(&self) -> &'static str {
        "cross_entropy-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = match s1 {
            CpuStorage::F32(_) => self.bwd::<f32>(s1, l1, s2, l2, s3, l3)?,
            CpuStorage::F64(_) => self.bwd::<f64>(s1, l1, s2, l2, s3, l3)?,
            s => bail!("{OP}: unsupported dtype {:?}", s.dtype()),
        };
        Ok((out, l1.shape().clone()))
    }

    /// `loss/grad` is in the accumulation dtype of the logits (see the module docs).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::pointwise::cross_entropy_bwd(s1, l1, s2, l2, s3, l3)?;
        Ok((out, l1.shape().clone()))
    }
}

/// See [`super::cross_entropy`].
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    cross_entropy_acc(logits, targets)?.to_dtype(logits.dtype())
}

/// See [`super::cross_entropy_acc`].
pub fn cross_entropy_acc(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let &[n, v] = logits.dims() else {
        bail!("{OP}: `logits` must be [n, v], got {:?}", logits.dims())
    };
    if targets.dims() != [n] {
        bail!(
            "{OP}: `targets` must be [n] = [{n}] for `logits` {:?}, got {:?}",
            logits.dims(),
            targets.dims()
        )
    }
    if targets.dtype() != DType::U32 {
        bail!("{OP}: `targets` must be u32, got {:?}", targets.dtype())
    }
    if v == 0 && n > 0 {
        bail!("{OP}: `logits` {:?} has no classes", logits.dims())
    }
    same_device(OP, ("logits", logits), ("targets", targets))?;
    let cdt = kernel_dtype(OP, "logits", logits)?;
    prepare(logits, cdt)?.apply_op2(&targets.detach().contiguous()?, CrossEntropy)
}

/// See [`super::cross_entropy_acc_bwd`].
pub fn cross_entropy_acc_bwd(
    logits: &Tensor,
    targets: &Tensor,
    losses: &Tensor,
    dlosses: &Tensor,
) -> Result<Tensor> {
    let cdt = kernel_dtype(OP, "logits", logits)?;
    let targets = targets.detach().contiguous()?;
    match CrossEntropy.bwd(&prepare(logits, cdt)?, &targets, losses, dlosses)? {
        (Some(d), _) => d.to_dtype(logits.dtype()),
        _ => bail!("{OP}: the backward kernel gave no gradient"),
    }
}
