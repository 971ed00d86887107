//! The axis moves around flat collective buffers (NCCL's, member-major): the concatenation
//! along any dimension from an all-gather's buffer, and the chunks along any dimension laid out
//! as a reduce-scatter's input. Along dimension 0 (sequence parallelism's token rows) or a
//! dimension with only size-1 axes before it both are free.

use candle_core::{Result, Tensor};

/// Axis order turning the gathered buffer `[n, d0, …, d(r-1)]` into
/// `[d0, …, d(dim-1), n, d(dim), …]`, whose merge of `n` and `d(dim)` is the concatenation along
/// `dim` in member order.
pub(crate) fn gather_order(rank: usize, dim: usize) -> Vec<usize> {
    (1..=dim).chain([0]).chain(dim + 1..=rank).collect()
}

/// Axis order turning `[d0, …, d(dim-1), n, d(dim)/n, …]` into `[n, d0, …]`: member `i`'s chunk
/// becomes the `i`-th contiguous block, as NCCL's reduce-scatter expects.
pub(crate) fn scatter_order(rank: usize, dim: usize) -> Vec<usize> {
    [dim]
        .into_iter()
        .chain(0..dim)
        .chain(dim + 1..=rank)
        .collect()
}

/// The concatenation along `dim` of `n` members' tensors of shape `dims`, from NCCL's flat
/// all-gather buffer (member-major).
pub(crate) fn gathered(flat: &Tensor, dims: &[usize], n: usize, dim: usize) -> Result<Tensor> {
    let stacked: Vec<usize> = [n].into_iter().chain(dims.iter().copied()).collect();
    let mut out = dims.to_vec();
    out[dim] *= n;
    let x = flat.reshape(stacked)?;
    // With only size-1 axes before `dim` (dim 0 among them) the member blocks already lie in
    // concatenation order: no copy.
    if dims[..dim].iter().product::<usize>() == 1 {
        return x.reshape(out);
    }
    x.permute(gather_order(dims.len(), dim))?
        .contiguous()?
        .reshape(out)
}

/// `t` rearranged so that its `n` chunks along `dim` are contiguous blocks in chunk order (the
/// input layout of NCCL's reduce-scatter). `t.dims()[dim]` must be a multiple of `n`.
pub(crate) fn scatter_input(t: &Tensor, n: usize, dim: usize) -> Result<Tensor> {
    let dims = t.dims();
    if dims[..dim].iter().product::<usize>() == 1 {
        return t.contiguous(); // the chunks are contiguous blocks already
    }
    let mut split = dims[..dim].to_vec();
    split.extend([n, dims[dim] / n]);
    split.extend(&dims[dim + 1..]);
    t.reshape(split)?
        .permute(scatter_order(dims.len(), dim))?
        .contiguous()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, IndexOp};

    #[test]
    fn orders_are_inverse_permutations() {
        assert_eq!(gather_order(2, 1), vec![1, 0, 2]);
        assert_eq!(gather_order(3, 2), vec![1, 2, 0, 3]);
        assert_eq!(scatter_order(3, 2), vec![2, 0, 1, 3]);
        for rank in 1..5 {
            for dim in 0..rank {
                let (g, s) = (gather_order(rank, dim), scatter_order(rank, dim));
                let composed: Vec<usize> = g.iter().map(|&i| s[i]).collect();
                assert_eq!(
                    composed,
                    (0..=rank).collect::<Vec<_>>(),
                    "rank {rank} dim {dim}"
                );
            }
        }
    }

    fn member(i: usize, dims: &[usize]) -> Tensor {
        let n: usize = dims.iter().product();
        let base = (i * 1000) as f32;
        Tensor::arange(base, base + n as f32, &Device::Cpu)
            .and_then(|t| t.reshape(dims))
            .expect("tensor")
    }

    /// `Σ |a − b|`.
    fn abs_sum(a: Tensor, b: Tensor) -> f32 {
        let diff = (a - b).expect("sub").abs().expect("abs");
        diff.sum_all()
            .expect("sum")
            .to_scalar::<f32>()
            .expect("scalar")
    }

    /// NCCL's all-gather buffer is the members' flat tensors back to back (also with leading
    /// size-1 axes, where no copy is made).
    #[test]
    fn gathered_equals_concatenation() {
        for dims in [[2, 3, 4], [1, 3, 4], [1, 1, 4]] {
            let members: Vec<Tensor> = (0..3).map(|i| member(i, &dims)).collect();
            let flats: Vec<Tensor> = members
                .iter()
                .map(|t| t.flatten_all().expect("flat"))
                .collect();
            let flat = Tensor::cat(&flats, 0).expect("cat");
            for dim in 0..dims.len() {
                let got = gathered(&flat, &dims, 3, dim).expect("gathered");
                let want = Tensor::cat(&members, dim).expect("cat");
                assert_eq!(abs_sum(got, want), 0.0, "{dims:?} dim {dim}");
            }
        }
    }

    /// NCCL's reduce-scatter gives member `i` the `i`-th contiguous block of the (summed) input.
    #[test]
    fn scatter_blocks_are_chunks() {
        for dims in [[4, 6, 2], [1, 6, 2], [1, 1, 2]] {
            scatter_blocks(&member(1, &dims));
        }
    }

    fn scatter_blocks(t: &Tensor) {
        for dim in (0..3).filter(|&d| t.dims()[d].is_multiple_of(2)) {
            let n = 2;
            let arranged = scatter_input(t, n, dim).expect("arranged").flatten_all();
            let arranged = arranged.expect("flat");
            let block = t.elem_count() / n;
            for i in 0..n {
                let mut dims = t.dims().to_vec();
                dims[dim] /= n;
                let got = arranged.i(i * block..(i + 1) * block).expect("block");
                let got = got.reshape(dims).expect("reshape");
                let want = t.narrow(dim, i * t.dims()[dim] / n, t.dims()[dim] / n);
                let want = want.expect("narrow").to_dtype(DType::F32).expect("dtype");
                assert_eq!(
                    abs_sum(got, want),
                    0.0,
                    "{:?} dim {dim} chunk {i}",
                    t.dims()
                );
            }
        }
    }
}
