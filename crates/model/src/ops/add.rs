//! `add`: the sum of two tensors of one shape, where the residual stream and the gradients that
//! meet where a tensor feeds several operations are added (seven times per block and micro-batch
//! in training). candle's addition broadcasts and reads element by element; on CUDA this op
//! moves 16 bytes at a time (`add` in kernels/pointwise.cu). Each sum is rounded once to the
//! storage type, as candle's addition does.

use super::common::{kernel_dtype, prepare, same_device, same_dtype, slice, zip_map, Float};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

const OP: &str = "add";

/// Elements per rayon task.
const CHUNK: usize = 64 * 1024;

struct Add;

impl Add {
    fn fwd<T: Float>(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<CpuStorage> {
        let a = slice::<T>(OP, "a", s1, l1)?;
        let b = slice::<T>(OP, "b", s2, l2)?;
        Ok(T::to_cpu_storage_owned(zip_map(a, b, CHUNK, |a, b| a + b)))
    }
}

impl CustomOp2 for Add {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = match s1 {
            CpuStorage::F32(_) => self.fwd::<f32>(s1, l1, s2, l2)?,
            CpuStorage::F64(_) => self.fwd::<f64>(s1, l1, s2, l2)?,
            s => bail!("{OP}: unsupported dtype {:?}", s.dtype()),
        };
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::pointwise::add(s1, l1, s2, l2)?;
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        _a: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad.clone()), Some(grad.clone())))
    }
}

/// See [`super::add`].
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.dims() != b.dims() {
        bail!(
            "{OP}: shape mismatch, `a` is {:?} but `b` is {:?}",
            a.dims(),
            b.dims()
        )
    }
    same_dtype(OP, ("a", a), ("b", b))?;
    same_device(OP, ("a", a), ("b", b))?;
    let dtype = a.dtype();
    let cdt = kernel_dtype(OP, "a", a)?;
    let y = prepare(a, cdt)?.apply_op2(&prepare(b, cdt)?, Add)?;
    y.to_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    /// Bit for bit candle's addition, in every dtype the model trains in (bf16 rounds the f32
    /// sum once, as candle's bf16 addition does), and its gradient reaches both inputs.
    #[test]
    fn equals_candles_addition_and_passes_the_gradient_to_both() {
        let dev = Device::Cpu;
        let n = 3 * 64 * 1024 + 5; // several rayon chunks and a short one
        let a = Tensor::randn(0f32, 1.0, (n,), &dev).unwrap();
        let b = (Tensor::randn(0f32, 1.0, (n,), &dev).unwrap() * 1e-3).unwrap();
        for dtype in [DType::F32, DType::F64, DType::BF16] {
            let (a, b) = (a.to_dtype(dtype).unwrap(), b.to_dtype(dtype).unwrap());
            let ours = super::add(&a, &b).unwrap();
            let theirs = (&a + &b).unwrap();
            assert_eq!(ours.dtype(), dtype);
            let bits = |t: &Tensor| t.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
            assert_eq!(bits(&ours), bits(&theirs), "{dtype:?}");
        }
        let (va, vb) = (Var::from_tensor(&a).unwrap(), Var::from_tensor(&a).unwrap());
        let w = Tensor::randn(0f32, 1.0, (n,), &dev).unwrap();
        let loss = (super::add(&va, &vb).unwrap() * &w)
            .unwrap()
            .sum_all()
            .unwrap();
        let grads = loss.backward().unwrap();
        for v in [&va, &vb] {
            let g = grads.get(v).unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(g, w.to_vec1::<f32>().unwrap());
        }
        let bad = Tensor::zeros((2, 3), DType::F32, &dev).unwrap();
        let e = super::add(&bad, &bad.t().unwrap()).unwrap_err().to_string();
        assert!(e.contains("add: shape mismatch"), "{e}");
    }
}
