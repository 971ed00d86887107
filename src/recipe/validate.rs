//! Recipe validation: every inconsistency becomes a message naming its fields, found before any
//! allocation.

use super::{LrCurve, Recipe};

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
        p
    }

    fn check_parallel(&self, p: &mut Vec<String>) {
        let (par, m) = (&self.parallel, &self.model);
        for (field, v) in [
            ("dp", par.dp),
            ("tp", par.tp),
            ("pp", par.pp),
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
        if m.num_attention_heads % par.tp != 0 || m.num_key_value_heads % par.tp != 0 {
            p.push(format!(
                "parallel.tp ({}) must divide model.num_attention_heads ({}) and model.num_key_value_heads ({})",
                par.tp, m.num_attention_heads, m.num_key_value_heads
            ));
        }
        if m.intermediate_size % par.tp != 0 {
            p.push(format!(
                "parallel.tp ({}) must divide model.intermediate_size ({})",
                par.tp, m.intermediate_size
            ));
        }
        if m.vocab_size % par.tp != 0 {
            p.push(format!(
                "parallel.tp ({}) must divide model.vocab_size ({})",
                par.tp, m.vocab_size
            ));
        }
        let chunks = par.pp * par.virtual_stages;
        if m.num_hidden_layers % chunks != 0 {
            p.push(format!(
                "parallel.pp × parallel.virtual_stages ({} × {}) must divide model.num_hidden_layers ({})",
                par.pp, par.virtual_stages, m.num_hidden_layers
            ));
        }
        if par.virtual_stages > 1 && par.pp == 1 {
            p.push("parallel.virtual_stages > 1 needs parallel.pp > 1".into());
        }
        if par.sequence_parallel && par.tp == 1 {
            p.push("parallel.sequence_parallel needs parallel.tp > 1".into());
        }
        if par.sequence_parallel && !self.train.seq_len.is_multiple_of(par.tp) {
            p.push(format!(
                "parallel.sequence_parallel: train.seq_len ({}) must be divisible by parallel.tp ({})",
                self.train.seq_len, par.tp
            ));
        }
        if !(par.timeout_s > 0.0 && par.timeout_s <= 1e7) {
            p.push(format!(
                "parallel.timeout_s ({}) must be positive and at most 1e7 seconds",
                par.timeout_s
            ));
        }
        if let Some(z) = par.zero1 {
            p.push(format!(
                "parallel.zero1 was replaced by parallel.zero (0-3); write parallel.zero: {}",
                u8::from(z)
            ));
        }
        if par.zero > 3 {
            p.push(format!("parallel.zero ({}) must be 0, 1, 2 or 3", par.zero));
        }
        if par.zero > 0 && par.dp == 1 {
            p.push(format!(
                "parallel.zero: {} shards state across data-parallel ranks and needs parallel.dp > 1",
                par.zero
            ));
        }
        if let Some(n) = par.zero_shard_size {
            if par.zero == 0 {
                p.push("parallel.zero_shard_size needs parallel.zero >= 1".into());
            } else if n == 0 || !par.dp.is_multiple_of(n) {
                p.push(format!(
                    "parallel.zero_shard_size ({n}) must divide parallel.dp ({})",
                    par.dp
                ));
            }
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
        if t.micro_batch > 0 && par.dp > 0 && t.global_batch % (t.micro_batch * par.dp) != 0 {
            p.push(format!(
                "train.global_batch ({}) must be divisible by train.micro_batch × parallel.dp ({} × {} = {})",
                t.global_batch,
                t.micro_batch,
                par.dp,
                t.micro_batch * par.dp
            ));
        } else if par.virtual_stages > 1 && t.micro_batch > 0 && par.dp > 0 {
            let m = t.global_batch / (t.micro_batch * par.dp);
            if m % par.pp != 0 {
                p.push(format!(
                    "interleaved pipeline: micro-batches per step ({m} = train.global_batch / (train.micro_batch × parallel.dp)) must be a multiple of parallel.pp ({})",
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
        if t.eval_interval > 0 && t.eval_batches == 0 {
            p.push("train.eval_batches must be positive when train.eval_interval is set".into());
        }
        if self.run.log_interval == 0 {
            p.push("run.log_interval must be positive".into());
        }
        if self.checkpoint.keep == 0 {
            p.push("checkpoint.keep must be at least 1".into());
        }
    }

    fn check_optimizer(&self, p: &mut Vec<String>) {
        let (o, s) = (&self.optimizer, &self.schedule);
        if !(o.lr > 0.0 && o.lr.is_finite()) {
            p.push(format!("optimizer.lr ({}) must be positive", o.lr));
        }
        for (field, b) in [("beta1", o.beta1), ("beta2", o.beta2)] {
            if !(0.0..1.0).contains(&b) {
                p.push(format!("optimizer.{field} ({b}) must be in [0, 1)"));
            }
        }
        if o.eps.is_nan() || o.eps <= 0.0 {
            p.push(format!("optimizer.eps ({}) must be positive", o.eps));
        }
        if o.weight_decay.is_nan() || o.weight_decay < 0.0 {
            p.push(format!(
                "optimizer.weight_decay ({}) must be non-negative",
                o.weight_decay
            ));
        }
        if s.warmup_steps > self.train.steps {
            p.push(format!(
                "schedule.warmup_steps ({}) exceeds train.steps ({})",
                s.warmup_steps, self.train.steps
            ));
        }
        if !(s.min_lr >= 0.0 && s.min_lr <= o.lr) {
            p.push(format!(
                "schedule.min_lr ({}) must be in [0, optimizer.lr = {}]",
                s.min_lr, o.lr
            ));
        }
        if s.kind == LrCurve::Wsd && !(s.decay_fraction > 0.0 && s.decay_fraction <= 1.0) {
            p.push(format!(
                "schedule.decay_fraction ({}) must be in (0, 1]",
                s.decay_fraction
            ));
        }
    }
}
