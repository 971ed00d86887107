//! FP8 rounding: a tensor's values as an FP8 GEMM sees them, with scales by block.
//!
//! An FP8 operand is `codes = fp8(x · s)` with one scale `s` per block of elements, and the GEMM
//! multiplies `codes / s`. [`fp8_round`] returns that value, `fp8(x · s) / s`, in `x`'s dtype:
//! the operand's exact value (an FP8 value times a power of two fits f32 and bf16 alike), which
//! a bf16 or f32 GEMM then multiplies. This is the emulated FP8 path: the numerics of FP8
//! training (rounding, saturation, the scales) without FP8's speed.
//!
//! Conventions, shared by the CPU code and `kernels/fp8.cu`:
//! - formats as NVIDIA's GPUs store them: E4M3 (max 448, no infinities) and E5M2 (max 57344);
//!   round to nearest even, saturating to the largest finite value (`SATFINITE`); NaN stays NaN.
//!   The CPU converts with the `float8` crate, the GPU with `cuda_fp8.h`;
//! - the tensor is read as `[rows, cols]` (`cols` its last dimension) and cut into blocks
//!   ([`Fp8Blocks`]): the whole tensor (tensorwise current scaling), 1 × 128 (a row's 128
//!   features: activations and gradients along their contraction), 128 × 1 (128 rows of one
//!   column: the transposed operands of the weight gradient) or 128 × 128 (weights);
//! - each block's scale is the largest power of two `s` with `amax · s ≤ max` ([`fp8_scale`]),
//!   `amax` the block's largest magnitude (NaN ignored); 1 for a block of zeros or with an
//!   infinity. A power of two makes `x · s` and `code / s` exact, so the CPU and the GPU agree
//!   bit for bit.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;

mod gemm;
mod operand;
mod packing;

pub use gemm::{
    fp8_add_product_into, fp8_linear, fp8_linear_dx, fp8_product_factors, LtGemm, LtMatrix, LtOut,
};
pub use operand::{fp8_add_product_of, fp8_linear_dx_of, fp8_linear_of, fp8_product, Fp8Operand};
pub use packing::{LtScale, Packing, Part};

const OP: &str = "fp8_round";

/// Elements per side of a scaling block (DeepSeek-V3's 1 × 128 and 128 × 128).
pub const FP8_BLOCK: usize = 128;

/// An 8-bit float format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// 4 exponent bits, 3 mantissa bits: forward operands.
    E4M3,
    /// 5 exponent bits, 2 mantissa bits: gradients.
    E5M2,
}

impl Fp8Format {
    /// The largest finite value.
    pub fn max(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 448.0,
            Fp8Format::E5M2 => 57344.0,
        }
    }

    /// `x`'s code: nearest even, saturating to ±[`Fp8Format::max`], NaN to NaN.
    pub fn encode(self, x: f32) -> u8 {
        match self {
            Fp8Format::E4M3 => float8::F8E4M3::from_f32(x).to_bits(),
            Fp8Format::E5M2 => float8::F8E5M2::from_f32(x).to_bits(),
        }
    }

    /// The value of `code` (from a table of the `float8` crate's values).
    pub fn decode(self, code: u8) -> f32 {
        static VALUES: std::sync::LazyLock<[[f32; 256]; 2]> = std::sync::LazyLock::new(|| {
            let mut t = [[0f32; 256]; 2];
            for c in 0..=255u8 {
                t[0][c as usize] = float8::F8E4M3::from_bits(c).to_f32();
                t[1][c as usize] = float8::F8E5M2::from_bits(c).to_f32();
            }
            t
        });
        VALUES[self.code() as usize][code as usize]
    }

    /// The number `kernels/fp8.cu` knows the format by.
    pub fn code(self) -> i32 {
        match self {
            Fp8Format::E4M3 => 0,
            Fp8Format::E5M2 => 1,
        }
    }
}

/// Which elements of a tensor read as `[rows, cols]` share one scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8Blocks {
    /// The whole tensor.
    Tensor,
    /// 1 × 128: runs of 128 along a row.
    Rows,
    /// 128 × 1: runs of 128 rows in one column.
    Cols,
    /// 128 × 128 tiles.
    Tiles,
}

impl Fp8Blocks {
    /// A block's `(rows, cols)` in a `[rows, cols]` tensor (edge blocks are cut short).
    pub fn dims(self, rows: usize, cols: usize) -> (usize, usize) {
        match self {
            Fp8Blocks::Tensor => (rows.max(1), cols.max(1)),
            Fp8Blocks::Rows => (1, FP8_BLOCK),
            Fp8Blocks::Cols => (FP8_BLOCK, 1),
            Fp8Blocks::Tiles => (FP8_BLOCK, FP8_BLOCK),
        }
    }
}

