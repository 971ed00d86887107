//! A ragged cuDNN attention call's device side (`cudnn.rs` runs it): the batch's length and
//! offset tables uploaded for the graph, and the log-sum-exp statistics moved between cuDNN's
//! token-major `[b, s, hq]` of a ragged call and the `[b, hq, s]` of every other.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use candle_core::cuda::{CudaDevice, CudaStorage};
use candle_core::{Layout, Result};

use super::alloc;
use crate::ops::attention::Dims;
use crate::ops::sdpa_ragged::Documents;

/// A ragged call's tables on the device (`sdpa_ragged.rs`).
pub(super) struct Tables {
    batch: i64,
    seq_len: CudaSlice<i32>, // [batch]
    offsets: CudaSlice<i64>, // [3, offset_row(batch)]
}

impl Tables {
    pub(super) fn upload(
        dev: &CudaDevice,
        docs: Option<&Documents>,
        dm: Dims,
    ) -> Result<Option<Self>> {
        let Some(docs) = docs else { return Ok(None) };
        let t = docs.tables(dm.hq, dm.hkv, dm.d);
        Ok(Some(Self {
            batch: docs.batch() as i64,
            seq_len: dev.clone_htod(&t.seq_len)?,
            offsets: dev.clone_htod(&t.offsets)?,
        }))
    }
}

/// Runs `f` with the shim's view of `tables`: the graph's batch and the device pointers of the
/// lengths and offsets, or `(0, null, null)` for a plain call.
pub(super) fn with_tables<R>(
    tables: &Option<Tables>,
    stream: &CudaStream,
    f: impl FnOnce(i64, *const i32, *const i64) -> R,
) -> R {
    match tables {
        Some(t) => {
            let (sp, _s) = t.seq_len.device_ptr(stream);
            let (op, _o) = t.offsets.device_ptr(stream);
            f(t.batch, sp as *const i32, op as *const i64)
        }
        None => f(0, std::ptr::null(), std::ptr::null()),
    }
}

/// `src` f32 `[a, m, n]` (its storage and layout) copied contiguous as `[a, n, m]`: the
/// statistics between cuDNN's token-major `[b, s, hq]` of a ragged call and the `[b, hq, s]` of
/// every other.
pub(super) fn swap_last((storage, layout): (&CudaStorage, &Layout)) -> Result<CudaStorage> {
    let dev = storage.device();
    // SAFETY: the copy below writes every element.
    let dst = unsafe { alloc::<f32>(dev, layout.shape().elem_count()) }?;
    let mut dst = CudaStorage::wrap_cuda_slice(dst, dev.clone());
    storage.copy_strided_src(&mut dst, 0, &layout.transpose(1, 2)?)?;
    Ok(dst)
}
