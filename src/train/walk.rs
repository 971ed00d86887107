//! What a step's walk of its schedule keeps track of (`pipeline.rs`): the activations held and
//! their peak ([`Activations`]), when each parameter's gradient is final ([`Finality`]), what a
//! (chunk, micro-batch) keeps between its forward and its backward ([`Live`]), and the weight
//! gradients a split backward leaves for its weight action ([`Deferred`], [`compact`]).

use std::collections::HashMap;

use anyhow::Result;
use candle_core::Tensor;
use model::moe::LayerStats;
use model::segment::{self, ParamGrad, SegmentRun};
use model::{Llama, Piece};

use super::hooks::StepHooks;

/// The activation memory of a rank's step: the distinct storages kept by its segments between
/// their forward and backward passes (tapes, or only inputs under recompute), plus the tape a
/// recomputing backward rebuilds while it runs. Parameters are not counted; a storage shared by
/// two segments (one's output is the next one's input) counts once.
#[derive(Default)]
pub(super) struct Activations {
    /// Bytes and holders of each live storage.
    pub(super) live: HashMap<usize, (usize, usize)>,
    pub(super) bytes: usize,
    pub(super) peak: usize,
}

impl Activations {
    pub(super) fn add(&mut self, held: &segment::Held) {
        for &(key, bytes) in held {
            let e = self.live.entry(key).or_insert((0, 0));
            if bytes > e.0 {
                self.bytes += bytes - e.0;
                e.0 = bytes;
            }
            e.1 += 1;
        }
        self.peak = self.peak.max(self.bytes);
    }

    pub(super) fn remove(&mut self, held: &segment::Held) {
        for (key, _) in held {
            if let Some(e) = self.live.get_mut(key) {
                e.1 -= 1;
                if e.1 == 0 {
                    self.bytes -= e.0;
                    self.live.remove(key);
                }
            }
        }
    }
}

/// When each parameter's gradient is final: before the step, every use of a parameter by a piece
/// on this rank is counted once per micro-batch; each accumulation of a piece's gradients (in its
/// backward, or in the weight action of a split backward) counts its parameters down, and a
/// parameter is final at zero. This holds for any schedule, for parameters used by
/// two pieces (the tied embedding) and for interleaved pipelines.
pub(super) struct Finality {
    pub(super) pending: Vec<usize>,
}

impl Finality {
    pub(super) fn new(model: &Llama, chunks: &[Vec<Piece>], micro_batches: usize) -> Self {
        let mut pending = vec![0usize; model.params().len()];
        for &p in chunks.iter().flatten() {
            for i in model.piece_params(p) {
                pending[i] += micro_batches;
            }
        }
        Self { pending }
    }

    /// The gradients of a piece using `params` are accumulated: calls `hooks.param_final` for
    /// each that no later accumulation adds to.
    pub(super) fn accumulated(
        &mut self,
        params: &[usize],
        hooks: &mut dyn StepHooks,
    ) -> Result<()> {
        for &i in params {
            // More accumulations than the schedule announced is a defect of the executor's
            // bookkeeping: an error, never a count wrapping below zero in a release build.
            self.pending[i] = self.pending[i].checked_sub(1).ok_or_else(|| {
                anyhow::anyhow!(
                    "parameter {i}: accumulated more often than the step's schedule uses it"
                )
            })?;
            if self.pending[i] == 0 {
                hooks.param_final(i)?;
            }
        }
        Ok(())
    }
}

/// What a (chunk, micro-batch) keeps between its forward and its backward.
pub(super) struct Live {
    pub(super) runs: Vec<(SegmentRun, segment::Held)>,
    pub(super) output: Option<Tensor>,
    pub(super) input_grad: Option<Tensor>,
}

/// A block's weight gradients that a split backward left for its weight action: the GEMM
/// factors (they hold the projections' inputs and upstream gradients) of `params`, and their
/// storages.
pub(super) struct Deferred {
    pub(super) piece: Piece,
    pub(super) params: Vec<usize>,
    pub(super) grads: Vec<(usize, ParamGrad)>,
    pub(super) held: segment::Held,
}

/// `grads` with the factors that are views into a larger buffer copied out (a buffer is kept
/// when the deferred factors viewing it cover it, as gate and up's gradients cover theirs), so
/// that waiting for the weight action does not keep the rest of that buffer alive.
pub(super) fn compact(grads: Vec<(usize, ParamGrad)>) -> Result<Vec<(usize, ParamGrad)>> {
    let key = |t: &Tensor| segment::storages(&[t]).first().copied().unwrap_or((0, 0));
    let own = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
    let mut viewed: HashMap<usize, usize> = HashMap::new(); // storage -> bytes its views cover
    for (_, g) in &grads {
        for t in g.tensors() {
            *viewed.entry(key(t).0).or_default() += own(t);
        }
    }
    let fit = |t: Tensor| -> Result<Tensor> {
        let (k, whole) = key(&t);
        match whole > viewed[&k] {
            true => Ok(t.force_contiguous()?),
            false => Ok(t),
        }
    };
    grads
        .into_iter()
        .map(|(i, g)| Ok((i, g.map_factors(fit)?)))
        .collect()
}

/// What a step's walk of the schedule carries from action to action.
#[derive(Default)]
pub(super) struct Walk {
    pub(super) live: HashMap<(usize, usize), Live>,
    /// Received activations and gradients, by (chunk, micro-batch).
    pub(super) acts: HashMap<(usize, usize), Tensor>,
    pub(super) dys: HashMap<(usize, usize), Tensor>,
    /// Weight gradients waiting for their weight action, by (chunk, micro-batch).
    pub(super) deferred: HashMap<(usize, usize), Vec<Deferred>>,
    /// The micro-batches' losses, summed where they are computed (f64, in schedule order) and
    /// read once at the end: no host wait per micro-batch on a GPU.
    pub(super) loss: Option<Tensor>,
    pub(super) held: Activations,
    pub(super) moe: Vec<LayerStats>,
    pub(super) tracked: usize,
    /// How far the host has run ahead of the device ([`super::ahead`]).
    pub(super) ahead: super::ahead::RunAhead,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records which parameters became final.
    struct Finals(Vec<usize>);

    impl StepHooks for Finals {
        fn param_final(&mut self, param: usize) -> Result<()> {
            self.0.push(param);
            Ok(())
        }
    }

    /// A parameter is final at its last announced accumulation, once; one more accumulation
    /// than announced is an error naming the parameter, not a count wrapping below zero.
    #[test]
    fn a_gradient_is_final_at_its_last_accumulation_and_never_past_it() {
        let mut finality = Finality {
            pending: vec![1, 2],
        };
        let mut finals = Finals(Vec::new());
        finality.accumulated(&[0, 1], &mut finals).unwrap();
        assert_eq!(finals.0, [0]);
        finality.accumulated(&[1], &mut finals).unwrap();
        assert_eq!(finals.0, [0, 1]);
        let e = finality.accumulated(&[1], &mut finals).unwrap_err();
        assert!(
            e.to_string()
                .contains("parameter 1: accumulated more often"),
            "{e}"
        );
        assert_eq!(finals.0, [0, 1]);
    }
}
