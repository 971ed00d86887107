//! `Mesh`: the single source of truth for how global ranks map onto the tensor-, context-, data-
//! and pipeline-parallel axes, and the communication groups of each axis.
//!
//! Ranks are laid out in Megatron's "tp-cp-dp-pp" order: the tensor-parallel coordinate varies
//! fastest, then context-parallel, then data-parallel, then pipeline:
//!
//! ```text
//! rank = tp + TP * (cp + CP * (dp + DP * pp))
//! ```
//!
//! so the ranks of a tensor-parallel group are adjacent (on one node, sharing the fastest links),
//! and a context-parallel ring (which moves K/V blocks every layer) is next closest. The code is
//! generic over an ordered list of axes (fastest first), so a further axis only needs a new
//! [`Axis`] variant and a place in that list; expert parallelism is not an axis of its own but a
//! subdivision of the data-parallel one (below).
//!
//! # Worked example: 16 ranks, dp = 2, tp = 2, pp = 4 (cp = 1)
//!
//! | rank | dp | tp | pp |   | rank | dp | tp | pp |
//! |-----:|---:|---:|---:|---|-----:|---:|---:|---:|
//! |    0 |  0 |  0 |  0 |   |    8 |  0 |  0 |  2 |
//! |    1 |  0 |  1 |  0 |   |    9 |  0 |  1 |  2 |
//! |    2 |  1 |  0 |  0 |   |   10 |  1 |  0 |  2 |
//! |    3 |  1 |  1 |  0 |   |   11 |  1 |  1 |  2 |
//! |    4 |  0 |  0 |  1 |   |   12 |  0 |  0 |  3 |
//! |    5 |  0 |  1 |  1 |   |   13 |  0 |  1 |  3 |
//! |    6 |  1 |  0 |  1 |   |   14 |  1 |  0 |  3 |
//! |    7 |  1 |  1 |  1 |   |   15 |  1 |  1 |  3 |
//!
//! Groups (ranks sharing every other coordinate):
//!
//! - tp groups (8 × 2): `[0,1] [2,3] [4,5] [6,7] [8,9] [10,11] [12,13] [14,15]`
//! - dp groups (8 × 2): `[0,2] [1,3] [4,6] [5,7] [8,10] [9,11] [12,14] [13,15]`
//! - pp groups (4 × 4): `[0,4,8,12] [1,5,9,13] [2,6,10,14] [3,7,11,15]`
//!
//! Pipeline neighbours follow the pp groups: rank 5's next stage is rank 9, its previous stage is
//! rank 1; ranks 0–3 are first-stage ranks and ranks 12–15 last-stage ranks.
//!
//! # Worked example: 16 ranks, tp = 2, cp = 2, dp = 2, pp = 2
//!
//! `rank = tp + 2·cp + 4·dp + 8·pp`:
//!
//! | rank | tp | cp | dp | pp |   | rank | tp | cp | dp | pp |
//! |-----:|---:|---:|---:|---:|---|-----:|---:|---:|---:|---:|
//! |    0 |  0 |  0 |  0 |  0 |   |    8 |  0 |  0 |  0 |  1 |
//! |    1 |  1 |  0 |  0 |  0 |   |    9 |  1 |  0 |  0 |  1 |
//! |    2 |  0 |  1 |  0 |  0 |   |   10 |  0 |  1 |  0 |  1 |
//! |    3 |  1 |  1 |  0 |  0 |   |   11 |  1 |  1 |  0 |  1 |
//! |    4 |  0 |  0 |  1 |  0 |   |   12 |  0 |  0 |  1 |  1 |
//! |    5 |  1 |  0 |  1 |  0 |   |   13 |  1 |  0 |  1 |  1 |
//! |    6 |  0 |  1 |  1 |  0 |   |   14 |  0 |  1 |  1 |  1 |
//! |    7 |  1 |  1 |  1 |  0 |   |   15 |  1 |  1 |  1 |  1 |
//!
//! - tp groups: `[0,1] [2,3] … [14,15]`; cp groups (rings): `[0,2] [1,3] [4,6] [5,7] …`
//! - dp groups: `[0,4] [1,5] [2,6] [3,7] …`; pp groups: `[0,8] [1,9] … [7,15]`
//! - gradient groups (dp × cp, [`Mesh::group_across`]): `[0,2,4,6] [1,3,5,7] [8,10,12,14]
//!   [9,11,13,15]`. Weights are replicated over cp ranks, so their gradients are reduced, and
//!   ZeRO shards, over these groups; the two cp ranks of a dp group read the same samples.
//!
//! # Expert parallelism: folded inside data parallelism
//!
//! Mixture-of-experts layers split their experts over `ep` ranks that read *different* samples,
//! so expert parallelism reuses data-parallel ranks rather than adding ranks (Megatron's
//! "tp-cp-ep-dp-pp" order): the data-parallel coordinate `d` is read as
//! `d = ep_index + ep · expert_replica`, the expert-parallel index varying fastest. Dense
//! parameters are replicated over all `dp` ranks as before; a rank holds the experts of its
//! `ep_index` only, and their gradients are reduced over the ranks with the same `ep_index`
//! (the expert gradient group, × cp). Tokens travel between the members of an expert-parallel
//! group (same tp, cp, pp and expert replica) by all-to-all.
//!
//! Worked example: 8 ranks, tp = 2, dp = 4, ep = 2 (`rank = tp + 2·dp`):
//!
//! | rank | tp | dp | ep_index | expert replica |
//! |-----:|---:|---:|---------:|---------------:|
//! |    0 |  0 |  0 |        0 |              0 |
//! |    1 |  1 |  0 |        0 |              0 |
//! |    2 |  0 |  1 |        1 |              0 |
//! |    3 |  1 |  1 |        1 |              0 |
//! |    4 |  0 |  2 |        0 |              1 |
//! |    5 |  1 |  2 |        0 |              1 |
//! |    6 |  0 |  3 |        1 |              1 |
//! |    7 |  1 |  3 |        1 |              1 |
//!
//! - dp (dense gradient) groups: `[0,2,4,6] [1,3,5,7]`
//! - ep groups (all-to-all, [`Mesh::ep_group`]): `[0,2] [4,6] [1,3] [5,7]`
//! - expert gradient groups ([`Mesh::expert_grad_group`]): `[0,4] [2,6] [1,5] [3,7]`: ranks 0
//!   and 4 hold experts `0 .. E/2` and sum their gradients; ranks 2 and 6 hold `E/2 .. E`.

