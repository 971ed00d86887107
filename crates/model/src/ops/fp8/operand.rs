//! An FP8 GEMM operand made once and read by several GEMMs: a weight by its forward and input
//! gradient in every micro-batch of a step, a norm's rows by the q, k and v (or gate and up)
//! projections. Quantizing is a pass over the operand (its amax, then its codes), so an operand
//! that several GEMMs read is quantized once.
//!
//! An [`Fp8Operand`] is either its rounded values in its own dtype ([`fp8_round`]'s: what the
//! emulated path, and FP8 GEMMs on the CPU, multiply with the model dtype's GEMM) or, on CUDA
//! with FP8 GEMMs, its one-byte codes packed with their inverse scales: the codes as laid out
//! and/or transposed (Hopper reads both operands K-major, [`super::LtGemm`]), each with its
//! scales ([`Packing`]). One amax pass and one cast pass write the parts that share their
//! blocks.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::packing::Packing;
use super::{fp8_round, Fp8Blocks, Fp8Format, Fp8Quant};

/// What an operand holds.
#[derive(Debug, Clone)]
enum Form {
    /// The rounded values `[rows, cols]`, in the operand's dtype.
    Values(Tensor),
    /// The packed codes and scales (u8 `[packing.len]`, CUDA).
    Codes {
        packed: Tensor,
        packing: Box<Packing>,
    },
}

/// A matrix `[rows, cols]` rounded to FP8 for the GEMMs that read it (see the module's header).
#[derive(Debug, Clone)]
pub struct Fp8Operand {
    rows: usize,
    cols: usize,
    format: Fp8Format,
    form: Form,
}

impl Fp8Operand {
    /// `x` read as rows of `cols`, rounded as `q` says: its values (any device, any blocks).
    pub fn values(x: &Tensor, cols: usize, q: Fp8Quant) -> Result<Self> {
        let rows = x.elem_count() / cols.max(1);
        Ok(Fp8Operand {
            rows,
            cols,
            format: q.format,
            form: Form::Values(fp8_round(&x.reshape((rows, cols))?, q)?),
        })
    }

    /// `x` read as rows of `cols`, quantized in `format` for FP8 GEMMs with the blocks given
    /// for its codes as laid out (`plain`) and/or `transposed`: on CUDA the codes and their
    /// inverse scales; elsewhere its rounded values, what those GEMMs multiply (one rounding:
    /// both parts' blocks must then be the same).
    pub fn codes(
        x: &Tensor,
        cols: usize,
        format: Fp8Format,
        (plain, transposed): (Option<Fp8Blocks>, Option<Fp8Blocks>),
    ) -> Result<Self> {
        let rows = x.elem_count() / cols.max(1);
        let x2 = x.reshape((rows, cols))?;
        if !x.device().is_cuda() {
            let blocks = match (plain, transposed) {
                (Some(a), Some(b)) if a != b => {
                    bail!("fp8 codes: rounded values hold one rounding, not {a:?} and {b:?} blocks")
                }
                (Some(a), _) | (None, Some(a)) => a,
                (None, None) => bail!("fp8 codes: neither layout asked for"),
            };
            return Self::values(&x2, cols, Fp8Quant { format, blocks });
        }
        if x.dtype() != candle_core::DType::BF16 {
            bail!(
                "fp8 codes: FP8 GEMMs on CUDA take bf16 operands (their products are bf16), got \
                 {:?}",
                x.dtype()
            )
        }
        let packing = Packing::new((rows, cols), plain, transposed);
        for part in packing.plain.iter().chain(&packing.transposed) {
            part.scale()?; // a layout a GEMM can read
        }
        let op = Quantize { format, packing };
        let packed = x2.contiguous()?.apply_op1_no_bwd(&op)?;
        Ok(Fp8Operand {
            rows,
            cols,
            format,
            form: Form::Codes {
                packed,
                packing: Box::new(packing),
            },
        })
    }

