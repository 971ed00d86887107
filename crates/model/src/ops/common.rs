//! Shared helpers of the op library: the element trait the CPU kernels are generic over,
//! contiguous-slice access to `CpuStorage`, dtype checks and a `Send` raw pointer for kernels
//! whose rayon tasks write disjoint, strided parts of one output buffer.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Layout, Result, Tensor, WithDType};
use rayon::prelude::*;

/// Element type of the CPU kernels (`f32` and `f64`); half types are computed through `f32`.
pub(crate) trait Float:
    num_traits::Float + WithDType + Send + Sync + std::iter::Sum + 'static
{
    /// `exp(self)`: a vectorisable polynomial for f32 (see [`exp_f32`]), `f64::exp` for f64.
    fn fast_exp(self) -> Self;
}

impl Float for f32 {
    #[inline(always)]
    fn fast_exp(self) -> f32 {
        exp_f32(self)
    }
}

impl Float for f64 {
    #[inline(always)]
    fn fast_exp(self) -> f64 {
        self.exp()
    }
}

/// Branch-free `exp` for f32 (Cephes `expf` scheme, relative error about 2e-7) that the compiler
/// can vectorise: `x = n ln2 + r`, `exp(r)` by a degree-6 polynomial on `|r| <= ln2 / 2`, `2^n`
/// built in the exponent bits. Inputs below -87 give 0, inputs above 88 give `exp(88)`; NaN stays
/// NaN.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let xc = if x > 88.0 { 88.0 } else { x };
    let xc = if xc < -87.0 { -87.0 } else { xc };
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND; // round(xc / ln2), in [-126, 127]
    let r = xc - n * LN2_HI - n * LN2_LO;
    let p = 1.987_569_1e-4_f32;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let er = p * r * r + r + 1.0;
    // The low mantissa bits of `t` hold `n`; 2^n has biased exponent n + 127.
    let n_bits = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let scale = f32::from_bits((n_bits.wrapping_add(127) << 23) as u32);
    if x < -87.0 {
        0.0
    } else {
        er * scale
    }
}

/// Runs `f` compiled for the widest SIMD level the CPU has (AVX-512 or AVX2 + FMA on x86-64,
/// detected at run time by `pulp`; the build's baseline elsewhere), so that the element-wise and
/// reduction loops inlined into it vectorise at that width instead of the baseline's 4 lanes.
/// Results do not depend on the level: every operation stays an IEEE operation in the same
/// order (sums keep their [`LANES`] accumulators, and Rust never contracts `a * b + c`).
#[inline(always)]
pub(crate) fn simd<R>(f: impl FnOnce() -> R) -> R {
    pulp::Arch::new().dispatch(f)
}

/// `f(a[i], b[i])` for every element of two slices of one length, in rayon tasks of `chunk`
/// elements, each loop compiled at the widest SIMD level ([`simd`]).
pub(crate) fn zip_map<T: Float>(
    a: &[T],
    b: &[T],
    chunk: usize,
    f: impl Fn(T, T) -> T + Sync,
) -> Vec<T> {
    let mut out = vec![T::zero(); a.len()];
    out.par_chunks_mut(chunk)
        .zip(a.par_chunks(chunk).zip(b.par_chunks(chunk)))
        .for_each(|(o, (a, b))| {
            simd(
                #[inline(always)]
                || {
                    for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
                        *o = f(a, b);
                    }
                },
            )
        });
    out
}

/// Lanes of the independent accumulators of [`sum`], [`max`] and [`dot`]: lets the compiler keep
/// them in SIMD registers (float reductions are not reassociated otherwise).
const LANES: usize = 8;

/// `Σ f(i)` over `0..len` with `LANES` interleaved accumulators.
#[inline(always)]
fn reduce<T: Float>(len: usize, f: impl Fn(usize) -> T) -> T {
    let mut acc = [T::zero(); LANES];
    let full = len / LANES * LANES;
    for base in (0..full).step_by(LANES) {
        for (l, a) in acc.iter_mut().enumerate() {
            *a += f(base + l);
        }
    }
    let mut total = acc.iter().fold(T::zero(), |s, &a| s + a);
    for i in full..len {
        total += f(i);
    }
    total
}

