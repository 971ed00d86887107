//! `RankCtx`: one rank's place in the job — its mesh coordinates, communicator and process groups.

use std::sync::Arc;

use candle_core::Device;
use model::Placement;
use parallel::mesh::{Axis, Coords, Mesh};
use parallel::tp::TensorParallel;
use parallel::{Comm, Group, ParallelConfig};

/// Everything a rank needs to know about the job layout.
#[derive(Clone)]
pub struct RankCtx {
    /// Global rank.
    pub rank: usize,
    /// The job's mesh.
    pub mesh: Mesh,
    /// This rank's coordinates.
    pub coords: Coords,
    /// The job's communicator.
    pub comm: Arc<dyn Comm>,
    /// Data-parallel group.
    pub dp: Group,
    /// Tensor-parallel group.
    pub tp: Group,
    /// Pipeline group (this rank's pipeline, stage order = member order).
    pub pp: Group,
    /// Model chunks per pipeline stage.
    pub virtual_stages: usize,
    /// Sequence parallelism on.
    pub sequence_parallel: bool,
    /// The device this rank computes on (thread-ranks sharing a GPU share one device handle).
    pub device: Device,
}

impl RankCtx {
    /// The context of `rank` in the layout `cfg`, communicating through `comm`.
    pub fn new(cfg: &ParallelConfig, rank: usize, comm: Arc<dyn Comm>) -> anyhow::Result<Self> {
        let mesh = Mesh::from_config(cfg)?;
        Ok(Self {
            rank,
            coords: mesh.coords(rank),
            dp: mesh.group(Axis::Dp, rank),
            tp: mesh.group(Axis::Tp, rank),
            pp: mesh.group(Axis::Pp, rank),
            virtual_stages: cfg.virtual_stages,
            mesh,
            comm,
            sequence_parallel: cfg.sequence_parallel,
            device: Device::Cpu,
        })
    }

    /// The same context computing on `device`.
    pub fn on(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// Tensor-parallel setup for the model (a one-rank group without tensor parallelism).
    pub fn tensor_parallel(&self) -> TensorParallel {
        TensorParallel::new(self.comm.clone(), self.tp.clone(), self.sequence_parallel)
    }

    /// The part of the model this rank holds: the layers of its pipeline chunks (global chunk
    /// `c · pp + stage` for local chunk `c`), the embedding on the first stage, the head on the last.
    pub fn placement(&self, num_layers: usize) -> Placement {
        let (pp, v, stage) = (self.pp.size(), self.virtual_stages, self.coords.pp);
        let layers = (0..v)
            .flat_map(|c| super::pipeline::chunk_pieces(stage, c, pp, v, num_layers))
            .filter_map(|p| match p {
                model::Piece::Block(i) => Some(i),
                _ => None,
            })
            .collect();
        Placement {
            tp: self.tensor_parallel(),
            layers,
            embedding: stage == 0,
            head: stage + 1 == pp,
        }
    }

    /// First and last pipeline stage of this rank's pipeline (they share tied embeddings).
    pub fn embedding_group(&self) -> Group {
        let r = self.pp.ranks();
        Group::new(vec![r[0], r[r.len() - 1]])
    }

    /// Whether this rank writes logs and run outputs.
    pub fn is_main(&self) -> bool {
        self.rank == 0
    }
}