    /// `(rows, cols)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    pub fn format(&self) -> Fp8Format {
        self.format
    }

    /// The rounded values `[rows, cols]`; `None` for codes.
    pub fn rounded(&self) -> Option<&Tensor> {
        match &self.form {
            Form::Values(v) => Some(v),
            Form::Codes { .. } => None,
        }
    }

    /// The packed codes and where their parts lie; `None` for values.
    pub(super) fn packed(&self) -> Option<(&Tensor, Packing)> {
        match &self.form {
            Form::Codes { packed, packing } => Some((packed, **packing)),
            Form::Values(_) => None,
        }
    }

    /// The tensor it holds: the rounded values, or the packed codes.
    pub fn tensor(&self) -> &Tensor {
        match &self.form {
            Form::Values(t) | Form::Codes { packed: t, .. } => t,
        }
    }

    /// The same operand with `f` applied to the tensor it holds (a copy into storage of its
    /// own, say), which must keep its shape.
    pub fn map_tensor<E>(
        self,
        f: impl FnOnce(Tensor) -> std::result::Result<Tensor, E>,
    ) -> std::result::Result<Self, E> {
        let form = match self.form {
            Form::Values(t) => Form::Values(f(t)?),
            Form::Codes { packed, packing } => Form::Codes {
                packed: f(packed)?,
                packing,
            },
        };
        Ok(Fp8Operand { form, ..self })
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match &self.form {
            Form::Values(v) => v.elem_count() * v.dtype().size_in_bytes(),
            Form::Codes { packing, .. } => packing.len,
        }
    }
}

/// `x · wᵀ` in `shape` from FP8 operands `x` `[rows, in]` and `w` `[out, in]`: one FP8 GEMM
/// on codes, or the model dtype's GEMM on rounded values.
pub fn fp8_linear_of(x: &Fp8Operand, w: &Fp8Operand, shape: impl Into<Shape>) -> Result<Tensor> {
    let shape = shape.into();
    let ((rows, inp), (out, w_in)) = (x.dims(), w.dims());
    formats("fp8 linear", [x, w], [Fp8Format::E4M3, Fp8Format::E4M3])?;
    if inp != w_in || shape.elem_count() != rows * out {
        bail!("fp8 linear: x [{rows}, {inp}] · w [{out}, {w_in}]ᵀ does not make shape {shape:?}")
    }
    match (&x.form, &w.form) {
        (Form::Values(xv), Form::Values(wv)) => super::super::linear_to(xv, wv, shape),
        (Form::Codes { .. }, Form::Codes { .. }) => {
            super::gemm::on_cuda_forward(x, w, (rows, out, inp))?.reshape(shape)
        }
        _ => bail!("fp8 linear: one operand as values, the other as codes"),
    }
}

/// `g · w` in `shape` from FP8 operands `w` `[out, in]` and `g` `[rows, out]`.
pub fn fp8_linear_dx_of(w: &Fp8Operand, g: &Fp8Operand, shape: &Shape) -> Result<Tensor> {
    let ((out, inp), (rows, g_out)) = (w.dims(), g.dims());
    formats("fp8 linear dx", [w, g], [Fp8Format::E4M3, Fp8Format::E5M2])?;
    if out != g_out || shape.elem_count() != rows * inp {
        bail!("fp8 linear dx: g [{rows}, {g_out}] · w [{out}, {inp}] does not make {shape:?}")
    }
    match (&w.form, &g.form) {
        (Form::Values(wv), Form::Values(gv)) => super::super::linear_dx(wv, gv, shape),
        (Form::Codes { .. }, Form::Codes { .. }) => {
            super::gemm::on_cuda_input_grad(w, g, (rows, out, inp))?.reshape(shape)
        }
        _ => bail!("fp8 linear dx: one operand as values, the other as codes"),
    }
}

/// The weight gradient `gᵀ · x` `[out, in]` of operands `g` `[rows, out]` (E5M2) and `x`
/// `[rows, in]` (E4M3): the rounded values' product in their dtype, or with codes one FP8 GEMM
/// into f32 zeros.
pub fn fp8_product(g: &Fp8Operand, x: &Fp8Operand) -> Result<Tensor> {
    formats("fp8 product", [g, x], [Fp8Format::E5M2, Fp8Format::E4M3])?;
    match (&g.form, &x.form) {
        (Form::Values(gv), Form::Values(xv)) => gv.t()?.matmul(xv),
        _ => {
            let (out, inp) = (g.cols, x.cols);
            let dst = Tensor::zeros(out * inp, candle_core::DType::F32, x.tensor().device())?;
            fp8_add_product_of(&dst, g, x)?;
            dst.reshape((out, inp))
        }
    }
}

/// `dst += gᵀ · x` as one FP8 GEMM on CUDA from operands with transposed codes (`dst` an f32
/// view of `out × in` elements): cuBLASLt accumulating into `dst`. Operands of rounded values
/// are the gradient buffer's to multiply; here they are an error.
pub fn fp8_add_product_of(dst: &Tensor, g: &Fp8Operand, x: &Fp8Operand) -> Result<()> {
    formats(
        "fp8 add-product",
        [g, x],
        [Fp8Format::E5M2, Fp8Format::E4M3],
    )?;
    let ((rows, out), (x_rows, inp)) = (g.dims(), x.dims());
    if x_rows != rows || dst.elem_count() != out * inp {
        bail!(
            "fp8 add-product: g [{rows}, {out}] and x [{x_rows}, {inp}] do not make the {} \
             elements of the buffer slice",
            dst.elem_count()
        )
    }
    super::gemm::on_cuda_weight_grad(dst, g, x, (rows, out, inp))
}

