//! The decoder blocks' hand-written backward pass against candle's autograd, through the real
//! training step at every layout the parallel tests cover, recompute and bf16: the same losses,
//! gradient norms and final weights.
//!
//! Tolerance: none. The hand-written pass runs autograd's kernels, dtype conversions and
//! collectives in autograd's order (the sums of the projections' input gradients included), and
//! adding a contribution to autograd's zero-filled gradient is exact, so the two paths agree bit
//! for bit on the CPU. (A different summation order would show as ~1e-7 relative differences;
//! a wrong gradient as 1e-3 or more.)

mod common;
use common::{compare, run};

fn assert_identical(layout: &str) {
    let autograd = run(&format!("{layout},train.block_backward=autograd"));
    let hand = run(layout);
    let d = compare(layout, &autograd, &hand);
    assert!(
        d.loss == 0.0 && d.grad_norm == 0.0 && d.weight_max == 0.0,
        "{layout}: the hand-written backward differs from autograd: {d:?}"
    );
}

#[test]
fn hand_written_block_backward_equals_autograd_at_every_layout() {
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
    ] {
        assert_identical(layout);
    }
}
