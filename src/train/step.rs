//! One optimizer step of a rank: the next global batch's micro-batches through the step
//! executor (with data-parallel sync and ZeRO through its hooks), the exact global gradient norm,
//! the clipped AdamW update over the owned flat ranges, and the parameters made from it; plus what
//! the step reports (its record, the rank's state bytes).

use std::time::Instant;

use anyhow::{Context, Result};
use model::moe::LayerStats;
use parallel::dp::{global_sum_squares, norm_runs, GatherStats};
use parallel::tp::Shard;

use super::guard::{LocalNumbers, Verdict};
use super::hooks::StepSync;
use super::metrics::{self, peak_rss_mib, StateBytes, StepRecord};
use super::pipeline::{Executor, MicroBatch};
use super::routing::StepRouting;
use super::stragglers::compute_seconds;
use super::{all_reduce_f64, zero, Trainer};
use crate::lr::lr_at;
use crate::recipe::StepTiming;

/// Bytes per MiB.
const MIB: f64 = (1u64 << 20) as f64;

/// What a step measured, for its record.
struct Measured {
    start: Instant,
    loss: f64,
    lr: f64,
    grad_norm: f64,
    /// Seconds since the start when the optimizer began.
    opt_start: f64,
    /// Seconds the update took.
    optimizer_s: f64,
    run: PassStats,
    routing: Option<StepRouting>,
    verdict: Verdict,
    compute: Option<super::stragglers::ComputeSpread>,
    /// The share of the causal attention pairs computed (below 1 with documents kept apart).
    attention_share: f64,
}

/// What the step's forward and backward passes left besides gradients.
struct PassStats {
    /// This rank's summed scaled loss.
    loss: f64,
    act_peak_bytes: usize,
    graph_tensors: usize,
    moe: Vec<LayerStats>,
    gathered: GatherStats,
}

impl Trainer {
    /// One optimizer step over the next global batch: its micro-batches through the schedule,
    /// the global loss and gradient norm, the step guard's verdict, the update, the record.
    pub fn train_step(&mut self) -> Result<StepRecord> {
        if self.waits_for_device(self.step + 1) {
            // Timed from its own start: the last step's update is done first.
            crate::device::synchronize(&self.ctx.device)?;
        }
        let start = Instant::now();
        if let Some(f) = &self.observe.flight {
            f.set_step(self.step as u64 + 1);
        }
        crate::device::reset_peak(&self.ctx.device);
        self.state.grads.zero()?;
        self.ctx.stats.take(); // count this step's measurements only
        let (mbs, targets) = self.micro_batches()?;
        let attention_share = self.attention_share(&mbs)?;
        let mut run = self.forward_backward(&mbs, start)?;
        self.inject_test_fault(self.step + 1)?;
        let ctx = &self.ctx;
        let comm = ctx.comm.as_ref();
        let loss = all_reduce_f64(comm, &ctx.groups.pp, run.loss)?;
        let loss = all_reduce_f64(comm, &ctx.groups.grad, loss)?;
        // After the data-parallel gradient traffic of the step has finished on every group.
        let moe = std::mem::take(&mut run.moe);
        let mut routing = super::routing::gather(self.model.config(), moe, ctx)?;
        let (grad_norm, grad_sq) = self.grad_norm()?;
        let local = LocalNumbers {
            loss: run.loss,
            grad_sq,
        };
        // The device is done with the backward and the last update now (the norm is read): the
        // job agrees once on what the step decides by (`guard.rs`).
        let logged = self.is_logged(self.step + 1);
        let seconds = logged.then(|| compute_seconds(&self.observe.timing));
        let agreed = self.agree(&local, seconds)?;
        // A global batch without a single loss target (`data.eod_mask_loss` on data of nothing
        // but end-of-document tokens) has nothing to learn: its loss is 0/0. Every rank counted
        // the same targets, so all skip alike.
        let (loss, verdict) = if targets == 0.0 {
            let why = format!(
                "step {}: no token of the global batch has a loss target (data.eod_mask_loss \
                 masks them all); the update is skipped",
                self.step + 1
            );
            if self.ctx.is_main() {
                tracing::warn!("{why}");
            }
            (f64::NAN, Verdict::Skip(why))
        } else {
            let verdict = self.judge(self.step + 1, loss, grad_norm, &agreed.bad)?;
            (loss, verdict)
        };
        let r = &self.recipe;
        let lr = lr_at(&r.schedule, r.optimizer.lr, self.step, r.train.steps);
        let opt_start = start.elapsed().as_secs_f64();
        let updated = verdict == Verdict::Update;
        if updated {
            self.update(lr, grad_norm, routing.as_mut())?;
            if self.waits_for_device(self.step + 1) {
                crate::device::synchronize(&self.ctx.device)?;
            }
        }
        let optimizer_s = start.elapsed().as_secs_f64() - opt_start;
        self.step += 1;
        self.consumed += self.recipe.train.global_batch as u64;
        // Whether the update left the state finite is asked where the host waits anyway: in
        // the next step's agreement, or before a validation, checkpoint or the run's end.
        if updated {
            self.edge.unsettled = Some(self.step);
        }
        self.edge.stop = agreed.signal;
        let compute = self.compute_spread(agreed.compute);
        let record = self.record(Measured {
            start,
            loss,
            lr,
            grad_norm,
            opt_start,
            optimizer_s,
            run,
            routing,
            verdict,
            compute,
            attention_share,
        })?;
        if self.plan.reorder_at == Some(self.step) {
            self.reorder()?;
        }
        Ok(record)
    }

