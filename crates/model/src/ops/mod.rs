//! The project's fused op library: every op here has a real backward pass.
//!
//! candle-nn's fast kernels (`softmax_last_dim`, `rms_norm`, `rope*`, `sdpa`, ...) have no backward and
//! silently drop gradients, so training code uses only these ops and candle's differentiable primitives.
//! Each op is a candle `CustomOp` with a CPU forward (f32 and f64; bf16 through f32), and a `bwd`
//! built from other ops of this library. Shapes use the model's activation layout `[b, s, heads, d]`.
//!
//! Common behaviour: inputs may be non-contiguous (the wrappers make them contiguous first); bad
//! shapes, dtypes or devices are reported as `candle_core::Error`s naming the op, never as panics.
//! On the CPU, bf16 and f16 inputs are computed in f32 and the result is converted back, and the
//! kernels parallelise with rayon. With the `cuda` feature every op (forward and backward kernel)
//! also has a CUDA implementation (`cuda/`, PTX built from `kernels/*.cu`) that reads f32, f64 or
//! bf16 storage directly and sums in f32 (f64 for f64); f16 goes through f32 there too.
//!
//! Each op's backward is also callable without a graph (`*_bwd`, `linear_dx`/`linear_factors`,
//! `causal_attention_saved`): the same functions autograd's `bwd` runs, which the model's
//! hand-written passes call. Autograd over these ops is the tests' reference for those passes.
//!
//! One file per op: `add.rs`, `linear.rs`, `rms_norm.rs`, `rope.rs`, `attention.rs` (+
//! `attention_bwd.rs`, and `attention_dims.rs` for a call's sizes and mask), `swiglu.rs`,
//! `cross_entropy.rs`, `embedding.rs`, `fp8/` (rounding to FP8 by block, operands quantized once
//! for several GEMMs, and a linear's FP8 GEMMs), `grouped.rs` (the experts' projections over their runs of rows as one call); shared kernel helpers live in `common.rs`; `sdpa.rs` holds the
//! attention backend choice (the project's kernels or cuDNN's fused attention) and the cuDNN
//! calls' descriptions, `sdpa_cache.rs` the cache of built graphs, `sdpa_ragged.rs` the documents
//! of a masked call as cuDNN's ragged batch.

use candle_core::{Result, Tensor};
pub use parallel::cp::Floor;
use parallel::cp::Kernels;

pub use fp8::{
    fp8_add_product_into, fp8_add_product_of, fp8_dtype_supported, fp8_linear, fp8_linear_dx,
    fp8_linear_dx_of, fp8_linear_of, fp8_product, fp8_product_factors, fp8_round, fp8_scale,
    Fp8Blocks, Fp8Format, Fp8Operand, Fp8Quant, LtGemm, LtMatrix, LtOut, LtScale, Packing, Part,
    FP8_BLOCK,
};
pub use grouped::{grouped_linear, Grouped};
pub use sdpa::{AttentionBackend, CUDNN_MAX_HEAD_DIM};

#[cfg(feature = "cuda")]
pub mod cuda;

mod add;
mod attention;
mod attention_bwd;
mod attention_dims;
mod common;
mod cross_entropy;
mod embedding;
mod fp8;
mod grouped;
mod linear;
mod rms_norm;
mod rope;
pub mod sdpa;
pub mod sdpa_cache;
mod sdpa_ragged;
mod swiglu;

/// Where a matrix's rows lie when they are contiguous but spaced `ld` elements apart (a range
/// of columns of a wider matrix: the fused projections' per-weight gradients): the elements
/// from its first to its last, and `ld`, for a 2-D layout with unit column stride and
/// `ld ≥ columns`; else `None`.
pub fn row_strided(l: &candle_core::Layout) -> Option<(std::ops::Range<usize>, usize)> {
    match (l.dims(), l.stride()) {
        (&[rows, cols], &[ld, 1]) if ld >= cols || rows <= 1 => {
            let (start, ld) = (l.start_offset(), ld.max(cols));
            let span = if rows == 0 { 0 } else { (rows - 1) * ld + cols };
            Some((start..start + span, ld))
        }
        _ => None,
    }
}

