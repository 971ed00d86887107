//! Tests of `Mesh`: the Megatron tp-dp-pp rank order, coordinate round trips, groups and
//! pipeline neighbours, including the worked example of the module docs.

use parallel::config::ParallelConfig;
use parallel::mesh::{Axis, Coords, Mesh, MeshError};
use parallel::Group;

fn ranks(groups: &[parallel::Group]) -> Vec<Vec<usize>> {
    groups.iter().map(|g| g.ranks().to_vec()).collect()
}

const SHAPES: [(usize, usize, usize); 10] = [
    (1, 1, 1),
    (2, 1, 1),
    (1, 2, 1),
    (1, 1, 2),
    (2, 2, 2),
    (3, 2, 1),
    (2, 3, 4),
    (4, 1, 3),
    (1, 8, 2),
    (5, 3, 2),
];

#[test]
fn new_rejects_zero_sizes() {
    for (dp, tp, pp) in [(0, 1, 1), (1, 0, 1), (1, 1, 0)] {
        let err = Mesh::new(dp, tp, pp).unwrap_err();
        assert!(matches!(err, MeshError::ZeroAxis { .. }), "{err:?}");
        assert!(err.to_string().contains("at least 1"), "{err}");
    }
    assert!(matches!(
        Mesh::new(usize::MAX, 2, 1),
        Err(MeshError::Overflow { .. })
    ));
}

#[test]
fn from_config_and_sizes() {
    let c = ParallelConfig {
        dp: 3,
        tp: 2,
        pp: 4,
        ..Default::default()
    };
    let m = Mesh::from_config(&c).unwrap();
    assert_eq!(m.world_size(), 24);
    assert_eq!(
        (m.size(Axis::Dp), m.size(Axis::Tp), m.size(Axis::Pp)),
        (3, 2, 4)
    );
}

#[test]
fn coords_round_trip_and_formula() {
    for (dp, tp, pp) in SHAPES {
        let m = Mesh::new(dp, tp, pp).unwrap();
        assert_eq!(m.world_size(), dp * tp * pp);
        for r in 0..m.world_size() {
            let c = m.coords(r);
            assert!(c.dp < dp && c.tp < tp && c.pp < pp);
            assert_eq!(r, c.tp + tp * (c.dp + dp * c.pp), "shape {dp}x{tp}x{pp}");
            assert_eq!(m.rank_of(c), r);
        }
    }
}

#[test]
fn groups_partition_the_world() {
    for (dp, tp, pp) in SHAPES {
        let m = Mesh::new(dp, tp, pp).unwrap();
        for axis in Axis::ORDER {
            let groups = m.groups(axis);
            assert_eq!(groups.len(), m.world_size() / m.size(axis));
            let mut seen = vec![false; m.world_size()];
            for g in &groups {
                assert_eq!(g.size(), m.size(axis));
                let c0 = m.coords(g.ranks()[0]);
                for (i, &r) in g.ranks().iter().enumerate() {
                    assert!(!seen[r], "rank {r} in two {axis} groups");
                    seen[r] = true;
                    assert_eq!(&m.group(axis, r), g);
                    // Members differ only along `axis`, and member i has coordinate i.
                    let c = m.coords(r);
                    assert_eq!(c.get(axis), i);
                    for other in Axis::ORDER.into_iter().filter(|&a| a != axis) {
                        assert_eq!(c.get(other), c0.get(other));
                    }
                }
            }
            assert!(seen.iter().all(|&s| s));
        }
    }
}

#[test]
fn megatron_ordering_2x2x2() {
    let m = Mesh::new(2, 2, 2).unwrap();
    assert_eq!(ranks(&m.groups(Axis::Tp)), [[0, 1], [2, 3], [4, 5], [6, 7]]);
    assert_eq!(ranks(&m.groups(Axis::Dp)), [[0, 2], [1, 3], [4, 6], [5, 7]]);
    assert_eq!(ranks(&m.groups(Axis::Pp)), [[0, 4], [1, 5], [2, 6], [3, 7]]);
}

