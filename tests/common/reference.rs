//! The tests' autograd reference for the model's hand-written passes: a whole single-rank Llama
//! (dense or mixture-of-experts) composed from the op library's differentiable ops — the same
//! `model::ops` the pieces' forwards call — over the model's own parameters as autograd
//! variables, differentiated by candle's autograd.
//!
//! It shares the ops (whose own backward kernels are checked against finite differences in
//! `crates/model/tests/ops_*.rs`) but none of the model's code: a wrong sum, a missed residual or
//! a gradient sent to the wrong parameter in a hand-written pass shows up as a difference. A MoE
//! layer is the dense masked form (every expert on every token, the top-k kept by a mask), as in
//! `tests/moe.rs`.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var, D};
use model::inventory::MlpParams;
use model::ops;
use model::{Llama, MoeConfig, Targets};

/// The scaled token loss `Σ loss·mask · loss_scale` of `model` (one rank, whole model, no
/// capacity or selection bias) on `tokens` `[b, s]` with `t`'s labels and mask, and every
/// parameter's gradient of it plus the MoE layers' balancing losses (weighted by
/// `aux_scale / MoE layers`), in parameter order (zeros for an expert no token chose).
pub fn loss_and_grads(model: &Llama, tokens: &Tensor, t: &Targets) -> Result<(f64, Vec<Tensor>)> {
    let vars: Vec<Var> = model
        .params()
        .iter()
        .map(|p| p.var())
        .collect::<Result<_>>()?;
    let (loss, aux) = objective(model, &vars, tokens, t)?;
    let value = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    let total = match aux {
        Some(a) => (&loss + a.to_dtype(loss.dtype())?)?,
        None => loss,
    };
    let grads: GradStore = total.backward()?;
    let grads = vars
        .iter()
        .map(|v| match grads.get(v.as_tensor()) {
            Some(g) => Ok(g.clone()),
            None => v.as_tensor().zeros_like(),
        })
        .collect::<Result<_>>()?;
    Ok((value, grads))
}

/// The token loss and, for a MoE model, the weighted balancing losses.
fn objective(
    model: &Llama,
    vars: &[Var],
    tokens: &Tensor,
    t: &Targets,
) -> Result<(Tensor, Option<Tensor>)> {
    let (labels, mask, scale, aux_scale) = (&t.labels, &t.loss_mask, t.loss_scale, t.aux_scale);
    let c = model.config();
    let inv = model.inventory();
    let w = |i: usize| vars[i].as_tensor();
    let (b, s) = tokens.dims2()?;
    let (h, d) = (c.hidden_size, c.head_dim());
    let (hq, hkv) = (c.num_attention_heads, c.num_key_value_heads);
    let (cos, sin) = model.rope_tables();
    let (cos, sin) = (cos.narrow(0, 0, s)?, sin.narrow(0, 0, s)?);
    let ids = tokens.flatten_all()?.to_dtype(DType::U32)?;
    let e = inv.embed_tokens.expect("a whole model");
    let mut x = ops::embedding(w(e), &ids)?.reshape((b, s, h))?;
    let mut aux = None;
    for blk in inv.blocks.values() {
        let n1 = ops::rms_norm(&x, w(blk.input_layernorm), c.rms_norm_eps)?;
        let q = ops::linear_to(&n1, w(blk.q_proj), (b, s, hq, d))?;
        let k = ops::linear_to(&n1, w(blk.k_proj), (b, s, hkv, d))?;
        let v = ops::linear_to(&n1, w(blk.v_proj), (b, s, hkv, d))?;
        let (q, k) = (ops::rope(&q, &cos, &sin)?, ops::rope(&k, &cos, &sin)?);
        let a = ops::causal_attention(&q, &k, &v, 1.0 / (d as f64).sqrt())?;
        x = (x + ops::linear_to(&a, w(blk.o_proj), (b, s, h))?)?;
        let n2 = ops::rms_norm(&x, w(blk.post_attention_layernorm), c.rms_norm_eps)?;
        let y = match &blk.mlp {
            MlpParams::Dense {
                gate_proj,
                up_proj,
                down_proj,
            } => {
                let g = ops::swiglu(
                    &ops::linear(&n2, w(*gate_proj))?,
                    &ops::linear(&n2, w(*up_proj))?,
                )?;
                ops::linear(&g, w(*down_proj))?
            }
            MlpParams::Moe(m) => {
                let cfg = c.moe().expect("a MoE layer has a MoE configuration");
                let experts: Vec<[&Tensor; 3]> = m
                    .experts
                    .iter()
                    .map(|e| [w(e.w1), w(e.w3), w(e.w2)])
                    .collect();
                let (y, layer_aux) =
                    dense_moe(&n2.flatten_to(1)?, w(m.router), None, &experts, &cfg)?;
                let weighted = (layer_aux * (aux_scale / c.num_moe_layers() as f64))?;
                aux = Some(match aux {
                    Some(a) => (a + weighted)?,
                    None => weighted,
                });
                y.reshape((b, s, h))?
            }
        };
        x = (x + y)?;
    }
    let (norm, head) = (inv.norm.expect("a head"), inv.lm_head.expect("a head"));
    let hn = ops::rms_norm(&x, w(norm), c.rms_norm_eps)?.flatten_to(1)?;
    let losses = ops::cross_entropy_acc(&ops::linear(&hn, w(head))?, labels)?;
    // The per-row weight `mask · scale` formed in the mask's dtype (f32), as the head forms its
    // losses' gradient.
    let dtype = losses.dtype();
    let loss = (losses * mask.affine(scale, 0.0)?.to_dtype(dtype)?)?.sum_all()?;
    Ok((loss, aux))
}

