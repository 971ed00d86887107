//! Recipe validation: every inconsistency becomes a message naming its fields, found before any
//! allocation; sizes whose memory cannot exist and products that overflow are refused by field.
//! Options that do nothing at the recipe's scale (sequence parallelism at tp = 1, ZeRO at dp = 1,
//! a warmup longer than the run) are warnings, as in Megatron-LM, and are switched off.

use super::{LrCurve, Recipe};
use model::Recompute;
use parallel::dp::ZeroStage;
use parallel::register::Dims;

/// Largest persistent training state (parameters, gradients, optimizer) one rank may hold: far
/// above any device or host of today, so only sizes that cannot exist are refused.
pub const MAX_STATE_BYTES_PER_RANK: f64 = (1u64 << 42) as f64; // 4 TiB
/// Largest number of training samples (`train.steps × train.global_batch`) a run may draw.
pub const MAX_SAMPLES: u64 = 1 << 32;
/// Most ranks a layout may have (2^20, far above any cluster of today).
pub const MAX_RANKS: usize = 1 << 20;
/// Largest number of tokens in one global batch (`train.global_batch × train.seq_len`).
pub const MAX_TOKENS_PER_STEP: u64 = 1 << 40;

/// `a × b`, or a message naming both fields when the product overflows.
fn product(a: (&str, usize), b: (&str, usize)) -> Result<usize, String> {
    a.1.checked_mul(b.1)
        .ok_or_else(|| format!("{} × {} ({} × {}) overflows", a.0, b.0, a.1, b.1))
}

