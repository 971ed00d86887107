//! Launch geometry of the tensor-core attention kernels (`kernels/attention_tc.cu`, module
//! [`Module::AttentionTc`]): `nvcuda::wmma` bf16 variants of `attn_fwd`, `attn_bwd_dq` and
//! `attn_bwd_dkv` for bf16 storage with head dim 64 or 128, with the same parameter lists,
//! outputs and determinism. [`super::attention`] picks them through [`TcGeometry::new`] and
//! launches them like the generic kernels (the backward's `attn_bwd_delta` is shared).
//!
//! Blocks of [`THREADS`] threads own [`ROWS`] query rows (forward, dQ) or keys (dK/dV); the
//! dynamic shared memory mirrors `TcCfg<D>` in the `.cu` file (at most 46,368 bytes, under the
//! 48 KiB default limit). The kernels trap on another block size, less shared memory, or a head
//! dim other than their `D`.

use candle_core::cuda::cudarc::driver::{CudaFunction, LaunchConfig};
use candle_core::cuda::CudaDevice;
use candle_core::{DType, Result};

use super::{grid, load, Module};

/// Threads per block (`TcCfg::THREADS`, 4 warps).
pub(super) const THREADS: u32 = 128;

/// Query rows (forward, dQ) or keys (dK/dV) per block (`TcCfg::BM`).
pub(super) const ROWS: usize = 64;

/// Which kernel of the module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    /// `attn_tc_fwd_d<D>_bf16`: blocks over `b·hq` and query tiles.
    Fwd,
    /// `attn_tc_dq_d<D>_bf16`: blocks over `b·hq` and query tiles.
    Dq,
    /// `attn_tc_dkv_d<D>_bf16`: blocks over `b·hq` and key tiles (GQA shares reduced after it).
    Dkv,
}

/// Shared memory of the three kernels for one head dim; must match `TcCfg<D>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct TcGeometry {
    /// Head dim: 64 or 128.
    d: usize,
    fwd_smem: u32,
    dq_smem: u32,
    dkv_smem: u32,
}

impl TcGeometry {
    /// The geometry for storage `dtype` and head dim `d`, or `None` where the tensor-core kernels
    /// do not apply (then the generic kernels of `attention.cu` run).
    pub(super) fn new(dtype: DType, d: usize) -> Option<Self> {
        if dtype != DType::BF16 || !(d == 64 || d == 128) {
            return None;
        }
        let ldh = d + 8; // bf16 [rows, d] tile pitch
        let fkt = if d == 64 { 64 } else { 32 }; // keys per forward tile
        let bt = 32; // keys (dQ) or queries (dK/dV) per backward tile
        let align = 32; // slack for aligning the shared memory to 32 bytes
        let smem = |x: usize| x as u32;
        Some(Self {
            d,
            fwd_smem: smem(align + 2 * fkt * ldh * 2 + ROWS * (fkt + 4) * 4 + ROWS * (fkt + 8) * 2),
            dq_smem: smem(align + 2 * bt * ldh * 2 + 2 * ROWS * (bt + 4) * 4 + ROWS * (bt + 8) * 2),
            dkv_smem: smem(
                align
                    + 2 * bt * ldh * 2
                    + 2 * bt * 4
                    + 2 * ROWS * (bt + 4) * 4
                    + 2 * ROWS * (bt + 8) * 2,
            ),
        })
    }

    /// The kernel of `step` and its launch shape for `blocks` blocks (`units · ceil(s / ROWS)`).
    pub(super) fn kernel(
        &self,
        dev: &CudaDevice,
        step: Step,
        blocks: usize,
    ) -> Result<(CudaFunction, LaunchConfig)> {
        let (base, smem) = match step {
            Step::Fwd => ("attn_tc_fwd", self.fwd_smem),
            Step::Dq => ("attn_tc_dq", self.dq_smem),
            Step::Dkv => ("attn_tc_dkv", self.dkv_smem),
        };
        let f = load(
            dev,
            Module::AttentionTc,
            &format!("{base}_d{}_bf16", self.d),
        )?;
        Ok((f, grid(blocks, THREADS, smem)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shared memory of `TcCfg<D>` in attention_tc.cu (the emulation harness checks the
    /// same numbers against the kernel file).
    #[test]
    fn tc_geometry_matches_kernels() {
        for (d, fwd, dq, dkv) in [(64, 45088, 32800, 38176), (128, 31776, 40992, 46368)] {
            let g = TcGeometry::new(DType::BF16, d).unwrap();
            assert_eq!((g.fwd_smem, g.dq_smem, g.dkv_smem), (fwd, dq, dkv), "d {d}");
            assert!(fwd.max(dq).max(dkv) <= 48 * 1024);
        }
        assert!(TcGeometry::new(DType::BF16, 80).is_none());
        assert!(TcGeometry::new(DType::F32, 64).is_none());
        assert!(TcGeometry::new(DType::F64, 128).is_none());
    }
}
