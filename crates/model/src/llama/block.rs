//! The decoder block: its forward, which builds no autograd graph and keeps exactly the tensors
//! its backward reads (a [`BlockTape`]), and its hand-written backward, which calls the fused ops'
//! backward kernels and the projections' GEMMs in reverse order.
//!
//! candle's autograd materialises a zero gradient for every edge of a graph and adds each
//! contribution into it: about thirty full-size fills and additions per block and micro-batch,
//! 19% of a 1B step on a GPU (docs/perf.md). Here the only additions are the ones the
//! mathematics has: the two residual streams and the input gradients of the projections that
//! share an input (q, k, v; gate, up), summed in that order. The projections' weight gradients
//! leave as their GEMM factors for the gradient buffer's fused accumulation.
//!
//! Tensor parallelism enters through the region entries' and exits' values and gradients
//! (`TensorParallel::{enter, exit}{,_grad}`), context parallelism through the ring attention's
//! forward and backward (`ContextParallel::{attention, attention_bwd}`, the plain kernels on one
//! rank). A block with a mixture of experts runs the MoE layer's pass (`moe::{forward,
//! backward}`, in `moe/pass.rs`) in place of the dense MLP's. The tests check the backward
//! against an autograd reference over the same ops and against finite differences
//! (`tests/hand_written_backward.rs`, `tests/moe.rs`).

use candle_core::{Result, Tensor};
use parallel::cp::DocumentStarts;

use super::project::GateUp;
use super::Llama;
use crate::config::LlamaConfig;
use crate::inventory::{BlockParams, MlpParams};
use crate::moe::{self, LayerStats, MoeTape};
use crate::ops;
use crate::segment::{ParamGrad, TapeShape};

/// What a decoder block's forward keeps for its backward pass (model dtype unless said
/// otherwise; `s` is the whole sequence, `s/tp` its share with sequence parallelism).
pub struct BlockTape {
    /// Global layer index.
    layer: usize,
    /// The block's input `[b, s(/tp), h]`.
    x: Tensor,
    /// The input's norm as the projections read it `[b, s, h]` (`None`: recomputed).
    h: Option<Tensor>,
    /// Rotated queries `[b, s, hq/tp, d]`.
    q: Tensor,
    /// Rotated keys `[b, s, hkv/tp, d]`.
    k: Tensor,
    /// Values `[b, s, hkv/tp, d]`.
    v: Tensor,
    /// Attention's output `[b, s, hq/tp, d]` (in the kernel dtype on one context-parallel rank,
    /// in the model dtype from the ring) and its log-sum-exp `[b, hq/tp, s]` (f32; f64 for
    /// f64); `None`: recomputed.
    attn: Option<(Tensor, Tensor)>,
    /// The residual stream after attention `[b, s(/tp), h]`.
    x1: Tensor,
    /// The feed-forward part's.
    mlp: MlpTape,
    /// The micro-batch's document starts, when the model keeps documents apart.
    docs: Option<DocumentStarts>,
}

/// What a block's feed-forward part keeps.
enum MlpTape {
    /// The dense SwiGLU MLP's.
    Dense {
        /// The norm of the residual as the MLP reads it `[b, s, h]` (`None`: recomputed).
        h2: Option<Tensor>,
        /// Gate and up projections, joined `[b, s, 2f/tp]` or apart.
        gu: GateUp,
        /// SwiGLU of the two `[b, s, f/tp]` (`None`: recomputed).
        act: Option<Tensor>,
    },
    /// The mixture of experts' (its input rows, the norm of the residual, included).
    Moe(Box<MoeTape>),
}

impl BlockTape {
    /// The bytes a tape of layer `layer` of model `c` keeps besides its input (dense: the
    /// attention half, the residual's norm as the MLP reads it `[n, h]`, and the MLP's gate, up
    /// and SwiGLU outputs; MoE: the attention half and [`MoeTape::bytes`]), without what
    /// `s.recomputed` drops.
    pub fn bytes(c: &LlamaConfig, s: &TapeShape, layer: usize) -> u64 {
        if c.is_moe_layer(layer) {
            return Self::attention_bytes(c, s) + MoeTape::bytes(c, s);
        }
        let f = c.intermediate_size as u64;
        let r = &s.recomputed;
        let h2 = if r.layernorm { 0 } else { s.n * s.h };
        let act = if r.mlp_act { 0 } else { s.n * f / s.t };
        Self::attention_bytes(c, s) + (h2 + 2 * s.n * f / s.t + act) * s.p
    }

