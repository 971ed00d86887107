//! The step guard: what a step may do with its update, decided the same way on every rank.
//!
//! - Before the update: a non-finite loss or gradient norm, or a loss spike (`train.spike_factor`
//!   × the mean of the last [`SPIKE_WINDOW`] losses), halts the run or skips the update
//!   (`train.on_nonfinite`), with at most `train.max_skips` skips in a row. The loss and norm are
//!   already reduced over the job, so every rank sees the same values and decides alike; the
//!   message names the ranks and pipeline stages whose own loss or gradients were non-finite.
//! - After the update: the optimizer's state (fp32 masters, of which the parameters are copies,
//!   and the moments) must be finite, or the run halts before anything is saved. AdamW's update
//!   flags a non-finite value as it stores it (one word read, no pass over the state); Muon's
//!   state is summed. The host asks once the device is done anyway: in the next step's
//!   agreement, or before a validation, a checkpoint or the run's end ([`Trainer::settle`]),
//!   so it need not wait for the update.
//! - One world-wide reduction a step, before the update ([`Trainer::agree`]), carries every
//!   rank's answers: non-finite loss or gradients, the last update's state, the stop signals
//!   (`signals.rs`, so all ranks stop after the same step) and, on logged steps, the compute
//!   times the straggler report compares.
//!
//! [`LoopState`] is what the guard remembers across steps; checkpoints carry it, so a resumed
//! run decides as the uninterrupted one would.

use std::collections::VecDeque;

use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use parallel::{Group, ReduceOp};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tracing::warn;

use super::Trainer;
use crate::job::signals;
use crate::recipe::{OnNonFinite, SPIKE_WINDOW};

/// The training loop's state beyond the optimizer's, saved in checkpoints.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LoopState {
    /// Updates applied (steps minus skipped steps).
    pub updates: u64,
    /// Steps skipped in a row up to now.
    pub skipped_in_a_row: usize,
    /// Losses of the last accepted steps, oldest first (at most [`SPIKE_WINDOW`]).
    pub recent_losses: VecDeque<f64>,
    /// Auxiliary-loss-free balancing: each MoE layer's expert selection biases (by global
    /// layer index; identical on every rank).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub expert_bias: BTreeMap<usize, Vec<f32>>,
    /// The seconds of a chunk's forward, B and W that the zbv schedule's order was fitted to
    /// (`train/order.rs`): a resumed run takes the same order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule_costs: Option<[f64; 3]>,
}

impl LoopState {
    /// What in this state (read from the manifest of a checkpoint of step `step`) no run can
    /// have written: more updates than steps, more skips in a row than skips, a spike window
    /// beyond its length or with non-finite losses, schedule costs that are no durations.
    pub fn problems(&self, step: u64) -> Vec<String> {
        let mut p = Vec::new();
        if self.updates > step {
            p.push(format!("updates {} exceeds the step {step}", self.updates));
        } else if self.skipped_in_a_row as u64 > step - self.updates {
            p.push(format!(
                "skipped_in_a_row {} exceeds the {} steps skipped (step {step} − updates {})",
                self.skipped_in_a_row,
                step - self.updates,
                self.updates
            ));
        }
        if self.recent_losses.len() > SPIKE_WINDOW {
            p.push(format!(
                "recent_losses holds {} losses, more than the window of {SPIKE_WINDOW}",
                self.recent_losses.len()
            ));
        }
        if self.recent_losses.iter().any(|l| !l.is_finite()) {
            p.push("recent_losses holds a non-finite loss".to_string());
        }
        if let Some(c) = self.schedule_costs {
            if c.iter()
                .any(|x| !(x.is_finite() && (0.0..=3600.0).contains(x)))
            {
                p.push(format!(
                    "schedule_costs {c:?} are not seconds of a chunk's forward, B and W (each \
                     between 0 and 3600)"
                ));
            }
        }
        p
    }
}

