//! Tests of the `local` communication backend and `run_local`: collectives against single-thread
//! references, bit-identical results across ranks, subgroups, concurrent groups, send/recv,
//! mismatch detection, timeouts, failure propagation and slot cleanup.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Result, Shape, Tensor};
use parallel::comm::local::{run_local, LocalComm, LocalWorld};
use parallel::{Channel, Comm, CommError, Group, ReduceOp};

const T: Duration = Duration::from_secs(10);

/// NCCL's rules, as the backend keeps them (its own file: this one holds the collectives).
#[path = "comm_local/nccl_rules.rs"]
mod nccl_rules;

/// A deterministic, rank-dependent tensor whose sums depend on the order of addition.
fn input(rank: usize, dims: &[usize], dtype: DType, salt: f64) -> Tensor {
    let n = dims.iter().product::<usize>() as u32;
    let t = Tensor::arange(0u32, n, &Device::Cpu).and_then(|t| t.to_dtype(DType::F64));
    let t = t.and_then(|t| t.affine(0.37 + 0.11 * rank as f64, salt + rank as f64));
    t.and_then(|t| t.sin()?.to_dtype(dtype)?.reshape(dims))
        .unwrap()
}

/// The same input, transposed (non-contiguous) when `strided`.
fn maybe_strided(rank: usize, dims: &[usize], dtype: DType, strided: bool) -> Tensor {
    if strided {
        let rev: Vec<usize> = dims.iter().rev().copied().collect();
        input(rank, &rev, dtype, 0.5).t().unwrap()
    } else {
        input(rank, dims, dtype, 0.5)
    }
}

