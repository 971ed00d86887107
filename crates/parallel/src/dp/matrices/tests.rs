//! Whole matrices' tests: owners' balance, spreading without sharding, tensor-parallel peers
//! splitting the iterations, shapes.

use super::*;

#[test]
fn owners_take_the_longest_jobs_first() {
    assert_eq!(
        assign_owners(&[1.0, 8.0, 3.0, 3.0, 2.0], 2),
        vec![0, 0, 1, 1, 1]
    );
    // One member owns everything.
    assert_eq!(assign_owners(&[5.0, 1.0], 1), vec![0, 0]);
    // Equal jobs go round the members.
    assert_eq!(assign_owners(&[1.0; 4], 3), vec![0, 1, 2, 0]);
}

/// `f` (doubling, counted) over four matrices of a layout cut into small buckets, by a rank
/// of `size` at `rank` spreading them as `spread` says: the results and the calls made.
fn mapped(comm: Arc<dyn Comm>, spread: Spread, size: usize) -> (Vec<f32>, usize) {
    let numels = [12, 20, 6, 30];
    let shapes = [[3, 4], [4, 5], [2, 3], [5, 6]];
    let layout = FlatLayout::new(&numels, 16, 1);
    let matrices = (0..4)
        .map(|i| Matrix {
            param: i,
            shape: shapes[i],
            tp_dim: None,
            expert: false,
        })
        .collect();
    let rank = comm.rank();
    let all = Group::new((0..size).collect());
    let groups = MatrixGroups {
        shard: all.clone(),
        expert_grad: all,
        tp: Group::new(vec![rank]),
    };
    let pos = (spread, ShardPos::uniform(rank, size));
    let total = layout.total;
    let whole = WholeMatrices::new(comm, layout, pos, groups, matrices, |s| {
        (s[0] * s[1]) as f64
    });
    let u = Tensor::arange(0f32, total as f32, &candle_core::Device::Cpu).unwrap();
    let mut calls = 0;
    let out = whole
        .map(&u, &mut |ms: &[Tensor]| {
            calls += ms.len();
            ms.iter().map(|m| m.affine(2.0, 0.0)).collect()
        })
        .unwrap();
    (out.to_vec1().unwrap(), calls)
}

/// Without sharding (ZeRO stage 0) the matrices are still spread: each is transformed by one
/// rank of the group, and every rank ends with what a rank alone computes.
#[test]
fn replicated_matrices_are_transformed_once_and_shared() {
    use crate::comm::local::LocalWorld;
    let timeout = std::time::Duration::from_secs(30);
    let alone = mapped(LocalWorld::new(1, timeout).remove(0), Spread::Alone, 1);
    assert_eq!(alone.1, 4);
    let handles: Vec<_> = LocalWorld::new(2, timeout)
        .into_iter()
        .map(|c| std::thread::spawn(move || mapped(c, Spread::Replicated, 2)))
        .collect();
    let got: Vec<(Vec<f32>, usize)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (out, calls) in &got {
        assert_eq!(out, &alone.0);
        assert!(
            *calls > 0 && *calls < 4,
            "{calls} of 4 matrices on one rank"
        );
    }
    assert_eq!(got[0].1 + got[1].1, 4, "each matrix transformed once");
}

/// Tensor-parallel peers split the matrices tensor parallelism cuts: each is iterated by one
/// peer and broadcast, and every peer keeps its own block of the result.
#[test]
fn tensor_parallel_peers_split_the_iterations() {
    use crate::comm::local::LocalWorld;
    let timeout = std::time::Duration::from_secs(30);
    let run = |comm: Arc<dyn Comm>| -> (Vec<f32>, usize) {
        // Four matrices, each cut along a dimension into two blocks (this rank's shown).
        let shapes = [[2, 4], [3, 5], [4, 2], [1, 6]];
        let numels: Vec<usize> = shapes.iter().map(|s| s[0] * s[1]).collect();
        let layout = FlatLayout::new(&numels, 16, 1);
        let matrices = (0..4)
            .map(|i| Matrix {
                param: i,
                shape: shapes[i],
                tp_dim: Some(i % 2),
                expert: false,
            })
            .collect();
        let rank = comm.rank();
        let me = Group::new(vec![rank]);
        let groups = MatrixGroups {
            shard: me.clone(),
            expert_grad: me,
            tp: Group::new(vec![0, 1]),
        };
        let pos = (Spread::Alone, ShardPos::uniform(0, 1));
        let total = layout.total;
        let whole = WholeMatrices::new(comm, layout, pos, groups, matrices, |s| {
            (s[0] * s[1]) as f64
        });
        let u = (Tensor::arange(0f32, total as f32, &candle_core::Device::Cpu).unwrap()
            + 100.0 * rank as f64)
            .unwrap();
        let mut calls = 0;
        let out = whole
            .map(&u, &mut |ms: &[Tensor]| {
                calls += ms.len();
                ms.iter().map(|m| m.affine(2.0, 0.0)).collect()
            })
            .unwrap();
        let want: Vec<f32> = u
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| 2.0 * x)
            .collect();
        assert_eq!(out.to_vec1::<f32>().unwrap(), want, "rank {rank}");
        (want, calls)
    };
    let handles: Vec<_> = LocalWorld::new(2, timeout)
        .into_iter()
        .map(|c| std::thread::spawn(move || run(c)))
        .collect();
    let calls: Vec<usize> = handles.into_iter().map(|h| h.join().unwrap().1).collect();
    assert_eq!(
        calls[0] + calls[1],
        4,
        "each matrix iterated once: {calls:?}"
    );
    assert!(calls.iter().all(|&c| c > 0), "both peers work: {calls:?}");
}

#[test]
fn whole_shapes_follow_the_cut() {
    let m = Matrix {
        param: 0,
        shape: [4, 6],
        tp_dim: Some(1),
        expert: false,
    };
    assert_eq!(m.whole_shape(2), [4, 12]);
    let held = Matrix { tp_dim: None, ..m };
    assert_eq!(held.whole_shape(2), [4, 6]);
}
