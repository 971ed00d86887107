//! Forward and backward of one micro-batch through the model's segments, accumulating every
//! parameter's gradient into the flat buffer.

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use data::Batch;
use model::{segment, Llama, Piece, Recompute, Targets};

use crate::optim::GradBuffer;

/// The tensors of one micro-batch on the compute device.
pub struct MicroBatch {
    /// `[b, s]` u32 input ids.
    pub tokens: Tensor,
    /// Labels, mask and loss scale for the head.
    pub targets: Targets,
}

impl MicroBatch {
    /// Moves a data batch to `device`; `loss_scale` is 1 / counted tokens of the global batch.
    pub fn new(b: &Batch, loss_scale: f64, device: &Device) -> Result<Self> {
        let n = b.micro_batch * b.seq_len;
        Ok(Self {
            tokens: Tensor::from_slice(&b.tokens, (b.micro_batch, b.seq_len), device)?,
            targets: Targets {
                labels: Tensor::from_slice(&b.labels, n, device)?,
                loss_mask: Tensor::from_slice(&b.loss_mask, n, device)?,
                loss_scale,
            },
        })
    }
}

/// Runs forward and backward of `mb`, adds the gradients into `grads` and returns the
/// micro-batch's scaled loss (its share of the global-batch mean). `ready(i)` is called for each
/// parameter right after the backward of the last piece that uses it.
pub fn forward_backward(
    model: &Llama,
    mb: &MicroBatch,
    recompute: Recompute,
    grads: &GradBuffer,
    ready: &mut dyn FnMut(usize) -> Result<()>,
) -> Result<f64> {
    let pieces = model.pieces();
    let run_piece = |piece: Piece| move |x: &Tensor| model.piece_forward(piece, x, &mb.targets);
    let mode = |piece: Piece| recompute.for_piece(piece);

    let mut runs = Vec::with_capacity(pieces.len());
    let mut x = mb.tokens.clone();
    for &piece in &pieces {
        let (y, run) = segment::forward(
            &run_piece(piece),
            &x,
            piece != Piece::Embedding,
            mode(piece),
        )?;
        runs.push(run);
        x = y;
    }
    let loss = x.to_scalar::<f32>()? as f64;

    // A parameter is final after the backward of the earliest piece (in forward order) using it.
    let mut seen = std::collections::HashSet::new();
    let first_use: Vec<Vec<usize>> = pieces
        .iter()
        .map(|&p| {
            model
                .piece_params(p)
                .into_iter()
                .filter(|i| seen.insert(*i))
                .collect()
        })
        .collect();

    let mut dy: Option<Tensor> = None;
    for ((&piece, run), finals) in pieces.iter().zip(runs).zip(&first_use).rev() {
        let (store, dx) = segment::backward(
            &run_piece(piece),
            run,
            piece != Piece::Embedding,
            dy.as_ref(),
        )?;
        for i in model.piece_params(piece) {
            let p = model.params().get(i);
            let Some(g) = store.get(p.var.as_tensor()) else {
                bail!(
                    "parameter {} received no gradient in segment {piece:?}",
                    p.name
                );
            };
            grads
                .accumulate(i, g)
                .with_context(|| format!("accumulating the gradient of {}", p.name))?;
        }
        for &i in finals {
            ready(i)?;
        }
        dy = dx;
    }
    Ok(loss)
}
