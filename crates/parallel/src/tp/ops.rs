//! Megatron's tensor-parallel communication primitives as differentiable ops.
//!
//! | op | forward | backward |
//! |---|---|---|
//! | [`copy_to_tp`] (f) | identity | all-reduce |
//! | [`reduce_from_tp`] (g) | all-reduce | identity |
//! | [`gather_from_tp`] | all-gather along `dim` | keep own chunk |
//! | [`scatter_to_tp`] | keep own chunk | all-gather along `dim` |
//! | [`gather_seq`] (sequence parallel) | all-gather along `dim` | reduce-scatter |
//! | [`reduce_scatter_seq`] (sequence parallel) | reduce-scatter along `dim` | all-gather |
//!
//! Each is a `Route` op: its forward value is produced by the communicator outside the autograd
//! graph and copied into the op's output; its backward applies the conjugate collective to the
//! incoming gradient. With one tensor-parallel rank every op is the identity.

use std::sync::{Arc, Mutex};

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Storage, Tensor};

use crate::comm::{Comm, Group, ReduceOp};

/// The tensor-parallel group of one rank.
#[derive(Clone)]
pub struct TpGroup {
    /// The job's communicator.
    pub comm: Arc<dyn Comm>,
    /// Ranks sharing this rank's layers.
    pub group: Group,
}

impl TpGroup {
    /// Tensor-parallel degree.
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// This rank's index within the group (its shard number).
    pub fn index(&self) -> usize {
        self.group
            .index_of(self.comm.rank())
            .expect("a rank belongs to its own tensor-parallel group")
    }
}

impl std::fmt::Debug for TpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TpGroup(rank {} of {:?})", self.comm.rank(), self.group)
    }
}

pub(crate) type GradFn = Box<dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync>;

/// A fresh copy of the elements of `s` that `l` addresses, contiguous.
pub(crate) fn copy_storage<S>(s: &S, l: &Layout) -> Result<(S, Shape)>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    // SAFETY: every element of `dst` is written by `copy_strided_src` before it is read.
    let mut dst = unsafe { s.device().alloc_uninit(l.shape(), s.dtype())? };
    s.copy_strided_src(&mut dst, 0, l)?;
    Ok((dst, l.shape().clone()))
}

/// Forward: returns a copy of a value computed outside the graph (or of its argument when there
/// is none). The value is taken out of the op when the forward copies it, so the graph holds
/// only the copy. Backward: gives the argument `grad_fn(upstream)`.
struct Route {
    name: &'static str,
    value: Mutex<Option<Tensor>>,
    grad_fn: GradFn,
}

impl Route {
    fn take_value(&self) -> Option<Tensor> {
        self.value.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

impl CustomOp1 for Route {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let Some(v) = self.take_value() else {
            return copy_storage(s, l);
        };
        let (storage, vl) = v.storage_and_layout();
        match &*storage {
            Storage::Cpu(vs) => copy_storage(vs, vl),
            _ => candle_core::bail!("{}: the value is not on the CPU", self.name),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let Some(v) = self.take_value() else {
            return copy_storage(s, l);
        };
        let (storage, vl) = v.storage_and_layout();
        match &*storage {
            Storage::Cuda(vs) => copy_storage(vs, vl),
            _ => candle_core::bail!("{}: the value is not on the GPU", self.name),
        }
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some((self.grad_fn)(grad)?))
    }
}

/// `x` with the forward value `value` (`None`: `x`'s own values) and the backward `grad_fn`.
pub(crate) fn route(
    x: &Tensor,
    value: Option<Tensor>,
    name: &'static str,
    grad_fn: GradFn,
) -> Result<Tensor> {
    x.apply_op1(Route {
        name,
        value: Mutex::new(value),
        grad_fn,
    })
}

/// This rank's chunk `index` of `size` equal chunks of `t` along `dim`.
fn chunk(t: &Tensor, dim: usize, index: usize, size: usize) -> Result<Tensor> {
    let n = t.dim(dim)?;
    if n % size != 0 {
        candle_core::bail!(
            "cannot split dimension {dim} of size {n} into {size} tensor-parallel chunks"
        );
    }
    t.narrow(dim, index * (n / size), n / size)?.contiguous()
}

/// f: identity forward, all-reduce (sum) of the gradient over the tensor-parallel group.
pub fn copy_to_tp(x: &Tensor, tp: &TpGroup) -> Result<Tensor> {
    if tp.size() == 1 {
        return Ok(x.clone());
    }
    let tp2 = tp.clone();
    route(
        x,
        None,
        "copy-to-tp",
        Box::new(move |g| tp2.comm.all_reduce(&tp2.group, g, ReduceOp::Sum)),
    )
}

/// g: all-reduce (sum) forward, identity backward.
pub fn reduce_from_tp(x: &Tensor, tp: &TpGroup) -> Result<Tensor> {
    if tp.size() == 1 {
        return Ok(x.clone());
    }
    let y = tp.comm.all_reduce(&tp.group, &x.detach(), ReduceOp::Sum)?;
    route(x, Some(y), "reduce-from-tp", Box::new(|g| Ok(g.clone())))
}

/// All-gather along `dim` forward; the gradient keeps this rank's chunk.
pub fn gather_from_tp(x: &Tensor, tp: &TpGroup, dim: usize) -> Result<Tensor> {
    if tp.size() == 1 {
        return Ok(x.clone());
    }
    let y = tp.comm.all_gather(&tp.group, &x.detach(), dim)?;
    let (index, size) = (tp.index(), tp.size());
    route(
        x,
        Some(y),
        "gather-from-tp",
        Box::new(move |g| chunk(g, dim, index, size)),
    )
}

/// Keeps this rank's chunk along `dim` forward; the gradient is all-gathered.
pub fn scatter_to_tp(x: &Tensor, tp: &TpGroup, dim: usize) -> Result<Tensor> {
    if tp.size() == 1 {
        return Ok(x.clone());
    }
    let y = chunk(&x.detach(), dim, tp.index(), tp.size())?;
    let tp2 = tp.clone();
    route(
        x,
        Some(y),
        "scatter-to-tp",
        Box::new(move |g| tp2.comm.all_gather(&tp2.group, g, dim)),
    )
}

/// Sequence parallel: all-gather the sequence shards along `dim` forward, reduce-scatter backward.
pub fn gather_seq(x: &Tensor, tp: &TpGroup, dim: usize) -> Result<Tensor> {
    if tp.size() == 1 {
        return Ok(x.clone());
    }
    let y = tp.comm.all_gather(&tp.group, &x.detach(), dim)?;
    let tp2 = tp.clone();
    route(
        x,
        Some(y),
        "gather-seq",
        Box::new(move |g| tp2.comm.reduce_scatter(&tp2.group, g, dim)),
    )
}

/// Sequence parallel: reduce-scatter along `dim` forward (sum of partial results, each rank keeps
/// its sequence shard), all-gather backward.
pub fn reduce_scatter_seq(x: &Tensor, tp: &TpGroup, dim: usize) -> Result<Tensor> {
    if tp.size() == 1 {
        return Ok(x.clone());
    }
    let y = tp.comm.reduce_scatter(&tp.group, &x.detach(), dim)?;
    let tp2 = tp.clone();
    route(
        x,
        Some(y),
        "reduce-scatter-seq",
        Box::new(move |g| tp2.comm.all_gather(&tp2.group, g, dim)),
    )
}
