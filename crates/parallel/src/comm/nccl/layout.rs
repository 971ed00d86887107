//! Pure helpers of the `nccl` backend: which communicator serves a call, the store keys of its
//! rendezvous, and the axis moves that turn NCCL's flat, member-major buffers into concatenations
//! and chunks along any dimension.

use std::fmt;

use candle_core::{Result, Tensor};

use crate::comm::Group;

/// Identifies one NCCL communicator of a rank.
#[derive(Clone, PartialEq, Eq, Hash)]
pub(super) enum CommKey {
    /// Collectives over the group; NCCL rank `i` is member `i` of the group.
    Group(Group),
    /// All-to-all exchanges over the group (expert parallelism's tokens), on a communicator of
    /// their own: the same ranks may form a data-parallel group whose reductions run at the same
    /// time on another thread, and one communicator's operations must be issued in the same
    /// order on every member.
    AllToAll(Group),
    /// Messages from `src` to `dst` only (NCCL rank 0 is `src`, 1 is `dst`). Each direction has its
    /// own communicator so that a send never queues behind a receive of the other direction.
    P2p { src: usize, dst: usize },
}

impl CommKey {
    /// Global ranks of the members, in NCCL rank order.
    pub(super) fn members(&self) -> Vec<usize> {
        match self {
            CommKey::Group(g) | CommKey::AllToAll(g) => g.ranks().to_vec(),
            CommKey::P2p { src, dst } => vec![*src, *dst],
        }
    }

    /// Store key prefix of this communicator's rendezvous, under the instance prefix `prefix`:
    /// `{prefix}/group/0,2,4`, `{prefix}/all-to-all/0,2` or `{prefix}/p2p/3->5`.
    pub(super) fn store_base(&self, prefix: &str) -> String {
        let list = |g: &Group| {
            let ranks: Vec<String> = g.ranks().iter().map(|r| r.to_string()).collect();
            ranks.join(",")
        };
        match self {
            CommKey::Group(g) => format!("{prefix}/group/{}", list(g)),
            CommKey::AllToAll(g) => format!("{prefix}/all-to-all/{}", list(g)),
            CommKey::P2p { src, dst } => format!("{prefix}/p2p/{src}->{dst}"),
        }
    }
}

impl fmt::Debug for CommKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CommKey::Group(g) => write!(f, "group {g:?}"),
            CommKey::AllToAll(g) => write!(f, "all-to-all group {g:?}"),
            CommKey::P2p { src, dst } => write!(f, "messages {src}->{dst}"),
        }
    }
}

/// Store key counting the `NcclComm`s created so far by `rank` (they are numbered per rank, in
/// creation order, so that the `k`-th instances of all ranks share keys and no others).
pub(super) fn instance_key(rank: usize) -> String {
    format!("nccl/instance/{rank}")
}

/// Store key prefix of instance `k`.
pub(super) fn instance_prefix(k: i64) -> String {
    format!("nccl/{k}")
}

/// Store keys of a communicator's rendezvous under `base` ([`CommKey::store_base`]).
pub(super) struct RendezvousKeys {
    /// The 128-byte NCCL unique id, set by member 0 before it arrives.
    pub id: String,
    /// Number of members that have arrived.
    pub count: String,
}

impl RendezvousKeys {
    pub(super) fn new(base: &str) -> Self {
        Self {
            id: format!("{base}/id"),
            count: format!("{base}/count"),
        }
    }

    /// Set to 1 once global rank `rank` has arrived (read only to name absent members).
    pub(super) fn here(base: &str, rank: usize) -> String {
        format!("{base}/here/{rank}")
    }
}

/// Store keys of the instance's failure record: `claim` (first `add` wins), then `rank` and
/// `reason`, then `count` (> 0 once `rank` and `reason` are readable).
pub(super) struct AbortKeys {
    pub claim: String,
    pub rank: String,
    pub reason: String,
    pub count: String,
}

impl AbortKeys {
    pub(super) fn new(prefix: &str) -> Self {
        Self {
            claim: format!("{prefix}/abort/claim"),
            rank: format!("{prefix}/abort/rank"),
            reason: format!("{prefix}/abort/reason"),
            count: format!("{prefix}/abort/count"),
        }
    }
}

/// Axis order turning the gathered buffer `[n, d0, …, d(r-1)]` into
/// `[d0, …, d(dim-1), n, d(dim), …]`, whose merge of `n` and `d(dim)` is the concatenation along
/// `dim` in member order.
pub(super) fn gather_order(rank: usize, dim: usize) -> Vec<usize> {
    (1..=dim).chain([0]).chain(dim + 1..=rank).collect()
}

