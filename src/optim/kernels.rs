//! In-place kernels over flat fp32 buffers: gradient accumulation (of a gradient, or of a
//! projection's weight gradient as one GEMM into the buffer), the AdamW update (fp32 master
//! weights, fp32 or bf16 moments, in `adamw.rs`) and the sum of squares for the global gradient norm and the
//! optimizer state's finiteness. Each is a candle op with a CPU version here
//! (rayon) and, with the `cuda` feature, a CUDA version launching the kernels of
//! `model::ops::cuda::flat`. The CUDA AdamW performs the same f32 operations in the same order
//! (bitwise equal results); its sum of squares is a fixed-order f64 reduction, deterministic but
//! summed in a different order than on the CPU.

use candle_core::backend::BackendStorage;
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{
    bail, CpuStorage, CustomOp1, DType, InplaceOp2, InplaceOp3, Layout, Result, Shape, Tensor,
};
use half::bf16;
#[cfg(feature = "cuda")]
use model::ops::cuda::{flat, products};
use model::ops::Fp8Operand;

mod adamw;
pub use adamw::{state_words, AdamWPart, AdamWStep, NonFinite};
use rayon::prelude::*;

/// Elements per parallel chunk of the element-wise kernels.
const CHUNK: usize = 1 << 14;

fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    let CpuStorage::F32(v) = s else {
        bail!("{what}: expected an f32 buffer, got {:?}", s.dtype())
    };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => bail!("{what}: buffer must be contiguous"),
    }
}

/// The f32 elements of a `[rows, cols]` matrix whose rows may lie `ld ≥ cols` apart (see
/// `model::ops::row_strided`), from its first to its last, and `ld`.
fn f32_rows<'a>(
    s: &'a CpuStorage,
    l: &Layout,
    (rows, cols): (usize, usize),
) -> Result<(&'a [f32], usize)> {
    let CpuStorage::F32(v) = s else {
        bail!("add-product: expected f32 factors, got {:?}", s.dtype())
    };
    let Some((range, ld)) = model::ops::row_strided(l).filter(|_| l.dims() == [rows, cols]) else {
        bail!("add-product: g must be [{rows}, {cols}] with rows of unit stride, got {l:?}")
    };
    match v.get(range) {
        Some(g) => Ok((g, ld)),
        None => bail!("add-product: g's rows reach past its buffer ({l:?})"),
    }
}

fn f32_slice_mut<'a>(s: &'a mut CpuStorage, l: &Layout, what: &str) -> Result<&'a mut [f32]> {
    let dtype = s.dtype();
    let CpuStorage::F32(v) = s else {
        bail!("{what}: expected an f32 buffer, got {dtype:?}")
    };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&mut v[a..b]),
        None => bail!("{what}: buffer must be contiguous"),
    }
}

/// `dst += src` where `dst` is an f32 view (e.g. a slice of a gradient buffer) and `src` a
/// contiguous gradient of any float dtype with the same number of elements; with `overwrite`,
/// `dst = src` (a step's first gradient, the old values never read).
struct AddInto {
    overwrite: bool,
}

