//! `rope`: rotary position embedding (Hugging Face rotate-half convention) on `[b, s, heads, d]`.
//! The backward pass is the same kernel with the inverse rotation (sin negated). The tables are
//! `[s, d / 2]` (every sample at the same positions) or `[b, s, d / 2]` (positions per sample,
//! as when they restart at each document): row `r` of `x`'s `b·s` rows takes table row
//! `r mod (table rows)`.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::common::{
    compute_dtype, kernel_dtype, prepare, rows_per_task, same_device, slice, Float,
};

const OP: &str = "rope";

/// Rotates the two halves of every head vector by the angle of its position:
/// `y1 = x1 cos - x2 sin`, `y2 = x2 cos + x1 sin` (with `-sin` when `inverse`).
struct Rope {
    inverse: bool,
}

impl Rope {
    #[allow(clippy::too_many_arguments)]
    fn fwd<T: Float>(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<CpuStorage> {
        let x = slice::<T>(OP, "x", s1, l1)?; // [b, s, heads, d]
        let cos = slice::<T>(OP, "cos", s2, l2)?; // [s, d / 2] or [b, s, d / 2]
        let sin = slice::<T>(OP, "sin", s3, l3)?;
        let &[_, _, heads, d] = l1.dims() else {
            bail!("{OP}: `x` must be [b, s, heads, d], got {:?}", l1.dims())
        };
        let half = d / 2;
        let row = heads * d; // one position: [heads, d]
        let mut y = vec![T::zero(); x.len()];
        if row == 0 {
            return Ok(T::to_cpu_storage_owned(y));
        }
        let seq = cos.len() / half; // table rows
        let sign = if self.inverse { -T::one() } else { T::one() };
        let rows = rows_per_task(row);
        y.par_chunks_mut(rows * row)
            .zip(x.par_chunks(rows * row))
            .enumerate()
            .for_each(|(task, (y, x))| {
                for (i, (y, x)) in y.chunks_exact_mut(row).zip(x.chunks_exact(row)).enumerate() {
                    let pos = (task * rows + i) % seq;
                    let c = &cos[pos * half..(pos + 1) * half]; // [d / 2]
                    let s = &sin[pos * half..(pos + 1) * half]; // [d / 2]
                    for (y, x) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
                        let (x1, x2) = x.split_at(half);
                        let (y1, y2) = y.split_at_mut(half);
                        for j in 0..half {
                            let sn = s[j] * sign;
                            y1[j] = x1[j] * c[j] - x2[j] * sn;
                            y2[j] = x2[j] * c[j] + x1[j] * sn;
                        }
                    }
                }
            });
        Ok(T::to_cpu_storage_owned(y))
    }
}

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        if self.inverse {
            "rope-bwd"
        } else {
            OP
        }
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
            CpuStorage::F32(_) => self.fwd::<f32>(s1, l1, s2, l2, s3, l3)?,
            CpuStorage::F64(_) => self.fwd::<f64>(s1, l1, s2, l2, s3, l3)?,
            s => bail!("{OP}: unsupported dtype {:?}", s.dtype()),
        };
        Ok((out, l1.shape().clone()))
    }

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
        let out = super::cuda::pointwise::rope(s1, l1, s2, l2, s3, l3, self.inverse)?;
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // The rotation is orthogonal: its transpose is the rotation by the negated angle.
        let grad = grad.contiguous()?;
        let inverse = Rope {
            inverse: !self.inverse,
        };
        let dx = grad.apply_op3_no_bwd(cos, sin, &inverse)?;
        Ok((Some(dx), None, None))
    }
}

/// See [`super::rope`]. `cos`/`sin` are converted to the dtype the kernel runs in for `x` (they get no
/// gradient), so f32 tables can be used with bf16 activations.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let &[_, s, _, d] = x.dims() else {
        bail!("{OP}: `x` must be [b, s, heads, d], got {:?}", x.dims())
    };
    if d % 2 != 0 {
        bail!(
            "{OP}: the head dim of `x` {:?} must be even, got {d}",
            x.dims()
        )
    }
    let b = x.dim(0)?;
    for (name, t) in [("cos", cos), ("sin", sin)] {
        if t.dims() != [s, d / 2] && t.dims() != [b, s, d / 2] {
            bail!(
                "{OP}: `{name}` must be [s, d / 2] = [{s}, {}] or [b, s, d / 2] for `x` {:?}, \
                 got {:?}",
                d / 2,
                x.dims(),
                t.dims()
            )
        }
        same_device(OP, ("x", x), (name, t))?;
        compute_dtype(OP, name, t.dtype())?;
    }
    let dtype = x.dtype();
    let cdt = kernel_dtype(OP, "x", x)?;
    let (cos, sin) = (prepare(&cos.detach(), cdt)?, prepare(&sin.detach(), cdt)?);
    let y = prepare(x, cdt)?.apply_op3(&cos, &sin, Rope { inverse: false })?;
    y.to_dtype(dtype)
}

/// See [`super::rope_bwd`].
pub fn rope_bwd(dy: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let dtype = dy.dtype();
    let cdt = kernel_dtype(OP, "dy", dy)?;
    let (cos, sin) = (prepare(&cos.detach(), cdt)?, prepare(&sin.detach(), cdt)?);
    let inverse = Rope { inverse: true };
    prepare(dy, cdt)?
        .apply_op3_no_bwd(&cos, &sin, &inverse)?
        .to_dtype(dtype)
}