/// `Σ xs`.
#[inline(always)]
pub(crate) fn sum<T: Float>(xs: &[T]) -> T {
    reduce(xs.len(), |i| xs[i])
}

/// `Σ a ∘ b` over the common length.
#[inline(always)]
pub(crate) fn dot<T: Float>(a: &[T], b: &[T]) -> T {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    reduce(n, |i| a[i] * b[i])
}

/// `Σ a ∘ b ∘ c` over the common length.
#[inline(always)]
pub(crate) fn dot3<T: Float>(a: &[T], b: &[T], c: &[T]) -> T {
    let n = a.len().min(b.len()).min(c.len());
    let (a, b, c) = (&a[..n], &b[..n], &c[..n]);
    reduce(n, |i| a[i] * b[i] * c[i])
}

/// `Σ exp(x - shift)` over `xs`.
#[inline(always)]
pub(crate) fn sum_exp<T: Float>(xs: &[T], shift: T) -> T {
    reduce(xs.len(), |i| (xs[i] - shift).fast_exp())
}

/// The largest element (NaNs are skipped); `-inf` for an empty slice.
#[inline(always)]
pub(crate) fn max<T: Float>(xs: &[T]) -> T {
    let mut acc = [T::neg_infinity(); LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = if x > *a { x } else { *a };
        }
    }
    let m = chunks
        .remainder()
        .iter()
        .fold(T::neg_infinity(), |m, &x| if x > m { x } else { m });
    acc.iter().fold(m, |m, &x| if x > m { x } else { m })
}

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

/// The dtype an op runs in for the tensor `t`: on CUDA the kernels read f32, f64 and bf16
/// storage directly (sums in f32 or f64) and f16 goes through f32; on the CPU as
/// [`compute_dtype`].
pub(crate) fn kernel_dtype(op: &str, name: &str, t: &Tensor) -> Result<DType> {
    match (t.device().is_cuda(), t.dtype()) {
        (true, DType::F32 | DType::F64 | DType::BF16) => Ok(t.dtype()),
        _ => compute_dtype(op, name, t.dtype()),
    }
}

/// The CPU storage of a tensor an op holds besides its inputs (`name`, for the error).
pub(crate) fn held_cpu<'a>(
    op: &str,
    name: &str,
    storage: &'a candle_core::Storage,
) -> Result<&'a CpuStorage> {
    match storage {
        candle_core::Storage::Cpu(s) => Ok(s),
        _ => bail!("{op}: `{name}` is not on the cpu, as the op's inputs are"),
    }
}

/// The CUDA storage of a tensor an op holds besides its inputs (`name`, for the error).
#[cfg(feature = "cuda")]
pub(crate) fn held_cuda<'a>(
    op: &str,
    name: &str,
    storage: &'a candle_core::Storage,
) -> Result<&'a candle_core::CudaStorage> {
    match storage {
        candle_core::Storage::Cuda(s) => Ok(s),
        _ => bail!("{op}: `{name}` is not on the CUDA device of the op's inputs"),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `exp_f32` vs f64 `exp` over [-87, 88]: relative error below 4e-7 (about 3 ulp); edge cases.
    #[test]
    fn exp_f32_accuracy() {
        let mut worst = 0f64;
        for i in 0..=1_750_000 {
            let x = -87.0 + i as f32 * 1e-4;
            let want = (x as f64).exp();
            worst = worst.max(((exp_f32(x) as f64) - want).abs() / want);
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(-100.0), 0.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert!(exp_f32(f32::NAN).is_nan());
        assert!(exp_f32(1000.0).is_finite());
    }

    #[test]
    fn reductions() {
        let xs: Vec<f32> = (0..19).map(|i| (i as f32 * 0.37).sin()).collect();
        let naive: f32 = xs.iter().sum();
        assert!((sum(&xs) - naive).abs() < 1e-5);
        assert!((dot(&xs, &xs) - xs.iter().map(|x| x * x).sum::<f32>()).abs() < 1e-5);
        assert_eq!(max(&xs), xs.iter().cloned().fold(f32::MIN, f32::max));
        assert_eq!(max::<f32>(&[]), f32::NEG_INFINITY);
    }
}