use std::fmt;

use crate::comm::Group;
use crate::config::ParallelConfig;

/// A parallelism axis of the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Axis {
    /// Tensor parallelism (fastest-varying coordinate).
    Tp,
    /// Context parallelism (the sequence split across ranks).
    Cp,
    /// Data parallelism.
    Dp,
    /// Pipeline parallelism (slowest-varying coordinate).
    Pp,
}

impl Axis {
    /// The axes in rank order, fastest-varying first.
    pub const ORDER: [Axis; 4] = [Axis::Tp, Axis::Cp, Axis::Dp, Axis::Pp];

    /// Position of the axis in [`Axis::ORDER`].
    fn position(self) -> usize {
        match self {
            Axis::Tp => 0,
            Axis::Cp => 1,
            Axis::Dp => 2,
            Axis::Pp => 3,
        }
    }
}

impl fmt::Display for Axis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Axis::Tp => "tp",
            Axis::Cp => "cp",
            Axis::Dp => "dp",
            Axis::Pp => "pp",
        })
    }
}

/// The position of one rank in the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Coords {
    /// Data-parallel replica index.
    pub dp: usize,
    /// Tensor-parallel index.
    pub tp: usize,
    /// Context-parallel index (which chunks of each sequence the rank holds).
    pub cp: usize,
    /// Pipeline stage index.
    pub pp: usize,
}

