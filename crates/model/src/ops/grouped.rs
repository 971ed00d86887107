//! Grouped linears: the projections of several experts over their contiguous runs of rows, as
//! one call. Rows `[m, in]` are cut into runs of `counts[e]` rows (in order, a run of 0 rows
//! skipped); run `e` is multiplied by weight `e`. On CUDA each is one
//! `cublasGemmGroupedBatchedEx` for all runs (`cuda/grouped.rs`; f32 and bf16 with widths that
//! keep every run 16-byte aligned, and weights that start so); elsewhere the runs' products, each the GEMM a lone
//! [`super::linear`] makes, run side by side on the thread pool, so on the CPU every run's
//! result is bit for bit the single product's of its rows and a grouped MoE layer equals its
//! expert-by-expert form. On CUDA the grouped kernel sums in its own order (within the GEMM
//! tolerance of `pretrain selftest`).

use candle_core::{bail, Result, Shape, Tensor};
use rayon::prelude::*;

/// Which product of a run: `x · wᵀ` (a forward) or `g · w` (an input gradient).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grouped {
    /// `x [c, in] · w [out, in]ᵀ → [c, out]`.
    Forward,
    /// `g [c, out] · w [out, in] → [c, in]`.
    InputGrad,
}

/// The rows and width of the result of `kind` on rows of `x` with weights `ws`, after checking
/// that the runs cover the rows and every weight has the shape of the first.
fn check(x: &Tensor, counts: &[usize], ws: &[&Tensor], kind: Grouped) -> Result<(usize, usize)> {
    let (m, width) = x.dims2()?;
    if counts.len() != ws.len() {
        bail!(
            "grouped linear: {} runs of rows for {} weights",
            counts.len(),
            ws.len()
        )
    }
    if counts.iter().sum::<usize>() != m {
        bail!("grouped linear: runs of {counts:?} rows for {m} rows")
    }
    let Some(first) = ws.first() else {
        bail!("grouped linear: no weights")
    };
    let (out, inp) = first.dims2()?;
    if ws.iter().any(|w| w.dims() != [out, inp]) {
        bail!("grouped linear: weights of different shapes")
    }
    match kind {
        Grouped::Forward if width == inp => Ok((m, out)),
        Grouped::InputGrad if width == out => Ok((m, inp)),
        _ => bail!("grouped linear: rows of {width} for {kind:?} with weights [{out}, {inp}]"),
    }
}

/// `kind`'s product for every run of rows of `x` (`counts[e]` rows with `ws[e]`), in the rows'
/// order `[m, ·]`.
pub fn grouped_linear(
    x: &Tensor,
    counts: &[usize],
    ws: &[&Tensor],
    kind: Grouped,
) -> Result<Tensor> {
    let (m, width) = check(x, counts, ws, kind)?;
    if m == 0 {
        return Tensor::zeros((0, width), x.dtype(), x.device());
    }
    // Weights may be views at any offset of a packed parameter tensor: the grouped call takes
    // them only where each starts 16 bytes into its buffer's alignment.
    #[cfg(feature = "cuda")]
    let aligned = ws
        .iter()
        .all(|w| (w.layout().start_offset() * w.dtype().size_in_bytes()) % 16 == 0);
    #[cfg(feature = "cuda")]
    if x.device().is_cuda()
        && aligned
        && [width, x.dim(1)?].iter().all(|w| w % 8 == 0)
        && matches!(
            x.dtype(),
            candle_core::DType::F32 | candle_core::DType::BF16
        )
    {
        return super::cuda::grouped::grouped(&x.contiguous()?, counts, ws, kind, width);
    }
    let mut runs = Vec::with_capacity(counts.len());
    let mut start = 0;
    for (&c, &w) in counts.iter().zip(ws) {
        if c > 0 {
            runs.push((x.narrow(0, start, c)?, w));
        }
        start += c;
    }
    let outs: Vec<Tensor> = runs
        .par_iter()
        .map(|(rows, w)| match kind {
            Grouped::Forward => super::linear(rows, w),
            Grouped::InputGrad => {
                super::linear_dx(w, rows, &Shape::from((rows.dim(0)?, w.dim(1)?)))
            }
        })
        .collect::<Result<_>>()?;
    match outs.len() {
        1 => Ok(outs.into_iter().next().expect("one run")),
        _ => Tensor::cat(&outs, 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// Each run's result is the lone product of its rows, bit for bit, empty runs included.
    #[test]
    fn every_run_is_its_own_product() -> Result<()> {
        let dev = Device::Cpu;
        let counts = [5, 0, 17, 1, 9];
        let m: usize = counts.iter().sum();
        for dtype in [DType::F32, DType::BF16, DType::F64] {
            let x = Tensor::randn(0f32, 1.0, (m, 24), &dev)?.to_dtype(dtype)?;
            let g = Tensor::randn(0f32, 1.0, (m, 40), &dev)?.to_dtype(dtype)?;
            let ws: Vec<Tensor> = (0..counts.len())
                .map(|_| Tensor::randn(0f32, 0.1, (40, 24), &dev)?.to_dtype(dtype))
                .collect::<Result<_>>()?;
            let refs: Vec<&Tensor> = ws.iter().collect();
            let y = grouped_linear(&x, &counts, &refs, Grouped::Forward)?;
            let dx = grouped_linear(&g, &counts, &refs, Grouped::InputGrad)?;
            assert_eq!((y.dims(), dx.dims()), (&[m, 40][..], &[m, 24][..]));
            let mut start = 0;
            for (&c, w) in counts.iter().zip(&ws) {
                let one = super::super::linear(&x.narrow(0, start, c)?, w)?;
                let f = |t: &Tensor| t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>();
                assert_eq!(f(&y.narrow(0, start, c)?)?, f(&one)?, "{dtype:?}");
                let shape = Shape::from((c, 24));
                let one = super::super::linear_dx(w, &g.narrow(0, start, c)?, &shape)?;
                assert_eq!(f(&dx.narrow(0, start, c)?)?, f(&one)?, "{dtype:?}");
                start += c;
            }
        }
        let x = Tensor::zeros((3, 24), DType::F32, &dev)?;
        let w = Tensor::zeros((40, 24), DType::F32, &dev)?;
        assert!(grouped_linear(&x, &[2], &[&w], Grouped::Forward).is_err());
        assert!(grouped_linear(&x, &[3], &[&w], Grouped::InputGrad).is_err());
        Ok(())
    }
}