    /// Fits the schedule's order to the costs the step just measured (see `order.rs`).
    fn reorder(&mut self) -> Result<()> {
        let costs = super::order::measured(&self.ctx, &self.observe.timing)?;
        let before = super::order::simulated_bubble(&self.plan.schedule, costs)?;
        if let Err(e) = self.set_order(costs) {
            // Every rank measured the same costs and fails alike: all keep the order they have.
            if self.ctx.is_main() {
                tracing::warn!("keeping the schedule's order: {e:#}");
            }
            self.plan.reorder_at = None;
            return Ok(());
        }
        if self.ctx.is_main() {
            let after = super::order::simulated_bubble(&self.plan.schedule, costs)?;
            let ms = |s: f64| 1e3 * s;
            tracing::info!(
                "{} ordered for the measured costs per chunk: forward {:.2} ms, B {:.2} ms, \
                 W {:.2} ms (simulated bubble {before:.3} -> {after:.3})",
                self.recipe.parallel.schedule_kind().recipe_name(),
                ms(costs.forward),
                ms(costs.backward),
                ms(costs.weight)
            );
            let (pp, m) = (self.plan.schedule.pp, self.plan.schedule.m);
            let plain = super::order::one_f_one_b_bubble(pp, m, costs)?;
            if after > plain + 0.01 {
                let caps = crate::plan::memory::zbv_caps(&self.recipe)?;
                tracing::warn!(
                    "zbv's simulated bubble {after:.3} is above 1F1B's {plain:.3} on these costs: \
                     within 1F1B's activation memory its stages may hold {caps:?} chunk \
                     activations (of {} each could), which holds micro-batches back (the first \
                     stage keeps the head's logits too); parallel.schedule 1f1b or zb-h1 runs \
                     this layout faster",
                    2 * pp
                );
            }
        }
        Ok(())
    }

    /// Runs the schedule in its order for `costs` from the next step on, and keeps the costs
    /// for checkpoints.
    pub(super) fn set_order(&mut self, costs: parallel::pipeline::SimCosts) -> Result<()> {
        let schedule = super::order::ordered(&self.recipe, &self.plan.schedule, costs)?;
        let chunks = self.ctx.chunks(self.model.config().num_hidden_layers);
        self.plan.uses = super::zero::piece_uses(&schedule, self.ctx.coords.pp, &chunks);
        self.plan.schedule = schedule;
        self.progress.schedule_costs = Some([costs.forward, costs.backward, costs.weight]);
        self.plan.reorder_at = None;
        Ok(())
    }