/// What a step does with its update.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Apply it.
    Update,
    /// Discard it, for this reason.
    Skip(String),
}

/// For each question the ranks that answered yes, and with figures asked every rank's.
type Answers = (Vec<Vec<usize>>, Option<Vec<f64>>);

/// What the whole job agreed at a step ([`Trainer::agree`]).
pub struct StepAgreement {
    /// The ranks whose own loss, and whose own gradients, were not finite.
    pub bad: [Vec<usize>; 2],
    /// The stop signal some rank received, the same on every rank.
    pub signal: Option<i32>,
    /// With the step's compute time asked: every rank's, by rank.
    pub compute: Option<Vec<f64>>,
}

/// A step's own view of its numbers, before they were reduced over the job.
pub struct LocalNumbers {
    /// This rank's share of the loss (last pipeline stage; 0 elsewhere).
    pub loss: f64,
    /// This rank's sum of squared gradients.
    pub grad_sq: f64,
}

impl Trainer {
    /// Makes this rank's gradients NaN, as an overflow in its backward would, when the injected
    /// faults ([`crate::faults`]) name this step and rank.
    pub(crate) fn inject_test_fault(&self, step: usize) -> Result<()> {
        if crate::faults::faults().nan_grads == Some((step, self.ctx.rank)) {
            let flat = self.state.grads.flat();
            for r in crate::optim::spans::spans(flat.elem_count(), crate::optim::spans::SPAN) {
                let nan = Tensor::full(f32::NAN, r.len(), flat.device())?;
                flat.slice_set(&nan, 0, r.start)?;
            }
        }
        Ok(())
    }

    /// Every rank of the job.
    pub(super) fn world_group(&self) -> Group {
        Group::new((0..self.ctx.mesh.world_size()).collect())
    }

    /// Sums `flags` (one row of 0/1 per question, one column per rank) over the job: for each
    /// question, the ranks that answered yes.
    fn ranks_where(&self, flags: &[bool]) -> Result<Vec<Vec<usize>>> {
        Ok(self.exchange(flags, None)?.0)
    }

    /// [`Trainer::ranks_where`] of `flags`, and with `seconds` every rank's figure (a row of
    /// them, one column per rank), in one world-wide reduction.
    fn exchange(&self, flags: &[bool], seconds: Option<f64>) -> Result<Answers> {
        let (world, me) = (self.ctx.mesh.world_size(), self.ctx.rank);
        let rows = flags.len() + usize::from(seconds.is_some());
        let mut v = vec![0f64; rows * world];
        for (k, &f) in flags.iter().enumerate() {
            v[k * world + me] = f as u8 as f64;
        }
        if let Some(s) = seconds {
            v[flags.len() * world + me] = s;
        }
        let t = Tensor::from_vec(v, rows * world, &Device::Cpu)?;
        let summed = if world > 1 {
            self.ctx
                .comm
                .all_reduce(&self.world_group(), &t, ReduceOp::Sum)?
        } else {
            t
        };
        let v = summed.to_vec1::<f64>()?;
        let ranks = (0..flags.len())
            .map(|k| (0..world).filter(|&r| v[k * world + r] > 0.0).collect())
            .collect();
        let figures = seconds.map(|_| v[flags.len() * world..].to_vec());
        Ok((ranks, figures))
    }

    /// Step `step`'s one agreement of the whole job, once its gradient norm is read (the device
    /// has done the step's backward and the last update by then, so waiting costs nothing):
    /// which ranks saw a non-finite loss or gradient, whether the last update left any rank's
    /// state non-finite (which halts the run, see [`Trainer::settle`]), the stop signal any rank
    /// received, and with `seconds` every rank's compute time. One small world-wide reduction.
    pub(crate) fn agree(
        &mut self,
        local: &LocalNumbers,
        seconds: Option<f64>,
    ) -> Result<StepAgreement> {
        let unsettled = self.edge.unsettled.take();
        let state_bad = unsettled.is_some() && self.state.optimizer.updated_nonfinite()?;
        let [term, int] = signal_flags();
        let flags = [
            !local.loss.is_finite(),
            !local.grad_sq.is_finite(),
            state_bad,
            term,
            int,
        ];
        let (ranks, compute) = self.exchange(&flags, seconds)?;
        if let Some(step) = unsettled.filter(|_| !ranks[2].is_empty()) {
            bail!("{}", self.state_halt(step, &ranks[2]));
        }
        Ok(StepAgreement {
            bad: [ranks[0].clone(), ranks[1].clone()],
            signal: agreed_signal(&ranks[3..]),
            compute,
        })
    }

