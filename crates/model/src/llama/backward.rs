//! The decoder block with a hand-written backward pass.
//!
//! candle's autograd materialises a zero gradient for every edge of a graph and adds each
//! contribution into it: about thirty full-size fills and additions per block and micro-batch,
//! 19% of a 1B step on a GPU (docs/perf.md). Here the forward runs without a graph and keeps
//! exactly the tensors its backward reads (a [`BlockTape`]); the backward calls the fused ops'
//! backward kernels and the projections' GEMMs in reverse order. Its only additions are the ones
//! the mathematics has: the two residual streams and the input gradients of the projections that
//! share an input (q, k, v; gate, up).
//!
//! It computes what autograd computes, op for op (the same kernels, dtype conversions and
//! collectives, the shared-input sums in autograd's order), so the two paths agree bit for bit on
//! the CPU (asserted by `tests/hand_written_backward.rs` for every parallel layout). Tensor parallelism
//! enters through the region entries' and exits' values and gradients
//! (`TensorParallel::{enter,exit}_{value,grad}`), context parallelism through the ring attention's
//! graph-free forward and backward (`ContextParallel::attention_{saved,bwd}`, the functions its
//! differentiable op runs). A block with a mixture of experts runs the MoE layer's own pass
//! (`moe::{forward_saved, backward}`, in `moe/saved.rs`) in place of the dense MLP's. The
//! head's hand-written pass is in `head.rs`.

use candle_core::{Result, Tensor};

use super::{Llama, MoeParts, KERNELS};
use crate::inventory::{BlockParams, MlpParams};
use crate::moe::{self, MoeTape};
use crate::ops::{self, linear, linear_to};
use crate::segment::{storages, Held, ParamGrad};
use crate::Piece;

/// What a decoder block's forward keeps for its backward pass (model dtype unless said
/// otherwise; `s` is the whole sequence, `s/tp` its share with sequence parallelism).
pub struct BlockTape {
    /// Global layer index.
    layer: usize,
    /// The block's input `[b, s(/tp), h]`.
    x: Tensor,
    /// The input's norm as the projections read it `[b, s, h]`.
    h: Tensor,
    /// Rotated queries `[b, s, hq/tp, d]`.
    q: Tensor,
    /// Rotated keys `[b, s, hkv/tp, d]`.
    k: Tensor,
    /// Values `[b, s, hkv/tp, d]`.
    v: Tensor,
    /// Attention's output `[b, s, hq/tp, d]`: in the kernel dtype on one context-parallel rank,
    /// in the model dtype from the ring.
    attn: Tensor,
    /// Attention's log-sum-exp `[b, hq/tp, s]` (f32; f64 for f64).
    lse: Tensor,
    /// The residual stream after attention `[b, s(/tp), h]`.
    x1: Tensor,
    /// The feed-forward part's.
    mlp: MlpTape,
}

/// What a block's feed-forward part keeps.
enum MlpTape {
    /// The dense SwiGLU MLP's.
    Dense {
        /// The norm of the residual as the MLP reads it `[b, s, h]`.
        h2: Tensor,
        /// Gate projection `[b, s, f/tp]`.
        gate: Tensor,
        /// Up projection `[b, s, f/tp]`.
        up: Tensor,
        /// SwiGLU of the two `[b, s, f/tp]`.
        act: Tensor,
    },
    /// The mixture of experts' (its input rows, the norm of the residual, included).
    Moe(Box<MoeTape>),
}

impl BlockTape {
    /// The storages the tape keeps alive, its input included.
    pub fn held(&self) -> Held {
        let mut kept = vec![
            &self.x, &self.h, &self.q, &self.k, &self.v, &self.attn, &self.lse, &self.x1,
        ];
        match &self.mlp {
            MlpTape::Dense { h2, gate, up, act } => kept.extend([h2, gate, up, act]),
            MlpTape::Moe(tape) => kept.extend(tape.tensors()),
        }
        storages(&kept)
    }
}

