//! `Mesh`: the single source of truth for how global ranks map onto the data-, tensor- and
//! pipeline-parallel axes, and the communication groups of each axis.
//!
//! Ranks are laid out in Megatron's "tp-dp-pp" order: the tensor-parallel coordinate varies
//! fastest, then data-parallel, then pipeline:
//!
//! ```text
//! rank = tp + TP * (dp + DP * pp)
//! ```
//!
//! so the ranks of a tensor-parallel group are adjacent (on one node, sharing the fastest links).
//! The code is generic over an ordered list of axes (fastest first), so further axes (context or
//! expert parallelism) only need a new [`Axis`] variant and a place in that list.
//!
//! # Worked example: 16 ranks, dp = 2, tp = 2, pp = 4
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

use std::fmt;

use crate::comm::Group;
use crate::config::ParallelConfig;

/// A parallelism axis of the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Axis {
    /// Tensor parallelism (fastest-varying coordinate).
    Tp,
    /// Data parallelism.
    Dp,
    /// Pipeline parallelism (slowest-varying coordinate).
    Pp,
}

impl Axis {
    /// The axes in rank order, fastest-varying first.
    pub const ORDER: [Axis; 3] = [Axis::Tp, Axis::Dp, Axis::Pp];

    /// Position of the axis in [`Axis::ORDER`].
    fn position(self) -> usize {
        match self {
            Axis::Tp => 0,
            Axis::Dp => 1,
            Axis::Pp => 2,
        }
    }
}

impl fmt::Display for Axis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Axis::Tp => "tp",
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
    /// Pipeline stage index.
    pub pp: usize,
}

impl Coords {
    /// The coordinate along `axis`.
    pub fn get(&self, axis: Axis) -> usize {
        match axis {
            Axis::Tp => self.tp,
            Axis::Dp => self.dp,
            Axis::Pp => self.pp,
        }
    }

    /// Sets the coordinate along `axis`.
    pub fn set(&mut self, axis: Axis, value: usize) {
        match axis {
            Axis::Tp => self.tp = value,
            Axis::Dp => self.dp = value,
            Axis::Pp => self.pp = value,
        }
    }
}

/// Why a mesh cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MeshError {
    /// An axis of size zero.
    #[error("parallel.{axis} must be at least 1 (got 0; mesh dp={dp} tp={tp} pp={pp})")]
    ZeroAxis {
        axis: Axis,
        dp: usize,
        tp: usize,
        pp: usize,
    },
    /// `dp × tp × pp` does not fit in a `usize`.
    #[error("mesh dp={dp} tp={tp} pp={pp}: world size overflows")]
    Overflow { dp: usize, tp: usize, pp: usize },
}

/// The sizes of the parallelism axes and the rank layout derived from them (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Mesh {
    /// Axis sizes indexed like [`Axis::ORDER`].
    sizes: [usize; 3],
}

impl Mesh {
    /// A mesh of `dp × tp × pp` ranks; every size must be at least 1.
    pub fn new(dp: usize, tp: usize, pp: usize) -> Result<Self, MeshError> {
        let mut sizes = [0; 3];
        for (axis, size) in [(Axis::Dp, dp), (Axis::Tp, tp), (Axis::Pp, pp)] {
            if size == 0 {
                return Err(MeshError::ZeroAxis { axis, dp, tp, pp });
            }
            sizes[axis.position()] = size;
        }
        sizes
            .iter()
            .try_fold(1usize, |acc, &s| acc.checked_mul(s))
            .ok_or(MeshError::Overflow { dp, tp, pp })?;
        Ok(Self { sizes })
    }

    /// The mesh described by the `parallel:` section of a recipe.
    pub fn from_config(c: &ParallelConfig) -> Result<Self, MeshError> {
        Self::new(c.dp, c.tp, c.pp)
    }

    /// Total number of ranks (`dp × tp × pp`).
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
