//! `RankCtx`: one rank's place in the job — its mesh coordinates, communicator and process groups
//! — and the layer placement that follows from it (`model::placement::chunk_pieces`).

use std::collections::HashSet;
use std::sync::Arc;

use candle_core::Device;
use data::Batch;
use model::placement::chunk_pieces;
use model::{Piece, Placement};
use parallel::cp::{local_chunks, ContextParallel};
use parallel::ep::ExpertParallel;
use parallel::mesh::{Axis, Coords, Mesh, RankGroups};
use parallel::pipeline::ChunkPlacement;
use parallel::stats::StepStats;
use parallel::tp::TensorParallel;
use parallel::{register, Channel, Comm, Group, ParallelConfig};

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
    /// Its communication groups, by name (all built by [`Mesh::rank_groups`]). Samples are split
    /// by the data-parallel index ([`RankCtx::data_index`]), gradients reduced over `grad`
    /// (`dp × cp`).
    pub groups: RankGroups,
    /// The job's layout (`parallel:`): chunks per stage, their layers, sequence parallelism.
    pub parallel: ParallelConfig,
    /// The device this rank computes on (thread-ranks sharing a GPU share one device handle).
    pub device: Device,
    /// The one sink the step's parallel parts report measurements to (the ring, the staged
    /// gradients, the reductions in flight), drained once per step.
    pub stats: Arc<StepStats>,
}

impl RankCtx {
    /// The context of `rank` in the layout `cfg`, communicating through `comm`.
    pub fn new(cfg: &ParallelConfig, rank: usize, comm: Arc<dyn Comm>) -> anyhow::Result<Self> {
        let mesh = Mesh::from_config(cfg)?;
        Ok(Self {
            rank,
            coords: mesh.coords(rank),
            groups: mesh.rank_groups(rank, cfg.shard_size()),
            parallel: cfg.clone(),
            mesh,
            comm,
            device: Device::Cpu,
            stats: Arc::default(),
        })
    }

    /// Opens `rank` of a job with layout `cfg` on `device`: creates every communicator of the
    /// job in one global order first ([`job_channels`], [`Comm::prepare`]), then the context.
    /// Training, evaluation and the tests all open their ranks here.
    pub fn open(
        cfg: &ParallelConfig,
        rank: usize,
        comm: Arc<dyn Comm>,
        device: Device,
    ) -> anyhow::Result<Self> {
        comm.prepare(&job_channels(cfg, &comm)?)?;
        Ok(Self::new(cfg, rank, comm)?.on(device))
    }

    /// Which data-parallel replica this rank is: the samples it reads.
    pub fn data_index(&self) -> usize {
        self.coords.dp
    }

    /// Number of data-parallel replicas (`parallel.dp`): the ways each global batch is split.
    pub fn data_size(&self) -> usize {
        self.mesh.size(Axis::Dp)
    }