/// The attention weights and norms of a block, detached (the forward builds no graph).
struct Weights {
    norm1: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    norm2: Tensor,
}

/// A projection's backward: the input gradient `g · w` (in `x`'s shape) and the weight gradient
/// `gᵀ · x` as its factors, for the gradient buffer to accumulate with one GEMM.
pub(crate) fn projection_bwd(x: &Tensor, w: &Tensor, g: &Tensor) -> Result<(Tensor, ParamGrad)> {
    let dx = ops::linear_dx(w, g, x.shape())?;
    let (g, x) = ops::linear_factors(x, w, g)?;
    Ok((dx, ParamGrad::Product { g, x }))
}

impl Llama {
    /// Whether `piece` runs with a hand-written backward: every decoder block (this module) and
    /// the head (`head.rs`); the embedding keeps autograd.
    pub fn hand_written(&self, piece: Piece) -> bool {
        match piece {
            Piece::Block(i) => self.inventory.blocks.contains_key(&i),
            Piece::Head => self.head_hand_written(),
            Piece::Embedding => false,
        }
    }

    fn block_weights(&self, layer: usize) -> Result<(&BlockParams, Weights)> {
        let blk = self
            .inventory
            .blocks
            .get(&layer)
            .ok_or_else(|| self.missing(&format!("layer {layer}")))?;
        let w = |i: usize| Ok::<_, candle_core::Error>(self.w(i)?.detach());
        let weights = Weights {
            norm1: w(blk.input_layernorm)?,
            q: w(blk.q_proj)?,
            k: w(blk.k_proj)?,
            v: w(blk.v_proj)?,
            o: w(blk.o_proj)?,
            norm2: w(blk.post_attention_layernorm)?,
        };
        Ok((blk, weights))
    }

    /// The MoE parts of block `blk` (layer `layer`) for a hand-written pass.
    fn moe_block(&self, layer: usize, blk: &BlockParams) -> Result<MoeParts> {
        match &blk.mlp {
            MlpParams::Moe(m) => self.moe_parts(layer, m, true, true),
            MlpParams::Dense { .. } => Err(self.missing(&format!("MoE layer {layer}"))),
        }
    }

    /// Causal attention over the whole sequence without a graph (the ring under context
    /// parallelism): the output and log-sum-exp [`Llama::attention_bwd`] reads.
    fn attention_saved(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f64,
    ) -> Result<(Tensor, Tensor)> {
        let cp = &self.placement.cp;
        if cp.size() == 1 {
            ops::causal_attention_saved(q, k, v, scale)
        } else {
            cp.attention_saved(q, k, v, scale, KERNELS)
        }
    }

    /// The gradients of [`Llama::attention_saved`]'s inputs from its output's `dout`.
    fn attention_bwd(
        &self,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        saved: (&Tensor, &Tensor),
        dout: &Tensor,
        scale: f64,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let cp = &self.placement.cp;
        if cp.size() == 1 {
            ops::causal_attention_bwd(q, k, v, saved, dout, scale)
        } else {
            cp.attention_bwd((q, k, v), saved, dout, scale, KERNELS)
        }
    }

    /// The rotary tables for `s` positions and the attention scale.
    fn rope_and_scale(&self, s: usize) -> Result<(Tensor, Tensor, f64)> {
        let cp = &self.placement.cp;
        let (cos, sin) = cp.rope_rows(&self.cos, &self.sin, s * cp.size())?;
        Ok((cos, sin, 1.0 / (self.config.head_dim() as f64).sqrt()))
    }