impl InplaceOp2 for AddInto {
    fn name(&self) -> &'static str {
        "add-into"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dl: &Layout,
        src: &CpuStorage,
        sl: &Layout,
    ) -> Result<()> {
        let dst = f32_slice_mut(dst, dl, "add-into")?;
        let Some((a, b)) = sl.contiguous_offsets() else {
            bail!("add-into: gradient must be contiguous")
        };
        if b - a != dst.len() {
            bail!(
                "add-into: gradient has {} elements, buffer slice {}",
                b - a,
                dst.len()
            );
        }
        fn add<T: Copy + Sync>(
            dst: &mut [f32],
            src: &[T],
            overwrite: bool,
            f: impl Fn(T) -> f32 + Sync,
        ) {
            dst.par_chunks_mut(CHUNK)
                .zip(src.par_chunks(CHUNK))
                .for_each(|(d, s)| match overwrite {
                    true => d.iter_mut().zip(s).for_each(|(d, s)| *d = f(*s)),
                    false => d.iter_mut().zip(s).for_each(|(d, s)| *d += f(*s)),
                });
        }
        let o = self.overwrite;
        match src {
            CpuStorage::F32(v) => add(dst, &v[a..b], o, |x| x),
            CpuStorage::F64(v) => add(dst, &v[a..b], o, |x| x as f32),
            CpuStorage::BF16(v) => add(dst, &v[a..b], o, |x| x.to_f32()),
            CpuStorage::F16(v) => add(dst, &v[a..b], o, |x| x.to_f32()),
            s => bail!("add-into: unsupported gradient dtype {:?}", s.dtype()),
        }
        Ok(())
    }

    /// `src` may be f32, f64 or bf16 on CUDA.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut CudaStorage,
        dl: &Layout,
        src: &CudaStorage,
        sl: &Layout,
    ) -> Result<()> {
        flat::add_into(dst, dl, src, sl, self.overwrite)
    }
}

/// `dst ← src` rounded to `dst`'s dtype (nearest even), in place: `dst` the parameters' flat
/// tensor (f32, f64 or bf16), `src` the f32 master weights of the same length. One pass where a
/// cast and a copy made two.
struct CastInto;

impl InplaceOp2 for CastInto {
    fn name(&self) -> &'static str {
        "cast-into"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dl: &Layout,
        src: &CpuStorage,
        sl: &Layout,
    ) -> Result<()> {
        let src = f32_slice(src, sl, "cast-into")?;
        let Some((a, b)) = dl.contiguous_offsets() else {
            bail!("cast-into: the destination must be contiguous")
        };
        if b - a != src.len() {
            bail!("cast-into: {} values into {} elements", src.len(), b - a)
        }
        fn each<T: Send>(dst: &mut [T], src: &[f32], f: impl Fn(f32) -> T + Sync) {
            dst.par_chunks_mut(CHUNK)
                .zip(src.par_chunks(CHUNK))
                .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, &s)| *d = f(s)));
        }
        match dst {
            CpuStorage::F32(v) => v[a..b].copy_from_slice(src),
            CpuStorage::F64(v) => each(&mut v[a..b], src, f64::from),
            CpuStorage::BF16(v) => each(&mut v[a..b], src, bf16::from_f32),
            other => bail!("cast-into: no cast to {:?}", other.dtype()),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut CudaStorage,
        dl: &Layout,
        src: &CudaStorage,
        sl: &Layout,
    ) -> Result<()> {
        flat::cast_into(dst, dl, src, sl)
    }
}

/// Writes the f32 `src` into `dst` (same length) rounded to `dst`'s dtype, in place.
pub fn cast_into(dst: &Tensor, src: &Tensor) -> Result<()> {
    if src.dtype() != DType::F32 || src.elem_count() != dst.elem_count() {
        bail!(
            "cast-into: {:?} {:?} into {:?} {:?}",
            src.dims(),
            src.dtype(),
            dst.dims(),
            dst.dtype()
        )
    }
    dst.inplace_op2(&src.contiguous()?, &CastInto)
}

/// Adds `grad` (any float dtype, same element count) into the f32 view `dst`.
pub fn add_into(dst: &Tensor, grad: &Tensor) -> Result<()> {
    dst.inplace_op2(&grad.contiguous()?, &AddInto { overwrite: false })
}

/// Writes `grad` (any float dtype, same element count) into the f32 view `dst` as f32, over
/// its old values: [`add_into`] onto zeros, without zeroing first.
pub fn write_into(dst: &Tensor, grad: &Tensor) -> Result<()> {
    dst.inplace_op2(&grad.contiguous()?, &AddInto { overwrite: true })
}