    /// The same context computing on `device`.
    pub fn on(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// Which global chunks each stage holds (a V for the zbv schedule).
    pub fn chunk_placement(&self) -> ChunkPlacement {
        self.parallel.schedule_kind().placement()
    }

    /// Tensor-parallel setup for the model (a one-rank group without tensor parallelism).
    pub fn tensor_parallel(&self) -> TensorParallel {
        let tp = self.groups.tp.clone();
        TensorParallel::new(self.comm.clone(), tp, self.parallel.sequence_parallel)
    }

    /// Context-parallel setup for the model (a one-rank group without context parallelism).
    pub fn context_parallel(&self) -> ContextParallel {
        match self.groups.cp.size() {
            1 => ContextParallel::single(),
            _ => ContextParallel::new(
                self.comm.clone(),
                self.groups.cp.clone(),
                self.stats.clone(),
            ),
        }
    }

    /// Expert-parallel setup for the model (a one-rank group without expert parallelism).
    pub fn expert_parallel(&self) -> ExpertParallel {
        match self.groups.ep.size() {
            1 => ExpertParallel::single(),
            _ => ExpertParallel::new(self.comm.clone(), self.groups.ep.clone()),
        }
    }

    /// This rank's share of a batch of whole sequences: the rows of its context-parallel chunks
    /// (the batch itself without context parallelism).
    pub fn local_batch(&self, b: Batch) -> anyhow::Result<Batch> {
        local_batch(b, self.groups.cp.size(), self.coords.cp)
    }

    /// Shape of the activations between pieces for a micro-batch of `b` sequences of `s` local
    /// tokens: `[b, s / tp, h]` with sequence parallelism, else `[b, s, h]`.
    pub fn activation_shape(&self, b: usize, s: usize, h: usize) -> candle_core::Shape {
        let split = if self.parallel.sequence_parallel {
            self.groups.tp.size()
        } else {
            1
        };
        candle_core::Shape::from((b, s / split, h))
    }

    /// The pieces of each of this rank's local pipeline chunks, in local chunk order (one chunk
    /// without virtual stages; everything on a rank without pipeline parallelism).
    pub fn chunks(&self, num_layers: usize) -> Vec<Vec<Piece>> {
        let (pp, v, stage) = (
            self.groups.pp.size(),
            self.parallel.virtual_stages,
            self.coords.pp,
        );
        let layout = self.parallel.pipeline_layout.as_deref();
        let layers = parallel::config::chunk_layers(layout, pp * v, num_layers);
        let place = self.chunk_placement();
        (0..v)
            .map(|c| chunk_pieces(place.global(pp, stage, c), &layers))
            .collect()
    }

    /// The part of the model this rank holds: the layers of its pipeline chunks, the embedding on
    /// the first stage, the head on the last.
    pub fn placement(&self, num_layers: usize) -> Placement {
        let pieces: Vec<Piece> = self.chunks(num_layers).into_iter().flatten().collect();
        let layers = pieces
            .iter()
            .filter_map(|p| match p {
                Piece::Block(i) => Some(*i),
                _ => None,
            })
            .collect();
        Placement {
            tp: self.tensor_parallel(),
            cp: self.context_parallel(),
            ep: self.expert_parallel(),
            layers,
            embedding: pieces.contains(&Piece::Embedding),
            head: pieces.contains(&Piece::Head),
        }
    }

    /// Whether this rank writes logs and run outputs.
    pub fn is_main(&self) -> bool {
        self.rank == 0
    }
}

/// Every communication channel of a job with layout `cfg`, in one global order that every rank
/// computes alike (see [`Comm::prepare`]): rank by rank, the world group and the channels each
/// parallelism registers for it (`parallel::register::channels`), each listed where it first
/// appears.
pub fn job_channels(cfg: &ParallelConfig, comm: &Arc<dyn Comm>) -> anyhow::Result<Vec<Channel>> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    let world = cfg.world_size();
    let all = Channel::Group(Group::new((0..world).collect()));
    for r in 0..world {
        let c = RankCtx::new(cfg, r, comm.clone())?;
        let channels = std::iter::once(all.clone()).chain(register::channels(r, &c.groups));
        for ch in channels {
            if seen.insert(ch.clone()) {
                out.push(ch);
            }
        }
    }
    Ok(out)
}

/// The columns `chunks` of every row of `seq_len` of `v` (row-major `[rows, seq_len]`).
/// Context-parallel rank `index` of `cp`'s share of a batch of whole sequences (see
/// [`RankCtx::local_batch`]).
pub fn local_batch(b: Batch, cp: usize, index: usize) -> anyhow::Result<Batch> {
    if cp == 1 {
        return Ok(b);
    }
    let chunks = local_chunks(b.seq_len, cp, index)?;
    Ok(Batch {
        tokens: local_rows(&b.tokens, b.seq_len, &chunks),
        labels: local_rows(&b.labels, b.seq_len, &chunks),
        loss_mask: local_rows(&b.loss_mask, b.seq_len, &chunks),
        micro_batch: b.micro_batch,
        seq_len: b.seq_len / cp,
        doc_starts: b.doc_starts,
    })
}

fn local_rows<T: Copy>(v: &[T], seq_len: usize, chunks: &[std::ops::Range<usize>]) -> Vec<T> {
    v.chunks_exact(seq_len)
        .flat_map(|row| {
            chunks
                .iter()
                .flat_map(move |c| row[c.clone()].iter().copied())
        })
        .collect()
}