/// `a + b` for tensors of one shape and dtype, each sum rounded once to the storage type (bit for
/// bit candle's addition); on CUDA one kernel moving 16 bytes at a time.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    add::add(a, b)
}

/// `x · wᵀ` for a weight stored `[out, in]` as in Hugging Face: `x` `[.., in]` → `[.., out]`, one
/// node in the autograd graph (candle's GEMMs, bit-identical on the CPU to composing reshape,
/// transpose and matmul, with two gradient edges instead of five and a contiguous `dw`).
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    linear::linear(x, w)
}

/// [`linear`] on `x` read as rows of `w`'s `in` features (any shape holding whole rows,
/// contiguous in row order, e.g. attention's `[b, s, heads, d]` for `in = heads · d`), with the
/// output given `shape` (`rows × out` elements, e.g. `[b, s, heads, d]`): the reshapes around a
/// projection without their graph edges.
pub fn linear_to(x: &Tensor, w: &Tensor, shape: impl Into<candle_core::Shape>) -> Result<Tensor> {
    linear::linear_to(x, w, shape)
}

/// The input gradient of [`linear`] alone, `g · w` in `shape` (`x`'s), without a graph.
pub fn linear_dx(w: &Tensor, grad: &Tensor, shape: &candle_core::Shape) -> Result<Tensor> {
    linear::linear_dx(w, grad, shape)
}

/// The factors of [`linear`]'s weight gradient `dw = gᵀ · x`: the upstream gradient as rows
/// `[rows, out]` and the input as rows `[rows, in]` (views, no copies), for accumulating the
/// product straight into a gradient buffer.
pub fn linear_factors(x: &Tensor, w: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor)> {
    linear::linear_factors(x, w, grad)
}

/// RMSNorm over the last dimension: `y = x / sqrt(mean(x²) + eps) * weight`.
/// `x`: `[.., h]`, `weight`: `[h]` (same dtype); returns the shape of `x`. Sums accumulate in the
/// compute dtype (f32, or f64 for f64). Backward gives `dx` and `dweight` (summed over all rows).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    rms_norm::rms_norm(x, weight, eps)
}

/// The residual addition and the RMSNorm of its result in one pass: `(s, rms_norm(s, weight))`
/// for `s = x + o`, bit for bit [`add`] then [`rms_norm`] (on CUDA one kernel reading `x` and
/// `o` once). Without a graph.
pub fn add_rms_norm(x: &Tensor, o: &Tensor, weight: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    rms_norm::add_rms_norm(x, o, weight, eps)
}

/// [`rms_norm_bwd`] with the residual stream's gradient `residual` added to `dx` as it is written:
/// `(residual + dx, dweight)`, bit for bit [`rms_norm_bwd`] then [`add`].
pub fn rms_norm_bwd_add(
    x: &Tensor,
    weight: &Tensor,
    eps: f64,
    dy: &Tensor,
    residual: &Tensor,
) -> Result<(Tensor, Tensor)> {
    rms_norm::rms_norm_bwd_add(x, weight, eps, dy, residual)
}

/// Gradients `(dx, dweight)` of [`rms_norm`] for the upstream gradient `dy`, without a graph (the
/// op's backward kernel, the same computation as autograd's, in the dtypes of `x` and `weight`).
pub fn rms_norm_bwd(
    x: &Tensor,
    weight: &Tensor,
    eps: f64,
    dy: &Tensor,
) -> Result<(Tensor, Tensor)> {
    rms_norm::rms_norm_bwd(x, weight, eps, dy)
}

