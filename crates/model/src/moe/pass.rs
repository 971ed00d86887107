//! The MoE layer's forward and its hand-written backward pass: [`forward`] computes the layer and
//! keeps a [`MoeTape`]; [`backward`] turns the output's gradient into the input's, the router's
//! and each local expert's.
//!
//! The backward, in reverse order of the forward (`n` tokens, `k` slots, `rows` kept pairs, `m`
//! rows on this rank's experts):
//!
//! ```text
//! y = Σⱼ wⱼ·ykⱼ          dykⱼ = wⱼ·dy, dwⱼ = ⟨dy, ykⱼ⟩                       [n, k, h], [n, k]
//! yk = unpermute(y_perm)  dy_perm = the rows of dyk in permuted order (gather)  [rows, h]
//! combine / dispatch      their reverse all-to-alls (ExpertParallel::{combine,dispatch}_grad)
//! expert e                projection and SwiGLU backward; weight gradients as GEMM factors
//! x_perm = x[tokens]      dx = Σ over each token's slots (gathered, summed)     [n, h]
//! w = p_sel (/ Σ p_sel)   dp_sel = (dw − ⟨dw, w⟩) / Σ p_sel when renormalised
//! p_sel = probs[chosen]   dprobs = scatter of dp_sel, plus the load-balancing loss's E·fᵢ/N
//! probs, lse = softmax    dlogits = probs·(dprobs − ⟨dprobs, probs⟩ + dlse), dlse = z-loss's 2·lse/N
//! logits = x Wᵀ           dx += dlogits·W, dW = dlogitsᵀ·x (router dtype)
//! ```
//!
//! The balancing losses enter with the weight they have in the objective (`aux_weight`: the
//! training step's scale over the MoE layers). The comparison with autograd over a dense
//! reference and with finite differences is in `tests/moe.rs` (f64).

use candle_core::{Result, Tensor};
use parallel::ep::{Dispatch, ExpertParallel};
use parallel::tp::TensorParallel;

use super::routing::Plan;
use super::{
    losses, route_rows, router_dtype, unpermute, weigh, with_zero_row, Expert, LayerStats, Routed,
    Router,
};
use crate::config::MoeConfig;
use crate::ops::{self, grouped_linear, Grouped};
use crate::segment::ParamGrad;

/// The local experts' gate, up and down weights, in expert order.
fn weights_of(experts: &[Expert]) -> (Vec<&Tensor>, Vec<&Tensor>, Vec<&Tensor>) {
    (
        experts.iter().map(|e| &e.w1).collect(),
        experts.iter().map(|e| &e.w3).collect(),
        experts.iter().map(|e| &e.w2).collect(),
    )
}

/// The local experts' saved activations over their `m` rows, in expert order (each expert's
/// run of `dispatch.counts[e]` rows).
struct ExpertsTape {
    /// Their input rows `[m, h]`.
    x: Tensor,
    /// Gate and up projections `[m, f]`.
    gate: Tensor,
    up: Tensor,
    /// Their SwiGLU `[m, f]` (`None`: recomputed, `moe_act`).
    act: Option<Tensor>,
}

/// What the MoE layer's forward keeps for [`backward`].
pub struct MoeTape {
    /// The layer's input rows `[n, h]` (`None`: recomputed by the block, `layernorm`).
    x: Option<Tensor>,
    /// Router probabilities `[n, E]` and log-sum-exps `[n]` (router dtype).
    probs: Tensor,
    lse: Tensor,
    /// The routing weights `[n, k]` (router dtype).
    weights: Tensor,
    /// The experts' outputs in (token, slot) order `[n, k, h]`.
    yk: Tensor,
    plan: Plan,
    dispatch: Dispatch,
    /// The local experts' (`None` when no row reached them).
    experts: Option<ExpertsTape>,
    /// `fᵢ` per expert `[E]` and the tokens the losses' means run over.
    share: Tensor,
    tokens: f64,
    /// The balancing losses' weights in the objective: `aux_weight · coef`.
    lb_weight: f64,
    z_weight: f64,
    norm_topk_prob: bool,
}

impl MoeTape {
    /// The bytes a MoE layer's tape keeps (model `c`, shapes `s`): the residual's norm as the
    /// router reads it `[n_s, h]` (the tokens this rank routes; unless `layernorm` is
    /// recomputed), the router's probabilities `[n_s, E]`, log-sum-exps, routing weights and
    /// expert shares (f32; f64 for f64), the experts' outputs in slot order and the rows in
    /// expert order (those received with expert parallelism, as many on average), and each
    /// expert's gate, up and SwiGLU outputs (the SwiGLU unless `moe_act` is recomputed),
    /// `[n_s·k, ·]` each (`[E·C, ·]` with every expert padded to its capacity `C`).
    pub fn bytes(c: &crate::LlamaConfig, s: &crate::segment::TapeShape) -> u64 {
        let Some(m) = c.moe() else { return 0 };
        let (ns, p, h) = (s.ns, s.p, s.h);
        let (e, k, fe) = (m.num_experts as u64, m.top_k as u64, m.expert_size as u64);
        let rows = m.expert_rows(ns as usize) as u64;
        let norm = if s.recomputed.layernorm { 0 } else { ns * h };
        let acts = if s.recomputed.moe_act { 2 } else { 3 };
        (norm + 2 * rows * h + acts * rows * fe) * p + s.acc() * (ns * e + ns + ns * k + e)
    }