#[test]
fn worked_example_16_ranks() {
    // The table of the module docs: dp=2, tp=2, pp=4; (rank, dp, tp, pp).
    #[rustfmt::skip]
    let table = [
        (0, 0, 0, 0), (1, 0, 1, 0), (2, 1, 0, 0), (3, 1, 1, 0),
        (4, 0, 0, 1), (5, 0, 1, 1), (6, 1, 0, 1), (7, 1, 1, 1),
        (8, 0, 0, 2), (9, 0, 1, 2), (10, 1, 0, 2), (11, 1, 1, 2),
        (12, 0, 0, 3), (13, 0, 1, 3), (14, 1, 0, 3), (15, 1, 1, 3),
    ];
    let m = Mesh::new(2, 2, 4).unwrap();
    assert_eq!(m.world_size(), 16);
    for (rank, dp, tp, pp) in table {
        assert_eq!(m.coords(rank), Coords { dp, tp, cp: 0, pp });
        assert_eq!(m.rank_of(Coords { dp, tp, cp: 0, pp }), rank);
    }
    let tp: Vec<Vec<usize>> = (0..8).map(|i| vec![2 * i, 2 * i + 1]).collect();
    assert_eq!(ranks(&m.groups(Axis::Tp)), tp);
    assert_eq!(
        ranks(&m.groups(Axis::Dp)),
        [
            [0, 2],
            [1, 3],
            [4, 6],
            [5, 7],
            [8, 10],
            [9, 11],
            [12, 14],
            [13, 15]
        ]
    );
    assert_eq!(
        ranks(&m.groups(Axis::Pp)),
        [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    );
    assert_eq!(m.pp_next(5), Some(9));
    assert_eq!(m.pp_prev(5), Some(1));
    assert!((0..4).all(|r| m.is_first_stage(r) && !m.is_last_stage(r)));
    assert!((12..16).all(|r| m.is_last_stage(r) && !m.is_first_stage(r)));
    assert!((4..12).all(|r| !m.is_first_stage(r) && !m.is_last_stage(r)));
}

#[test]
fn pipeline_neighbours() {
    for (dp, tp, pp) in SHAPES {
        let m = Mesh::new(dp, tp, pp).unwrap();
        for r in 0..m.world_size() {
            let c = m.coords(r);
            assert_eq!(m.is_first_stage(r), c.pp == 0);
            assert_eq!(m.is_last_stage(r), c.pp == pp - 1);
            assert_eq!(m.pp_prev(r).is_none(), m.is_first_stage(r));
            assert_eq!(m.pp_next(r).is_none(), m.is_last_stage(r));
            if let Some(n) = m.pp_next(r) {
                assert_eq!(m.coords(n), Coords { pp: c.pp + 1, ..c });
                assert_eq!(m.pp_prev(n), Some(r));
            }
        }
    }
    let single = Mesh::new(4, 2, 1).unwrap();
    assert!((0..8).all(|r| single.is_first_stage(r) && single.is_last_stage(r)));
}

#[test]
fn worked_example_with_context_parallelism() {
    // The second table of the module docs: tp=2, cp=2, dp=2, pp=2; rank = tp + 2cp + 4dp + 8pp.
    let m =
        Mesh::with_sizes(&[(Axis::Tp, 2), (Axis::Cp, 2), (Axis::Dp, 2), (Axis::Pp, 2)]).unwrap();
    assert_eq!(m.world_size(), 16);
    for rank in 0..16 {
        let (tp, cp, dp, pp) = (rank % 2, rank / 2 % 2, rank / 4 % 2, rank / 8);
        assert_eq!(m.coords(rank), Coords { dp, tp, cp, pp });
        assert_eq!(m.rank_of(Coords { dp, tp, cp, pp }), rank);
    }
    assert_eq!(
        ranks(&m.groups(Axis::Cp))[..4],
        [[0, 2], [1, 3], [4, 6], [5, 7]]
    );
    assert_eq!(
        ranks(&m.groups(Axis::Dp))[..4],
        [[0, 4], [1, 5], [2, 6], [3, 7]]
    );
    assert_eq!(ranks(&m.groups(Axis::Pp))[..2], [[0, 8], [1, 9]]);
    let grad = |r| m.group_across(&[Axis::Dp, Axis::Cp], r).ranks().to_vec();
    assert_eq!(grad(0), [0, 2, 4, 6]);
    assert_eq!(grad(6), [0, 2, 4, 6]);
    assert_eq!(grad(9), [9, 11, 13, 15]);
    let e = Mesh::with_sizes(&[(Axis::Cp, 0)]).unwrap_err().to_string();
    assert!(
        e.contains("parallel.cp must be at least 1") && e.contains("cp=0"),
        "{e}"
    );
}

/// Expert parallelism folded inside data parallelism: the groups of the worked example in
/// `mesh.rs` (tp 2, dp 4, ep 2), and ep must divide dp.
#[test]
fn expert_groups_follow_the_worked_example() {
    let m = Mesh::new(4, 2, 1).unwrap().with_ep(2).unwrap();
    let groups = |f: &dyn Fn(usize) -> Group| -> Vec<Vec<usize>> {
        let mut all: Vec<Vec<usize>> = (0..8).map(|r| f(r).ranks().to_vec()).collect();
        all.sort();
        all.dedup();
        all
    };
    assert_eq!(
        groups(&|r| m.ep_group(r)),
        vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
    );
    assert_eq!(
        groups(&|r| m.expert_grad_group(r)),
        vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
    );
    let idx: Vec<usize> = (0..8).map(|r| m.ep_index(r)).collect();
    assert_eq!(idx, vec![0, 0, 1, 1, 0, 0, 1, 1]);
    // Without expert parallelism: one-rank ep groups, the expert group is the dp group.
    let plain = Mesh::new(4, 2, 1).unwrap();
    assert_eq!(plain.ep_group(3).ranks(), &[3]);
    assert_eq!(plain.expert_grad_group(3), plain.group(Axis::Dp, 3));
    let e = Mesh::new(4, 1, 1)
        .unwrap()
        .with_ep(3)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("parallel.ep (3) must be at least 1 and divide parallel.dp (4)"),
        "{e}"
    );
}