/// Axis order turning `[d0, …, d(dim-1), n, d(dim)/n, …]` into `[n, d0, …]`: member `i`'s chunk
/// becomes the `i`-th contiguous block, as NCCL's reduce-scatter expects.
pub(super) fn scatter_order(rank: usize, dim: usize) -> Vec<usize> {
    [dim]
        .into_iter()
        .chain(0..dim)
        .chain(dim + 1..=rank)
        .collect()
}

/// The concatenation along `dim` of `n` members' tensors of shape `dims`, from NCCL's flat
/// all-gather buffer (member-major).
pub(super) fn gathered(flat: &Tensor, dims: &[usize], n: usize, dim: usize) -> Result<Tensor> {
    let stacked: Vec<usize> = [n].into_iter().chain(dims.iter().copied()).collect();
    let mut out = dims.to_vec();
    out[dim] *= n;
    let x = flat.reshape(stacked)?;
    if dim == 0 {
        return x.reshape(out);
    }
    x.permute(gather_order(dims.len(), dim))?
        .contiguous()?
        .reshape(out)
}

/// `t` rearranged so that its `n` chunks along `dim` are contiguous blocks in chunk order (the
/// input layout of NCCL's reduce-scatter). `t.dims()[dim]` must be a multiple of `n`.
pub(super) fn scatter_input(t: &Tensor, n: usize, dim: usize) -> Result<Tensor> {
    let dims = t.dims();
    if dim == 0 {
        return t.contiguous();
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
    fn keys_name_the_group_or_direction() {
        let g = CommKey::Group(Group::new(vec![4, 0, 2]));
        assert_eq!(g.store_base("nccl/3"), "nccl/3/group/0,2,4");
        assert_eq!(g.members(), vec![0, 2, 4]);
        let a = CommKey::AllToAll(Group::new(vec![2, 0]));
        assert_eq!(a.store_base("nccl/3"), "nccl/3/all-to-all/0,2");
        assert_ne!(a, CommKey::Group(Group::new(vec![0, 2])));
        let p = CommKey::P2p { src: 5, dst: 3 };
        assert_eq!(p.store_base("nccl/0"), "nccl/0/p2p/5->3");
        assert_eq!(p.members(), vec![5, 3]);
        assert_ne!(p, CommKey::P2p { src: 3, dst: 5 });
        let k = RendezvousKeys::new("b");
        assert_eq!((k.id.as_str(), k.count.as_str()), ("b/id", "b/count"));
        assert_eq!(RendezvousKeys::here("b", 7), "b/here/7");
        assert_eq!(
            AbortKeys::new(&instance_prefix(2)).count,
            "nccl/2/abort/count"
        );
        assert_eq!(instance_key(1), "nccl/instance/1");
    }

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

    /// NCCL's all-gather buffer is the members' flat tensors back to back.
    #[test]
    fn gathered_equals_concatenation() {
        let dims = [2, 3, 4];
        let members: Vec<Tensor> = (0..3).map(|i| member(i, &dims)).collect();
        let flats: Vec<Tensor> = members
            .iter()
            .map(|t| t.flatten_all().expect("flat"))
            .collect();
        let flat = Tensor::cat(&flats, 0).expect("cat");
        for dim in 0..dims.len() {
            let got = gathered(&flat, &dims, 3, dim).expect("gathered");
            let want = Tensor::cat(&members, dim).expect("cat");
            let diff = (got - want).expect("sub").abs().expect("abs");
            let diff = diff
                .sum_all()
                .expect("sum")
                .to_scalar::<f32>()
                .expect("scalar");
            assert_eq!(diff, 0.0, "dim {dim}");
        }
    }

    /// NCCL's reduce-scatter gives member `i` the `i`-th contiguous block of the (summed) input.
    #[test]
    fn scatter_blocks_are_chunks() {
        let t = member(1, &[4, 6, 2]);
        for dim in 0..3 {
            let n = 2;
            let arranged = scatter_input(&t, n, dim).expect("arranged").flatten_all();
            let arranged = arranged.expect("flat");
            let block = t.elem_count() / n;
            for i in 0..n {
                let mut dims = t.dims().to_vec();
                dims[dim] /= n;
                let got = arranged.i(i * block..(i + 1) * block).expect("block");
                let got = got.reshape(dims).expect("reshape");
                let want = t.narrow(dim, i * t.dims()[dim] / n, t.dims()[dim] / n);
                let want = want.expect("narrow").to_dtype(DType::F32).expect("dtype");
                let diff = (got - want).expect("sub").abs().expect("abs");
                let diff = diff
                    .sum_all()
                    .expect("sum")
                    .to_scalar::<f32>()
                    .expect("scalar");
                assert_eq!(diff, 0.0, "dim {dim} chunk {i}");
            }
        }
    }
}