    /// The tensors the tape keeps alive (its input included).
    pub fn tensors(&self) -> Vec<&Tensor> {
        let mut kept = vec![&self.probs, &self.lse, &self.weights, &self.yk, &self.share];
        kept.extend(&self.x);
        if let Some(e) = &self.experts {
            kept.extend([&e.x, &e.gate, &e.up]);
            kept.extend(&e.act);
        }
        kept
    }

    /// Drops the layer's input rows (`input`) and the experts' SwiGLU outputs (`act`) from the
    /// tape: the block's backward gives the rows back ([`MoeTape::restore_input`]) and
    /// [`backward`] recomputes the SwiGLU from the kept gate and up projections.
    pub fn forget(&mut self, input: bool, act: bool) {
        if input {
            self.x = None;
        }
        if let (true, Some(e)) = (act, &mut self.experts) {
            e.act = None;
        }
    }

    /// Whether the input rows were dropped.
    pub fn forgot_input(&self) -> bool {
        self.x.is_none()
    }

    /// Gives back the input rows `[n, h]` the forward read (recomputed bit for bit).
    pub fn restore_input(&mut self, x: Tensor) {
        self.x = Some(x);
    }
}

/// The gradients of the MoE layer's inputs.
pub struct MoeGrads {
    /// The input rows' `[n, h]`.
    pub dx: Tensor,
    /// The router weight's `[E, h]`.
    pub router: Tensor,
    /// Per local expert, `(w1, w3, w2)`'s as GEMM factors; `None` for an expert without rows.
    pub experts: Vec<Option<[ParamGrad; 3]>>,
}

/// The MoE layer on `x` `[n, h]` with `router` and this rank's experts of layer `layer` (all
/// `E`, or its share of the expert-parallel group `ep`, which the rows travel to); with
/// sequence parallelism (`tp` splits the tokens) the balancing losses are this rank's share of
/// the micro-batch's (`split_losses`). `aux_weight` is the weight of the balancing losses in the
/// objective. Returns the output `[n, h]`, the measurements and the tape.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    x: &Tensor,
    router: &Router,
    experts: &[Expert],
    ep: &ExpertParallel,
    tp: &TensorParallel,
    cfg: &MoeConfig,
    layer: usize,
    aux_weight: f64,
) -> Result<(Tensor, LayerStats, MoeTape)> {
    let x = x.clone();
    let Routed {
        probs,
        lse,
        plan,
        weights,
        x_perm,
    } = route_rows(&x, router, experts.len(), ep, cfg, layer)?;
    let (x_local, dispatch) = ep.dispatch(&x_perm, &plan.counts, plan.padded)?; // [m, h]

    // Every local expert over its run of rows, one grouped call per projection.
    let counts = &dispatch.counts;
    let (w1, w3, w2) = weights_of(experts);
    let (y_local, tapes) = if x_local.dim(0)? == 0 {
        (x_local, None)
    } else {
        let gate = grouped_linear(&x_local, counts, &w1, Grouped::Forward)?; // [m, f]
        let up = grouped_linear(&x_local, counts, &w3, Grouped::Forward)?;
        let act = ops::swiglu(&gate, &up)?;
        let y = grouped_linear(&act, counts, &w2, Grouped::Forward)?; // [m, h]
        let tape = ExpertsTape {
            x: x_local,
            gate,
            up,
            act: Some(act),
        };
        (y, Some(tape))
    };
    let y_perm = ep.combine(&y_local, &dispatch)?; // [rows, h]
    let yk = unpermute(&y_perm, &plan)?; // [n, k, h]
    let y = weigh(&yk, &weights)?; // [n, h]

    let l = losses(&probs, &lse, &plan, tp, layer)?;
    let tape = MoeTape {
        x: Some(x),
        probs,
        lse,
        weights,
        yk,
        plan,
        dispatch,
        experts: tapes,
        share: l.share,
        tokens: l.tokens,
        lb_weight: aux_weight * cfg.aux_loss_coef,
        z_weight: aux_weight * cfg.z_loss_coef,
        norm_topk_prob: cfg.norm_topk_prob,
    };
    Ok((y, l.stats, tape))
}

