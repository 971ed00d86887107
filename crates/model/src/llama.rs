//! The Llama decoder: token embedding, `num_hidden_layers` pre-norm blocks (grouped-query attention
//! with rotary embeddings, SwiGLU MLP), final RMSNorm and the output projection, with Hugging Face
//! parameter names. The model is cut into segments (embedding, each block, head + loss) that
//! [`crate::segment`] runs with separate autograd graphs.

use candle_core::{DType, Device, Result, Tensor};

use crate::config::LlamaConfig;
use crate::init::Init;
use crate::ops;
use crate::params::{ParamKind, ParamSet};

/// Indices (into the model's [`ParamSet`]) of one decoder block's parameters.
#[derive(Debug, Clone)]
struct Block {
    input_layernorm: usize,
    q_proj: usize,
    k_proj: usize,
    v_proj: usize,
    o_proj: usize,
    post_attention_layernorm: usize,
    gate_proj: usize,
    up_proj: usize,
    down_proj: usize,
}

/// A piece of the model run as one segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece {
    /// Token ids `[b, s]` → hidden states `[b, s, h]`.
    Embedding,
    /// Decoder block `i`: `[b, s, h]` → `[b, s, h]`.
    Block(usize),
    /// Final norm, output projection and the loss: `[b, s, h]` → scalar.
    Head,
}

/// Targets of one micro-batch, for the head segment.
#[derive(Debug, Clone)]
pub struct Targets {
    /// Next-token ids, `[b * s]` u32.
    pub labels: Tensor,
    /// 1 where the position counts in the loss, else 0; `[b * s]` f32.
    pub loss_mask: Tensor,
    /// Factor applied to this micro-batch's summed loss so that the sum over all micro-batches is
    /// the mean over the global batch's counted tokens: `1 / counted tokens in the global batch`.
    pub loss_scale: f64,
}

/// A Llama model whose parameters live in a [`ParamSet`].
#[derive(Debug, Clone)]
pub struct Llama {
    config: LlamaConfig,
    params: ParamSet,
    embed_tokens: usize,
    blocks: Vec<Block>,
    norm: usize,
    lm_head: usize,
    /// `[max_pos, head_dim / 2]` rotary tables in the parameter dtype.
    cos: Tensor,
    sin: Tensor,
}

