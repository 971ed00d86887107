//! `embedding`: the rows of a table `[v, h]` for ids `[n]` (u32) → `[n, h]`, as one op whose
//! backward on a GPU is our own deterministic kernel.
//!
//! The forward is the row gather candle's `embedding` does. Its backward, a scatter-add of the
//! `[n, h]` gradient rows into a zeroed `[v, h]` table, is candle's `index_add` on the CPU
//! (sequential, in position order: unchanged results). On CUDA candle launches that as one thread
//! per column looping over every position — two blocks for a 2048-wide table, the rest of the GPU
//! idle; `embedding_bwd` (`kernels/pointwise.cu`) instead marks the ids present and gives each
//! vocabulary row a block that sums its positions in position order, so it fills the GPU and stays
//! bitwise reproducible.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

const OP: &str = "embedding";

/// Rows `ids` of `w`.
struct Embedding;

fn out_shape(lw: &Layout, lids: &Layout) -> Result<Shape> {
    let &[_, h] = lw.dims() else {
        bail!("{OP}: the table must be [v, h], got {:?}", lw.dims())
    };
    Ok(Shape::from((lids.shape().elem_count(), h)))
}

impl CustomOp2 for Embedding {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        sw: &CpuStorage,
        lw: &Layout,
        sids: &CpuStorage,
        lids: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Ok((sw.index_select(sids, lw, lids, 0)?, out_shape(lw, lids)?))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sw: &candle_core::CudaStorage,
        lw: &Layout,
        sids: &candle_core::CudaStorage,
        lids: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((sw.index_select(sids, lw, lids, 0)?, out_shape(lw, lids)?))
    }

    fn bwd(
        &self,
        w: &Tensor,
        ids: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (v, _) = w.dims2()?;
        Ok((Some(embedding_bwd(grad, ids, v, w.dtype())?), None))
    }
}

/// See [`super::embedding_bwd`].
pub fn embedding_bwd(grad: &Tensor, ids: &Tensor, v: usize, dtype: DType) -> Result<Tensor> {
    let (_, h) = grad.dims2()?;
    if grad.device().is_cpu() {
        Tensor::zeros((v, h), dtype, grad.device())?.index_add(ids, &grad.to_dtype(dtype)?, 0)
    } else {
        grad.contiguous()?
            .apply_op2_no_bwd(&ids.contiguous()?, &EmbeddingBwd { v })?
            .to_dtype(dtype)
    }
}

/// The GPU backward: `(grad [n, h], ids [n])` → `dw` `[v, h]`.
struct EmbeddingBwd {
    v: usize,
}

impl CustomOp2 for EmbeddingBwd {
    fn name(&self) -> &'static str {
        "embedding-bwd"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!(
            "{OP}: the CPU backward of a [{}, h] table is candle's index_add",
            self.v
        )
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sg: &candle_core::CudaStorage,
        lg: &Layout,
        sids: &candle_core::CudaStorage,
        lids: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let h = *lg.dims().last().unwrap_or(&0);
        let dw = super::cuda::pointwise::embedding_bwd(sg, lg, sids, lids, self.v)?;
        Ok((dw, Shape::from((self.v, h))))
    }
}

/// See [`super::embedding`].
pub fn embedding(w: &Tensor, ids: &Tensor) -> Result<Tensor> {
    if w.rank() != 2 {
        bail!("{OP}: the table must be [v, h], got {:?}", w.dims());
    }
    if ids.dtype() != DType::U32 {
        bail!("{OP}: ids must be u32, got {:?}", ids.dtype());
    }
    w.contiguous()?
        .apply_op2(&ids.flatten_all()?.contiguous()?, Embedding)
}