/// The layer's backward from its tape and the output's gradient `dy` `[n, h]`, with the router
/// weight `[E, h]` and local experts the forward used. Every member of the
/// expert-parallel group calls it (its all-to-alls), with or without local rows.
pub fn backward(
    tape: MoeTape,
    router: &Tensor,
    experts: &[Expert],
    ep: &ExpertParallel,
    dy: &Tensor,
) -> Result<MoeGrads> {
    let MoeTape {
        x,
        probs,
        lse,
        weights,
        yk,
        plan,
        dispatch,
        experts: tapes,
        share,
        tokens,
        lb_weight,
        z_weight,
        norm_topk_prob,
    } = tape;
    let x = x.ok_or_else(|| {
        candle_core::Error::Msg(
            "MoE backward: the tape's input rows were dropped and not restored".into(),
        )
    })?;
    let (n, h) = x.dims2()?;
    let (dt, rdt) = (x.dtype(), router_dtype(x.dtype()));
    let dy = dy.to_dtype(dt)?.unsqueeze(1)?; // [n, 1, h]

    // y = Σⱼ wⱼ·ykⱼ.
    let dyk = dy.broadcast_mul(&weights.to_dtype(dt)?.unsqueeze(2)?)?; // [n, k, h]
    let dw = dy.broadcast_mul(&yk)?.sum(2)?.to_dtype(rdt)?; // [n, k]
    let dy_perm =
        with_zero_row(&dyk.reshape((n * plan.k, h))?, plan.padded)?.index_select(&plan.order, 0)?; // [rows, h]; a padding row reads zero
    let dy_local = ep.combine_grad(&dy_perm, &dispatch)?; // [m, h]

    // The experts over their runs of rows, one grouped call per projection; each weight
    // gradient as the factors of its run.
    let counts = &dispatch.counts;
    let (w1, w3, w2) = weights_of(experts);
    let (dx_local, grads) = match tapes {
        None => (dy_local, experts.iter().map(|_| None).collect()),
        Some(t) => {
            let act = match t.act {
                Some(act) => act,
                None => ops::swiglu(&t.gate, &t.up)?, // as the forward computed it
            };
            let dact = grouped_linear(&dy_local, counts, &w2, Grouped::InputGrad)?; // [m, f]
            let (dgate, dup) = ops::swiglu_bwd(&t.gate, &t.up, &dact)?;
            let dx_up = grouped_linear(&dup, counts, &w3, Grouped::InputGrad)?; // [m, h]
            let dx_gate = grouped_linear(&dgate, counts, &w1, Grouped::InputGrad)?;
            let product = |g: &Tensor, x: &Tensor, start, c| -> Result<ParamGrad> {
                Ok(ParamGrad::Product {
                    g: g.narrow(0, start, c)?,
                    x: x.narrow(0, start, c)?,
                })
            };
            let mut grads = Vec::with_capacity(experts.len());
            let mut start = 0;
            for &c in counts {
                grads.push(match c {
                    0 => None,
                    _ => Some([
                        product(&dgate, &t.x, start, c)?,
                        product(&dup, &t.x, start, c)?,
                        product(&dy_local, &act, start, c)?,
                    ]),
                });
                start += c;
            }
            ((dx_up + dx_gate)?, grads)
        }
    }; // dx_local: [m, h]
    let dx_perm = ep.dispatch_grad(&dx_local, &dispatch)?; // [rows, h]

    // Each token's k slots, gathered back to slot order (a dropped slot reads zero) and summed:
    // deterministic, and parallel on a GPU, where a scatter-add over the rows is neither.
    let dx = unpermute(&dx_perm, &plan)?.sum(1)?; // [n, h]

    // The router: routing weights, balancing losses, softmax, projection.
    let chosen = &plan.chosen;
    let dp_sel = if norm_topk_prob {
        let sum = probs.gather(chosen, 1)?.sum_keepdim(1)?; // [n, 1]
        let dot = (&dw * &weights)?.sum_keepdim(1)?;
        dw.broadcast_sub(&dot)?.broadcast_div(&sum)?
    } else {
        dw
    }; // [n, k]
    let e = probs.dim(1)?;
    let lb = (share * (lb_weight * e as f64 / tokens))?.unsqueeze(0)?; // [1, E]
    let dprobs = probs
        .zeros_like()?
        .scatter_add(chosen, &dp_sel, 1)?
        .broadcast_add(&lb)?; // [n, E]
    let dlse = (lse * (2.0 * z_weight / tokens))?.unsqueeze(1)?; // [n, 1]
    let dot = (&dprobs * &probs)?.sum_keepdim(1)?; // [n, 1]
    let dlogits = (&probs * dprobs.broadcast_sub(&dot)?.broadcast_add(&dlse)?)?; // [n, E]
    let w = router.to_dtype(rdt)?;
    let dx_router = dlogits.matmul(&w)?.to_dtype(dt)?; // [n, h]
    let d_router = dlogits
        .t()?
        .matmul(&x.to_dtype(rdt)?)?
        .to_dtype(router.dtype())?; // [E, h]
    Ok(MoeGrads {
        dx: (dx + dx_router)?,
        router: d_router,
        experts: grads,
    })
}
