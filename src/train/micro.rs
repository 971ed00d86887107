//! A micro-batch's tensors on the compute device: [`Staged`] by the data prefetch thread before
//! the global batch's token count is known, [`MicroBatch`] with its loss scales, and the
//! document starts a batch brings ([`documents`]).

use anyhow::Result;
use candle_core::{Device, Tensor};
use data::Batch;
use model::{DocumentStarts, Targets};

/// The tensors of one micro-batch on the compute device.
pub struct MicroBatch {
    /// `[b, s]` u32 input ids.
    pub tokens: Tensor,
    /// Labels, mask and loss scale for the head.
    pub targets: Targets,
}

impl MicroBatch {
    /// Moves a data batch to `device`; `loss_scale` is 1 / counted tokens of the global batch,
    /// `aux_scale` 1 / micro-batches of the global batch (see [`Targets`]).
    pub fn new(b: &Batch, loss_scale: f64, aux_scale: f64, device: &Device) -> Result<Self> {
        Ok(Staged::new(b, device)?.into_micro_batch(loss_scale, aux_scale))
    }
}

/// A micro-batch already on the compute device whose loss scales are not known yet (they need
/// the token count of the whole global batch, an all-reduce the training thread does). The data
/// prefetch thread makes these, so the host-to-device copies of the next step's batches are
/// enqueued while this step computes and never on the training thread's path.
pub struct Staged {
    /// `[b, s]` u32 input ids.
    tokens: Tensor,
    /// `[b·s]` u32 labels.
    labels: Tensor,
    /// `[b·s]` f32 loss mask.
    loss_mask: Tensor,
    /// The number of counted tokens (the loss mask's sum, read on the host before the copy).
    pub counted: f64,
    /// Where its documents start, when they are kept apart.
    documents: Option<DocumentStarts>,
}

impl Staged {
    /// Copies a data batch to `device`.
    pub fn new(b: &Batch, device: &Device) -> Result<Self> {
        let n = b.micro_batch * b.seq_len;
        Ok(Self {
            tokens: Tensor::from_slice(&b.tokens, (b.micro_batch, b.seq_len), device)?,
            labels: Tensor::from_slice(&b.labels, n, device)?,
            loss_mask: Tensor::from_slice(&b.loss_mask, n, device)?,
            counted: b.loss_mask.iter().map(|&m| m as f64).sum(),
            documents: documents(b)?,
        })
    }

    /// The micro-batch with its loss scales (see [`MicroBatch::new`]).
    pub fn into_micro_batch(self, loss_scale: f64, aux_scale: f64) -> MicroBatch {
        MicroBatch {
            tokens: self.tokens,
            targets: Targets {
                labels: self.labels,
                loss_mask: self.loss_mask,
                loss_scale,
                aux_scale,
                documents: self.documents,
            },
        }
    }
}

/// The document starts a batch brings (whole sequences: `micro_batch` rows of their length).
pub fn documents(b: &Batch) -> Result<Option<DocumentStarts>> {
    let Some(starts) = &b.doc_starts else {
        return Ok(None);
    };
    let whole = starts.len() / b.micro_batch.max(1);
    Ok(Some(DocumentStarts::new(starts.clone(), whole)?))
}