impl Coords {
    /// The coordinate along `axis`.
    pub fn get(&self, axis: Axis) -> usize {
        match axis {
            Axis::Tp => self.tp,
            Axis::Cp => self.cp,
            Axis::Dp => self.dp,
            Axis::Pp => self.pp,
        }
    }

    /// Sets the coordinate along `axis`.
    pub fn set(&mut self, axis: Axis, value: usize) {
        match axis {
            Axis::Tp => self.tp = value,
            Axis::Cp => self.cp = value,
            Axis::Dp => self.dp = value,
            Axis::Pp => self.pp = value,
        }
    }
}

/// Why a mesh cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MeshError {
    /// An axis of size zero.
    #[error("parallel.{axis} must be at least 1 (got 0; mesh {layout})")]
    ZeroAxis { axis: Axis, layout: String },
    /// `dp × tp × cp × pp` does not fit in a `usize`.
    #[error("mesh {layout}: world size overflows")]
    Overflow { layout: String },
    /// Expert parallelism that does not divide data parallelism.
    #[error("parallel.ep ({ep}) must be at least 1 and divide parallel.dp ({dp}): expert-parallel ranks are data-parallel ranks")]
    ExpertAxis { ep: usize, dp: usize },
}

/// Every communication group of one rank, by name ([`Mesh::rank_groups`] builds them all).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankGroups {
    /// Tensor-parallel group.
    pub tp: Group,
    /// Context-parallel group: the ranks sharing this rank's samples, each holding a share of
    /// every sequence.
    pub cp: Group,
    /// The gradient group: the ranks holding the same weights, which reduce their gradients (and
    /// split ZeRO state) among themselves — the data-parallel ranks and, with context
    /// parallelism, the context-parallel ranks of each (`dp × cp`).
    pub grad: Group,
    /// ZeRO shard group: the gradient-group ranks that split sharded state among themselves (all
    /// of `grad`, or a group of `parallel.zero_shard_size` with hybrid sharding; this rank alone
    /// without sharding).
    pub shard: Group,
    /// The ranks of the other shard groups holding the same shard (only this rank without hybrid
    /// sharding).
    pub replicate: Group,
    /// Expert-parallel group: the data-parallel ranks among which each MoE layer's experts are
    /// split and tokens travel by all-to-all (this rank alone without expert parallelism).
    pub ep: Group,
    /// Expert gradient group: the gradient-group ranks holding this rank's experts, which reduce
    /// (and shard) the experts' gradients (the gradient group without expert parallelism).
    pub expert_grad: Group,
    /// Pipeline group (this rank's pipeline, stage order = member order).
    pub pp: Group,
    /// The first and last stage of this rank's pipeline (they share tied embeddings).
    pub pipeline_ends: Group,
}

impl RankGroups {
    /// Every group with its name, in one fixed order.
    pub fn named(&self) -> [(&'static str, &Group); 9] {
        [
            ("tp", &self.tp),
            ("cp", &self.cp),
            ("grad", &self.grad),
            ("shard", &self.shard),
            ("replicate", &self.replicate),
            ("expert_grad", &self.expert_grad),
            ("ep", &self.ep),
            ("pp", &self.pp),
            ("pipeline_ends", &self.pipeline_ends),
        ]
    }
}

/// The sizes of the parallelism axes and the rank layout derived from them (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Mesh {
    /// Axis sizes indexed like [`Axis::ORDER`].
    sizes: [usize; 4],
    /// Expert-parallel size, a divisor of the data-parallel size (see the module docs).
    ep: usize,
}

impl Mesh {
    /// A mesh of `dp × tp × pp` ranks (no context parallelism); every size must be at least 1.
    pub fn new(dp: usize, tp: usize, pp: usize) -> Result<Self, MeshError> {
        Self::with_sizes(&[(Axis::Dp, dp), (Axis::Tp, tp), (Axis::Pp, pp)])
    }

