//! The project's fused op library: every op here has a real backward pass.
//!
//! candle-nn's fast kernels (`softmax_last_dim`, `rms_norm`, `rope*`, `sdpa`, ...) have no backward and
//! silently drop gradients, so training code uses only these ops and candle's differentiable primitives.
//! Each op is a candle `CustomOp` with a CPU forward (f32 and f64; bf16 through f32), and a `bwd`
//! built from other ops of this library. Shapes use the model's activation layout `[b, s, heads, d]`.

use candle_core::{Result, Tensor};

mod attention;
mod attention_bwd;
mod common;
mod cross_entropy;
mod grad_inject;
mod rms_norm;
mod rope;
mod swiglu;

/// RMSNorm over the last dimension: `y = x / sqrt(mean(x²) + eps) * weight`.
/// `x`: `[.., h]`, `weight`: `[h]`; returns the shape of `x`.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    rms_norm::rms_norm(x, weight, eps)
}

/// Rotary position embedding in Hugging Face's rotate-half convention:
/// `y = x * cos + rotate_half(x) * sin`, `rotate_half([x1, x2]) = [-x2, x1]` on the halves of `d`.
/// `x`: `[b, s, heads, d]`; `cos`, `sin`: `[s, d / 2]` (the angle of pair `i` at position `p`).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    rope::rope(x, cos, sin)
}

/// Causal scaled-dot-product attention with grouped-query heads.
/// `q`: `[b, s, hq, d]`, `k`, `v`: `[b, s, hkv, d]` with `hq % hkv == 0`; returns `[b, s, hq, d]`.
/// Query head `i` attends with kv head `i / (hq / hkv)`. Only the per-row log-sum-exp (`[b, hq, s]`)
/// is kept for the backward pass; scores are recomputed there, never stored.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    attention::causal_attention(q, k, v, scale)
}

/// SwiGLU: `silu(gate) * up`, elementwise, same shapes.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    swiglu::swiglu(gate, up)
}

/// Per-row cross-entropy: `logits` `[n, v]` (float), `targets` `[n]` (u32); returns `[n]` losses
/// `logsumexp(logits[i]) - logits[i, targets[i]]` in the dtype of `logits`.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    cross_entropy::cross_entropy(logits, targets)
}

/// A scalar whose backward pass hands `grad` to `y`: calling `.backward()` on the result
/// back-propagates the upstream gradient `grad` (same shape as `y`) through `y`'s graph.
pub fn grad_inject(y: &Tensor, grad: &Tensor) -> Result<Tensor> {
    grad_inject::grad_inject(y, grad)
}
