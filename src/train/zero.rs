//! ZeRO around the model's pieces: a rank's gradient and optimizer state by stage
//! ([`rank_state`], over `parallel::dp::StateLayout`), the stage-3 gatherer's view of the
//! model's pieces ([`gatherer`], [`piece_uses`]), and the parameters made from the optimizer's
//! master weights ([`publish`]). The layout and the gathering themselves live in
//! `crates/parallel/src/dp/` (`state.rs`, `gather.rs`).

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use model::placement::state_layout;
use model::{Llama, ParamKind, Piece};
use parallel::dp::{
    moved, publish_bucket, publish_shards, publish_shards_into, DataParallel, FlatLayout, Gatherer,
    MatrixGroups, Partial, Pass, ShardPos, Spread, StateLayout, WholeMatrices, ZeroStage,
};
use parallel::pipeline::{Action, Schedule};
use parallel::tp::Shard;
use parallel::Group;

use super::RankCtx;
use crate::optim::{flatten_params, initial_owned, write_params, GradBuffer, Optimizer};
use crate::recipe::{Offload, OptimizerName, Recipe};

/// The buckets holding piece `p`'s parameters, ascending.
pub fn piece_buckets(model: &Llama, layout: &FlatLayout, p: Piece) -> Vec<usize> {
    let mut b: Vec<usize> = model
        .piece_params(p)
        .into_iter()
        .map(|i| layout.bucket_of(i))
        .collect();
    b.sort_unstable();
    b.dedup();
    b
}

/// Every piece use of one stage's action list, in order: a forward runs a chunk's pieces first
/// to last, a backward last to first.
pub fn piece_uses(
    schedule: &Schedule,
    stage: usize,
    chunks: &[Vec<Piece>],
) -> Vec<(Piece, usize, Pass)> {
    let mut uses = Vec::new();
    for a in &schedule.actions[stage] {
        match *a {
            Action::Forward { chunk, micro } => {
                uses.extend(chunks[chunk].iter().map(|&p| (p, micro, Pass::Forward)));
            }
            Action::Backward { chunk, micro } => {
                uses.extend(
                    chunks[chunk]
                        .iter()
                        .rev()
                        .map(|&p| (p, micro, Pass::Backward)),
                );
            }
            _ => {}
        }
    }
    uses
}

/// ZeRO-3's gatherer for `model`'s pieces in `chunks`, over its parameters laid out by `layout`.
pub fn gatherer(model: &Llama, layout: FlatLayout, chunks: &[Vec<Piece>]) -> Gatherer<Piece> {
    let needs = chunks
        .iter()
        .flatten()
        .map(|&p| (p, piece_buckets(model, &layout, p)))
        .collect();
    let elem = model.params().get(0).dtype.size_in_bytes();
    Gatherer::new(layout, elem, needs)
}

/// The whole flat parameters `[layout.total]` (f32) of a stage-3 rank, all-gathered bucket by
/// bucket (every rank of the shard group takes part).
pub fn gather_all(dp: &DataParallel) -> Result<Tensor> {
    let parts = (0..dp.layout().buckets.len())
        .map(|b| Ok(dp.gather(b)?.wait()?.0.to_dtype(DType::F32)?))
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&parts, 0)?)
}

/// A rank's gradients, optimizer and data parallelism at its ZeRO stage.
pub struct RankState {
    /// Gradients: whole (stages 0, 1) or this rank's shards (2, 3).
    pub grads: GradBuffer,
    /// AdamW (and Muon) over the owned flat ranges.
    pub optimizer: Optimizer,
    /// Gradient completion, sync and (stage 3) parameter shards.
    pub dp: DataParallel,
    /// Stage 3: installs the parameters pieces use.
    pub gather: Option<Gatherer<Piece>>,
}

/// The model a rank of `recipe` starts from: at ZeRO stage 3 declared without parameter values
/// (its shards come from [`rank_state`], and a piece's full parameters are installed only while
/// it runs, so the unsharded model is never held), else built with the recipe's seed; attention
/// runs on the recipe's backend (`train.attention`), blocks keep what `train.recompute` says and
/// keep documents apart as `data.reset_attention_mask` and `data.reset_position_ids` say.
pub fn rank_model(recipe: &Recipe, ctx: &RankCtx) -> Result<Llama> {
    let (c, t) = (&recipe.model, &recipe.train);
    let placement = ctx.placement(c.num_hidden_layers);
    let (dtype, device) = (t.dtype.dtype(), &ctx.device);
    let mut model = if recipe.parallel.zero.shards_parameters() {
        Llama::declare(c, placement, dtype, device)?
    } else {
        Llama::new(c, placement, t.seed, dtype, device)?
    };
    let backend = t.attention_backend();
    crate::device::prepare_attention(backend)?;
    model.set_attention_backend(backend);
    model.set_recomputed(t.recomputed());
    model.set_fp8(t.fp8.linears(c.num_hidden_layers));
    if !t.fp8.is_off() {
        crate::device::check_fp8(device, &t.fp8)?;
    }
    model.set_documents(model::DocumentUse {
        mask: recipe.data.reset_attention_mask,
        positions: recipe.data.reset_position_ids,
    });
    Ok(model)
}