/// How [`fp8_round`] rounds: a format and the blocks that share a scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fp8Quant {
    pub format: Fp8Format,
    pub blocks: Fp8Blocks,
}

/// The scale of a block whose largest magnitude is `amax`: the largest power of two `s` with
/// `amax · s ≤ max` (from `max / amax` rounded in f32, its mantissa cleared), within
/// `[2^-126, 2^127]`; 1 when `amax` is zero or not finite.
pub fn fp8_scale(amax: f32, max: f32) -> f32 {
    if !(amax > 0.0 && amax.is_finite()) {
        return 1.0;
    }
    let r = max / amax;
    if r >= 2f32.powi(127) {
        return 2f32.powi(127);
    }
    if r < f32::MIN_POSITIVE {
        return f32::MIN_POSITIVE;
    }
    f32::from_bits(r.to_bits() & 0x7F80_0000)
}

/// `x` rounded to FP8 as `q` says, in `x`'s dtype and shape (see the module's header). Without
/// a graph: the emulated FP8 linears round their operands, and the gradient flows through the
/// rounding unchanged (the straight-through rule of FP8 training).
pub fn fp8_round(x: &Tensor, q: Fp8Quant) -> Result<Tensor> {
    x.contiguous()?.apply_op1_no_bwd(&Fp8Round(q))
}

struct Fp8Round(Fp8Quant);

/// `x`'s `(rows, cols)`: its last dimension and the rest.
fn rows_cols(l: &Layout) -> (usize, usize) {
    let cols = l.dims().last().copied().unwrap_or(1);
    let n = l.shape().elem_count();
    (n.checked_div(cols).unwrap_or(0), cols)
}

/// The CPU rounding of `x` `[rows, cols]` (row-major) in place: each block's amax, then each
/// element.
pub(crate) fn round_cpu(x: &mut [f32], cols: usize, q: Fp8Quant) {
    if x.is_empty() || cols == 0 {
        return;
    }
    let rows = x.len() / cols;
    let (br, bc) = q.blocks.dims(rows, cols);
    let (nbr, nbc) = (rows.div_ceil(br), cols.div_ceil(bc));
    let max = q.format.max();
    // Each band of `br` rows owns its blocks' amaxes.
    let scales: Vec<f32> = x
        .par_chunks(br * cols)
        .flat_map_iter(|band| {
            let mut amax = vec![0f32; nbc];
            for row in band.chunks(cols) {
                for (run, a) in row.chunks(bc).zip(amax.iter_mut()) {
                    // f32::max ignores NaN.
                    *a = run.iter().fold(*a, |a, v| a.max(v.abs()));
                }
            }
            amax.into_iter().map(move |a| fp8_scale(a, max))
        })
        .collect();
    debug_assert_eq!(scales.len(), nbr * nbc);
    x.par_chunks_mut(cols).enumerate().for_each(|(r, row)| {
        let s = &scales[r / br * nbc..(r / br + 1) * nbc];
        for (run, &s) in row.chunks_mut(bc).zip(s) {
            let inv = 1.0 / s;
            for v in run {
                *v = q.format.decode(q.format.encode(*v * s)) * inv;
            }
        }
    });
}

impl CustomOp1 for Fp8Round {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, cols) = rows_cols(l);
        let range = l.start_offset()..l.start_offset() + l.shape().elem_count();
        let out = match s {
            CpuStorage::F32(v) => {
                let mut x = v[range].to_vec();
                round_cpu(&mut x, cols, self.0);
                CpuStorage::F32(x)
            }
            CpuStorage::F64(v) => {
                let mut x: Vec<f32> = v[range].iter().map(|&a| a as f32).collect();
                round_cpu(&mut x, cols, self.0);
                CpuStorage::F64(x.into_iter().map(f64::from).collect())
            }
            CpuStorage::BF16(v) => {
                let mut x: Vec<f32> = v[range].iter().map(|a| a.to_f32()).collect();
                round_cpu(&mut x, cols, self.0);
                CpuStorage::BF16(x.into_iter().map(bf16::from_f32).collect())
            }
            s => bail!("{OP}: unsupported dtype {:?}", s.dtype()),
        };
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, cols) = rows_cols(l);
        let out = super::cuda::fp8::fp8_round(s, l, (rows, cols), self.0)?;
        Ok((out, l.shape().clone()))
    }
}

/// The dtypes [`fp8_round`] takes.
pub fn fp8_dtype_supported(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::BF16)
}

#[cfg(test)]
mod tests;
