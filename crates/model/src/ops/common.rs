//! Shared helpers of the op library: the element trait the CPU kernels are generic over,
//! contiguous-slice access to `CpuStorage`, dtype checks and a `Send` raw pointer for kernels
//! whose rayon tasks write disjoint, strided parts of one output buffer.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Layout, Result, Tensor, WithDType};

/// Element type of the CPU kernels (`f32` and `f64`); half types are computed through `f32`.
pub(crate) trait Float:
    num_traits::Float + WithDType + Send + Sync + std::iter::Sum + 'static
{
}

impl Float for f32 {}
impl Float for f64 {}

/// The contiguous data of `(storage, layout)` as a slice of `T`; errors (naming `op` and the
/// argument `name`) on a dtype mismatch or a non-contiguous layout.
pub(crate) fn slice<'a, T: WithDType>(
    op: &str,
    name: &str,
    storage: &'a CpuStorage,
    layout: &Layout,
) -> Result<&'a [T]> {
    let data = match T::cpu_storage_as_slice(storage) {
        Ok(data) => data,
        Err(_) => bail!(
            "{op}: `{name}` has dtype {:?}, expected {:?}",
            storage.dtype(),
            T::DTYPE
        ),
    };
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => bail!("{op}: `{name}` must be contiguous (layout {layout:?})"),
    }
}

/// The dtype a kernel runs in for a tensor of dtype `dtype`: `f32`/`f64` as is, `bf16`/`f16`
/// through `f32`; any other dtype is an error naming `op` and the argument `name`.
pub(crate) fn compute_dtype(op: &str, name: &str, dtype: DType) -> Result<DType> {
    match dtype {
        DType::F32 | DType::F64 => Ok(dtype),
        DType::BF16 | DType::F16 => Ok(DType::F32),
        _ => bail!("{op}: `{name}` must be a float tensor (f32, f64, bf16, f16), got {dtype:?}"),
    }
}

/// `t` converted to `dtype` (a no-op when it already has it) and made contiguous.
pub(crate) fn prepare(t: &Tensor, dtype: DType) -> Result<Tensor> {
    t.to_dtype(dtype)?.contiguous()
}

/// Errors unless `a` and `b` have the same dtype.
pub(crate) fn same_dtype(op: &str, a: (&str, &Tensor), b: (&str, &Tensor)) -> Result<()> {
    if a.1.dtype() != b.1.dtype() {
        bail!(
            "{op}: dtype mismatch, `{}` is {:?} but `{}` is {:?}",
            a.0,
            a.1.dtype(),
            b.0,
            b.1.dtype()
        )
    }
    Ok(())
}

/// Errors unless `a` and `b` are on the same device.
pub(crate) fn same_device(op: &str, a: (&str, &Tensor), b: (&str, &Tensor)) -> Result<()> {
    if !a.1.device().same_device(b.1.device()) {
        bail!(
            "{op}: device mismatch, `{}` is on {:?} but `{}` is on {:?}",
            a.0,
            a.1.device().location(),
            b.0,
            b.1.device().location()
        )
    }
    Ok(())
}

/// A raw pointer that rayon tasks may share. Each task must write a disjoint set of elements.
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr<T>(pub(crate) *mut T);

// SAFETY: the kernels using `SyncPtr` only write disjoint elements from different tasks and the
// buffer outlives the parallel region.
unsafe impl<T: Send> Send for SyncPtr<T> {}
unsafe impl<T: Send> Sync for SyncPtr<T> {}

impl<T> SyncPtr<T> {
    /// The pointer; a method (not field access) so closures capture the whole `Send` wrapper.
    #[inline]
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

/// Rows per rayon task for row-wise kernels: about 32k elements, at least one row.
pub(crate) fn rows_per_task(row_len: usize) -> usize {
    (32 * 1024 / row_len.max(1)).max(1)
}