impl Llama {
    /// Builds the model with seeded initialisation (bit-identical for equal `seed`).
    pub fn new(config: &LlamaConfig, seed: u64, dtype: DType, device: &Device) -> Result<Self> {
        let (h, f, v) = (
            config.hidden_size,
            config.intermediate_size,
            config.vocab_size,
        );
        let kv = config.num_key_value_heads * config.head_dim();
        let std = config.init_std;
        let out_std = std / (2.0 * config.num_hidden_layers as f64).sqrt();
        let mut p = ParamSet::default();
        let mut add = |name: &str, shape: &[usize], kind: ParamKind, init: Init| {
            p.add(name, shape, kind, init, seed, dtype, device)
        };
        let embed_tokens = add(
            "model.embed_tokens.weight",
            &[v, h],
            ParamKind::Embedding,
            Init::Normal { std },
        )?;
        let mut blocks = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let n = |s: &str| format!("model.layers.{i}.{s}.weight");
            let (one, w, wo) = (
                Init::Constant(1.0),
                Init::Normal { std },
                Init::Normal { std: out_std },
            );
            blocks.push(Block {
                input_layernorm: add(&n("input_layernorm"), &[h], ParamKind::Norm, one)?,
                q_proj: add(&n("self_attn.q_proj"), &[h, h], ParamKind::Matrix, w)?,
                k_proj: add(&n("self_attn.k_proj"), &[kv, h], ParamKind::Matrix, w)?,
                v_proj: add(&n("self_attn.v_proj"), &[kv, h], ParamKind::Matrix, w)?,
                o_proj: add(&n("self_attn.o_proj"), &[h, h], ParamKind::Matrix, wo)?,
                post_attention_layernorm: add(
                    &n("post_attention_layernorm"),
                    &[h],
                    ParamKind::Norm,
                    one,
                )?,
                gate_proj: add(&n("mlp.gate_proj"), &[f, h], ParamKind::Matrix, w)?,
                up_proj: add(&n("mlp.up_proj"), &[f, h], ParamKind::Matrix, w)?,
                down_proj: add(&n("mlp.down_proj"), &[h, f], ParamKind::Matrix, wo)?,
            });
        }
        let norm = add(
            "model.norm.weight",
            &[h],
            ParamKind::Norm,
            Init::Constant(1.0),
        )?;
        let lm_head = if config.tie_word_embeddings {
            embed_tokens
        } else {
            add(
                "lm_head.weight",
                &[v, h],
                ParamKind::Matrix,
                Init::Normal { std },
            )?
        };
        let (cos, sin) = rope_tables(config, dtype, device)?;
        Ok(Self {
            config: config.clone(),
            params: p,
            embed_tokens,
            blocks,
            norm,
            lm_head,
            cos,
            sin,
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// All trainable parameters.
    pub fn params(&self) -> &ParamSet {
        &self.params
    }

    /// The segments of a full forward pass, in order.
    pub fn pieces(&self) -> Vec<Piece> {
        let mut v = vec![Piece::Embedding];
        v.extend((0..self.blocks.len()).map(Piece::Block));
        v.push(Piece::Head);
        v
    }

    /// Indices of the parameters a piece uses.
    pub fn piece_params(&self, piece: Piece) -> Vec<usize> {
        match piece {
            Piece::Embedding => vec![self.embed_tokens],
            Piece::Block(i) => {
                let b = &self.blocks[i];
                vec![
                    b.input_layernorm,
                    b.q_proj,
                    b.k_proj,
                    b.v_proj,
                    b.o_proj,
                    b.post_attention_layernorm,
                    b.gate_proj,
                    b.up_proj,
                    b.down_proj,
                ]
            }
            Piece::Head => vec![self.norm, self.lm_head],
        }
    }

    fn w(&self, i: usize) -> &Tensor {
        self.params.get(i).var.as_tensor()
    }

    /// Token ids `[b, s]` → hidden states `[b, s, h]`.
    pub fn embed(&self, tokens: &Tensor) -> Result<Tensor> {
        let (b, s) = tokens.dims2()?;
        self.w(self.embed_tokens)
            .embedding(&tokens.flatten_all()?)?
            .reshape((b, s, self.config.hidden_size))
    }

    /// Decoder block `i`: `[b, s, h]` → `[b, s, h]`.
    pub fn block(&self, i: usize, x: &Tensor) -> Result<Tensor> {
        let c = &self.config;
        let blk = &self.blocks[i];
        let (b, s, _) = x.dims3()?;
        let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim());
        let (cos, sin) = (self.cos.narrow(0, 0, s)?, self.sin.narrow(0, 0, s)?);

        let h = ops::rms_norm(x, self.w(blk.input_layernorm), c.rms_norm_eps)?; // [b, s, h]
        let q = linear(&h, self.w(blk.q_proj))?.reshape((b, s, hq, d))?;
        let k = linear(&h, self.w(blk.k_proj))?.reshape((b, s, hkv, d))?;
        let v = linear(&h, self.w(blk.v_proj))?.reshape((b, s, hkv, d))?;
        let (q, k) = (ops::rope(&q, &cos, &sin)?, ops::rope(&k, &cos, &sin)?);
        let a = ops::causal_attention(&q, &k, &v, 1.0 / (d as f64).sqrt())?; // [b, s, hq, d]
        let x = (x + linear(&a.reshape((b, s, hq * d))?, self.w(blk.o_proj))?)?;

        let h = ops::rms_norm(&x, self.w(blk.post_attention_layernorm), c.rms_norm_eps)?;
        let g = ops::swiglu(
            &linear(&h, self.w(blk.gate_proj))?,
            &linear(&h, self.w(blk.up_proj))?,
        )?; // [b, s, f]
        x + linear(&g, self.w(blk.down_proj))?
    }

    /// Final norm and output projection: `[b, s, h]` → logits `[b * s, v]` (f32).
    pub fn logits(&self, x: &Tensor) -> Result<Tensor> {
        let h = ops::rms_norm(x, self.w(self.norm), self.config.rms_norm_eps)?;
        linear(&h.flatten_to(1)?, self.w(self.lm_head))?.to_dtype(DType::F32)
    }

    /// Head segment: the micro-batch's summed masked cross-entropy times `targets.loss_scale`.
    pub fn head_loss(&self, x: &Tensor, targets: &Targets) -> Result<Tensor> {
        let losses = ops::cross_entropy(&self.logits(x)?, &targets.labels)?; // [b * s]
        (losses * &targets.loss_mask)?.sum_all()? * targets.loss_scale
    }

    /// Full forward without segments (evaluation, tests): per-position losses `[b * s]`.
    pub fn token_losses(&self, tokens: &Tensor, labels: &Tensor) -> Result<Tensor> {
        let mut x = self.embed(tokens)?;
        for i in 0..self.blocks.len() {
            x = self.block(i, &x)?;
        }
        ops::cross_entropy(&self.logits(&x)?, labels)
    }
}

/// `x · wᵀ` for a weight stored `[out, in]` as in Hugging Face: `[.., in]` → `[.., out]`.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let n_in = *dims.last().unwrap_or(&0);
    let rows = x.elem_count() / n_in.max(1);
    let y = x.reshape((rows, n_in))?.matmul(&w.t()?)?; // [rows, out]
    let mut out = dims;
    *out.last_mut().expect("linear input has at least one dim") = w.dim(0)?;
    y.reshape(out)
}

/// Rotary tables `cos, sin`: `[max_pos, head_dim / 2]`, angle `p · θ^(−2i/d)` computed in f64.
fn rope_tables(c: &LlamaConfig, dtype: DType, device: &Device) -> Result<(Tensor, Tensor)> {
    let (half, n) = (c.head_dim() / 2, c.max_position_embeddings);
    let inv: Vec<f64> = (0..half)
        .map(|i| c.rope_theta.powf(-(2.0 * i as f64) / c.head_dim() as f64))
        .collect();
    let angles: Vec<f64> = (0..n)
        .flat_map(|p| inv.iter().map(move |f| p as f64 * f))
        .collect();
    let cos: Vec<f64> = angles.iter().map(|a| a.cos()).collect();
    let sin: Vec<f64> = angles.iter().map(|a| a.sin()).collect();
    let t = |v: Vec<f64>| Tensor::from_vec(v, (n, half), device)?.to_dtype(dtype);
    Ok((t(cos)?, t(sin)?))
}

/// Mean of `losses` over positions where `mask` is 1 (for logging); `[n]`, `[n]` → scalar f64.
pub fn masked_mean(losses: &Tensor, mask: &Tensor) -> Result<f64> {
    let num = (losses.to_dtype(DType::F64)? * mask.to_dtype(DType::F64)?)?
        .sum_all()?
        .to_scalar::<f64>()?;
    let den = mask.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
    Ok(num / den.max(1.0))
}
