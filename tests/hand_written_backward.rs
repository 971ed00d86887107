//! The hand-written backward passes (dense decoder blocks, and the head with the fused or the
//! vocab-parallel loss) against candle's autograd, through the real training step at every layout the
//! parallel tests cover (context parallelism's ring included), recompute, bf16 and larger
//! micro-batches: the same losses, gradient norms and final weights.
//!
//! Tolerance: the hand-written passes run autograd's kernels, dtype conversions and collectives
//! in autograd's order (the sums of the projections' input gradients included), so they compute
//! the same values; the one difference is where a projection's weight gradient meets the
//! gradient buffer. Autograd computes `gᵀx` and adds it; the fused accumulation runs one GEMM
//! into the buffer, and when the GEMM splits its inner dimension (the micro-batch's rows) into
//! several blocks, their partial sums are added into the buffer one by one. Measured: bit for bit
//! up to 512 rows per micro-batch (and at 2048 rows in a single micro-batch); with 1024 rows and
//! four micro-batches, losses 1.5e-8 relative, gradient norms 6.5e-8, weights 1.3e-6 (Adam's
//! amplification of near-zero gradients, see `tests/parallel.rs`). Asserted: the parallel
//! tests' tolerances (losses < 1e-6, step-1 gradient norm < 1e-6, weights < 3e-4, mean < 2e-7).
//! A 1e-4 error in one input gradient or in the fused product moves the loss or the step-1 norm
//! by 4e-6 to 8e-5 and fails.

mod common;
use common::{assert_equivalent, compare, run, MOE};

fn assert_same(layout: &str) {
    let autograd = run(&format!("{layout},train.backward=autograd"));
    let hand = run(layout);
    assert_equivalent(layout, compare(layout, &autograd, &hand));
}

#[test]
fn hand_written_backward_equals_autograd_at_every_layout() {
    for layout in [
        "parallel.dp=1",
        "parallel.tp=2",
        "parallel.dp=2,parallel.tp=2,parallel.sequence_parallel=true",
        "parallel.dp=2,parallel.zero=1,parallel.bucket_size=65536",
        "parallel.dp=2,parallel.zero=3",
        "parallel.pp=2,parallel.virtual_stages=2",
        "parallel.dp=2,parallel.tp=2,parallel.pp=2,parallel.virtual_stages=2,parallel.sequence_parallel=true,parallel.zero=1,parallel.bucket_size=65536",
        "train.recompute=full",
        "parallel.tp=2,parallel.sequence_parallel=true,train.recompute=full",
        "train.dtype=bf16",
        "train.micro_batch=16",
        "train.global_batch=32,train.micro_batch=8",
        "parallel.dp=2,parallel.pp=2,train.global_batch=32,train.micro_batch=8",
        "parallel.cp=2",
        "parallel.cp=4,train.dtype=bf16",
        "parallel.cp=2,parallel.tp=2,parallel.sequence_parallel=true,train.recompute=full",
    ] {
        assert_same(layout);
    }
}

/// The MoE blocks' pass at the layouts of `tests/moe.rs` and `tests/expert_parallel.rs`.
///
/// Tolerance: the MoE layer's own backward reaches the router through the closed-form softmax
/// and renormalisation gradients and computes the router's weight gradient with another GEMM,
/// so the f32 sums differ from autograd's in order (`tests/moe.rs` compares the layer alone in
/// f64 at 1e-12). In f32 that stays within the parallel tests' tolerances (measured: losses
/// ≤ 3.2e-8 relative, step-1 gradient norms ≤ 3.8e-9). In bf16 an f32 difference of one part in
/// 10⁷ sometimes flips the rounding of a bf16 gradient element (one part in 256), which the
/// backward then carries through every layer: measured 1.8e-5 in the loss, 2.7e-5 in the step-1
/// gradient norm, weights ≤ 1.1e-2 apart (about one bf16 step of a weight near 1, or Adam's
/// sign flip of an update on a near-zero gradient) and 2.9e-5 on average; asserted with about
/// three times those bounds. A relative error of 1e-3 in the load-balancing or the
/// renormalisation gradient, or 1e-6 added to the router's weight gradient, fails the f32
/// layouts (a uniform scale of one parameter's gradient would not: Adam's update ignores it).
#[test]
fn moe_blocks_equal_autograd_at_every_layout() {
    for layout in [
        "parallel.dp=1",
        "model.moe_expert_capacity_factor=1.0",
        "model.router_bias_update_rate=0.001",
        "model.mlp_only_layers=[0],train.recompute=full",
        "parallel.tp=2,parallel.sequence_parallel=true",
        "parallel.dp=2,parallel.ep=2,parallel.zero=1",
        "parallel.dp=4,parallel.ep=4",
        "parallel.dp=2,parallel.ep=2,parallel.pp=2,parallel.zero=3,train.recompute=full",
    ] {
        assert_same(&format!("{MOE},{layout}"));
    }
    let layout = format!("{MOE},train.dtype=bf16");
    let autograd = run(&format!("{layout},train.backward=autograd"));
    let d = compare(&layout, &autograd, &run(&layout));
    assert!(
        d.loss < 6e-5 && d.grad_norm_first < 1e-4 && d.grad_norm < 2e-2,
        "{layout}: {d:?}"
    );
    assert!(
        d.weight_max < 3e-2 && d.weight_mean < 1e-4,
        "{layout}: {d:?}"
    );
}