    /// `ranks` with their pipeline stages, for messages.
    fn describe(&self, ranks: &[usize]) -> String {
        let mut stages: Vec<usize> = ranks.iter().map(|&r| self.ctx.mesh.coords(r).pp).collect();
        stages.dedup();
        let list = |v: &[usize]| {
            v.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            "rank(s) {} (pipeline stage(s) {})",
            list(ranks),
            list(&stages)
        )
    }

    /// Decides what step `step` (1-based) does with its update, given the job-wide `loss` and
    /// `grad_norm` and the ranks whose own loss or gradients were non-finite (`bad`, from
    /// [`Trainer::agree`]); an error halts the run.
    pub(crate) fn judge(
        &mut self,
        step: usize,
        loss: f64,
        grad_norm: f64,
        bad: &[Vec<usize>; 2],
    ) -> Result<Verdict> {
        let loss = loss * crate::faults::faults().loss_factor(step);
        let t = &self.recipe.train;
        // One decision for the whole job: whether any rank saw a non-finite loss or gradient is
        // asked of every rank every step. The job-wide numbers are not enough: without ZeRO the
        // norm is not reduced over data-parallel replicas (their gradients are equal after the
        // all-reduce), so a replica whose gradients went bad afterwards (a faulty kernel, a bit
        // flip) is the only one to see it, and deciding alone desynchronises the collectives.
        let nonfinite = !loss.is_finite() || !grad_norm.is_finite();
        let problem = if nonfinite || bad.iter().any(|r| !r.is_empty()) {
            let mut parts = Vec::new();
            if !bad[0].is_empty() {
                parts.push(format!("non-finite loss on {}", self.describe(&bad[0])));
            }
            if !bad[1].is_empty() {
                parts.push(format!(
                    "non-finite gradients on {}",
                    self.describe(&bad[1])
                ));
            }
            if parts.is_empty() {
                parts.push("overflow in the job-wide reduction".into());
            }
            Some(format!(
                "step {step}: loss {loss}, gradient norm {grad_norm}: {}",
                parts.join("; ")
            ))
        } else {
            spike(&self.progress.recent_losses, t.spike_factor, loss, step)
        };
        let Some(problem) = problem else {
            let p = &mut self.progress;
            p.skipped_in_a_row = 0;
            p.recent_losses.push_back(loss);
            while p.recent_losses.len() > SPIKE_WINDOW {
                p.recent_losses.pop_front();
            }
            return Ok(Verdict::Update);
        };
        match t.on_nonfinite {
            OnNonFinite::Halt => {
                let last = ckpt::find_latest(&self.checkpoint_root()).ok().flatten();
                let kept = match last {
                    Some(dir) => format!("the last checkpoint, {}, is untouched", dir.display()),
                    None => "no checkpoint has been written".into(),
                };
                bail!("{problem}; halting before the update (train.on_nonfinite: halt; {kept})")
            }
            OnNonFinite::Skip if self.progress.skipped_in_a_row >= t.max_skips => bail!(
                "{problem}; halting: {} steps in a row were skipped already (train.max_skips)",
                self.progress.skipped_in_a_row
            ),
            OnNonFinite::Skip => {
                self.progress.skipped_in_a_row += 1;
                if self.ctx.is_main() {
                    warn!("{problem}; update skipped (train.on_nonfinite: skip)");
                }
                Ok(Verdict::Skip(problem))
            }
        }
    }

