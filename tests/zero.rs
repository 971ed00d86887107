//! ZeRO stages 2 and 3 train like one rank at every layout they compose with (data, tensor +
//! sequence, pipeline and interleaved parallelism, hybrid sharding), with and without activation
//! recompute, within the tolerances of `tests/parallel.rs`.

mod common;
use common::{assert_equivalent, compare, run};

#[test]
fn zero_2_and_3_train_like_one_rank_at_every_layout() {
    let base = run("parallel.dp=1");
    for stage in [2, 3] {
        for layout in [
            "parallel.dp=2",
            "parallel.dp=4",
            "parallel.dp=2,parallel.tp=2,parallel.sequence_parallel=true",
            "parallel.dp=2,parallel.pp=2",
            "parallel.dp=2,parallel.tp=2,parallel.pp=2,parallel.virtual_stages=2,parallel.sequence_parallel=true",
            "parallel.dp=4,parallel.zero_shard_size=2",
        ] {
            for recompute in ["none", "full"] {
                let l = format!("{layout},parallel.zero={stage},train.recompute={recompute}");
                assert_equivalent(&l, compare(&l, &base, &run(&l)));
            }
        }
    }
}