    /// Block `layer`'s forward without a graph: its output `[b, s(/tp), h]` (the value of
    /// [`Llama::block`]) and the tape its [`Llama::block_backward`] needs. A MoE layer's
    /// balancing losses enter the objective times `aux_scale` (as in training).
    pub fn block_forward_saved(
        &self,
        layer: usize,
        x: &Tensor,
        aux_scale: f64,
    ) -> Result<(Tensor, BlockTape)> {
        let (blk, w) = self.block_weights(layer)?;
        let c = &self.config;
        let tp = &self.placement.tp;
        let (hq, hkv, d) = (
            c.num_attention_heads / tp.size(),
            c.num_key_value_heads / tp.size(),
            c.head_dim(),
        );
        let x = x.detach();
        let h = tp.enter_value(&ops::rms_norm(&x, &w.norm1, c.rms_norm_eps)?)?; // [b, s, h]
        let (b, s, _) = h.dims3()?;
        let (cos, sin, scale) = self.rope_and_scale(s)?;
        let q = linear_to(&h, &w.q, (b, s, hq, d))?; // [b, s, hq/tp, d]
        let k = linear_to(&h, &w.k, (b, s, hkv, d))?; // [b, s, hkv/tp, d]
        let v = linear_to(&h, &w.v, (b, s, hkv, d))?;
        let (q, k) = (ops::rope(&q, &cos, &sin)?, ops::rope(&k, &cos, &sin)?);
        let (attn, lse) = self.attention_saved(&q, &k, &v, scale)?;
        let a = attn.to_dtype(x.dtype())?; // [b, s, hq/tp, d]
        let o = linear_to(&a, &w.o, (b, s, c.hidden_size))?; // [b, s, h] partial
        let x1 = (&x + tp.exit_value(&o)?)?;

        let normed = ops::rms_norm(&x1, &w.norm2, c.rms_norm_eps)?; // [b, s(/tp), h]
        let (y, mlp) = match &blk.mlp {
            MlpParams::Dense {
                gate_proj,
                up_proj,
                down_proj,
            } => {
                let h2 = tp.enter_value(&normed)?; // [b, s, h]
                let gate = linear(&h2, &self.w(*gate_proj)?.detach())?; // [b, s, f/tp]
                let up = linear(&h2, &self.w(*up_proj)?.detach())?;
                let act = ops::swiglu(&gate, &up)?;
                let down = linear(&act, &self.w(*down_proj)?.detach())?;
                let y = (&x1 + tp.exit_value(&down)?)?;
                (y, MlpTape::Dense { h2, gate, up, act })
            }
            MlpParams::Moe(_) => {
                let parts = self.moe_block(layer, blk)?;
                let aux_weight = aux_scale / c.num_moe_layers() as f64;
                let (out, stats, tape) = moe::forward_saved(
                    &normed.flatten_to(1)?, // [b·s(/tp), h]
                    &parts.router(),
                    &parts.experts,
                    &self.placement.ep,
                    self.moe_split(),
                    &parts.cfg,
                    layer,
                    aux_weight,
                )?;
                self.record_moe(stats);
                let y = (&x1 + out.reshape(normed.shape())?)?;
                (y, MlpTape::Moe(Box::new(tape)))
            }
        };
        let tape = BlockTape {
            layer,
            x,
            h,
            q,
            k,
            v,
            attn,
            lse,
            x1,
            mlp,
        };
        Ok((y, tape))
    }