/// Builds the state of rank `ctx` for `model` (from [`rank_model`]): the optimizer's master
/// weights are the model's values (stages 0-2) or, at stage 3, this rank's shards of the initial
/// values computed directly from the seed — bit for bit what sharding the built model gives.
pub fn rank_state(recipe: &Recipe, ctx: &RankCtx, model: &Llama) -> Result<RankState> {
    let par = &recipe.parallel;
    let zero = par.zero;
    let chunks = ctx.chunks(model.config().num_hidden_layers);
    let numels: Vec<usize> = model.params().iter().map(|p| p.numel()).collect();
    let shard_index = ctx.groups.shard.index_of(ctx.rank).unwrap_or(0);
    let expert_index = ctx.groups.expert_grad.index_of(ctx.rank).unwrap_or(0);
    let StateLayout { layout, owned } = state_layout(
        par,
        model.inventory(),
        &numels,
        &chunks,
        (shard_index, expert_index),
    );
    let device = &ctx.device;
    if device.is_cuda() {
        // The planner ranks only layouts this admits (the same function).
        if let Some(p) = crate::device::element_problems(recipe).first() {
            anyhow::bail!("rank {}: {p}", ctx.rank);
        }
    }
    if !zero.shards_parameters() {
        // One flat tensor in the layout's order: the update writes it in one pass.
        crate::optim::pack_params(model.params(), &layout)?;
    }
    let grads = if zero.shards_gradients() {
        GradBuffer::sharded(layout.clone(), owned.clone(), device, ctx.stats.clone())?
    } else {
        // Every parameter but a routed expert receives a gradient in every step.
        let always: Vec<bool> = model
            .inventory()
            .expert_flags()
            .iter()
            .map(|e| !e)
            .collect();
        GradBuffer::new(layout.clone(), device)?.overwriting(&always)?
    };
    let (params, optim) = (model.params(), &recipe.optimizer);
    let (master, shards) = if zero.shards_parameters() {
        let seed = recipe.train.seed;
        // Offloaded, the masters are made where they live.
        let at = match optim.offload {
            Offload::Cpu => &Device::Cpu,
            Offload::None => device,
        };
        let master = initial_owned(params, &layout, &owned, seed, at)?;
        let shards = crate::optim::spans::cast(&master, params.get(0).dtype)?;
        (Some(master), Some(moved(&shards, device)?))
    } else {
        (None, None)
    };
    let hidden = model.inventory().hidden_matrices();
    let muon = (optim.name == OptimizerName::Muon).then(|| {
        let pos = ShardPos {
            dense: (shard_index, par.shard_size()),
            expert: (expert_index, par.expert_grad_ranks()),
        };
        whole_matrices(recipe, ctx, model, &layout, pos)
    });
    let muon = muon.map(|w| (w, hidden.as_slice()));
    let optimizer = Optimizer::new(params, &layout, owned.clone(), optim, master, muon)?;
    // A tied embedding whose two uses sit on different stages (the first and the last when
    // looped; a V keeps both on the first) is summed over the pipeline's ends.
    let pl = model.placement();
    let tied_pipeline = recipe.model.tie_word_embeddings && !(pl.embedding && pl.head);
    let partial = model
        .params()
        .iter()
        .map(|p| Partial {
            over_tp: ctx.parallel.sequence_parallel && p.shard == Shard::Replicated,
            over_pipeline_ends: tied_pipeline && p.kind == ParamKind::Embedding,
        })
        .collect();
    let dp = DataParallel::new(
        (ctx.comm.clone(), ctx.stats.clone()),
        layout.clone(),
        ctx.groups.clone(),
        zero,
        partial,
        grads.flat().clone(),
        owned,
        shards,
    )?;
    let gather = zero
        .shards_parameters()
        .then(|| gatherer(model, layout, &chunks));
    Ok(RankState {
        grads,
        optimizer,
        dp,
        gather,
    })
}