/// Rotary position embedding in Hugging Face's rotate-half convention:
/// `y = x * cos + rotate_half(x) * sin`, `rotate_half([x1, x2]) = [-x2, x1]` on the halves of `d`.
/// `x`: `[b, s, heads, d]`; `cos`, `sin`: `[s, d / 2]` (the angle of pair `i` at position `p`), or
/// `[b, s, d / 2]` when the samples' positions differ (they restart at each document).
/// `cos`/`sin` may have any float dtype (converted to the compute dtype of `x`) and get no gradient;
/// the backward pass is the inverse rotation of the upstream gradient.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    rope::rope(x, cos, sin)
}

/// The gradient of [`rope`]'s input for the upstream gradient `dy` (the inverse rotation), without
/// a graph.
pub fn rope_bwd(dy: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    rope::rope_bwd(dy, cos, sin)
}

/// Causal scaled-dot-product attention with grouped-query heads.
/// `q`: `[b, s, hq, d]`, `k`, `v`: `[b, s, hkv, d]` with `hq % hkv == 0`; returns `[b, s, hq, d]`.
/// Query head `i` attends with kv head `i / (hq / hkv)`. Only the per-row log-sum-exp (`[b, hq, s]`)
/// is kept for the backward pass; scores are recomputed there, never stored. The CPU kernel runs
/// one task per `(batch, query head)` over blocks of 64 query rows (transient scratch of
/// `64 × s` per task); the backward sums `dK`/`dV` over the query heads sharing a kv head.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    attention::causal_attention(q, k, v, scale)
}

/// [`causal_attention`] without a graph, for a hand-written backward: returns what
/// [`causal_attention_bwd`] needs, the output in the kernel dtype (f32 for 16-bit inputs on the
/// CPU; the input dtype on CUDA) and the log-sum-exp `[b, hq, s]`. The caller converts the output
/// to the model dtype.
///
/// `floor` keeps documents apart (`data.reset_attention_mask`): `[b · s]`, the first key each
/// query row may see (its document's first position), `None` for plain causal attention. The
/// kernels skip the keys below a block's floor (on CUDA the project's flash kernels; cuDNN runs
/// the documents as a ragged batch, `sdpa_ragged.rs`).
pub fn causal_attention_saved(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    floor: Floor<'_>,
) -> Result<(Tensor, Tensor)> {
    attention::causal_attention_saved((q, k, v), scale, floor, AttentionBackend::Own)
}

/// Gradients `(dq, dk, dv)` of [`causal_attention`] (dtypes of `q`, `k`, `v`) from the inputs,
/// what [`causal_attention_saved`] returned and the output's upstream gradient `dout`: the same
/// backward kernel as autograd's.
pub fn causal_attention_bwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    saved: (&Tensor, &Tensor),
    dout: &Tensor,
    scale: f64,
    floor: Floor<'_>,
) -> Result<(Tensor, Tensor, Tensor)> {
    attention::causal_attention_bwd((q, k, v), saved, dout, scale, floor, AttentionBackend::Own)
}

/// One block of attention without autograd, for ring attention (context parallelism): `q`
/// `[b, s, hq, d]` against `k`, `v` `[b, sk, hkv, d]`, causally (`sk == s`, query `i` sees keys
/// `0..=i`) or unmasked (every query sees every key). Returns the output `[b, s, hq, d]` and the
/// per-row log-sum-exp of the scaled scores `[b, hq, s]`, both in the accumulation dtype (f32;
/// f64 for f64), from which blocks are merged (CPU and CUDA kernels). With a `floor` (see
/// [`causal_attention_saved`], counted in this block's keys), a row that sees none of the
/// block's keys gets a zero output and a log-sum-exp of −∞.
pub fn attention_block(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    causal: bool,
    floor: Floor<'_>,
) -> Result<(Tensor, Tensor)> {
    attention::attention_block((q, k, v), scale, (causal, floor), AttentionBackend::Own)
}