/// Every group of a rank comes from the mesh: with tp 2 × cp 2 × dp 4 (ep 2) × pp 2 and shard
/// groups of 4 over the 8-rank gradient group (dp × cp), rank 2 (tp 0, cp 1, dp 0, pp 0).
#[test]
fn rank_groups_name_every_group_of_a_rank() {
    let mesh = Mesh::with_sizes(&[(Axis::Tp, 2), (Axis::Cp, 2), (Axis::Dp, 4), (Axis::Pp, 2)])
        .unwrap()
        .with_ep(2)
        .unwrap();
    let g = mesh.rank_groups(2, 4);
    assert_eq!(g.tp.ranks(), &[2, 3]);
    assert_eq!(g.cp.ranks(), &[0, 2]);
    // Gradient group: the dp × cp ranks with tp 0, pp 0, in rank order.
    assert_eq!(g.grad.ranks(), &[0, 2, 4, 6, 8, 10, 12, 14]);
    // Rank 2 is member 1 of the gradient group: shard group 0 (members 0-3), shard 1; its
    // replicas hold shard 1 of the other shard groups.
    assert_eq!(g.shard.ranks(), &[0, 2, 4, 6]);
    assert_eq!(g.replicate.ranks(), &[2, 10]);
    // Expert parallelism pairs data-parallel indices 0 and 1 (same tp, cp, pp).
    assert_eq!(g.ep.ranks(), &[2, 6]);
    assert_eq!(g.expert_grad.ranks(), &[0, 2, 8, 10]);
    assert_eq!(g.pp.ranks(), &[2, 18]);
    assert_eq!(g.pipeline_ends.ranks(), &[2, 18]);
    let names: Vec<&str> = g.named().iter().map(|(n, _)| *n).collect();
    assert_eq!(
        names,
        [
            "tp",
            "cp",
            "grad",
            "shard",
            "replicate",
            "expert_grad",
            "ep",
            "pp",
            "pipeline_ends"
        ]
    );
    // Without sharding every rank is its own shard group and the gradient group replicates.
    let one = mesh.rank_groups(2, 1);
    assert_eq!(one.shard.ranks(), &[2]);
    assert_eq!(one.replicate.ranks(), one.grad.ranks());
}