    /// A mesh with these axis sizes (axes not named have size 1); every size must be at least 1.
    pub fn with_sizes(sizes: &[(Axis, usize)]) -> Result<Self, MeshError> {
        let mut all = [1; 4];
        for &(axis, size) in sizes {
            all[axis.position()] = size;
        }
        let layout = || {
            Axis::ORDER
                .iter()
                .map(|a| format!("{a}={}", all[a.position()]))
                .collect::<Vec<_>>()
                .join(" ")
        };
        if let Some(&axis) = Axis::ORDER.iter().find(|a| all[a.position()] == 0) {
            return Err(MeshError::ZeroAxis {
                axis,
                layout: layout(),
            });
        }
        all.iter()
            .try_fold(1usize, |acc, &s| acc.checked_mul(s))
            .ok_or_else(|| MeshError::Overflow { layout: layout() })?;
        Ok(Self { sizes: all, ep: 1 })
    }

    /// This mesh with expert parallelism `ep` folded inside its data-parallel axis (`ep` must
    /// divide the data-parallel size).
    pub fn with_ep(mut self, ep: usize) -> Result<Self, MeshError> {
        let dp = self.size(Axis::Dp);
        if ep == 0 || !dp.is_multiple_of(ep) {
            return Err(MeshError::ExpertAxis { ep, dp });
        }
        self.ep = ep;
        Ok(self)
    }

    /// The mesh described by the `parallel:` section of a recipe.
    pub fn from_config(c: &ParallelConfig) -> Result<Self, MeshError> {
        Self::with_sizes(&[
            (Axis::Tp, c.tp),
            (Axis::Cp, c.cp),
            (Axis::Dp, c.dp),
            (Axis::Pp, c.pp),
        ])?
        .with_ep(c.ep)
    }

    /// The expert-parallel size (1 without expert parallelism).
    pub fn ep(&self) -> usize {
        self.ep
    }

    /// `rank`'s index in its expert-parallel group: which `1 / ep` of the experts it holds.
    pub fn ep_index(&self, rank: usize) -> usize {
        self.coords(rank).dp % self.ep
    }

    /// The expert-parallel group of `rank`: the `ep` data-parallel ranks (same tp, cp, pp
    /// coordinates) whose data-parallel coordinates differ only in the expert-parallel index;
    /// tokens travel among them by all-to-all.
    pub fn ep_group(&self, rank: usize) -> Group {
        let mut c = self.coords(rank);
        let base = c.dp - c.dp % self.ep;
        let ranks = (base..base + self.ep)
            .map(|d| {
                c.dp = d;
                self.rank_of(c)
            })
            .collect();
        Group::new(ranks)
    }

    /// The expert gradient group of `rank`: the ranks of its gradient group (dp × cp) with its
    /// expert-parallel index, which hold the same experts and reduce their gradients together.
    pub fn expert_grad_group(&self, rank: usize) -> Group {
        let me = self.ep_index(rank);
        let ranks = self
            .group_across(&[Axis::Dp, Axis::Cp], rank)
            .ranks()
            .iter()
            .copied()
            .filter(|&r| self.ep_index(r) == me)
            .collect();
        Group::new(ranks)
    }

    /// Every communication group of `rank` by name, with ZeRO shard groups of `shard_size`
    /// gradient-group ranks (1 without sharding; all of them without hybrid sharding).
    pub fn rank_groups(&self, rank: usize, shard_size: usize) -> RankGroups {
        let grad = self.group_across(&[Axis::Dp, Axis::Cp], rank);
        // Gradient-group index d = r · n + s: shard s of shard group r (shards vary fastest).
        let n = shard_size.max(1);
        let d = grad
            .index_of(rank)
            .expect("a rank is in its gradient group");
        let (r, s) = (d / n, d % n);
        let members = grad.ranks();
        let pp = self.group(Axis::Pp, rank);
        let ends = pp.ranks();
        RankGroups {
            tp: self.group(Axis::Tp, rank),
            cp: self.group(Axis::Cp, rank),
            shard: Group::new(members[r * n..(r + 1) * n].to_vec()),
            replicate: Group::new(members.iter().skip(s).step_by(n).copied().collect()),
            ep: self.ep_group(rank),
            expert_grad: self.expert_grad_group(rank),
            pipeline_ends: Group::new(vec![ends[0], ends[ends.len() - 1]]),
            pp,
            grad,
        }
    }

