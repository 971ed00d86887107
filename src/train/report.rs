//! What a training run logs: the layout line at the start and, per logged step, its line (loss,
//! rates, memory, ZeRO-3 gathers, the ring, MoE routing), the stragglers, and the traced step's
//! pipeline bubble and gradient-sync overlap.

use tracing::{info, warn};

use super::metrics::StepRecord;
use super::Trainer;

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

impl Trainer {
    /// The run's first lines: model, layout and micro-batches, and rank 0's state bytes.
    pub(super) fn log_start(&self) {
        let (r, c) = (&self.recipe, self.model.config());
        let attention = crate::device::prepare_attention(self.model.attention_backend())
            .unwrap_or_else(|e| e.to_string());
        info!(
            "model: {} parameters, {} layers; layout {}; {} micro-batches of {} × {} tokens per rank and step; attention {attention}",
            c.num_params(),
            c.num_hidden_layers,
            r.parallel.describe(),
            r.grad_accum_steps(),
            r.train.micro_batch,
            r.train.seq_len / r.parallel.cp
        );
        if let Some(fp8) = r.train.fp8.describe(c.num_hidden_layers) {
            info!("{fp8}");
        }
        let b = self.state_bytes();
        let host = (self.state.optimizer.offload_threads()).map_or(String::new(), |t| {
            format!(" in host memory, updated on {t} threads")
        });
        info!(
            "rank 0 state: parameters {:.2} MiB, gradients {:.2} MiB, optimizer {:.2} MiB{host}",
            mib(b.param_bytes),
            mib(b.grad_bytes),
            mib(b.optimizer_bytes)
        );
        // The planner's prediction, to read beside each step's measured `mem=` (this process's
        // peak resident memory on the CPU, the device pool's on a GPU).
        if let Ok(stages) = crate::plan::memory::stages(r) {
            let most = stages.iter().map(|s| s.bytes.total).max().unwrap_or(0);
            info!(
                "planned memory: {:.1} MiB per rank (most loaded stage; `pretrain plan` itemises \
                 it); each step's mem= is the measured peak of this process (all the thread-ranks \
                 it runs) or of the GPU's memory pool",
                mib(most as usize)
            );
        }
    }

    /// A step's lines (at the log interval, and the traced step's).
    pub(super) fn log_step(&self, rec: &StepRecord) {
        let (r, steps) = (&self.recipe, self.recipe.train.steps);
        if rec.step.is_multiple_of(r.run.log_interval) || rec.step == steps {
            info!("{}", step_line(rec, steps));
        }
        if r.run.trace_step == Some(rec.step) {
            let path = r.run.dir.join("trace.json");
            info!("step={} timeline: {}", rec.step, path.display());
        }
        if let Some(b) = rec.time.bubble {
            let (p, v, m) = (
                self.ctx.groups.pp.size() as f64,
                self.ctx.parallel.virtual_stages as f64,
                r.grad_accum_steps() as f64,
            );
            info!(
                "step={} pipeline bubble: measured {:.3} of the pipeline phase; ideal (p-1)/(v·m+p-1) = {:.3}, i.e. (p-1)/(v·m) = {:.3} of the compute time",
                rec.step,
                b,
                (p - 1.0) / (v * m + p - 1.0),
                (p - 1.0) / (v * m),
            );
        }
        if let Some(c) = rec.compute.as_ref().filter(|c| !c.stragglers.is_empty()) {
            let named: Vec<String> = c
                .stragglers
                .iter()
                .map(|s| {
                    format!(
                        "rank {} {:.1} ms ({:.2}x)",
                        s.rank,
                        1e3 * s.compute_s,
                        s.ratio
                    )
                })
                .collect();
            warn!(
                "step={} stragglers (compute above {}x the median {:.1} ms): {}",
                rec.step,
                r.run.straggler_factor,
                1e3 * c.compute_median_s,
                named.join(", ")
            );
        }
        if let (Some(o), Some(t)) = (rec.time.sync_overlap, rec.time.sync_exposed_s) {
            info!(
                "step={} data-parallel gradient sync: {:.0}% of the buckets reduced during the backward passes; the step waited {:.1} ms for the rest",
                rec.step,
                100.0 * o,
                1e3 * t
            );
        }
    }
}

/// A loss for the log: `n/a` when nothing had a loss target (NaN).
pub fn loss_text(loss: f64) -> String {
    if loss.is_nan() {
        "n/a".into()
    } else {
        format!("{loss:.4}")
    }
}

/// The log line of a step of `steps`.
fn step_line(rec: &StepRecord, steps: usize) -> String {
    // Both counts where the peak is known: causal attention once, and over every pair.
    let mfu = match (rec.rate.mfu, rec.rate.mfu_full_attention) {
        (Some(m), Some(f)) => format!("{:.1}% mfu_full_attention={:.1}%", 100.0 * m, 100.0 * f),
        (Some(m), None) => format!("{:.1}%", 100.0 * m),
        _ => "n/a".to_string(),
    };
    let gathers = rec.time.gather_s.map_or(String::new(), |s| {
        let hidden = rec.time.gather_hidden.unwrap_or(0.0);
        format!(" gathers={:.0}ms ({:.0}% hidden)", 1e3 * s, 100.0 * hidden)
    });
    let ring = rec.time.ring_s.map_or(String::new(), |s| {
        let exposed = rec.time.ring_exposed_s.unwrap_or(0.0);
        format!(" ring={:.0}ms ({:.0}ms exposed)", 1e3 * s, 1e3 * exposed)
    });
    // On a GPU: the device memory allocated at the step's end, its peak, what the pool holds,
    // and what is in use outside it.
    let outside = rec
        .memory
        .device_outside_pool_mib
        .map_or(String::new(), |o| format!(", outside {o:.0}MiB"));
    let mem = match (
        rec.memory.device_mem_mib,
        rec.memory.device_peak_mib,
        rec.memory.device_pool_mib,
    ) {
        (Some(now), Some(peak), Some(pool)) => {
            format!("{now:.0}MiB (peak {peak:.0}MiB, pool {pool:.0}MiB{outside})")
        }
        _ => format!("{:.0}MiB", rec.memory.mem_mib),
    };
    let moe = rec.moe.as_ref().map_or(String::new(), |m| {
        let bias = m
            .bias_max_abs
            .map_or(String::new(), |b| format!(" |bias|<={b:.4}"));
        let bias = match m.dropped {
            Some(d) => format!("{bias} dropped={:.2}%", 100.0 * d),
            None => bias,
        };
        format!(
            " moe_lb={:.3} moe_z={:.3} max/mean={:.2} cv={:.2}{bias}",
            m.load_balancing, m.z_loss, m.max_over_mean, m.cv
        )
    });
    let skip = if rec.skipped.is_some() {
        " (update skipped)"
    } else {
        ""
    };
    let units = rec.memory.param_unit_peak_bytes + rec.memory.grad_unit_peak_bytes;
    let loss = loss_text(rec.loss);
    format!(
        "step={}/{} loss={loss} lr={:.3e} grad_norm={:.3} tok/s={:.0} tflops={:.3} mfu={} mem={mem} state={:.1}MiB acts={:.1}MiB units={:.1}MiB opt={:.1}ms{gathers}{ring}{moe}{skip}",
        rec.step, steps, rec.lr, rec.grad_norm, rec.rate.tokens_per_s, rec.rate.tflops, mfu,
        mib(rec.memory.state.total()), mib(rec.memory.act_peak_bytes), mib(units), 1e3 * rec.time.optimizer_s
    )
}