/// Gradients `(dq, dk, dv)` of one block of [`attention_block`] given the *merged* attention's
/// output `out` `[b, s, hq, d]`, its upstream gradient `dout` and its log-sum-exp `lse`
/// `[b, hq, s]`: the block's probabilities are then its share of the merged softmax, and the
/// blocks' `dq` sum to the full `dq` (each block's `dk`, `dv` are those of its own keys). The
/// gradients are in the accumulation dtype (that of `lse`).
#[allow(clippy::too_many_arguments)]
pub fn attention_block_bwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    dout: &Tensor,
    lse: &Tensor,
    scale: f64,
    causal: bool,
    floor: Floor<'_>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let merged = (out, lse);
    attention::attention_block_bwd(
        (q, k, v),
        merged,
        dout,
        scale,
        (causal, floor),
        AttentionBackend::Own,
    )
}

/// The attention kernels of `backend`: the plain causal ones on one context-parallel rank, the
/// blocks the ring merges on more.
pub fn attention_kernels(backend: AttentionBackend) -> Kernels {
    match backend {
        AttentionBackend::Own => Kernels {
            causal: causal_attention_saved,
            causal_bwd: causal_attention_bwd,
            block: attention_block,
            block_bwd: attention_block_bwd,
        },
        AttentionBackend::Cudnn => Kernels {
            causal: cudnn::causal_attention_saved::<true>,
            causal_bwd: cudnn::causal_attention_bwd::<true>,
            block: cudnn::attention_block::<true>,
            block_bwd: cudnn::attention_block_bwd::<true>,
        },
        AttentionBackend::CudnnNondeterministic => Kernels {
            causal: cudnn::causal_attention_saved::<false>,
            causal_bwd: cudnn::causal_attention_bwd::<false>,
            block: cudnn::attention_block::<false>,
            block_bwd: cudnn::attention_block_bwd::<false>,
        },
    }
}

/// Attention calls (forward or backward) that ran on cuDNN in this process; 0 without the `cuda`
/// feature.
pub fn cudnn_runs() -> u64 {
    #[cfg(feature = "cuda")]
    {
        cuda::cudnn::runs()
    }
    #[cfg(not(feature = "cuda"))]
    {
        0
    }
}

/// The attention entry points with the cuDNN backend: the calls it routes there (CUDA, bf16, a
/// head dim cuDNN takes) run cuDNN's fused attention, every other call the same kernels as the
/// functions of the same names above, with the same arguments and results. `DETERMINISTIC`
/// picks cuDNN's backward algorithm ([`AttentionBackend::deterministic`]).
pub mod cudnn {
    use super::{attention, AttentionBackend, Floor, Result, Tensor};

    /// The backend of the entry points below.
    const fn backend(deterministic: bool) -> AttentionBackend {
        if deterministic {
            AttentionBackend::Cudnn
        } else {
            AttentionBackend::CudnnNondeterministic
        }
    }

    /// [`super::causal_attention_saved`] on the cuDNN backend.
    pub fn causal_attention_saved<const DETERMINISTIC: bool>(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f64,
        floor: Floor<'_>,
    ) -> Result<(Tensor, Tensor)> {
        attention::causal_attention_saved((q, k, v), scale, floor, backend(DETERMINISTIC))
    }

    /// [`super::causal_attention_bwd`] on the cuDNN backend.
    pub fn causal_attention_bwd<const DETERMINISTIC: bool>(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        saved: (&Tensor, &Tensor),
        dout: &Tensor,
        scale: f64,
        floor: Floor<'_>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        attention::causal_attention_bwd(
            (q, k, v),
            saved,
            dout,
            scale,
            floor,
            backend(DETERMINISTIC),
        )
    }

    /// [`super::attention_block`] on the cuDNN backend.
    pub fn attention_block<const DETERMINISTIC: bool>(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f64,
        causal: bool,
        floor: Floor<'_>,
    ) -> Result<(Tensor, Tensor)> {
        attention::attention_block((q, k, v), scale, (causal, floor), backend(DETERMINISTIC))
    }

    /// [`super::attention_block_bwd`] on the cuDNN backend.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_block_bwd<const DETERMINISTIC: bool>(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        dout: &Tensor,
        lse: &Tensor,
        scale: f64,
        causal: bool,
        floor: Floor<'_>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let mask = (causal, floor);
        attention::attention_block_bwd(
            (q, k, v),
            (out, lse),
            dout,
            scale,
            mask,
            backend(DETERMINISTIC),
        )
    }
}

