//! `RankCtx`: one rank's place in the job — its mesh coordinates, communicator and process groups
//! — and the layer placement that follows from it ([`chunk_pieces`]).

use std::collections::HashSet;
use std::sync::Arc;

use candle_core::Device;
use data::Batch;
use model::{Piece, Placement};
use parallel::cp::{local_chunks, ContextParallel};
use parallel::ep::ExpertParallel;
use parallel::mesh::{Axis, Coords, Mesh};
use parallel::tp::TensorParallel;
use parallel::{Channel, Comm, Group, ParallelConfig};

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
    /// The gradient group: the ranks holding the same weights, which reduce their gradients
    /// (and split ZeRO state) among themselves — the data-parallel ranks and, with context
    /// parallelism, the context-parallel ranks of each (`dp × cp` ranks). Samples are split by
    /// [`RankCtx::data_index`] instead.
    pub dp: Group,
    /// Context-parallel group: the ranks sharing this rank's samples, each holding a share of
    /// every sequence.
    pub cp: Group,
    /// Which data-parallel replica this rank is (`coords.dp`): the samples it reads.
    pub data_index: usize,
    /// Number of data-parallel replicas (`parallel.dp`): the ways each global batch is split.
    pub data_size: usize,
    /// ZeRO shard group: the gradient-group ranks that split sharded state among themselves (all
    /// of `dp`, or a group of `parallel.zero_shard_size` with hybrid sharding; this rank alone at
    /// stage 0).
    pub dp_shard: Group,
    /// The ranks of the other shard groups holding the same shard (only this rank without hybrid
    /// sharding).
    pub dp_replicate: Group,
    /// Expert-parallel group: the data-parallel ranks among which each MoE layer's experts are
    /// split and tokens travel by all-to-all (this rank alone without expert parallelism).
    pub ep: Group,
    /// Expert gradient group: the gradient-group ranks holding this rank's experts, which reduce
    /// (and, with ZeRO, shard) the experts' gradients (the gradient group without expert
    /// parallelism).
    pub expert_dp: Group,
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
        let coords = mesh.coords(rank);
        let dp = mesh.group_across(&[Axis::Dp, Axis::Cp], rank);
        // Gradient-group index d = r · n + s: shard s of shard group r (shards vary fastest).
        let n = cfg.shard_size();
        let d = dp.index_of(rank).expect("a rank is in its gradient group");
        let (r, s) = (d / n, d % n);
        let members = dp.ranks();
        Ok(Self {
            rank,
            coords,
            cp: mesh.group(Axis::Cp, rank),
            data_index: coords.dp,
            data_size: mesh.size(Axis::Dp),
            dp_shard: Group::new(members[r * n..(r + 1) * n].to_vec()),
            dp_replicate: Group::new(members.iter().skip(s).step_by(n).copied().collect()),
            dp,
            ep: mesh.ep_group(rank),
            expert_dp: mesh.expert_grad_group(rank),
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

    /// Context-parallel setup for the model (a one-rank group without context parallelism).
    pub fn context_parallel(&self) -> ContextParallel {
        if self.cp.size() == 1 {
            ContextParallel::single()
        } else {
            ContextParallel::new(self.comm.clone(), self.cp.clone())
        }
    }

    /// Expert-parallel setup for the model (a one-rank group without expert parallelism).
    pub fn expert_parallel(&self) -> ExpertParallel {
        if self.ep.size() == 1 {
            ExpertParallel::single()
        } else {
            ExpertParallel::new(self.comm.clone(), self.ep.clone())
        }
    }

    /// This rank's share of a batch of whole sequences: the rows of its context-parallel chunks
    /// (the batch itself without context parallelism).
    pub fn local_batch(&self, b: Batch) -> anyhow::Result<Batch> {
        local_batch(b, self.cp.size(), self.coords.cp)
    }

    /// Shape of the activations between pieces for a micro-batch of `b` sequences of `s` local
    /// tokens: `[b, s / tp, h]` with sequence parallelism, else `[b, s, h]`.
    pub fn activation_shape(&self, b: usize, s: usize, h: usize) -> candle_core::Shape {
        let split = if self.sequence_parallel {
            self.tp.size()
        } else {
            1
        };
        candle_core::Shape::from((b, s / split, h))
    }

    /// The pieces of each of this rank's local pipeline chunks, in local chunk order (one chunk
    /// without virtual stages; everything on a rank without pipeline parallelism).
    pub fn chunks(&self, num_layers: usize) -> Vec<Vec<Piece>> {
        let (pp, v, stage) = (self.pp.size(), self.virtual_stages, self.coords.pp);
        (0..v)
            .map(|c| chunk_pieces(stage, c, pp, v, num_layers))
            .collect()
    }

    /// The part of the model this rank holds: the layers of its pipeline chunks, the embedding on
    /// the first stage, the head on the last.
    pub fn placement(&self, num_layers: usize) -> Placement {
        let (pp, stage) = (self.pp.size(), self.coords.pp);
        let layers = self
            .chunks(num_layers)
            .into_iter()
            .flatten()
            .filter_map(|p| match p {
                Piece::Block(i) => Some(i),
                _ => None,
            })
            .collect();
        Placement {
            tp: self.tensor_parallel(),
            cp: self.context_parallel(),
            ep: self.expert_parallel(),
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

/// Every communication channel of a job with layout `cfg`, in one global order that every rank
/// computes alike (see [`Comm::prepare`]): rank by rank, its world, tensor-, context-,
/// gradient-, shard-, replica-, expert-gradient-, expert-parallel (the gradient norm's sum at
/// stage 0), pipeline- and pipeline-ends groups, its expert-parallel all-to-all group, and its
/// point-to-point directions (to the next and the previous pipeline stage, and to the next rank
/// of the context-parallel ring), each listed where it first appears.
pub fn job_channels(cfg: &ParallelConfig, comm: &Arc<dyn Comm>) -> anyhow::Result<Vec<Channel>> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    let world = cfg.world_size();
    let all = Group::new((0..world).collect());
    for r in 0..world {
        let c = RankCtx::new(cfg, r, comm.clone())?;
        let mut add = |ch: Channel| {
            if seen.insert(ch.clone()) {
                out.push(ch);
            }
        };
        for g in [
            &all,
            &c.tp,
            &c.cp,
            &c.dp,
            &c.dp_shard,
            &c.dp_replicate,
            &c.expert_dp,
            &c.ep,
            &c.pp,
        ] {
            add(Channel::Group(g.clone()));
        }
        add(Channel::Group(c.embedding_group()));
        add(Channel::AllToAll(c.ep.clone()));
        let (pp, stage) = (c.pp.ranks(), c.coords.pp);
        if pp.len() > 1 {
            let n = pp.len();
            add(Channel::P2p {
                src: r,
                dst: pp[(stage + 1) % n],
            });
            add(Channel::P2p {
                src: r,
                dst: pp[(stage + n - 1) % n],
            });
        }
        let ring = c.cp.ranks();
        if ring.len() > 1 {
            let at = c.cp.index_of(r).unwrap_or(0);
            add(Channel::P2p {
                src: r,
                dst: ring[(at + 1) % ring.len()],
            });
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

/// The pieces of local chunk `c` of pipeline stage `stage`: global chunk `c · pp + stage` holds
/// `num_layers / (pp · v)` consecutive layers, the embedding if it is the first global chunk and
/// the head if it is the last (Megatron's virtual-pipeline layout).
pub fn chunk_pieces(stage: usize, c: usize, pp: usize, v: usize, num_layers: usize) -> Vec<Piece> {
    let g = c * pp + stage;
    let per = num_layers / (pp * v);
    let mut pieces = Vec::new();
    if g == 0 {
        pieces.push(Piece::Embedding);
    }
    pieces.extend((g * per..(g + 1) * per).map(Piece::Block));
    if g + 1 == pp * v {
        pieces.push(Piece::Head);
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_hold_consecutive_layers_with_embedding_first_and_head_last() {
        use Piece::{Block, Embedding, Head};
        // One stage, one chunk: the whole model.
        assert_eq!(
            chunk_pieces(0, 0, 1, 1, 3),
            vec![Embedding, Block(0), Block(1), Block(2), Head]
        );
        // pp 2 × v 2 over 8 layers: stage 0 holds global chunks 0 and 2, stage 1 chunks 1 and 3.
        assert_eq!(
            chunk_pieces(0, 0, 2, 2, 8),
            vec![Embedding, Block(0), Block(1)]
        );
        assert_eq!(chunk_pieces(0, 1, 2, 2, 8), vec![Block(4), Block(5)]);
        assert_eq!(chunk_pieces(1, 0, 2, 2, 8), vec![Block(2), Block(3)]);
        assert_eq!(chunk_pieces(1, 1, 2, 2, 8), vec![Block(6), Block(7), Head]);
    }
}