fn vals(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn sum_ref(xs: &[Tensor]) -> Tensor {
    xs[1..].iter().fold(xs[0].clone(), |a, x| a.add(x).unwrap())
}

/// Runs `f(rank, comm)` on one thread per rank of a fresh `LocalWorld`; returns the outcomes.
fn with_world<R: Send>(
    n: usize,
    timeout: Duration,
    f: impl Fn(usize, &Arc<LocalComm>) -> R + Sync,
) -> Vec<R> {
    with_comms(&LocalWorld::new(n, timeout), f)
}

/// Runs `f(rank, comm)` on one thread per communicator; returns the outcomes.
fn with_comms<R: Send>(
    comms: &[Arc<LocalComm>],
    f: impl Fn(usize, &Arc<LocalComm>) -> R + Sync,
) -> Vec<R> {
    std::thread::scope(|s| {
        let f = &f;
        let spawn = |(r, c)| s.spawn(move || f(r, c));
        let hs: Vec<_> = comms.iter().enumerate().map(spawn).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn world(n: usize) -> Group {
    Group::new((0..n).collect())
}

#[test]
fn collectives_match_reference_and_are_identical() {
    for n in [1, 2, 4] {
        for dtype in [DType::F32, DType::F64] {
            for strided in [false, true] {
                let dims = [4, 8];
                let xs: Vec<Tensor> = (0..n)
                    .map(|r| maybe_strided(r, &dims, dtype, strided))
                    .collect();
                let out = run_local(n, T, |r, c| -> Result<_> {
                    let g = world(n);
                    let x = maybe_strided(r, &dims, dtype, strided);
                    let mut res = vec![
                        c.all_reduce(&g, &x, ReduceOp::Sum)?,
                        c.all_reduce(&g, &x, ReduceOp::Max)?,
                    ];
                    for dim in 0..2 {
                        res.push(c.all_gather(&g, &x, dim)?);
                        res.push(c.reduce_scatter(&g, &x, dim)?);
                    }
                    Ok(res.iter().map(vals).collect::<Vec<_>>())
                })
                .unwrap();
                let sum = sum_ref(&xs);
                let max = xs[1..]
                    .iter()
                    .fold(xs[0].clone(), |a, x| a.maximum(x).unwrap());
                for (r, res) in out.iter().enumerate() {
                    assert_eq!(res[0], vals(&sum), "sum n={n} {dtype:?}");
                    assert_eq!(res[1], vals(&max), "max n={n} {dtype:?}");
                    for dim in 0..2 {
                        let gathered = Tensor::cat(&xs, dim).unwrap();
                        assert_eq!(res[2 + 2 * dim], vals(&gathered), "gather dim {dim}");
                        let chunk = dims[dim] / n;
                        let part = sum.narrow(dim, r * chunk, chunk).unwrap();
                        assert_eq!(res[3 + 2 * dim], vals(&part), "scatter dim {dim}");
                    }
                    // Bit-identical across ranks for the shared results.
                    for k in [0, 1, 2, 4] {
                        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&res[k]), bits(&out[0][k]));
                    }
                }
            }
        }
    }
}

#[test]
fn reduce_scatter_3d_every_dim() {
    let n = 4;
    let dims = [4, 8, 12];
    let xs: Vec<Tensor> = (0..n).map(|r| input(r, &dims, DType::F32, 1.0)).collect();
    let sum = sum_ref(&xs);
    let out = run_local(n, T, |r, c| -> Result<_> {
        let x = input(r, &dims, DType::F32, 1.0);
        (0..3)
            .map(|d| Ok(vals(&c.reduce_scatter(&world(n), &x, d)?)))
            .collect::<Result<Vec<_>>>()
    })
    .unwrap();
    for (r, res) in out.iter().enumerate() {
        for d in 0..3 {
            let chunk = dims[d] / n;
            assert_eq!(res[d], vals(&sum.narrow(d, r * chunk, chunk).unwrap()));
        }
    }
}

#[test]
fn broadcast_and_barrier() {
    let n = 4;
    let out = run_local(n, T, |r, c| -> Result<_> {
        let g = world(n);
        let mut res = vec![];
        for root in 0..n {
            let x = maybe_strided(r, &[3, 5], DType::F64, r % 2 == 1);
            c.barrier(&g)?;
            res.push(vals(&c.broadcast(&g, &x, root)?));
        }
        Ok(res)
    })
    .unwrap();
    for res in &out {
        for (root, v) in res.iter().enumerate() {
            assert_eq!(
                *v,
                vals(&maybe_strided(root, &[3, 5], DType::F64, root % 2 == 1))
            );
        }
    }
}

/// Every direction of a job, in one global order (what a job prepares).
fn directions(n: usize) -> Vec<Channel> {
    let pairs = (0..n).flat_map(|src| (0..n).map(move |dst| (src, dst)));
    let other = pairs.filter(|(src, dst)| src != dst);
    other.map(|(src, dst)| Channel::P2p { src, dst }).collect()
}

#[test]
fn send_recv_fifo() {
    let n = 4;
    let out = run_local(n, T, |r, c| -> Result<_> {
        c.prepare(&directions(n))?;
        for dst in (0..n).filter(|&d| d != r) {
            for k in 0..5 {
                c.send(&input(r, &[2, 3], DType::F32, (dst * 10 + k) as f64), dst)?;
            }
        }
        let mut got = vec![];
        for src in (0..n).rev().filter(|&s| s != r) {
            for _ in 0..5 {
                got.push(vals(&c.recv(src, &Shape::from(vec![2, 3]), DType::F32)?));
            }
        }
        Ok(got)
    })
    .unwrap();
    for (r, got) in out.iter().enumerate() {
        let mut i = 0;
        for src in (0..n).rev().filter(|&s| s != r) {
            for k in 0..5 {
                assert_eq!(
                    got[i],
                    vals(&input(src, &[2, 3], DType::F32, (r * 10 + k) as f64))
                );
                i += 1;
            }
        }
    }
}

#[test]
fn disjoint_subgroups_run_concurrently() {
    let out = run_local(4, T, |r, c| -> Result<_> {
        let g = Group::new(vec![r % 2, r % 2 + 2]);
        let mut last = vec![];
        for i in 0..50 {
            last = vals(&c.all_reduce(&g, &input(r, &[6], DType::F32, i as f64), ReduceOp::Sum)?);
        }
        Ok(last)
    })
    .unwrap();
    for (r, v) in out.iter().enumerate() {
        let pair = [r % 2, r % 2 + 2].map(|p| input(p, &[6], DType::F32, 49.0));
        assert_eq!(*v, vals(&sum_ref(&pair)));
    }
}

#[test]
fn two_threads_of_a_rank_use_two_groups() {
    // World 4 as tp=2 × dp=2: the main thread all-reduces over tp, a helper thread over dp.
    let out = run_local(4, T, |r, c| -> Result<_> {
        let (tp, dp) = (
            Group::new(vec![r / 2 * 2, r / 2 * 2 + 1]),
            Group::new(vec![r % 2, r % 2 + 2]),
        );
        std::thread::scope(|s| {
            let helper = s.spawn(|| -> Result<Vec<f64>> {
                let x = input(r, &[5], DType::F64, 7.0);
                let mut last = vec![];
                for _ in 0..200 {
                    last = vals(&c.all_reduce(&dp, &x, ReduceOp::Sum)?);
                }
                Ok(last)
            });
            let x = input(r, &[5], DType::F64, 3.0);
            let mut main = vec![];
            for _ in 0..200 {
                main = vals(&c.all_reduce(&tp, &x, ReduceOp::Max)?);
            }
            Ok((main, helper.join().unwrap()?))
        })
    })
    .unwrap();
    for (r, (main, helper)) in out.iter().enumerate() {
        let tp = [r / 2 * 2, r / 2 * 2 + 1].map(|p| input(p, &[5], DType::F64, 3.0));
        let dp = [r % 2, r % 2 + 2].map(|p| input(p, &[5], DType::F64, 7.0));
        assert_eq!(*main, vals(&tp[0].maximum(&tp[1]).unwrap()));
        assert_eq!(*helper, vals(&sum_ref(&dp)));
    }
}

#[test]
fn mismatches_are_invalid_on_every_rank() {
    let comms = LocalWorld::new(3, T);
    let errs = with_comms(&comms, |r, c| {
        let g = world(3);
        let dims = if r == 1 { [2, 4] } else { [4, 2] };
        let x = input(r, &dims, DType::F32, 0.0);
        let shape = c.all_reduce(&g, &x, ReduceOp::Sum);
        let x = input(r, &[4], if r == 2 { DType::F64 } else { DType::F32 }, 0.0);
        let dtype = c.all_gather(&g, &x, 0);
        let x = input(r, &[4], DType::F32, 0.0);
        let kind = match r {
            0 => c.all_gather(&g, &x, 0),
            _ => c.all_reduce(&g, &x, ReduceOp::Sum),
        };
        let errs = [
            shape.map(|_| ()),
            dtype.map(|_| ()),
            kind.map(|_| ()),
            c.reduce_scatter(&g, &x, 0).map(|_| ()), // 4 rows, 3 members
            c.barrier(&Group::new(vec![(r + 1) % 3])),
            c.broadcast(&g, &x, 7).map(|_| ()),
            c.barrier(&Group::new(vec![0, 1, 2, 5])),
            c.send(&x, 3),
        ];
        c.barrier(&g).unwrap(); // still usable afterwards
        errs.map(|e| e.unwrap_err().to_string())
    });
    for (r, errs) in errs.iter().enumerate() {
        let expected = [
            "all_reduce over ranks [0, 1, 2]: call #0 on this group does not match".to_string(),
            "all_gather over ranks [0, 1, 2]: call #1 on this group does not match".to_string(),
            "passed all_reduce(Sum) of [4] F32 on Cpu".to_string(),
            "dim 0 of size 4 is not divisible by 3 members".to_string(),
            format!("rank {r} is not a member of the group"),
            "broadcast root 7 is not a member".to_string(),
            "no rank 5 in a job of 3 ranks".to_string(),
            "send over ranks [".to_string() + &format!("{r}, 3]: no rank 3"),
        ];
        for (e, want) in errs.iter().zip(&expected) {
            assert!(e.contains(want.as_str()), "rank {r}: {e:?} lacks {want:?}");
        }
    }
    assert_eq!(comms[0].pending_slots(), 0);
}

#[test]
fn recv_checks_shape_and_dtype() {
    let out = with_world(2, T, |r, c| {
        if r == 0 {
            c.send(&input(0, &[3], DType::F32, 0.0), 1)
                .map(|_| String::new())
                .unwrap()
        } else {
            c.recv(0, &Shape::from(vec![4]), DType::F32)
                .unwrap_err()
                .to_string()
        }
    });
    assert!(
        out[1].contains("expected [4] F32 from rank 0, got [3] F32"),
        "{}",
        out[1]
    );
}

#[test]
fn missing_rank_times_out() {
    let timeout = Duration::from_millis(200);
    let out = with_world(3, timeout, |r, c| {
        let start = Instant::now();
        let res = match r {
            2 => return (String::new(), start.elapsed()),
            1 => c.recv(2, &Shape::from(vec![1]), DType::F32).map(|_| ()),
            _ => c.barrier(&Group::new(vec![0, 2])),
        };
        (res.unwrap_err().to_string(), start.elapsed())
    });
    for (msg, elapsed) in &out[..2] {
        assert!(
            msg.contains("timed out") && msg.contains("waiting for ranks [2]"),
            "{msg}"
        );
        assert!(*elapsed >= timeout && *elapsed < timeout * 5, "{elapsed:?}");
    }
}

/// Every other rank's pending call fails promptly with PeerFailed naming rank 2 and the op;
/// `run_local` reports rank 2's own error.
fn check_failure_propagates(panic: bool) {
    let seen = Mutex::new(vec![]);
    let start = Instant::now();
    let err = run_local(4, T, |r, c| -> Result<()> {
        let g = world(4);
        for i in 0..3 {
            c.all_reduce(&g, &input(r, &[3], DType::F32, i as f64), ReduceOp::Sum)?;
        }
        if r == 2 {
            std::thread::sleep(Duration::from_millis(50));
            if panic {
                panic!("kaboom");
            }
            return Err(candle_core::Error::msg("boom"));
        }
        let res = if r == 3 {
            c.recv(2, &Shape::from(vec![1]), DType::F32).map(|_| ())
        } else {
            c.all_reduce(&g, &input(r, &[3], DType::F32, 0.0), ReduceOp::Sum)
                .map(|_| ())
        };
        let e = res.unwrap_err();
        // Typed, and still typed inside the candle error model code returns.
        let (typed, e) = (e.is_peer_failure(), candle_core::Error::from(e));
        let typed = typed && CommError::find(&e).is_some_and(CommError::is_peer_failure);
        let mut seen = seen.lock().unwrap();
        seen.push((r, e.to_string(), start.elapsed(), typed));
        Err(e)
    })
    .unwrap_err();
    let reason = if panic { "panicked: kaboom" } else { "boom" };
    assert_eq!(err.rank, 2, "{err}: {}", err.error);
    assert_eq!(err.to_string(), "rank 2 failed");
    let own = err.error.to_string();
    assert!(own.contains(reason), "{own}");
    assert!(!own.contains("aborted"), "root cause expected, got {own}");
    // The rank's own error is the cause, not a copy of its text.
    let source = std::error::Error::source(&err).map(|s| s.to_string());
    assert_eq!(source.as_deref(), Some(own.as_str()));
    let seen = seen.into_inner().unwrap();
    assert_eq!(seen.len(), 3);
    for (r, msg, elapsed, typed) in seen {
        assert!(typed, "rank {r}: not a typed peer failure: {msg}");
        let op = if r == 3 { "recv" } else { "all_reduce" };
        assert!(msg.contains(&format!("rank {r}: {op}")), "{msg}");
        assert!(msg.contains(&format!("rank 2 failed: {reason}")), "{msg}");
        assert!(elapsed < T / 2, "{elapsed:?}");
    }
}

#[test]
fn error_propagates_to_peers() {
    check_failure_propagates(false);
}

#[test]
fn panic_propagates_to_peers() {
    check_failure_propagates(true);
}

#[test]
fn later_calls_fail_after_abort() {
    let out = with_world(2, T, |r, c| {
        if r == 0 {
            c.abort("stop");
        }
        let e = c.barrier(&world(2)).unwrap_err().to_string();
        (
            e,
            c.send(&input(0, &[1], DType::F32, 0.0), 1 - r)
                .unwrap_err()
                .to_string(),
        )
    });
    for (a, b) in out {
        assert!(
            a.contains("barrier") && a.contains("rank 0 failed: stop"),
            "{a}"
        );
        assert!(
            b.contains("send") && b.contains("rank 0 failed: stop"),
            "{b}"
        );
    }
}

#[test]
fn long_loop_leaves_no_slots() {
    let comms = LocalWorld::new(2, T);
    with_comms(&comms, |r, c| {
        let g = world(2);
        let mut channels = directions(2);
        channels.push(Channel::Group(g.clone()));
        c.prepare(&channels).unwrap();
        let x = input(r, &[4], DType::F32, 0.0);
        for i in 0..10_000 {
            let y = c.all_reduce(&g, &x, ReduceOp::Sum).unwrap();
            if i % 1000 == 0 {
                c.send(&y, 1 - r).unwrap();
                c.recv(1 - r, y.shape(), DType::F32).unwrap();
            }
        }
    });
    assert_eq!(
        (comms[0].pending_slots(), comms[1].pending_messages()),
        (0, 0)
    );
}

#[test]
fn run_local_returns_results_in_rank_order() {
    let names = run_local(3, T, |r, c| -> Result<_> {
        assert_eq!((c.rank(), c.world_size()), (r, 3));
        Ok(std::thread::current().name().map(str::to_string))
    })
    .unwrap();
    assert_eq!(
        names,
        ["rank-0", "rank-1", "rank-2"].map(|s| Some(s.to_string()))
    );
}

/// All-to-all with uneven splits (some empty) delivers every chunk to its member, in member
/// order, on a subgroup; counts that do not match the rows are refused.
#[test]
fn all_to_all_delivers_uneven_chunks() {
    let group = Group::new(vec![0, 2, 3]);
    let count = |from: usize, to: usize| (2 * from + to + 1) % 3; // member indices
    let rows_of = |m: usize| -> usize { (0..3).map(|j| count(m, j)).sum() };
    let out = with_world(4, T, |rank, comm| {
        let m = group.index_of(rank)?;
        let send: Vec<usize> = (0..3).map(|j| count(m, j)).collect();
        let recv: Vec<usize> = (0..3).map(|j| count(j, m)).collect();
        let x = input(m, &[rows_of(m), 2], DType::F32, 0.0);
        let bad = comm.all_to_all(&group, &x, &[1, 1, 1, 1], &recv);
        assert!(bad
            .unwrap_err()
            .to_string()
            .contains("4 send and 3 receive counts"));
        Some(vals(&comm.all_to_all(&group, &x, &send, &recv).unwrap()))
    });
    for (m, &rank) in group.ranks().iter().enumerate() {
        let mut want = Vec::new();
        for j in 0..3 {
            let x = vals(&input(j, &[rows_of(j), 2], DType::F32, 0.0));
            let start: usize = (0..m).map(|t| count(j, t)).sum();
            want.extend_from_slice(&x[2 * start..2 * (start + count(j, m))]);
        }
        assert_eq!(out[rank].as_ref().unwrap(), &want, "member {m}");
    }
    assert!(out[1].is_none());
}
