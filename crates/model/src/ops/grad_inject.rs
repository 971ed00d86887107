//! `grad_inject`: a zero scalar whose backward pass hands a given upstream gradient to its input.
//! Used where the gradient of an activation comes from outside the local graph (e.g. from the next
//! pipeline stage): `grad_inject(y, dy).backward()` back-propagates `dy` through `y`'s graph.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, WithDType};

use super::common::same_device;

const OP: &str = "grad_inject";

/// The custom op: holds the gradient to hand to its argument.
struct GradInject {
    grad: Tensor,
}

impl CustomOp1 for GradInject {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, storage: &CpuStorage, _layout: &Layout) -> Result<(CpuStorage, Shape)> {
        // A scalar zero in the dtype of `y`.
        let zero = match storage {
            CpuStorage::F32(v) => zero_like(v),
            CpuStorage::F64(v) => zero_like(v),
            CpuStorage::BF16(v) => zero_like(v),
            CpuStorage::F16(v) => zero_like(v),
            s => bail!("{OP}: `y` must be a float tensor, got {:?}", s.dtype()),
        };
        Ok((zero, Shape::from(())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        _layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda::zeros;
        use candle_core::{CudaStorage, DType};
        // A scalar zero in the dtype of `y`.
        let dev = storage.device();
        let zero = match storage.dtype() {
            DType::F32 => CudaStorage::wrap_cuda_slice(zeros::<f32>(dev, 1)?, dev.clone()),
            DType::F64 => CudaStorage::wrap_cuda_slice(zeros::<f64>(dev, 1)?, dev.clone()),
            DType::BF16 => CudaStorage::wrap_cuda_slice(zeros::<half::bf16>(dev, 1)?, dev.clone()),
            DType::F16 => CudaStorage::wrap_cuda_slice(zeros::<half::f16>(dev, 1)?, dev.clone()),
            d => bail!("{OP}: `y` must be a float tensor, got {d:?}"),
        };
        Ok((zero, Shape::from(())))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        if self.grad.dims() != arg.dims() {
            bail!(
                "{OP}: gradient shape {:?} does not match `y` shape {:?}",
                self.grad.dims(),
                arg.dims()
            )
        }
        // d(result)/dy = grad; scale by the upstream scalar gradient (1 for a direct `backward`).
        let grad_res = grad_res.to_dtype(self.grad.dtype())?;
        Ok(Some(self.grad.broadcast_mul(&grad_res)?))
    }
}

/// A one-element storage holding zero, of the element type of `_data`.
fn zero_like<T: WithDType>(_data: &[T]) -> CpuStorage {
    T::to_cpu_storage_owned(vec![T::from_f64(0.0)])
}

/// See [`super::grad_inject`].
pub fn grad_inject(y: &Tensor, grad: &Tensor) -> Result<Tensor> {
    if grad.dims() != y.dims() {
        bail!(
            "{OP}: gradient shape {:?} does not match `y` shape {:?}",
            grad.dims(),
            y.dims()
        )
    }
    if !y.dtype().is_float() {
        bail!("{OP}: `y` must be a float tensor, got {:?}", y.dtype())
    }
    same_device(OP, ("y", y), ("grad", grad))?;
    let grad = grad.detach().to_dtype(y.dtype())?;
    y.apply_op1(GradInject { grad })
}