    /// The share of the causal mask's (query, key) pairs the step's attention computes over the
    /// global batch: 1 unless documents are kept apart by the attention mask, then the pairs the
    /// document mask keeps over all of them (every rank of a gradient group counts its own
    /// micro-batches; context-parallel ranks count the same samples, which cancels).
    fn attention_share(&self, mbs: &[MicroBatch]) -> Result<f64> {
        if !self.recipe.data.reset_attention_mask {
            return Ok(1.0);
        }
        let (mut kept, mut causal) = (0f64, 0f64);
        for d in mbs.iter().filter_map(|m| m.targets.documents.as_ref()) {
            let s = d.seq_len() as f64;
            kept += d.pairs() as f64;
            causal += d.batch() as f64 * s * (s + 1.0) / 2.0;
        }
        let (ctx, grad) = (&self.ctx, &self.ctx.groups.grad);
        let kept = all_reduce_f64(ctx.comm.as_ref(), grad, kept)?;
        let causal = all_reduce_f64(ctx.comm.as_ref(), grad, causal)?;
        Ok(if causal > 0.0 { kept / causal } else { 1.0 })
    }

    /// This step's micro-batches (read and staged during the last step), with their loss scales
    /// from the global batch's token count, and a request for the next step's; with the global
    /// batch's count of loss targets.
    fn micro_batches(&mut self) -> Result<(Vec<MicroBatch>, f64)> {
        let (t, ctx) = (&self.recipe.train, &self.ctx);
        let next = (self.step + 1 < t.steps).then(|| self.consumed + t.global_batch as u64);
        let staged = self.data.prefetch.get(self.consumed, next)?;
        let local: f64 = staged.iter().map(|b| b.counted).sum();
        let grad = &ctx.groups.grad;
        let targets = all_reduce_f64(ctx.comm.as_ref(), grad, local)?;
        let scale = 1.0 / targets.max(1.0);
        let aux_scale = 1.0 / (staged.len() * grad.size()) as f64;
        let mbs = staged
            .into_iter()
            .map(|b| b.into_micro_batch(scale, aux_scale))
            .collect();
        Ok((mbs, targets))
    }

    /// The schedule's forward and backward passes over `mbs`, with the data-parallel sync and
    /// ZeRO-3 gathering through the executor's hooks, waited for at the end.
    fn forward_backward(&mut self, mbs: &[MicroBatch], start: Instant) -> Result<PassStats> {
        let (t, ctx) = (&self.recipe.train, &self.ctx);
        let local_seq = t.seq_len / ctx.groups.cp.size();
        let mut exec = Executor::new(
            &self.model,
            ctx,
            &self.plan.schedule,
            t.recompute,
            t.micro_batch,
            local_seq,
        );
        // The traced step, on a GPU each logged step (its compute time is compared across the
        // ranks), and the step whose costs order the next ones, run on the device's clock.
        let next = self.step + 1;
        let logged_on_gpu = self.ctx.device.is_cuda() && self.is_logged(next);
        let reorders = self.plan.reorder_at == Some(next);
        if self.recipe.run.trace_step == Some(next) || logged_on_gpu || reorders {
            exec = exec.timed_on_device(&self.ctx.device);
        }
        self.state.dp.start();
        if let Some(g) = &mut self.state.gather {
            g.start(self.plan.uses.clone());
        }
        let mut hooks = StepSync {
            model: &self.model,
            grads: &self.state.grads,
            dp: &mut self.state.dp,
            gather: self.state.gather.as_mut(),
        };
        let run = exec.step(mbs, &self.state.grads, &mut hooks, start)?;
        let mut gathered = GatherStats::default();
        if let Some(g) = &mut self.state.gather {
            g.finish(self.model.params())?;
            gathered = g.stats();
        }
        let reduced = self
            .state
            .dp
            .finish()
            .context("synchronising gradients across data-parallel ranks")?;
        let since_start = |i: Instant| i.saturating_duration_since(start).as_secs_f64();
        self.observe.sync_timing = reduced
            .iter()
            .map(|b| (b.bucket, since_start(b.start)..since_start(b.end)))
            .collect();
        self.observe.timing = run.timing;
        Ok(PassStats {
            loss: run.loss,
            act_peak_bytes: run.act_peak_bytes,
            graph_tensors: run.tracked,
            moe: run.moe,
            gathered,
        })
    }