/// Errors unless the operands have the formats the product reads them in (an FP8 GEMM reads
/// its codes as the plan's formats say, whatever they were made in).
fn formats(op: &str, operands: [&Fp8Operand; 2], want: [Fp8Format; 2]) -> Result<()> {
    let got = operands.map(Fp8Operand::format);
    if got != want {
        bail!("{op}: operands in {got:?}, the product reads {want:?}")
    }
    Ok(())
}

/// Packs `[rows, cols]` as codes (CUDA only).
struct Quantize {
    format: Fp8Format,
    packing: Packing,
}

impl CustomOp1 for Quantize {
    fn name(&self) -> &'static str {
        "fp8_quantize"
    }

    fn cpu_fwd(&self, s: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!(
            "fp8_quantize: FP8 codes ({:?}, {} x {}, {} bytes packed) are made on CUDA; a {:?} \
             operand on the CPU keeps its rounded values",
            self.format,
            self.packing.rows,
            self.packing.cols,
            self.packing.len,
            s.dtype()
        )
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = super::super::cuda::fp8::quantize(s, l, self.format, self.packing)?;
        Ok((out, Shape::from(self.packing.len)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// On the CPU codes are the tensorwise rounded values, and the GEMMs of operands equal the
    /// plain GEMMs of those values bit for bit.
    #[test]
    fn operands_on_the_cpu_multiply_their_rounded_values() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (3, 5, 64), &dev)?; // [b, s, in]
        let w = Tensor::randn(0f32, 0.05, (48, 64), &dev)?; // [out, in]
        let g = Tensor::randn(0f32, 1e-3, (15, 48), &dev)?; // [rows, out]
        let t = |format| Fp8Quant {
            format,
            blocks: Fp8Blocks::Tensor,
        };
        let tensor = Some(Fp8Blocks::Tensor);
        let xq = Fp8Operand::codes(&x, 64, Fp8Format::E4M3, (tensor, None))?;
        let wq = Fp8Operand::codes(&w, 64, Fp8Format::E4M3, (tensor, tensor))?;
        let gq = Fp8Operand::codes(&g, 48, Fp8Format::E5M2, (tensor, None))?;
        assert_eq!(
            (xq.dims(), wq.dims(), gq.dims()),
            ((15, 64), (48, 64), (15, 48))
        );
        let xr = fp8_round(&x.reshape((15, 64))?, t(Fp8Format::E4M3))?;
        let wr = fp8_round(&w, t(Fp8Format::E4M3))?;
        let gr = fp8_round(&g, t(Fp8Format::E5M2))?;
        let v = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
        assert_eq!(v(xq.rounded().unwrap())?, v(&xr)?);
        let y = fp8_linear_of(&xq, &wq, (3, 5, 48))?;
        assert_eq!(
            v(&y)?,
            v(&super::super::super::linear_to(&xr, &wr, (3, 5, 48))?)?
        );
        let dx = fp8_linear_dx_of(&wq, &gq, x.shape())?;
        assert_eq!(
            v(&dx)?,
            v(&super::super::super::linear_dx(&wr, &gr, x.shape())?)?
        );
        // The weight gradient of the factors' operands: the product of their rounded values.
        let g_by_token = Fp8Operand::codes(&g, 48, Fp8Format::E5M2, (tensor, tensor))?;
        let x_by_token = Fp8Operand::codes(&x, 64, Fp8Format::E4M3, (None, tensor))?;
        let (gf, xf) = super::super::fp8_product_factors(&g, &x.reshape((15, 64))?)?;
        assert_eq!(
            v(&fp8_product(&g_by_token, &x_by_token)?)?,
            v(&gf.t()?.matmul(&xf)?)?
        );
        assert!(fp8_product(&x_by_token, &g_by_token).is_err());
        assert!(fp8_linear_of(&xq, &wq, (3, 5, 47)).is_err());
        let two = (Some(Fp8Blocks::Rows), Some(Fp8Blocks::Cols));
        assert!(Fp8Operand::codes(&g, 48, Fp8Format::E5M2, two).is_err());
        assert!(fp8_linear_dx_of(&wq, &xq, x.shape()).is_err());
        let e = fp8_linear_of(&gq, &wq, (15, 48)).unwrap_err().to_string(); // g as an input
        assert!(e.contains("operands in [E5M2, E4M3]"), "{e}");
        Ok(())
    }
}
