//! A rank's data: the training split with the background thread that reads, cuts and stages the
//! next step's micro-batches ([`super::prefetch`]), and the validation split.

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use data::{GptData, Split};

use super::pipeline::Staged;
use super::prefetch::Prefetch;
use super::{rank, RankCtx};
use crate::recipe::Recipe;

/// The splits a rank reads.
pub struct RankData {
    /// The training split (its sample count bounds a resumed run).
    pub train: Arc<GptData>,
    /// The next step's micro-batches, read, cut to this rank's share and copied to the device
    /// on a background thread during the current step.
    pub prefetch: Prefetch<Vec<Staged>>,
    /// The validation split, when validation is on.
    pub valid: Option<GptData>,
}

impl RankData {
    /// Opens the recipe's splits for rank `ctx` (relative paths from the working directory) and
    /// starts its prefetch thread.
    pub fn open(recipe: &Recipe, ctx: &RankCtx) -> Result<Self> {
        let t = &recipe.train;
        let open = |split, samples| {
            GptData::open(
                &recipe.data,
                Path::new("."),
                split,
                t.seq_len,
                t.seed,
                samples,
            )
        };
        let total_samples = (t.steps * t.global_batch) as u64;
        let train = open(Split::Train, total_samples).context("opening the training data")?;
        if train.vocab_size() > recipe.model.vocab_size {
            bail!(
                "model.vocab_size ({}) is smaller than the tokenizer's vocabulary ({})",
                recipe.model.vocab_size,
                train.vocab_size()
            );
        }
        let train = Arc::new(train);
        let prefetch = {
            let (data, gb, mb) = (train.clone(), t.global_batch, t.micro_batch);
            let (index, size) = (ctx.data_index(), ctx.data_size());
            let (cp, cp_index) = (ctx.groups.cp.size(), ctx.coords.cp);
            let device = ctx.device.clone();
            Prefetch::new(
                &format!("data-rank{}", ctx.rank),
                Arc::new(move |consumed| {
                    data::micro_batch_indices(consumed, gb, mb, index, size)
                        .iter()
                        .map(|ix| {
                            let b = rank::local_batch(data.batch(ix)?, cp, cp_index)?;
                            Staged::new(&b, &device)
                        })
                        .collect()
                }),
            )?
        };
        let valid = if t.eval_interval > 0 {
            let n = (t.eval_batches * t.global_batch) as u64;
            Some(open(Split::Valid, n).context("opening the validation data")?)
        } else {
            None
        };
        Ok(Self {
            train,
            prefetch,
            valid,
        })
    }
}