    /// The clipped AdamW update at learning rate `lr`, the parameters made from it, and with
    /// auxiliary-loss-free balancing the experts' selection biases moved by the step's loads.
    fn update(&mut self, lr: f64, grad_norm: f64, routing: Option<&mut StepRouting>) -> Result<()> {
        let clip = self.recipe.train.grad_clip;
        let scale = if clip > 0.0 && grad_norm > clip {
            clip / (grad_norm + 1e-6)
        } else {
            1.0
        };
        let state = &mut self.state;
        zero::update(
            &mut state.optimizer,
            &state.grads,
            (lr, scale),
            &mut state.dp,
            (&self.model, &self.ctx),
        )?;
        self.progress.updates += 1;
        let rate = (self.model.config().moe()).map_or(0.0, |m| m.bias_update_rate);
        if let Some(r) = routing.filter(|_| rate > 0.0) {
            let bias = &mut self.progress.expert_bias;
            r.bias_max_abs = Some(super::routing::update_bias(bias, r, rate));
            self.model.set_expert_bias(bias);
        }
        Ok(())
    }

    /// The step's record (and, for the traced step, its timeline), once the device is done.
    fn record(&mut self, m: Measured) -> Result<StepRecord> {
        let (r, ctx) = (&self.recipe, &self.ctx);
        let (traced, simulated) = if r.run.trace_step == Some(self.step) {
            let optimizer = (m.opt_start, m.start.elapsed().as_secs_f64());
            let path = r.run.dir.join("trace.json");
            let (schedule, timing) = (
                &self.plan.schedule,
                (&self.observe.timing[..], m.run.act_peak_bytes),
            );
            let traced = metrics::write_trace(
                ctx,
                schedule,
                timing,
                optimizer,
                &self.observe.sync_timing,
                &path,
            )?;
            // The schedule's own bubble on the costs its actions measured (every rank's mean).
            let costs = super::order::measured(ctx, &self.observe.timing)?;
            let simulated = super::order::simulated_bubble(&self.plan.schedule, costs)?;
            (traced, Some(simulated))
        } else {
            (None, None)
        };
        // On the CPU the ring's calls run as they are made; on CUDA they return once queued, so
        // the host's clock cannot time them (a traced step shows them on the device's clock).
        let counts = ctx.stats.take(); // the step's measurements, read once
        let ring = Some(counts.ring).filter(|_| ctx.groups.cp.size() > 1 && !ctx.device.is_cuda());
        // The update's kernels may still be queued: waited for where the step's times are the
        // device's, else the step's time is its cadence (`run.timing`).
        let waits = self.waits_for_device(self.step);
        if waits {
            crate::device::synchronize(&self.ctx.device)?;
        }
        let end = Instant::now();
        let from = match self.edge.last_end {
            Some(last) if !waits => last,
            _ => m.start,
        };
        let secs = (end - from).as_secs_f64();
        self.edge.last_end = Some(end);
        let device_mem = crate::device::memory(&self.ctx.device);
        let t = &r.train;
        let tokens = (t.global_batch * t.seq_len) as f64;
        let skipped = r.model.attention_flops_per_token(t.seq_len) * (1.0 - m.attention_share);
        // Per rank (one GPU each), as the planner and Megatron-LM report it.
        let ranks = r.parallel.world_size() as f64;
        let tflops = tokens * (r.model.flops_per_token(t.seq_len) - skipped) / secs / 1e12 / ranks;
        // PaLM's count, as most tables report MFU: attention over every (query, key) pair.
        let full =
            r.model.flops_per_token(t.seq_len) + r.model.attention_flops_per_token(t.seq_len);
        let tflops_full = tokens * full / secs / 1e12 / ranks;
        let g = m.run.gathered;
        let zero3 = self.state.gather.is_some();
        let rate = metrics::StepRate {
            tokens_per_s: tokens / secs,
            tflops,
            attention_share: r.data.reset_attention_mask.then_some(m.attention_share),
            mfu: r.run.peak_tflops.map(|p| tflops / p),
            mfu_full_attention: r.run.peak_tflops.map(|p| tflops_full / p),
        };
        let memory = metrics::StepMemory {
            mem_mib: peak_rss_mib(),
            device_mem_mib: device_mem.map(|d| d.current as f64 / MIB),
            device_peak_mib: device_mem.map(|d| d.peak as f64 / MIB),
            device_pool_mib: device_mem.map(|d| d.reserved as f64 / MIB),
            device_outside_pool_mib: device_mem.map(|d| d.outside_pool as f64 / MIB),
            state: self.state_bytes(),
            act_peak_bytes: m.run.act_peak_bytes,
            graph_tensors: m.run.graph_tensors,
            param_unit_peak_bytes: g.peak_bytes,
            grad_unit_peak_bytes: counts.grads_staged_peak + counts.reductions_staged_peak,
            act_peak_max_bytes: traced.map(|s| s.act_peak_max_bytes),
        };
        let pipelined = ctx.groups.pp.size() > 1;
        let time = metrics::StepTimes {
            step_time_s: secs,
            optimizer_s: m.optimizer_s,
            gather_s: zero3.then_some(g.gather_s),
            gather_hidden: (zero3 && g.gather_s > 0.0)
                .then(|| 1.0 - (g.wait_s / g.gather_s).min(1.0)),
            ring_s: ring.map(|r| r.total_s),
            ring_exposed_s: ring.map(|r| r.wait_s + r.send_s),
            bubble: traced.filter(|_| pipelined).map(|s| s.bubble),
            bubble_simulated: simulated.filter(|_| pipelined),
            sync_overlap: traced.and_then(|s| s.sync_overlap),
            sync_exposed_s: traced.and_then(|s| s.sync_exposed_s),
        };
        Ok(StepRecord {
            step: self.step,
            loss: m.loss,
            lr: m.lr,
            grad_norm: m.grad_norm,
            rate,
            memory,
            time,
            moe: m.routing,
            consumed_samples: self.consumed,
            skipped: match m.verdict {
                Verdict::Update => None,
                Verdict::Skip(why) => Some(why),
            },
            compute: m.compute,
        })
    }

