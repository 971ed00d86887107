//! `beta · c + alpha · (a · b)` with one rounding of the result, as `torch.addmm` computes the
//! Newton-Schulz steps of `torch.optim.Muon`: f32 accumulation and f32 scalars whatever the
//! element type. In bf16 the difference matters: separate candle ops round the quintic's
//! coefficients to bf16 (3.4445 becomes 3.4375) and every intermediate sum, which moved the
//! iteration's result 5-8e-2 from the f32 iteration on an H100 where `addmm`'s rounding stays
//! near 1.3e-2 (torch, 96 × 160).
//!
//! CPU: f32 through the `gemm` crate (bf16 widened to f32, the result rounded once); CUDA: one
//! `cublasGemmEx`, or for a batch one `cublasGemmStridedBatchedEx`
//! (`model::ops::cuda::products::scaled_product`).

use candle_core::backend::BackendStorage;
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{bail, CpuStorage, InplaceOp3, Layout, Result, Tensor};
use half::bf16;
#[cfg(feature = "cuda")]
use model::ops::cuda::products;

/// `beta · c + alpha · (a · b)` for `a` `[m, k]`, `b` `[k, n]` and `c` `[m, n]` of one dtype
/// (f32 or bf16), or for a batch of them (`[B, m, k]`, `[B, k, n]`, `[B, m, n]`: one
/// strided-batched GEMM on a GPU, each product as the unbatched one on the CPU); a new tensor.
pub fn addmm(c: &Tensor, a: &Tensor, b: &Tensor, beta: f64, alpha: f64) -> Result<Tensor> {
    let dims = |t: &Tensor| -> Option<(usize, usize, usize)> {
        match *t.dims() {
            [r, c] => Some((1, r, c)),
            [b, r, c] => Some((b, r, c)),
            _ => None,
        }
    };
    let same_rank = a.rank() == b.rank() && b.rank() == c.rank();
    let fits = match (dims(a), dims(b), dims(c)) {
        (Some((ba, m, k)), Some((bb, kb, n)), Some((bc, cm, cn))) if same_rank => {
            (ba == bb && bb == bc && kb == k && (cm, cn) == (m, n)).then_some((ba, (m, k, n)))
        }
        _ => None,
    };
    let Some((batch, mkn)) = fits.filter(|_| a.dtype() == c.dtype() && b.dtype() == c.dtype())
    else {
        bail!(
            "addmm: a {:?} {:?}, b {:?} {:?} and c {:?} {:?} do not make one product",
            a.dims(),
            a.dtype(),
            b.dims(),
            b.dtype(),
            c.dims(),
            c.dtype()
        )
    };
    let out = c.copy()?; // [(B,) m, n], its own storage
    let op = ScaledProduct {
        batch,
        mkn,
        alpha: alpha as f32,
        beta: beta as f32,
    };
    out.inplace_op3(&a.contiguous()?, &b.contiguous()?, &op)?;
    Ok(out)
}

/// `dst ← beta · dst + alpha · a · b` in place over `dst` `[B, m, n]`.
struct ScaledProduct {
    batch: usize,
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
        let ((m, k, n), batch) = (self.mkn, self.batch);
        let Some((start, end)) = dl.contiguous_offsets() else {
            bail!("addmm: the output must be contiguous")
        };
        let (av, bv) = (widened(a, al)?, widened(b, bl)?); // [B, m, k], [B, k, n]
        let mut dv = widened(dst, dl)?; // [B, m, n]
        if av.len() != batch * m * k || bv.len() != batch * k * n || dv.len() != batch * m * n {
            bail!(
                "addmm: operands of {}, {} and {} elements for {batch} × [{m}, {k}] x [{k}, {n}]",
                av.len(),
                bv.len(),
                dv.len()
            )
        }
        for i in (0..batch).filter(|_| m * n > 0) {
            let (a, b) = (&av[i * m * k..], &bv[i * k * n..]);
            let d = &mut dv[i * m * n..(i + 1) * m * n];
            // SAFETY: row-major [m, n], [m, k] and [k, n] views of slices at least that long
            // (checked above); `dv` is its own allocation.
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    k,
                    d.as_mut_ptr(),
                    1,
                    n as isize,
                    true,
                    a.as_ptr(),
                    1,
                    k as isize,
                    b.as_ptr(),
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
        let scale = (self.alpha, self.beta);
        products::scaled_product(dst, dl, (a, al), (b, bl), (self.batch, self.mkn), scale)
    }
}