/// SwiGLU: `silu(gate) * up`, elementwise, same shapes and dtypes. Backward gives `d gate` and `d up`.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    swiglu::swiglu(gate, up)
}

/// Gradients `(d gate, d up)` of [`swiglu`] for the upstream gradient `dy`, without a graph.
pub fn swiglu_bwd(gate: &Tensor, up: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    swiglu::swiglu_bwd(gate, up, dy)
}

/// [`swiglu`] of the fused gate/up GEMM's output `gu` `[.., 2f]` (each row's gate, then its
/// up): `[.., f]`, bit for bit `swiglu` of the two halves.
pub fn swiglu_joined(gu: &Tensor) -> Result<Tensor> {
    swiglu::swiglu_joined(gu)
}

/// The gradient of [`swiglu_joined`] for `dy` `[.., f]`: `[.., 2f]` in `gu`'s layout (each
/// row's `d gate`, then its `d up`), bit for bit [`swiglu_bwd`]'s.
pub fn swiglu_joined_bwd(gu: &Tensor, dy: &Tensor) -> Result<Tensor> {
    swiglu::swiglu_joined_bwd(gu, dy)
}

/// Rows of `w` `[v, h]` for `ids` (u32, any shape of `n` elements): `[n, h]`. Backward: the
/// gradient rows summed per id in position order (deterministic; our own kernel on CUDA).
pub fn embedding(w: &Tensor, ids: &Tensor) -> Result<Tensor> {
    embedding::embedding(w, ids)
}

/// The gradient of [`embedding`]'s table, `[v, h]` in `dtype`, from the rows' gradient `grad`
/// `[n, h]` and their `ids` `[n]` (u32), without a graph: each id's rows summed in position order
/// (candle's `index_add` on the CPU, our kernel on CUDA; the same computation as autograd's).
pub fn embedding_bwd(
    grad: &Tensor,
    ids: &Tensor,
    v: usize,
    dtype: candle_core::DType,
) -> Result<Tensor> {
    embedding::embedding_bwd(grad, ids, v, dtype)
}

/// Per-row cross-entropy: `logits` `[n, v]` (float), `targets` `[n]` (u32); returns `[n]` losses
/// `logsumexp(logits[i]) - logits[i, targets[i]]` in the dtype of `logits`. A target `>= v` is an
/// error. Backward gives `dlogits = (softmax - onehot) * grad_loss`; `targets` get no gradient.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    cross_entropy::cross_entropy(logits, targets)
}

/// [`cross_entropy`] with the losses in the accumulation dtype: f32 for f32 and bf16 logits, f64
/// for f64. On CUDA bf16 logits are read as they are (no f32 copy of `[n, v]`) and their
/// gradient is bf16; on the CPU they are widened to f32 first.
pub fn cross_entropy_acc(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    cross_entropy::cross_entropy_acc(logits, targets)
}

/// The logits' gradient of [`cross_entropy_acc`] without a graph: `logits` and `targets` as
/// given to it, `losses` what it returned and `dlosses` their upstream gradient (`[n]`, any float
/// dtype); the result has the logits' dtype.
pub fn cross_entropy_acc_bwd(
    logits: &Tensor,
    targets: &Tensor,
    losses: &Tensor,
    dlosses: &Tensor,
) -> Result<Tensor> {
    cross_entropy::cross_entropy_acc_bwd(logits, targets, losses, dlosses)
}