    /// Total number of ranks (`dp × tp × cp × pp`).
    pub fn world_size(&self) -> usize {
        self.sizes.iter().product()
    }

    /// Number of ranks along `axis`.
    pub fn size(&self, axis: Axis) -> usize {
        self.sizes[axis.position()]
    }

    /// Stride of `axis` in the rank numbering.
    fn stride(&self, axis: Axis) -> usize {
        self.sizes[..axis.position()].iter().product()
    }

    /// The coordinates of global `rank`.
    ///
    /// # Panics
    /// If `rank >= world_size()` (a programming error).
    pub fn coords(&self, rank: usize) -> Coords {
        assert!(
            rank < self.world_size(),
            "rank {rank} out of range for a mesh of {} ranks",
            self.world_size()
        );
        let mut c = Coords {
            dp: 0,
            tp: 0,
            cp: 0,
            pp: 0,
        };
        for axis in Axis::ORDER {
            c.set(axis, rank / self.stride(axis) % self.size(axis));
        }
        c
    }

    /// The global rank at coordinates `c`.
    ///
    /// # Panics
    /// If a coordinate is out of range (a programming error).
    pub fn rank_of(&self, c: Coords) -> usize {
        Axis::ORDER
            .iter()
            .map(|&axis| {
                let v = c.get(axis);
                assert!(
                    v < self.size(axis),
                    "{axis} coordinate {v} out of range (size {})",
                    self.size(axis)
                );
                v * self.stride(axis)
            })
            .sum()
    }

    /// The group along `axis` containing `rank`: the ranks that share all other coordinates.
    pub fn group(&self, axis: Axis, rank: usize) -> Group {
        let mut c = self.coords(rank);
        let ranks = (0..self.size(axis))
            .map(|i| {
                c.set(axis, i);
                self.rank_of(c)
            })
            .collect();
        Group::new(ranks)
    }

    /// The group of the ranks that share `rank`'s coordinates on every axis but `axes` (e.g. dp
    /// and cp: the ranks that reduce gradients together), sorted.
    pub fn group_across(&self, axes: &[Axis], rank: usize) -> Group {
        let mut ranks = vec![rank];
        for &axis in axes {
            ranks = ranks
                .iter()
                .flat_map(|&r| self.group(axis, r).ranks().to_vec())
                .collect();
        }
        Group::new(ranks)
    }

    /// All groups along `axis`: disjoint, covering the world, ordered by their lowest rank.
    pub fn groups(&self, axis: Axis) -> Vec<Group> {
        (0..self.world_size())
            .filter(|&r| self.coords(r).get(axis) == 0)
            .map(|r| self.group(axis, r))
            .collect()
    }

    /// The rank of the next pipeline stage with the same dp and tp coordinates, if any.
    pub fn pp_next(&self, rank: usize) -> Option<usize> {
        let mut c = self.coords(rank);
        (c.pp + 1 < self.size(Axis::Pp)).then(|| {
            c.pp += 1;
            self.rank_of(c)
        })
    }

    /// The rank of the previous pipeline stage with the same dp and tp coordinates, if any.
    pub fn pp_prev(&self, rank: usize) -> Option<usize> {
        let mut c = self.coords(rank);
        (c.pp > 0).then(|| {
            c.pp -= 1;
            self.rank_of(c)
        })
    }

    /// Whether `rank` holds the first pipeline stage.
    pub fn is_first_stage(&self, rank: usize) -> bool {
        self.coords(rank).pp == 0
    }

    /// Whether `rank` holds the last pipeline stage.
    pub fn is_last_stage(&self, rank: usize) -> bool {
        self.coords(rank).pp + 1 == self.size(Axis::Pp)
    }
}
