//! Context parallelism's positions and RoPE rows, checked directly: each rank's rows of the
//! cos/sin tables are the tables' rows at its global positions, the load-balanced pair of chunks
//! (rank i holds chunks i and 2·cp − 1 − i), and the ranks' positions partition the sequence.
//! (Wrong positions change the tiny model's loss only slightly, so the layout tests alone catch
//! them with little margin.)

use std::time::Duration;

use candle_core::{Device, Result, Tensor};
use parallel::comm::local::run_local;
use parallel::cp::ContextParallel;
use parallel::Group;

#[test]
fn rope_rows_are_the_tables_rows_at_each_ranks_positions() {
    let (seq, rows, dim) = (32usize, 64usize, 3usize);
    // Row r of cos holds r, of sin −r.
    let table: Vec<f32> = (0..rows * dim).map(|i| (i / dim) as f32).collect();
    let cos = Tensor::from_vec(table, (rows, dim), &Device::Cpu).unwrap();
    let sin = cos.neg().unwrap();
    for cp in [1usize, 2, 4] {
        let all = run_local(cp, Duration::from_secs(30), |rank, comm| -> Result<_> {
            let c = match cp {
                1 => ContextParallel::single(),
                _ => ContextParallel::new(comm, Group::new((0..cp).collect()), Default::default()),
            };
            let pos = c.positions(seq)?;
            let (rc, rs) = c.rope_rows(&cos, &sin, seq)?;
            let first = |t: &Tensor| -> Result<Vec<f32>> {
                Ok(t.to_vec2::<f32>()?.iter().map(|r| r[0]).collect())
            };
            Ok((rank, pos, first(&rc)?, first(&rs.neg()?)?))
        })
        .unwrap_or_else(|e| panic!("{e}"));
        let chunk = seq / (2 * cp);
        let mut seen = vec![false; seq];
        for (rank, pos, c_rows, s_rows) in all {
            let pair = 2 * cp - 1 - rank;
            let want: Vec<usize> = (rank * chunk..(rank + 1) * chunk)
                .chain(pair * chunk..(pair + 1) * chunk)
                .collect();
            assert_eq!(pos, want, "cp {cp} rank {rank}: positions");
            let at: Vec<f32> = pos.iter().map(|&p| p as f32).collect();
            assert_eq!(c_rows, at, "cp {cp} rank {rank}: cos rows");
            assert_eq!(s_rows, at, "cp {cp} rank {rank}: sin rows");
            for p in pos {
                assert!(!seen[p], "position {p} twice");
                seen[p] = true;
            }
        }
        assert!(seen.iter().all(|&s| s), "cp {cp}: every position once");
    }
}