    /// The backward pass of a block from its tape and the output's gradient `dy`
    /// `[b, s(/tp), h]`: the input's gradient and every parameter's, by parameter index (the
    /// projections' as the factors of `gᵀ · x`).
    pub fn block_backward(
        &self,
        tape: BlockTape,
        dy: &Tensor,
    ) -> Result<(Tensor, Vec<(usize, ParamGrad)>)> {
        let BlockTape {
            layer,
            x,
            h,
            q,
            k,
            v,
            attn,
            lse,
            x1,
            mlp,
        } = tape;
        let (blk, w) = self.block_weights(layer)?;
        let (c, tp) = (&self.config, &self.placement.tp);
        let dy = dy.to_dtype(x.dtype())?;
        let mut grads = Vec::with_capacity(9);

        // The feed-forward part: y = x1 + mlp(norm(x1)).
        let (dx1, d_norm2) = match (mlp, &blk.mlp) {
            (
                MlpTape::Dense { h2, gate, up, act },
                MlpParams::Dense {
                    gate_proj,
                    up_proj,
                    down_proj,
                },
            ) => {
                // mlp = exit(swiglu(h2 gᵀ, h2 uᵀ) dᵀ), h2 = enter(norm(x1)).
                let dd = tp.exit_grad(&dy)?; // [b, s, h]
                let wt = |i: usize| Ok::<_, candle_core::Error>(self.w(i)?.detach());
                let (dact, d_down) = projection_bwd(&act, &wt(*down_proj)?, &dd)?; // [b, s, f/tp]
                let (dgate, dup) = ops::swiglu_bwd(&gate, &up, &dact)?;
                let (dh2_up, d_up) = projection_bwd(&h2, &wt(*up_proj)?, &dup)?; // [b, s, h] partial
                let (dh2_gate, d_gate) = projection_bwd(&h2, &wt(*gate_proj)?, &dgate)?;
                let dh2 = (dh2_up + dh2_gate)?;
                grads.extend([(*gate_proj, d_gate), (*up_proj, d_up), (*down_proj, d_down)]);
                ops::rms_norm_bwd(&x1, &w.norm2, c.rms_norm_eps, &tp.enter_grad(&dh2)?)?
            }
            (MlpTape::Moe(tape), MlpParams::Moe(m)) => {
                let parts = self.moe_block(layer, blk)?;
                let g = moe::backward(
                    *tape,
                    &parts.weight,
                    &parts.experts,
                    &self.placement.ep,
                    &dy.flatten_to(1)?,
                )?;
                grads.push((m.router, ParamGrad::Tensor(g.router)));
                for (e, g) in m.experts.iter().zip(g.experts) {
                    if let Some([d1, d3, d2]) = g {
                        grads.extend([(e.w1, d1), (e.w3, d3), (e.w2, d2)]);
                    }
                }
                let dh2 = g.dx.reshape(x1.shape())?; // [b, s(/tp), h]
                ops::rms_norm_bwd(&x1, &w.norm2, c.rms_norm_eps, &dh2)?
            }
            _ => return Err(self.missing(&format!("the feed-forward part of layer {layer}"))),
        };
        let dx1 = (&dy + dx1)?; // [b, s(/tp), h]

        // Attention: x1 = x + exit(attn(rope(h qᵀ), rope(h kᵀ), h vᵀ) oᵀ), h = enter(norm(x)).
        let (cos, sin, scale) = self.rope_and_scale(h.dim(1)?)?;
        let dout = tp.exit_grad(&dx1)?; // [b, s, h]
        let a = attn.to_dtype(x.dtype())?;
        let (da, d_o) = projection_bwd(&a, &w.o, &dout)?; // [b, s, hq/tp, d]
        let (dq, dk, dv) = self.attention_bwd((&q, &k, &v), (&attn, &lse), &da, scale)?;
        let (dq, dk) = (
            ops::rope_bwd(&dq, &cos, &sin)?,
            ops::rope_bwd(&dk, &cos, &sin)?,
        );
        let (dh_v, d_v) = projection_bwd(&h, &w.v, &dv)?; // [b, s, h] partial
        let (dh_k, d_k) = projection_bwd(&h, &w.k, &dk)?;
        let (dh_q, d_q) = projection_bwd(&h, &w.q, &dq)?;
        let dh = ((dh_v + dh_k)? + dh_q)?;
        let (dx, d_norm1) = ops::rms_norm_bwd(&x, &w.norm1, c.rms_norm_eps, &tp.enter_grad(&dh)?)?;
        let dx = (dx1 + dx)?;
        grads.extend([
            (blk.input_layernorm, ParamGrad::Tensor(d_norm1)),
            (blk.q_proj, d_q),
            (blk.k_proj, d_k),
            (blk.v_proj, d_v),
            (blk.o_proj, d_o),
            (blk.post_attention_layernorm, ParamGrad::Tensor(d_norm2)),
        ]);
        Ok((dx, grads))
    }
}
