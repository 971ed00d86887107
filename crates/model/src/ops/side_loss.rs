//! `with_side_loss`: returns its activation unchanged and adds a scalar loss to the objective.
//!
//! A layer that owns a loss of its own (a mixture-of-experts router's balancing losses) hands it
//! on through its output: the forward pass copies `y`, and the backward pass gives `y` its
//! upstream gradient unchanged and the scalar a gradient of exactly 1, so the scalar is added to
//! whatever objective `y`'s gradient comes from. Segments, recompute and pipeline stages then
//! need nothing extra: the loss rides on the activation they already pass.

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

use super::common::same_device;

const OP: &str = "with_side_loss";

struct SideLoss;

/// A copy of the tensor viewed by `layout` into fresh contiguous storage.
fn copy<S>(s: &S, layout: &Layout) -> Result<(S, Shape)>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    // SAFETY: every element of the new storage is written by the strided copy below.
    let mut dst = unsafe { s.device().alloc_uninit(layout.shape(), s.dtype())? };
    s.copy_strided_src(&mut dst, 0, layout)?;
    Ok((dst, layout.shape().clone()))
}

impl CustomOp2 for SideLoss {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        y: &CpuStorage,
        ly: &Layout,
        _loss: &CpuStorage,
        _ll: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        copy(y, ly)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        y: &candle_core::CudaStorage,
        ly: &Layout,
        _loss: &candle_core::CudaStorage,
        _ll: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        copy(y, ly)
    }

    fn bwd(
        &self,
        _y: &Tensor,
        loss: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad_res.clone()), Some(loss.ones_like()?)))
    }
}

/// See [`super::with_side_loss`].
pub fn with_side_loss(y: &Tensor, loss: &Tensor) -> Result<Tensor> {
    if loss.rank() != 0 || !loss.dtype().is_float() {
        bail!(
            "{OP}: the loss must be a float scalar, got {:?} {:?}",
            loss.dtype(),
            loss.dims()
        );
    }
    same_device(OP, ("y", y), ("loss", loss))?;
    y.apply_op2(loss, SideLoss)
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    /// `sum(y · c) + loss` through `with_side_loss`: `y` gets `c`, the loss's inputs get their
    /// own gradient once, and the value of `y` is unchanged.
    #[test]
    fn passes_the_gradient_and_adds_the_loss() {
        let dev = Device::Cpu;
        let y = Var::new(&[[1f32, 2.0], [3.0, 4.0]], &dev).unwrap();
        let a = Var::new(3f32, &dev).unwrap();
        let loss = (a.as_tensor() * a.as_tensor()).unwrap(); // d/da = 2a = 6
        let out = super::with_side_loss(&y.as_tensor().t().unwrap(), &loss).unwrap();
        assert_eq!(
            out.to_vec2::<f32>().unwrap(),
            vec![vec![1.0, 3.0], vec![2.0, 4.0]]
        );
        let c = Tensor::new(&[[10f32, 20.0], [30.0, 40.0]], &dev).unwrap();
        let total = (out * &c).unwrap().sum_all().unwrap();
        let g = total.backward().unwrap();
        let gy = g.get(y.as_tensor()).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(gy, vec![vec![10.0, 30.0], vec![20.0, 40.0]]);
        let ga = g.get(a.as_tensor()).unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(ga, 6.0);
        assert!(super::with_side_loss(&c, &c).is_err());
    }
}