/// The hidden matrices of `model` on rank `ctx` (at `pos` in its shard groups), assembled whole
/// for Muon across tensor parallelism and ZeRO shards (see `parallel::dp::matrices`). Without
/// sharding the state is replicated over the gradient groups, and the matrices are spread over
/// them instead: each is orthogonalised by one rank of the group and broadcast.
fn whole_matrices(
    recipe: &Recipe,
    ctx: &RankCtx,
    model: &Llama,
    layout: &FlatLayout,
    pos: ShardPos,
) -> WholeMatrices {
    let par = &recipe.parallel;
    let inventory = model.inventory();
    let hidden = inventory.hidden_matrices();
    // Routed experts' matrices are sharded over the expert gradient group when split off.
    let expert: Vec<bool> = (inventory.expert_flags().into_iter())
        .map(|e| e && par.ep > 1)
        .collect();
    let (g, eg) = (&ctx.groups.grad, &ctx.groups.expert_grad);
    let (spread, shard, pos) = if par.zero.shards_optimizer() {
        (Spread::Sharded, ctx.groups.shard.clone(), pos)
    } else if g.size() > 1 || eg.size() > 1 {
        let index = |group: &Group| group.index_of(ctx.rank).unwrap_or(0);
        let pos = ShardPos {
            dense: (index(g), g.size()),
            expert: (index(eg), eg.size()),
        };
        (Spread::Replicated, g.clone(), pos)
    } else {
        (Spread::Alone, ctx.groups.shard.clone(), pos)
    };
    let groups = MatrixGroups {
        shard,
        expert_grad: eg.clone(),
        tp: ctx.groups.tp.clone(),
    };
    crate::optim::muon::exchange(
        ctx.comm.clone(),
        layout,
        (spread, pos),
        groups,
        (model.params(), &hidden, &expert),
        &recipe.optimizer.muon,
    )
}

/// The optimizer's update at learning rate `lr`, gradients scaled by `scale` (clipping), and the
/// parameters made from it ([`publish`]). Offloaded, each bucket's part is handed on as soon as
/// the host has updated it and published while the host updates the next (at stage 3 the
/// shards are set once every part is updated).
pub fn update(
    optimizer: &mut Optimizer,
    grads: &GradBuffer,
    (lr, scale): (f64, f64),
    dp: &mut DataParallel,
    (model, ctx): (&Llama, &RankCtx),
) -> Result<()> {
    if dp.zero() == ZeroStage::Off && optimizer.writes_params() {
        // The parameters packed at the layout's offsets: the update writes them as it goes.
        let layout = dp.layout();
        let step = |flat: &Tensor| optimizer.step_into(grads, (lr, scale), flat);
        if model
            .params()
            .write_flat(&layout.offsets, layout.total, step)?
        {
            return Ok(());
        }
    }
    if !optimizer.offloaded() || dp.zero() == ZeroStage::Parameters {
        optimizer.step(grads, lr, scale)?;
        return publish(optimizer, dp, model, ctx);
    }
    let (layout, params) = (dp.layout(), model.params());
    let to = (params.get(0).dtype, &ctx.device);
    let groups = (
        ctx.comm.as_ref(),
        &ctx.groups.shard,
        &ctx.groups.expert_grad,
    );
    let sharded = dp.zero().shards_optimizer();
    optimizer.step_parts(grads, lr, scale, |part, masters| {
        if sharded {
            // This rank's shard of the bucket: gathered from the shard group.
            let write = |i: usize, values: &Tensor| params.get(i).set(values);
            return publish_bucket(layout, part.bucket, masters, to, groups, write);
        }
        for i in layout.buckets[part.bucket].params.clone() {
            let r = layout.range(i);
            params
                .get(i)
                .set(&masters.narrow(0, r.start - part.flat.start, r.len())?)?;
        }
        Ok(())
    })?;
    Ok(())
}