    /// Whether step `step` (1-based) is timed on its own, the host waiting for the device at
    /// its start and its end: every step with `run.timing: synchronized`; else the traced and
    /// the last step, and a step a validation or checkpoint follows (which waits for its
    /// update anyway). Other steps are timed by their cadence (`run.timing`).
    fn waits_for_device(&self, step: usize) -> bool {
        let run = &self.recipe.run;
        run.timing == StepTiming::Synchronized
            || run.trace_step == Some(step)
            || step == self.recipe.train.steps
            || self.validates_after(step)
            || self.saves_after(step)
    }

    /// Bytes of this rank's persistent training state.
    pub fn state_bytes(&self) -> StateBytes {
        let param_bytes = match self.state.dp.param_shards() {
            Some(s) => s.elem_count() * s.dtype().size_in_bytes(),
            None => self
                .model
                .params()
                .iter()
                .map(|p| p.numel() * p.dtype.size_in_bytes())
                .sum(),
        };
        StateBytes {
            param_bytes,
            grad_bytes: self.state.grads.bytes(),
            optimizer_bytes: self.state.optimizer.state_bytes(),
        }
    }

    /// Whether this rank's copy of `p` is the one that counts (in the gradient norm, in
    /// checkpoints): tensor-parallel replicas count on TP index 0, the tied output matrix's copy on
    /// the last pipeline stage not at all (the first stage's embedding does).
    pub(crate) fn owns_copy(&self, p: &model::Parameter) -> bool {
        let tp_replica = p.shard == Shard::Replicated && self.ctx.coords.tp != 0;
        let tied_copy = p.kind == model::ParamKind::Embedding && !self.model.placement().embedding;
        !tp_replica && !tied_copy
    }

    /// The global gradient norm, each element counted once over the whole job (see
    /// `parallel::dp::norm`; a copy counts where [`Trainer::owns_copy`] says), and this rank's
    /// own sum of squares.
    fn grad_norm(&self) -> Result<(f64, f64)> {
        let (ctx, model) = (&self.ctx, &self.model);
        let counts: Vec<bool> = model.params().iter().map(|p| self.owns_copy(p)).collect();
        let expert = model.inventory().expert_flags();
        let split = ctx.groups.ep.size() > 1;
        let owned = self.state.optimizer.owned();
        let runs = norm_runs(self.state.grads.layout(), &counts, &expert, owned, split);
        let mut local = [0.0; 2];
        for (sum, runs) in local.iter_mut().zip(runs) {
            for r in runs {
                *sum += self.state.grads.sum_squares(r)?;
            }
        }
        let g = &ctx.groups;
        let zero = self.recipe.parallel.zero;
        let sq = global_sum_squares(ctx.comm.as_ref(), g, zero, local)?;
        Ok((sq.sqrt(), local[0] + local[1]))
    }
}