    /// Halts if the last update not yet checked made any rank's parameters or optimizer moments
    /// non-finite (AdamW's flag, one word read once the device has done the update; Muon's
    /// state summed), with one small collective; nothing when every update is checked. The next
    /// step asks in its agreement ([`Trainer::agree`]); before a validation, a checkpoint or
    /// the run's end this asks: a non-finite state is never saved or updated again.
    pub fn settle(&mut self) -> Result<()> {
        let Some(step) = self.edge.unsettled.take() else {
            return Ok(());
        };
        let bad = self.state.optimizer.updated_nonfinite()?;
        let answers = self.ranks_where(&[bad])?;
        if !answers[0].is_empty() {
            bail!("{}", self.state_halt(step, &answers[0]));
        }
        Ok(())
    }

    /// Why the run halts when step `step`'s update left the state of `ranks` non-finite.
    fn state_halt(&self, step: usize, ranks: &[usize]) -> String {
        format!(
            "step {step}: the update made parameters or optimizer moments non-finite on {}; \
             halting before anything is saved (is optimizer.lr too large?)",
            self.describe(ranks)
        )
    }

    /// The stop signal some rank has received, agreed by every rank (one small collective):
    /// asked again after a validation, which may take long enough for a scheduler's grace period.
    pub(crate) fn stop_signal(&self) -> Result<Option<i32>> {
        let answers = self.ranks_where(&signal_flags())?;
        Ok(agreed_signal(&answers))
    }
}

/// `[this rank received SIGTERM, … SIGINT]`.
fn signal_flags() -> [bool; 2] {
    let sig = signals::pending();
    [
        sig == Some(signals::STOP_SIGNALS[0]),
        sig == Some(signals::STOP_SIGNALS[1]),
    ]
}

/// The first stop signal any rank received, from the ranks that flagged each.
fn agreed_signal(ranks: &[Vec<usize>]) -> Option<i32> {
    signals::STOP_SIGNALS
        .iter()
        .zip(ranks)
        .find(|(_, r)| !r.is_empty())
        .map(|(&s, _)| s)
}

/// The spike rule: with `factor` k set and a full window of `recent` losses, a `loss` above k
/// times their mean is a problem (described for step `step`).
fn spike(recent: &VecDeque<f64>, factor: Option<f64>, loss: f64, step: usize) -> Option<String> {
    let k = factor?;
    if recent.len() < SPIKE_WINDOW {
        return None;
    }
    let mean = recent.iter().sum::<f64>() / recent.len() as f64;
    (loss > k * mean).then(|| {
        format!(
            "step {step}: loss spike: {loss:.4} is above train.spike_factor × the mean of the \
             last {SPIKE_WINDOW} steps ({k} × {mean:.4})"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The spike rule on its own: above k × the window's mean is a spike, at or below it is
    /// not, and a window one short of full never is.
    #[test]
    fn a_spike_is_above_the_factor_times_a_full_windows_mean() {
        let full: VecDeque<f64> = (0..SPIKE_WINDOW)
            .map(|i| 0.9 + 0.2 * (i % 2) as f64)
            .collect();
        let mean = full.iter().sum::<f64>() / SPIKE_WINDOW as f64;
        assert!((mean - 1.0).abs() < 1e-12);
        let k = 3.0;
        let e = spike(&full, Some(k), 3.0 * mean + 1e-9, 7).unwrap();
        assert!(
            e.starts_with("step 7: loss spike: 3.0000") && e.contains("(3 × 1.0000)"),
            "{e}"
        );
        assert_eq!(spike(&full, Some(k), 3.0 * mean - 1e-9, 7), None);
        assert_eq!(spike(&full, None, 1e9, 7), None);
        let mut short = full.clone();
        short.pop_front();
        assert_eq!(spike(&short, Some(k), 1e9, 7), None);
    }
}
