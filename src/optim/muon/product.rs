//! `beta · c + alpha · (a · b)` with one rounding of the result, as `torch.addmm` computes the
//! Newton-Schulz steps of `torch.optim.Muon`: f32 accumulation and f32 scalars whatever the
//! element type. In bf16 the difference matters: separate candle ops round the quintic's
//! coefficients to bf16 (3.4445 becomes 3.4375) and every intermediate sum, which moved the
//! iteration's result 5-8e-2 from the f32 iteration on an H100 where `addmm`'s rounding stays
//! near 1.3e-2 (torch, 96 × 160).
//!
//! CPU: f32 through the `gemm` crate (bf16 widened to f32, the result rounded once); CUDA: one
//! `cublasGemmEx` (`model::ops::cuda::flat::scaled_product`).

use candle_core::backend::BackendStorage;
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{bail, CpuStorage, InplaceOp3, Layout, Result, Tensor};
use half::bf16;
#[cfg(feature = "cuda")]
use model::ops::cuda::flat;

/// `beta · c + alpha · (a · b)` for `a` `[m, k]`, `b` `[k, n]` and `c` `[m, n]` of one dtype
/// (f32 or bf16); a new tensor.
pub fn addmm(c: &Tensor, a: &Tensor, b: &Tensor, beta: f64, alpha: f64) -> Result<Tensor> {
    let ((m, k), (kb, n)) = (a.dims2()?, b.dims2()?);
    if kb != k || c.dims2()? != (m, n) || a.dtype() != c.dtype() || b.dtype() != c.dtype() {
        bail!(
            "addmm: a {:?} {:?}, b {:?} {:?} and c {:?} {:?} do not make one product",
            a.dims(),
            a.dtype(),
            b.dims(),
            b.dtype(),
            c.dims(),
            c.dtype()
        )
    }
    let out = c.copy()?; // [m, n], its own storage
    let op = ScaledProduct {
        mkn: (m, k, n),
        alpha: alpha as f32,
        beta: beta as f32,
    };
    out.inplace_op3(&a.contiguous()?, &b.contiguous()?, &op)?;
    Ok(out)
}

/// `dst ← beta · dst + alpha · a · b` in place over `dst` `[m, n]`.
struct ScaledProduct {
    mkn: (usize, usize, usize),
    alpha: f32,
    beta: f32,
}

/// The contiguous elements of `s` (f32 or bf16) as f32.
fn widened(s: &CpuStorage, l: &Layout) -> Result<Vec<f32>> {
    let Some((a, b)) = l.contiguous_offsets() else {
        bail!("addmm: operands must be contiguous")
    };
    Ok(match s {
        CpuStorage::F32(v) => v[a..b].to_vec(),
        CpuStorage::BF16(v) => v[a..b].iter().map(|x| x.to_f32()).collect(),
        other => bail!("addmm: {:?} operands (f32 or bf16)", other.dtype()),
    })
}

impl InplaceOp3 for ScaledProduct {
    fn name(&self) -> &'static str {
        "addmm"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dl: &Layout,
        a: &CpuStorage,
        al: &Layout,
        b: &CpuStorage,
        bl: &Layout,
    ) -> Result<()> {
        let (m, k, n) = self.mkn;
        let Some((start, end)) = dl.contiguous_offsets() else {
            bail!("addmm: the output must be contiguous")
        };
        let (av, bv) = (widened(a, al)?, widened(b, bl)?); // [m, k], [k, n]
        let mut dv = widened(dst, dl)?; // [m, n]
        if av.len() != m * k || bv.len() != k * n || dv.len() != m * n {
            bail!(
                "addmm: operands of {}, {} and {} elements for [{m}, {k}] x [{k}, {n}]",
                av.len(),
                bv.len(),
                dv.len()
            )
        }
        if m * n > 0 {
            // SAFETY: row-major [m, n], [m, k] and [k, n] views of vectors of exactly those
            // lengths (checked above); `dv` is its own allocation.
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    k,
                    dv.as_mut_ptr(),
                    1,
                    n as isize,
                    true,
                    av.as_ptr(),
                    1,
                    k as isize,
                    bv.as_ptr(),
                    1,
                    n as isize,
                    self.beta,
                    self.alpha,
                    false,
                    false,
                    false,
                    gemm::Parallelism::Rayon(rayon::current_num_threads()),
                )
            }
        }
        match dst {
            CpuStorage::F32(v) => v[start..end].copy_from_slice(&dv),
            CpuStorage::BF16(v) => {
                for (o, x) in v[start..end].iter_mut().zip(&dv) {
                    *o = bf16::from_f32(*x);
                }
            }
            other => bail!("addmm: {:?} output (f32 or bf16)", other.dtype()),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut CudaStorage,
        dl: &Layout,
        a: &CudaStorage,
        al: &Layout,
        b: &CudaStorage,
        bl: &Layout,
    ) -> Result<()> {
        flat::scaled_product(dst, dl, (a, al), (b, bl), self.mkn, (self.alpha, self.beta))
    }
}