/// A mixture of experts written with candle's primitive ops: every expert on every row of `x`
/// `[n, h]`, the top-k kept by a mask (chosen on the host by probability plus the selection
/// `bias`, larger first, lower index on ties), `y = Σₑ wₑ · expertₑ(x)` with
/// `wₑ = pₑ·maskₑ (/ Σ p·mask)`; and the weighted balancing losses
/// `coef_lb · E·Σ fᵢPᵢ + coef_z · mean(lse²)` from their definitions. The router computes in f32
/// (f64 for f64), as the layer does. `experts[e]` is `[w1, w3, w2]`.
pub fn dense_moe(
    x: &Tensor,
    router: &Tensor,
    bias: Option<&[f32]>,
    experts: &[[&Tensor; 3]],
    cfg: &MoeConfig,
) -> Result<(Tensor, Tensor)> {
    let (n, e, k) = (x.dim(0)?, cfg.num_experts, cfg.top_k);
    let rdt = if x.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let logits = x.to_dtype(rdt)?.matmul(&router.to_dtype(rdt)?.t()?)?; // [n, E]
    let ex = logits.exp()?;
    let sum = ex.sum_keepdim(D::Minus1)?;
    let probs = ex.broadcast_div(&sum)?;
    let p = probs.to_dtype(DType::F64)?.to_vec2::<f64>()?;
    let mut mask = vec![0f64; n * e];
    let bias = |j: usize| bias.map_or(0.0, |b| f64::from(b[j]));
    for (t, row) in p.iter().enumerate() {
        let mut idx: Vec<usize> = (0..e).collect();
        idx.sort_by(|&a, &b| {
            (row[b] + bias(b))
                .total_cmp(&(row[a] + bias(a)))
                .then(a.cmp(&b))
        });
        for &j in &idx[..k] {
            mask[t * e + j] = 1.0;
        }
    }
    let mask = Tensor::from_vec(mask, (n, e), &Device::Cpu)?
        .to_device(x.device())?
        .to_dtype(rdt)?;
    let mut wts = (&probs * &mask)?;
    if cfg.norm_topk_prob {
        wts = wts.broadcast_div(&wts.sum_keepdim(D::Minus1)?)?;
    }
    let wts = wts.to_dtype(x.dtype())?;
    let mut y = x.zeros_like()?;
    for (j, [w1, w3, w2]) in experts.iter().enumerate() {
        let g = x.matmul(&w1.t()?)?.silu()?;
        let u = x.matmul(&w3.t()?)?;
        let out = (g * u)?.matmul(&w2.t()?)?; // [n, h]
        y = (y + out.broadcast_mul(&wts.narrow(1, j, 1)?)?)?;
    }
    let f = mask.mean(0)?; // share of tokens choosing each expert (sums to k)
    let lb = ((f * probs.mean(0)?)?.sum_all()? * e as f64)?;
    let lse = sum.log()?.squeeze(1)?;
    let z = lse.sqr()?.mean_all()?;
    let aux = ((lb * cfg.aux_loss_coef)? + (z * cfg.z_loss_coef)?)?;
    Ok((y, aux))
}
