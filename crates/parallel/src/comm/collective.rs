//! What every backend computes the same way: the collective kinds ([`Kind`]) and their results
//! from the members' contributions ([`compute`]), reductions in member order
//! (`((x0 op x1) op x2) …`) so every backend that gathers contributions gives bit-identical results.

use candle_core::{Error, Result, Tensor};

use super::{Group, ReduceOp};

/// A collective and the parameters every member must agree on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    AllReduce(ReduceOp),
    AllGather(usize),
    ReduceScatter(usize),
    Broadcast(usize),
    Barrier,
}

impl Kind {
    /// The operation's name in error messages.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::AllReduce(_) => "all_reduce",
            Kind::AllGather(_) => "all_gather",
            Kind::ReduceScatter(_) => "reduce_scatter",
            Kind::Broadcast(_) => "broadcast",
            Kind::Barrier => "barrier",
        }
    }
}

/// Whether NCCL can move tensors of `dtype` (u8, u32, i32, i64, f16, bf16, f32, f64): every
/// backend refuses the others, as the `nccl` one must.
pub(crate) fn nccl_dtype(dtype: candle_core::DType) -> bool {
    use candle_core::DType as D;
    matches!(
        dtype,
        D::U8 | D::U32 | D::I32 | D::I64 | D::F16 | D::BF16 | D::F32 | D::F64
    )
}

/// A new tensor with `t`'s values (never sharing `t`'s storage), holding just them: candle's
/// `copy` would clone the whole storage a view lies in (a flat buffer, for a bucket's view).
pub(crate) fn fresh(t: &Tensor) -> Result<Tensor> {
    t.force_contiguous()
}

/// Element-wise reduction of `inputs` in member order: `((x0 op x1) op x2) …`.
fn reduce(inputs: &[Tensor], op: ReduceOp) -> Result<Tensor> {
    let Some((first, rest)) = inputs.split_first() else {
        return Err(Error::msg("no contributions"));
    };
    if rest.is_empty() {
        return fresh(first);
    }
    let mut acc = first.clone();
    for x in rest {
        acc = match op {
            ReduceOp::Sum => acc.add(x)?,
            ReduceOp::Max => acc.maximum(x)?,
        };
    }
    Ok(acc)
}

fn check_dim(inputs: &[Tensor], dim: usize) -> Result<()> {
    match inputs.first() {
        Some(t) if dim >= t.rank() => {
            let msg = format!("dim {dim} out of range for shape {:?}", t.shape());
            Err(Error::msg(msg))
        }
        _ => Ok(()),
    }
}

/// The per-member results of collective `kind` over `inputs` (one per member, in member order).
pub(crate) fn compute(
    kind: Kind,
    group: &Group,
    inputs: Vec<Tensor>,
) -> Result<Vec<Option<Tensor>>> {
    let n = group.size();
    let shared = |t: Tensor| vec![Some(t); n];
    match kind {
        Kind::Barrier => Ok(vec![None; n]),
        Kind::AllReduce(op) => Ok(shared(reduce(&inputs, op)?)),
        Kind::AllGather(dim) => {
            check_dim(&inputs, dim)?;
            let all = if n == 1 {
                fresh(&inputs[0])?
            } else {
                Tensor::cat(&inputs, dim)?
            };
            Ok(shared(all))
        }
        Kind::ReduceScatter(dim) => {
            check_dim(&inputs, dim)?;
            let len = inputs[0].dim(dim)?;
            if len % n != 0 {
                let msg = format!("dim {dim} of size {len} is not divisible by {n} members");
                return Err(Error::msg(msg));
            }
            let sum = reduce(&inputs, ReduceOp::Sum)?;
            let chunk = len / n;
            let part = |i: usize| Ok(Some(sum.narrow(dim, i * chunk, chunk)?.contiguous()?));
            (0..n).map(part).collect()
        }
        Kind::Broadcast(root) => match group.index_of(root) {
            Some(i) => Ok(shared(fresh(&inputs[i])?)),
            None => Err(Error::msg(format!("broadcast root {root} is not a member"))),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Storage};

    /// A copy of a view holds the view's values and nothing of the buffer around it.
    #[test]
    fn a_fresh_copy_of_a_view_holds_just_the_view() {
        let flat = Tensor::arange(0f32, 1000.0, &Device::Cpu).unwrap();
        let view = flat.narrow(0, 600, 10).unwrap();
        let copy = fresh(&view).unwrap();
        assert_eq!(
            copy.to_vec1::<f32>().unwrap(),
            view.to_vec1::<f32>().unwrap()
        );
        let (storage, _) = copy.storage_and_layout();
        let Storage::Cpu(candle_core::CpuStorage::F32(v)) = &*storage else {
            panic!("an f32 CPU storage")
        };
        assert_eq!(v.len(), 10);
    }
}