/// `dst += gᵀ · x` for an f32 view `dst` holding a weight gradient `[out, in]` (row-major), the
/// upstream gradient `g` `[rows, out]` and the input `x` `[rows, in]` (both contiguous, same
/// dtype): Megatron's gradient-accumulation fusion, one GEMM reading and writing the buffer with
/// no `[out, in]` temporary. CPU: f32 factors through the `gemm` crate; CUDA: f32 or bf16 factors
/// through cuBLAS (`cublasGemmEx`, f32 accumulation and output, beta = 1). With `overwrite`,
/// `dst = gᵀ · x` instead (beta = 0: the old values never read).
struct AddProduct {
    rows: usize,
    out: usize,
    inp: usize,
    overwrite: bool,
}

impl InplaceOp3 for AddProduct {
    fn name(&self) -> &'static str {
        "add-product"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dl: &Layout,
        g: &CpuStorage,
        gl: &Layout,
        x: &CpuStorage,
        xl: &Layout,
    ) -> Result<()> {
        let dst = f32_slice_mut(dst, dl, "add-product")?;
        let (rows, out, inp) = (self.rows, self.out, self.inp);
        let (g, ld) = f32_rows(g, gl, (rows, out))?; // [rows, out], rows `ld` apart
        let x = f32_slice(x, xl, "add-product")?; // [rows, in]
        if dst.len() != out * inp || x.len() != rows * inp {
            bail!(
                "add-product: buffer of {} for [{out}, {inp}] from x of {} ({rows} rows)",
                dst.len(),
                x.len()
            )
        }
        if rows == 0 || dst.is_empty() {
            if self.overwrite {
                dst.fill(0.0); // an empty sum
            }
            return Ok(());
        }
        // SAFETY: the strides address dst [out, in] row-major, gᵀ as (o, r) = g[r·ld + o] and
        // x as (r, i) = x[r·in + i], all within the slices (lengths checked above and by
        // `f32_rows`); `dst` is borrowed mutably and overlaps neither input.
        unsafe {
            gemm::gemm(
                out,
                inp,
                rows,
                dst.as_mut_ptr(),
                1,
                inp as isize,
                !self.overwrite, // read dst: accumulate (1.0 · dst + 1.0 · gᵀx), else gᵀx
                g.as_ptr(),
                ld as isize,
                1,
                x.as_ptr(),
                1,
                inp as isize,
                1.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::Rayon(rayon::current_num_threads()),
            )
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut CudaStorage,
        dl: &Layout,
        g: &CudaStorage,
        gl: &Layout,
        x: &CudaStorage,
        xl: &Layout,
    ) -> Result<()> {
        let beta = if self.overwrite { 0.0 } else { 1.0 };
        let dims = (self.rows, self.out, self.inp, beta);
        products::add_product(dst, dl, (g, gl), (x, xl), dims)
    }
}

/// Adds the weight gradient `gᵀ · x` into the f32 view `dst` (`[out, in]` elements): `g`
/// `[rows, out]` and `x` `[rows, in]` of one float dtype. One GEMM into the buffer for f32 on
/// the CPU and f32 or bf16 on CUDA; other dtypes compute the product and add it.
pub fn add_product_into(dst: &Tensor, g: &Tensor, x: &Tensor) -> Result<()> {
    product_into(dst, g, x, false)
}

/// Writes the weight gradient `gᵀ · x` into the f32 view `dst` over its old values, as
/// [`add_product_into`] onto zeros, without zeroing first (beta = 0).
pub fn write_product_into(dst: &Tensor, g: &Tensor, x: &Tensor) -> Result<()> {
    product_into(dst, g, x, true)
}