    /// The attention half of a block's tape: the input's norm as the projections read it
    /// `[n, h]`, the rotated q and k, v, the attention output (in the kernel dtype, f32 for
    /// 16-bit models on the CPU, except from context parallelism's ring, which keeps the model
    /// dtype) and its f32 log-sum-exp, and the residual stream after attention `[n_s, h]`;
    /// without what `s.recomputed` drops.
    fn attention_bytes(c: &LlamaConfig, s: &TapeShape) -> u64 {
        let (n, ns, t, p, h) = (s.n, s.ns, s.t, s.p, s.h);
        let (q, kv) = (
            c.q_dim() as u64,
            (c.num_key_value_heads * c.head_dim()) as u64,
        );
        let norm = if s.recomputed.layernorm { 0 } else { n * h };
        let elems = ns * h + norm + n * (q + 2 * kv) / t;
        let attn = n * q / t * if s.upcast && !s.ring { 4 } else { p };
        let core = attn + 4 * n * c.num_attention_heads as u64 / t;
        elems * p + if s.recomputed.core_attn { 0 } else { core }
    }

    /// The tensors the tape keeps, its input included.
    pub fn tensors(&self) -> Vec<&Tensor> {
        let mut kept = vec![&self.x, &self.q, &self.k, &self.v, &self.x1];
        kept.extend(&self.h);
        kept.extend(self.attn.iter().flat_map(|(a, l)| [a, l]));
        match &self.mlp {
            MlpTape::Dense { h2, gu, act } => {
                kept.extend(gu.tensors());
                kept.extend(h2.iter().chain(act));
            }
            MlpTape::Moe(tape) => kept.extend(tape.tensors()),
        }
        kept
    }
}

/// The norms of a block (its projections are read by parameter index).
struct Weights {
    norm1: Tensor,
    norm2: Tensor,
}

impl Llama {
    fn block_weights(&self, layer: usize) -> Result<(&BlockParams, Weights)> {
        let blk = self
            .inventory
            .blocks
            .get(&layer)
            .ok_or_else(|| self.missing(&format!("layer {layer}")))?;
        let w = |i: usize| self.w(i);
        let weights = Weights {
            norm1: w(blk.input_layernorm)?,
            norm2: w(blk.post_attention_layernorm)?,
        };
        Ok((blk, weights))
    }

    /// The rotary tables for this rank's `s` rows of `b` sequences (`[s, d/2]`, or `[b, s, d/2]`
    /// when positions restart at each document) and the attention scale.
    fn rope_and_scale(
        &self,
        (b, s): (usize, usize),
        docs: Option<&DocumentStarts>,
    ) -> Result<(Tensor, Tensor, f64)> {
        let cp = &self.placement.cp;
        let scale = 1.0 / (self.config.head_dim() as f64).sqrt();
        let Some(docs) = docs.filter(|_| self.documents.positions) else {
            let (cos, sin) = cp.rope_rows(&self.cos, &self.sin, s * cp.size())?;
            return Ok((cos, sin, scale));
        };
        let rows = cp.positions(s * cp.size())?;
        let at = docs.positions(&rows); // [b·s], each row's position in its document
        let ids = Tensor::from_vec(at, b * s, self.cos.device())?;
        let half = self.cos.dim(1)?;
        let table = |t: &Tensor| t.index_select(&ids, 0)?.reshape((b, s, half));
        Ok((table(&self.cos)?, table(&self.sin)?, scale))
    }