/// Makes the optimizer's owned master weights the parameters (after a step or a checkpoint
/// load): written whole (stage 0), gathered from the shard group (1, 2), or kept as this rank's
/// shards (3).
pub fn publish(
    optimizer: &Optimizer,
    dp: &mut DataParallel,
    model: &Llama,
    ctx: &RankCtx,
) -> Result<()> {
    let master = optimizer.master()?;
    match dp.zero() {
        ZeroStage::Off => write_params(model.params(), dp.layout(), &master)?,
        ZeroStage::Optimizer | ZeroStage::Gradients => {
            let (params, layout) = (model.params(), dp.layout());
            let groups = (
                ctx.comm.as_ref(),
                &ctx.groups.shard,
                &ctx.groups.expert_grad,
            );
            // Packed at the layout's offsets (`pack_params`): each bucket gathered where its
            // parameters lie. (Offloaded masters take the bucket-by-bucket path below.)
            if master.device().same_device(&ctx.device) {
                let cast = |place: &Tensor, masters: &Tensor| {
                    crate::optim::kernels::cast_into(place, masters)
                };
                let into = |flat: &Tensor| publish_shards_into(layout, &master, flat, groups, cast);
                if params.write_flat(&layout.offsets, layout.total, into)? {
                    return Ok(());
                }
            }
            let to = (params.get(0).dtype, &ctx.device);
            publish_shards(layout, &master, to, groups, |i, values| {
                params.get(i).set(values)
            })?;
        }
        ZeroStage::Parameters => {
            let dtype = dp.param_shards().map_or(DType::F32, |s| s.dtype());
            let shards = crate::optim::spans::cast(&master, dtype)?;
            dp.set_param_shards(&moved(&shards, &ctx.device)?)?
        }
    }
    Ok(())
}

/// This rank's whole parameters `[layout.total]` in f32 (at stage 3 all-gathered: every rank of
/// the shard group takes part).
pub fn whole_params(dp: &DataParallel, model: &Llama) -> Result<Tensor> {
    if dp.zero().shards_parameters() {
        gather_all(dp)
    } else {
        Ok(flatten_params(model.params(), dp.layout())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use parallel::comm::local::LocalWorld;
    use parallel::dp::owned_ranges;

    /// ZeRO-1/2's publish into the packed parameters (each bucket's shard cast into its place,
    /// the bucket gathered in place) gives every rank the parameters that gathering each bucket
    /// and writing parameter by parameter gives, bit for bit.
    #[test]
    fn publishing_into_the_packed_parameters_equals_writing_them_one_by_one() {
        use model::Placement;
        let c = crate::optim::tests::small_model();
        let comms = LocalWorld::new(2, std::time::Duration::from_secs(30));
        let group = Group::new(vec![0, 1]);
        let results: Vec<bool> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .iter()
                .enumerate()
                .map(|(rank, comm)| {
                    let (c, group) = (&c, &group);
                    s.spawn(move || -> anyhow::Result<bool> {
                        let dev = Device::Cpu;
                        let build = || Llama::new(c, Placement::whole(c), 3, DType::F32, &dev);
                        let (apart, packed) = (build()?, build()?);
                        let layout = crate::optim::layout_of(apart.params(), 700, 2);
                        crate::optim::pack_params(packed.params(), &layout)?;
                        // The job's new masters (the same on both ranks), of which this rank
                        // owns its shard of each bucket.
                        let all = Tensor::randn(0f32, 1.0, layout.total, &Device::Cpu)?;
                        let owned = owned_ranges(&layout, true, ShardPos::uniform(rank, 2));
                        let parts = owned
                            .iter()
                            .map(|r| all.narrow(0, r.start, r.len()))
                            .collect::<candle_core::Result<Vec<_>>>()?;
                        let own = Tensor::cat(&parts, 0)?;
                        let groups = (comm.as_ref() as &dyn parallel::Comm, group, group);
                        let into = |flat: &Tensor| {
                            let cast =
                                |p: &Tensor, m: &Tensor| crate::optim::kernels::cast_into(p, m);
                            publish_shards_into(&layout, &own, flat, groups, cast)
                        };
                        let params = packed.params();
                        assert!(params.write_flat(&layout.offsets, layout.total, into)?);
                        let to = (DType::F32, &dev);
                        let set = |i: usize, v: &Tensor| apart.params().get(i).set(v);
                        publish_shards(&layout, &own, to, groups, set)?;
                        let mut same = true;
                        for (a, b) in apart.params().iter().zip(params.iter()) {
                            let (a, b) = (a.tensor()?.flatten_all()?, b.tensor()?.flatten_all()?);
                            let bits = |t: &Tensor| -> candle_core::Result<Vec<u32>> {
                                Ok(t.to_vec1::<f32>()?.iter().map(|x| x.to_bits()).collect())
                            };
                            same &= bits(&a)? == bits(&b)?;
                        }
                        Ok(same)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap().unwrap())
                .collect()
        });
        assert_eq!(results, [true, true]);
    }
}