impl Recipe {
    /// All problems of the recipe (empty when it is usable).
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if let Err(e) = self.model.validate() {
            p.push(e);
        }
        if let Err(e) = self.data.validate() {
            p.push(e.to_string());
        }
        self.check_parallel(&mut p);
        self.check_train(&mut p);
        self.check_optimizer(&mut p);
        self.check_policies(&mut p);
        if p.is_empty() {
            self.check_state_size(&mut p);
        }
        p
    }

    /// Switches off options that do nothing at this recipe's scale and says so: sequence
    /// parallelism at tp = 1 and ZeRO sharding at dp = 1. (A warmup longer than the run is only
    /// reported: the learning rate then never reaches its peak.) Returns the warnings.
    pub fn scale_down(&mut self) -> Vec<String> {
        let mut w = Vec::new();
        let par = &mut self.parallel;
        if par.sequence_parallel && par.tp == 1 {
            w.push(
                "parallel.sequence_parallel does nothing at parallel.tp = 1; switched off".into(),
            );
            par.sequence_parallel = false;
        }
        if par.zero.shards_optimizer() && par.grad_ranks() == 1 {
            w.push(format!(
                "parallel.zero: {} shards state across data- (and context-) parallel ranks and \
                 does nothing at parallel.dp = parallel.cp = 1; switched off",
                par.zero
            ));
            par.zero = ZeroStage::Off;
            par.zero_shard_size = None;
        }
        w.extend(self.schedule_warning());
        let dense = self.model.num_local_experts.is_none_or(|e| e == 0);
        let modules = self.train.recompute_modules.as_deref().unwrap_or_default();
        if dense && modules.contains(&model::RecomputeModule::MoeAct) {
            w.push(
                "train.recompute_modules lists moe_act, which does nothing in a dense model \
                 (model.num_local_experts is unset)"
                    .into(),
            );
        }
        w
    }

    /// A learning-rate schedule that cannot do what it says within `train.steps`: a warmup
    /// longer than the run, or one that leaves a decaying curve (`cosine`, `wsd`) too few of the
    /// steps it needs.
    fn schedule_warning(&self) -> Option<String> {
        let (s, steps) = (&self.schedule, self.train.steps);
        let warmup = s.warmup_steps;
        if warmup > steps {
            return Some(format!(
                "schedule.warmup_steps ({warmup}) exceeds train.steps ({steps}): the learning \
                 rate never reaches optimizer.lr"
            ));
        }
        match s.kind {
            LrCurve::Cosine if steps - warmup < 2 => Some(format!(
                "schedule.warmup_steps ({warmup}) fills the run of {steps} steps: the cosine \
                 curve has no steps left to decay to schedule.min_lr"
            )),
            LrCurve::Wsd => {
                let decay = ((steps as f64 * s.decay_fraction).round() as usize).max(1);
                (warmup + decay > steps).then(|| {
                    format!(
                        "schedule.warmup_steps ({warmup}) runs into the decay window of \
                         schedule.decay_fraction ({}: the last {decay} of {steps} steps): the \
                         decay to schedule.min_lr takes only {} steps",
                        s.decay_fraction,
                        steps - warmup
                    )
                })
            }
            _ => None,
        }
    }

    /// The non-finite and loss-spike policy.
    fn check_policies(&self, p: &mut Vec<String>) {
        if let Some(k) = self.train.spike_factor {
            if !(k > 1.0 && k.is_finite()) {
                p.push(format!(
                    "train.spike_factor ({k}) must be a finite factor above 1"
                ));
            }
        }
    }

    /// Refuses a persistent state (parameters, fp32 gradients and master weights, moments)
    /// per rank that no machine holds, estimated in floating point so that no size overflows.
    fn check_state_size(&self, p: &mut Vec<String>) {
        let par = &self.parallel;
        let per_rank = self.model.num_params_f64() / (par.tp * par.pp) as f64;
        let owned = per_rank / par.shard_size() as f64;
        let dtype = self.train.dtype.dtype().size_in_bytes() as f64;
        let moment = self.optimizer.state_dtype.dtype().size_in_bytes() as f64;
        let bytes = par
            .zero
            .state_bytes(per_rank, per_rank, owned, dtype, moment)
            .total();
        if bytes > MAX_STATE_BYTES_PER_RANK {
            p.push(format!(
                "the training state would take {:.1} TiB per rank ({:.3e} parameters over \
                 parallel.tp × parallel.pp = {} × {}), more than {:.0} TiB: check the model's sizes \
                 or the layout",
                bytes / (1u64 << 40) as f64,
                self.model.num_params_f64(),
                par.tp,
                par.pp,
                MAX_STATE_BYTES_PER_RANK / (1u64 << 40) as f64
            ));
        }
    }

    fn check_parallel(&self, p: &mut Vec<String>) {
        let (par, m) = (&self.parallel, &self.model);
        for (field, v) in [
            ("dp", par.dp),
            ("tp", par.tp),
            ("cp", par.cp),
            ("pp", par.pp),
            ("ep", par.ep),
            ("virtual_stages", par.virtual_stages),
            ("bucket_size", par.bucket_size),
        ] {
            if v == 0 {
                p.push(format!("parallel.{field} must be at least 1"));
            }
        }
        if p.iter().any(|e| e.starts_with("parallel.")) {
            return;
        }
        let world = [par.tp, par.cp, par.pp]
            .iter()
            .try_fold(par.dp, |acc, &n| acc.checked_mul(n));
        if world.is_none_or(|w| w > MAX_RANKS) {
            p.push(format!(
                "parallel.dp × tp × cp × pp ({} × {} × {} × {}) exceeds {MAX_RANKS} ranks",
                par.dp, par.tp, par.cp, par.pp
            ));
            return;
        }
        let dims = Dims {
            heads: m.num_attention_heads,
            kv_heads: m.num_key_value_heads,
            intermediate: m.intermediate_size,
            vocab: m.vocab_size,
            layers: m.num_hidden_layers,
            seq_len: self.train.seq_len,
            experts: m.num_local_experts,
            expert_capacity: m.moe_expert_capacity_factor.is_some(),
        };
        // Each parallelism's own checks (`crates/parallel/src/*/register.rs`).
        p.extend(parallel::register::problems(par, &dims));
        let (run, save) = (par.timeout_s, self.checkpoint.timeout_s);
        for (key, secs) in [("parallel.timeout_s", run), ("checkpoint.timeout_s", save)] {
            if !(secs > 0.0 && secs <= 1e7) {
                p.push(format!(
                    "{key} ({secs}) must be positive and at most 1e7 seconds"
                ));
            }
        }
        if self.train.backward.is_some() {
            p.push(
                "train.backward was removed: every model piece runs one forward and its \
                 hand-written backward (autograd is only the tests' reference for them); delete \
                 the key"
                    .into(),
            );
        }
        if let Some(z) = par.zero1 {
            p.push(format!(
                "parallel.zero1 was replaced by parallel.zero (0-3); write parallel.zero: {}",
                u8::from(z)
            ));
        }
    }

    fn check_train(&self, p: &mut Vec<String>) {
        let (t, par) = (&self.train, &self.parallel);
        for (field, v) in [
            ("steps", t.steps),
            ("global_batch", t.global_batch),
            ("micro_batch", t.micro_batch),
            ("seq_len", t.seq_len),
        ] {
            if v == 0 {
                p.push(format!("train.{field} must be positive"));
            }
        }
        if p.iter().any(|e| e.starts_with("train.")) {
            return;
        }
        let per_step = match product(
            ("train.micro_batch", t.micro_batch),
            ("parallel.dp", par.dp),
        ) {
            Ok(0) => return, // parallel.dp = 0, reported with the layout
            Ok(n) => n,
            Err(e) => return p.push(e),
        };
        let samples = (t.steps as u128) * (t.global_batch as u128);
        if samples > MAX_SAMPLES as u128 {
            p.push(format!(
                "train.steps × train.global_batch ({} × {} = {samples}) exceeds the {MAX_SAMPLES} samples a run may draw",
                t.steps, t.global_batch
            ));
        }
        let eval_samples = (t.eval_batches as u128) * (t.global_batch as u128);
        if eval_samples > MAX_SAMPLES as u128 {
            p.push(format!(
                "train.eval_batches × train.global_batch ({} × {} = {eval_samples}) exceeds the \
                 {MAX_SAMPLES} samples a validation may draw",
                t.eval_batches, t.global_batch
            ));
        }
        let tokens = (t.global_batch as u128) * (t.seq_len as u128);
        if tokens > MAX_TOKENS_PER_STEP as u128 {
            p.push(format!(
                "train.global_batch × train.seq_len ({} × {} = {tokens}) exceeds {MAX_TOKENS_PER_STEP} tokens per step",
                t.global_batch, t.seq_len
            ));
        }
        if t.global_batch % per_step != 0 {
            p.push(format!(
                "train.global_batch ({}) must be divisible by train.micro_batch × parallel.dp ({} × {} = {})",
                t.global_batch, t.micro_batch, par.dp, per_step
            ));
        } else if par.virtual_stages > 1 && par.pp > 0 {
            let m = t.global_batch / per_step;
            if m % par.pp != 0 {
                let schedule = match par.schedule_kind() {
                    parallel::pipeline::ScheduleKind::ZeroBubbleV => "zbv",
                    _ => "interleaved",
                };
                p.push(format!(
                    "{schedule} pipeline: micro-batches per step ({m} = train.global_batch / (train.micro_batch × parallel.dp)) must be a multiple of parallel.pp ({})",
                    par.pp
                ));
            }
        }
        if t.seq_len > self.model.max_position_embeddings {
            p.push(format!(
                "train.seq_len ({}) exceeds model.max_position_embeddings ({})",
                t.seq_len, self.model.max_position_embeddings
            ));
        }
        if t.grad_clip.is_nan() || t.grad_clip < 0.0 {
            p.push(format!(
                "train.grad_clip ({}) must be 0 (off) or positive",
                t.grad_clip
            ));
        }
        p.extend(t.attention_problems());
        p.extend(t.fp8.problems(self));
        match (&t.recompute_modules, t.recompute) {
            (Some(m), Recompute::Selective) if m.is_empty() => p.push(
                "train.recompute_modules is empty: name what `recompute: selective` recomputes \
                 (layernorm, mlp_act, moe_act, core_attn), or use train.recompute: none"
                    .into(),
            ),
            (Some(_), r) if r != Recompute::Selective => p.push(format!(
                "train.recompute_modules is set but train.recompute is {r}: the modules apply \
                 only to train.recompute: selective"
            )),
            _ => {}
        }
        if t.eval_interval > 0 && t.eval_batches == 0 {
            p.push("train.eval_batches must be positive when train.eval_interval is set".into());
        }
        if self.run.log_interval == 0 {
            p.push("run.log_interval must be positive".into());
        }
        if let Some(peak) = self
            .run
            .peak_tflops
            .filter(|p| !(p.is_finite() && *p > 0.0))
        {
            p.push(format!(
                "run.peak_tflops ({peak}) must be a positive finite number (one device's dense \
                 peak in TFLOP/s)"
            ));
        }
        if let Some(step) = self.run.trace_step.filter(|&s| s == 0 || s > t.steps) {
            p.push(format!(
                "run.trace_step ({step}) must name a step of the run, 1 to train.steps ({})",
                t.steps
            ));
        }
        let f = self.run.straggler_factor;
        if !(f.is_finite() && f > 1.0) {
            p.push(format!(
                "run.straggler_factor ({f}) must be a finite number above 1 (a rank is a \
                 straggler when slower than this many times the median)"
            ));
        }
        if self.checkpoint.keep == 0 {
            p.push("checkpoint.keep must be at least 1".into());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    fn warnings(set: &str) -> Vec<String> {
        let mut r =
            crate::recipe::load(Path::new("recipes/tiny.yaml"), &[set.to_string()]).unwrap();
        r.scale_down()
    }

    #[test]
    fn schedules_that_cannot_decay_in_the_run_are_said() {
        let base = "train.steps=8,schedule.min_lr=0.0";
        let said = |set: &str| warnings(&format!("{base},{set}")).join("; ");
        assert!(said("schedule.warmup_steps=9").contains("exceeds train.steps (8)"));
        let w = said("schedule.kind=cosine,schedule.warmup_steps=7");
        assert!(w.contains("no steps left to decay"), "{w}");
        assert_eq!(said("schedule.kind=cosine,schedule.warmup_steps=6"), "");
        let w = said("schedule.kind=wsd,schedule.warmup_steps=6,schedule.decay_fraction=0.5");
        assert!(
            w.contains("the last 4 of 8 steps") && w.contains("takes only 2 steps"),
            "{w}"
        );
        assert_eq!(
            said("schedule.kind=wsd,schedule.warmup_steps=4,schedule.decay_fraction=0.5"),
            ""
        );
        assert_eq!(said("schedule.kind=constant,schedule.warmup_steps=8"), "");
    }

    #[test]
    fn impossible_peaks_and_trace_steps_are_refused() {
        let refused = |set: &str| {
            let e = crate::recipe::load(Path::new("recipes/tiny.yaml"), &[set.to_string()])
                .unwrap_err()
                .to_string();
            assert!(e.contains(set.split('=').next().unwrap()), "{e}");
        };
        for bad in [
            "run.peak_tflops=0",
            "run.peak_tflops=-5",
            "run.peak_tflops=.inf",
        ] {
            refused(bad);
        }
        refused("run.trace_step=0");
        refused("run.trace_step=201");
        refused("train.eval_batches=18446744073709551615");
        let ok = "run.peak_tflops=989,run.trace_step=200";
        crate::recipe::load(Path::new("recipes/tiny.yaml"), &[ok.to_string()]).unwrap();
    }

    #[test]
    fn moe_recompute_in_a_dense_model_is_said() {
        let set = "train.recompute=selective,train.recompute_modules=[moe_act]";
        assert!(warnings(set)
            .join("; ")
            .contains("moe_act, which does nothing"));
    }

    #[test]
    fn newton_schulz_coefficients_that_diverge_are_refused() {
        assert_eq!(
            crate::recipe::optimizer::ns_growth([3.4445, -4.775, 2.0315]),
            None
        );
        assert_eq!(
            crate::recipe::optimizer::ns_growth([8.28721, -23.5959, 17.3004]),
            None
        );
        assert_eq!(crate::recipe::optimizer::ns_growth([2.0, -1.5, 0.5]), None);
        let (x, y) = crate::recipe::optimizer::ns_growth([1e300, 1.0, 1.0]).unwrap();
        assert!(x > 0.0 && y > 4.0, "{x} {y}");
        let r = crate::recipe::load(
            Path::new("recipes/tiny.yaml"),
            &["optimizer.name=muon,optimizer.muon.ns_coefficients=[1e300,1,1]".to_string()],
        );
        let e = format!("{:#}", r.unwrap_err());
        assert!(e.contains("optimizer.muon.ns_coefficients"), "{e}");
    }
}