    /// The micro-batch's document starts as attention uses them (the mask), checked against
    /// this rank's `b` rows of `s` positions.
    fn document_mask<'a>(
        &self,
        docs: Option<&'a DocumentStarts>,
        (b, s): (usize, usize),
    ) -> Result<Option<&'a DocumentStarts>> {
        let Some(d) = docs.filter(|_| self.documents.mask || self.documents.positions) else {
            return Ok(None);
        };
        let whole = s * self.placement.cp.size();
        if (d.batch(), d.seq_len()) != (b, whole) {
            candle_core::bail!(
                "document starts for {} × {} positions, but the micro-batch has {b} × {whole}",
                d.batch(),
                d.seq_len()
            )
        }
        Ok(docs.filter(|_| self.documents.mask))
    }

    /// Block `layer`'s forward: its output `[b, s(/tp), h]` (with context parallelism `s` is
    /// this rank's share of the sequence), the tape [`Llama::block_backward`] reads and a MoE
    /// layer's routing measurements. In training (`aux_scale` given) a MoE layer applies its
    /// capacity and its balancing losses enter the objective times `aux_scale`; in evaluation it
    /// is dropless and measures nothing.
    pub fn block(
        &self,
        layer: usize,
        x: &Tensor,
        aux_scale: Option<f64>,
        docs: Option<&DocumentStarts>,
    ) -> Result<(Tensor, BlockTape, Option<LayerStats>)> {
        let (blk, w) = self.block_weights(layer)?;
        let c = &self.config;
        let tp = &self.placement.tp;
        let (hq, hkv, d) = (
            c.num_attention_heads / tp.size(),
            c.num_key_value_heads / tp.size(),
            c.head_dim(),
        );
        let x = x.clone();
        let h = tp.enter(&ops::rms_norm(&x, &w.norm1, c.rms_norm_eps)?)?; // [b, s, h]
        let (b, s, _) = h.dims3()?;
        let mask = self.document_mask(docs, (b, s))?;
        let (cos, sin, scale) = self.rope_and_scale((b, s), docs)?;
        let [q, k, v] = self.project(
            layer,
            &h,
            [
                (blk.q_proj, (b, s, hq, d).into()),  // [b, s, hq/tp, d]
                (blk.k_proj, (b, s, hkv, d).into()), // [b, s, hkv/tp, d]
                (blk.v_proj, (b, s, hkv, d).into()),
            ],
        )?;
        let (q, k) = (ops::rope(&q, &cos, &sin)?, ops::rope(&k, &cos, &sin)?);
        let (attn, lse) = self.placement.cp.attention(
            (&q, &k, &v),
            scale,
            ops::attention_kernels(self.attention),
            mask,
        )?;
        let a = attn.to_dtype(x.dtype())?; // [b, s, hq/tp, d]
        let [o] = self.project(layer, &a, [(blk.o_proj, (b, s, c.hidden_size).into())])?; // [b, s, h] partial

        // x1 = x + o and its norm in one pass; [b, s(/tp), h] each.
        let (x1, normed) = ops::add_rms_norm(&x, &tp.exit(&o)?, &w.norm2, c.rms_norm_eps)?;
        let (y, mlp, stats) = match &blk.mlp {
            MlpParams::Dense {
                gate_proj,
                up_proj,
                down_proj,
            } => {
                let h2 = tp.enter(&normed)?; // [b, s, h]
                let gu = self.gate_up(layer, &h2, [*gate_proj, *up_proj])?;
                let act = gu.act()?; // [b, s, f/tp]
                let [down] =
                    self.project(layer, &act, [(*down_proj, (b, s, c.hidden_size).into())])?;
                let y = ops::add(&x1, &tp.exit(&down)?)?;
                let r = &self.recomputed;
                let tape = MlpTape::Dense {
                    h2: (!r.layernorm).then_some(h2),
                    gu,
                    act: (!r.mlp_act).then_some(act),
                };
                (y, tape, None)
            }
            MlpParams::Moe(m) => {
                let parts = self.moe_parts(layer, m, aux_scale.is_some())?;
                let aux_weight = aux_scale.unwrap_or(0.0) / c.num_moe_layers() as f64;
                let (out, stats, tape) = moe::forward(
                    &normed.flatten_to(1)?, // [b·s(/tp), h]
                    &parts.router(),
                    &parts.experts,
                    &self.placement.ep,
                    tp,
                    &parts.cfg,
                    layer,
                    aux_weight,
                )?;
                let y = ops::add(&x1, &out.reshape(normed.shape())?)?;
                let mut tape = Box::new(tape);
                tape.forget(self.recomputed.layernorm, self.recomputed.moe_act);
                (y, MlpTape::Moe(tape), aux_scale.map(|_| stats))
            }
        };
        let r = &self.recomputed;
        let tape = BlockTape {
            layer,
            x,
            h: (!r.layernorm).then_some(h),
            q,
            k,
            v,
            attn: (!r.core_attn).then_some((attn, lse)),
            x1,
            mlp,
            docs: docs.cloned(),
        };
        Ok((y, tape, stats))
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
            x1,
            mlp,
            docs,
        } = tape;
        let (blk, w) = self.block_weights(layer)?;
        let (c, tp) = (&self.config, &self.placement.tp);
        let dy = dy.to_dtype(x.dtype())?;
        let mut grads = Vec::with_capacity(9);

        // The feed-forward part: y = x1 + mlp(norm(x1)).
        let (dx1, d_norm2) = match (mlp, &blk.mlp) {
            (
                MlpTape::Dense { h2, gu, act },
                MlpParams::Dense {
                    gate_proj,
                    up_proj,
                    down_proj,
                },
            ) => {
                // mlp = exit(swiglu(h2 gᵀ, h2 uᵀ) dᵀ), h2 = enter(norm(x1)); what the tape left
                // out is recomputed by the forward's operations, so it is bit for bit the same.
                let h2 = match h2 {
                    Some(h2) => h2,
                    None => tp.enter(&ops::rms_norm(&x1, &w.norm2, c.rms_norm_eps)?)?,
                };
                let act = match act {
                    Some(act) => act,
                    None => gu.act()?,
                };
                let dd = tp.exit_grad(&dy)?; // [b, s, h]
                let (dact, [d_down]) = self.project_bwd(layer, &act, [(*down_proj, &dd)])?; // [b, s, f/tp]

                // [b, s, h] partial.
                let (dh2, [d_gate, d_up]) =
                    self.gate_up_bwd(layer, &h2, [*gate_proj, *up_proj], &gu, &dact)?;
                grads.extend([d_gate, d_up, d_down]);
                let dh2 = tp.enter_grad(&dh2)?;
                ops::rms_norm_bwd_add(&x1, &w.norm2, c.rms_norm_eps, &dh2, &dy)?
            }
            (MlpTape::Moe(mut tape), MlpParams::Moe(m)) => {
                if tape.forgot_input() {
                    let normed = ops::rms_norm(&x1, &w.norm2, c.rms_norm_eps)?; // [b, s(/tp), h]
                    tape.restore_input(normed.flatten_to(1)?);
                }
                let parts = self.moe_parts(layer, m, true)?;
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
                ops::rms_norm_bwd_add(&x1, &w.norm2, c.rms_norm_eps, &dh2, &dy)?
            }
            _ => return Err(self.missing(&format!("the feed-forward part of layer {layer}"))),
        }; // dx1: [b, s(/tp), h], the residual's gradient added

        // Attention: x1 = x + exit(attn(rope(h qᵀ), rope(h kᵀ), h vᵀ) oᵀ), h = enter(norm(x)).
        let h = match h {
            Some(h) => h,
            None => tp.enter(&ops::rms_norm(&x, &w.norm1, c.rms_norm_eps)?)?, // [b, s, h]
        };
        let (b, s) = (h.dim(0)?, h.dim(1)?);
        let mask = self.document_mask(docs.as_ref(), (b, s))?;
        let (cos, sin, scale) = self.rope_and_scale((b, s), docs.as_ref())?;
        let kernels = ops::attention_kernels(self.attention);
        let cp = &self.placement.cp;
        let (attn, lse) = match attn {
            Some(kept) => kept,
            None => cp.attention((&q, &k, &v), scale, kernels, mask)?,
        };
        let dout = tp.exit_grad(&dx1)?; // [b, s, h]
        let a = attn.to_dtype(x.dtype())?;
        let (da, [d_o]) = self.project_bwd(layer, &a, [(blk.o_proj, &dout)])?; // [b, s, hq/tp, d]
        let saved = (&attn, &lse);
        let (dq, dk, dv) = cp.attention_bwd((&q, &k, &v), saved, &da, scale, kernels, mask)?;
        let (dq, dk) = (
            ops::rope_bwd(&dq, &cos, &sin)?,
            ops::rope_bwd(&dk, &cos, &sin)?,
        );
        // [b, s, h] partial: v's contribution, then k's, then q's.
        let (dh, [d_v, d_k, d_q]) = self.project_bwd(
            layer,
            &h,
            [(blk.v_proj, &dv), (blk.k_proj, &dk), (blk.q_proj, &dq)],
        )?;
        let dh = tp.enter_grad(&dh)?;
        let (dx, d_norm1) = ops::rms_norm_bwd_add(&x, &w.norm1, c.rms_norm_eps, &dh, &dx1)?;
        grads.extend([
            (blk.input_layernorm, ParamGrad::Tensor(d_norm1)),
            d_q,
            d_k,
            d_v,
            d_o,
            (blk.post_attention_layernorm, ParamGrad::Tensor(d_norm2)),
        ]);
        Ok((dx, grads))
    }
}