/// [`add_product_into`], or with `overwrite` [`write_product_into`].
fn product_into(dst: &Tensor, g: &Tensor, x: &Tensor, overwrite: bool) -> Result<()> {
    let ((rows, out), (xrows, inp)) = (g.dims2()?, x.dims2()?);
    if xrows != rows || dst.elem_count() != out * inp || g.dtype() != x.dtype() {
        bail!(
            "add-product: g {:?} {:?} and x {:?} {:?} do not make the {} elements of the buffer slice",
            g.dims(),
            g.dtype(),
            x.dims(),
            x.dtype(),
            dst.elem_count()
        )
    }
    let fused = match g.dtype() {
        DType::F32 => true,
        DType::BF16 => g.device().is_cuda(),
        _ => false,
    };
    if !fused {
        let product = g.contiguous()?.t()?.matmul(x)?;
        let op = AddInto { overwrite };
        return dst.inplace_op2(&product.contiguous()?, &op);
    }
    let op = AddProduct {
        rows,
        out,
        inp,
        overwrite,
    };
    // A range of a wider gradient's columns is read in place, its rows `ld` apart.
    let g = match model::ops::row_strided(g.layout()) {
        Some(_) => g.clone(),
        None => g.contiguous()?,
    };
    dst.inplace_op3(&g, &x.contiguous()?, &op)
}

/// [`add_product_into`] for a linear with FP8 GEMMs (`ParamGrad::Fp8Product`), from the
/// factors' operands: one FP8 GEMM on CUDA (their transposed codes), their rounded values
/// multiplied elsewhere. With `overwrite` the product replaces the old values (the FP8 GEMM
/// adds into the view once it is zeroed).
pub fn add_fp8_product_into(
    dst: &Tensor,
    g: &Fp8Operand,
    x: &Fp8Operand,
    overwrite: bool,
) -> Result<()> {
    match (g.rounded(), x.rounded()) {
        (Some(g), Some(x)) => product_into(dst, g, x, overwrite),
        _ => {
            if overwrite {
                dst.zero_set()?;
            }
            model::ops::fp8_add_product_of(dst, g, x)
        }
    }
}

/// Sum of squares of an f32 buffer whose words hold elements of `elems` (f32, or bf16 two to a
/// word), accumulated in f64 (a scalar f64 tensor).
struct SumSquares {
    elems: DType,
}

impl CustomOp1 for SumSquares {
    fn name(&self) -> &'static str {
        "sum-squares"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let words = f32_slice(s, l, "sum-squares")?;
        // Per-chunk sums in parallel, added in chunk order: rayon's parallel `sum` would combine
        // them in an order that depends on work stealing, so the norm could differ by an ulp from
        // run to run (and with it the clipping factor).
        fn total<T: Copy + Sync>(v: &[T], f: impl Fn(T) -> f64 + Sync) -> f64 {
            let partial: Vec<f64> = v
                .par_chunks(CHUNK)
                .map(|c| c.iter().map(|&x| f(x) * f(x)).sum::<f64>())
                .collect();
            partial.iter().sum()
        }
        let sum = match self.elems {
            DType::F32 => total(words, |x| x as f64),
            DType::BF16 => total(bytemuck::cast_slice::<f32, bf16>(words), |x| x.to_f64()),
            d => bail!("sum-squares: elements of dtype {d:?} (f32 or bf16 are supported)"),
        };
        Ok((CpuStorage::F64(vec![sum]), Shape::from(())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        Ok((flat::sum_squares(s, l, self.elems)?, Shape::from(())))
    }
}

/// `Σ x²` of a contiguous f32 buffer, in f64.
pub fn sum_squares(buf: &Tensor) -> Result<f64> {
    sum_squares_of(buf, DType::F32)
}

/// `Σ x²` of a contiguous f32 buffer whose words hold elements of `elems` (f32, or bf16 two to
/// a word), in f64.
pub fn sum_squares_of(buf: &Tensor, elems: DType) -> Result<f64> {
    sum_squares_tensor(buf, elems)?.to_scalar::<f64>()
}

/// [`sum_squares_of`] left on the buffer's device: a one-element f64 tensor (no host read).
pub fn sum_squares_tensor(buf: &Tensor, elems: DType) -> Result<Tensor> {
    buf.apply_op1_no_bwd(&SumSquares { elems })
}
