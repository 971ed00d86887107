//! Tests of the `tcp` communication backend on loopback: every collective bit-identical to the
//! `local` backend, subgroups, send/recv order, stray connections rejected, mismatches, timeouts
//! and failure propagation.

use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use parallel::comm::local::LocalWorld;
use parallel::comm::tcp::TcpComm;
use parallel::store::{Store, StoreServer};
use parallel::{Comm, Group, ReduceOp};

const TOKEN: &str = "job-token";

/// Starts a store and runs `f(rank, comm)` on one thread per rank of a `tcp` job of `n` ranks.
fn with_tcp<R: Send>(
    n: usize,
    timeout: Duration,
    f: impl Fn(usize, Arc<TcpComm>) -> R + Sync,
) -> Vec<R> {
    let server = StoreServer::start("127.0.0.1:0", TOKEN, timeout).unwrap();
    let addr = server.addr().to_string();
    std::thread::scope(|s| {
        let (f, addr) = (&f, &addr);
        let hs: Vec<_> = (0..n)
            .map(|r| {
                s.spawn(move || {
                    let mut store = Store::connect(addr, TOKEN, timeout).unwrap();
                    let comm = TcpComm::connect(r, n, &mut store, TOKEN, timeout).unwrap();
                    f(r, comm)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn input(rank: usize, dims: &[usize], salt: f64) -> Tensor {
    let n = dims.iter().product::<usize>() as u32;
    Tensor::arange(0u32, n, &Device::Cpu)
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.affine(0.37 + 0.11 * rank as f64, salt + rank as f64))
        .and_then(|t| t.sin()?.to_dtype(DType::F32)?.reshape(dims))
        .unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
    v.iter().map(|x| x.to_bits()).collect()
}

/// The results of a fixed sequence of collectives on `comm`.
fn program(rank: usize, comm: &dyn Comm) -> Vec<Vec<u32>> {
    let n = comm.world_size();
    let all = Group::new((0..n).collect());
    let evens = Group::new((0..n).step_by(2).collect());
    let x = input(rank, &[4, 6], 0.5);
    let mut out = vec![
        bits(&comm.all_reduce(&all, &x, ReduceOp::Sum).unwrap()),
        bits(&comm.all_reduce(&all, &x, ReduceOp::Max).unwrap()),
        bits(&comm.all_gather(&all, &x, 1).unwrap()),
        bits(&comm.reduce_scatter(&all, &x, 0).unwrap()),
        bits(&comm.broadcast(&all, &x, n - 1).unwrap()),
    ];
    if evens.index_of(rank).is_some() {
        out.push(bits(&comm.all_reduce(&evens, &x, ReduceOp::Sum).unwrap()));
    }
    comm.barrier(&all).unwrap();
    // A ring of grouped hops, two per neighbour, waited for in order.
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    let a = comm.send_recv(&all, &x, next, prev).unwrap();
    let b = comm
        .send_recv(&all, &(&x * 2.0).unwrap(), next, prev)
        .unwrap();
    out.push(bits(&a.wait().unwrap()));
    out.push(bits(&b.wait().unwrap()));
    // A chain of point-to-point messages (no cycle: every first send meets its receive).
    if rank + 1 < n {
        comm.send(&x, rank + 1).unwrap();
    }
    if rank > 0 {
        out.push(bits(&comm.recv(rank - 1, x.shape(), DType::F32).unwrap()));
    }
    // All-to-all with uneven splits, some empty: rank r sends (r + 2j) % 3 rows to rank j.
    let count = |from: usize, to: usize| (from + 2 * to) % 3;
    let send: Vec<usize> = (0..n).map(|j| count(rank, j)).collect();
    let recv: Vec<usize> = (0..n).map(|j| count(j, rank)).collect();
    let rows = input(rank, &[send.iter().sum(), 3], 0.25);
    out.push(bits(&comm.all_to_all(&all, &rows, &send, &recv).unwrap()));
    out
}

#[test]
fn collectives_equal_the_local_backend_bit_for_bit() {
    let n = 4;
    let tcp = with_tcp(n, Duration::from_secs(20), |r, c| program(r, c.as_ref()));
    let comms = LocalWorld::new(n, Duration::from_secs(20));
    let local: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(r, c)| s.spawn(move || program(r, c.as_ref())))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(tcp, local);
    // Identical on every member.
    assert_eq!(tcp[0][0], tcp[3][0]);
    assert_eq!(tcp[1][2], tcp[2][2]);
}

/// A two-rank job whose rank 1 joins only after `strangers(rank 0's listener, the store)` has
/// connected whatever it likes (kept open until the job is up); both ranks' all-reduce results.
fn two_ranks_after(
    timeout: Duration,
    strangers: impl FnOnce(&str, &str) -> Vec<TcpStream>,
) -> (Tensor, Tensor) {
    let server = StoreServer::start("127.0.0.1:0", TOKEN, timeout).unwrap();
    let addr = server.addr().to_string();
    std::thread::scope(|s| {
        let addr = &addr;
        let h0 = s.spawn(move || {
            let mut store = Store::connect(addr, TOKEN, timeout).unwrap();
            let comm = TcpComm::connect(0, 2, &mut store, TOKEN, timeout).unwrap();
            comm.all_reduce(&Group::new(vec![0, 1]), &input(0, &[3], 0.0), ReduceOp::Sum)
                .unwrap()
        });
        let mut store = Store::connect(addr, TOKEN, timeout).unwrap();
        let rank0 = String::from_utf8(store.get("tcp/0").unwrap()).unwrap();
        let held = strangers(&rank0, addr);
        let comm = TcpComm::connect(1, 2, &mut store, TOKEN, timeout).unwrap();
        let mine = comm
            .all_reduce(&Group::new(vec![0, 1]), &input(1, &[3], 0.0), ReduceOp::Sum)
            .unwrap();
        drop(held);
        (h0.join().unwrap(), mine)
    })
}

#[test]
fn stray_connections_are_rejected() {
    // A stranger connects to rank 0's listener first with a wrong token.
    let out = two_ranks_after(Duration::from_secs(20), |rank0, _| {
        let mut stray = TcpStream::connect(rank0).unwrap();
        let mut hello = vec![1u8, 0];
        hello.extend_from_slice(&0u64.to_le_bytes());
        hello.extend_from_slice(&1u64.to_le_bytes());
        hello.extend_from_slice(&5u64.to_le_bytes());
        hello.extend_from_slice(b"wrong");
        stray.write_all(&hello).unwrap();
        vec![stray]
    });
    assert_eq!(bits(&out.0), bits(&out.1));
}

/// Connections that never greet cannot stall start-up: with greetings read concurrently, rank 1
/// joins long before one silent connection's greeting timeout (10 s) would have passed, even
/// behind several of them; the job's timeout here is 5 s.
#[test]
fn silent_connections_do_not_stall_start_up() {
    let out = two_ranks_after(Duration::from_secs(5), |rank0, store| {
        // Silent connections to the store are no obstacle either.
        (0..5)
            .map(|_| TcpStream::connect(rank0).unwrap())
            .chain((0..5).map(|_| TcpStream::connect(store).unwrap()))
            .collect()
    });
    assert_eq!(bits(&out.0), bits(&out.1));
}

#[test]
fn mismatched_shapes_are_invalid() {
    let out = with_tcp(2, Duration::from_secs(20), |r, c| {
        let x = input(r, &[2 + r], 0.0);
        c.all_reduce(&Group::new(vec![0, 1]), &x, ReduceOp::Sum)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    for (r, o) in out.iter().enumerate() {
        let e = o.as_ref().unwrap_err();
        assert!(
            e.contains(&format!(
                "rank {r}: all_reduce over ranks [0, 1]: rank {}",
                1 - r
            )),
            "{e}"
        );
    }
}

#[test]
fn a_missing_rank_times_out_naming_it() {
    let start = Instant::now();
    let out = with_tcp(3, Duration::from_secs(5), |r, c| {
        if r == 2 {
            std::thread::sleep(Duration::from_secs(9));
            return Ok(());
        }
        c.all_reduce(
            &Group::new(vec![0, 1, 2]),
            &input(r, &[3], 0.0),
            ReduceOp::Sum,
        )
        .map(|_| ())
        .map_err(|e| e.to_string())
    });
    for o in &out[..2] {
        let e = o.as_ref().unwrap_err();
        assert!(
            e.contains("timed out after 5.0s waiting for ranks [2]"),
            "{e}"
        );
    }
    assert!(start.elapsed() < Duration::from_secs(30));
}

#[test]
fn abort_reaches_every_rank() {
    let out = with_tcp(3, Duration::from_secs(20), |r, c| {
        if r == 1 {
            c.abort("disk full");
            return Ok(());
        }
        c.barrier(&Group::new(vec![0, 1, 2]))
            .map_err(|e| e.to_string())
    });
    for (r, o) in [(0, &out[0]), (2, &out[2])] {
        let e = o.as_ref().unwrap_err();
        let want =
            format!("rank {r}: barrier over ranks [0, 1, 2] aborted: rank 1 failed: disk full");
        assert!(e.contains(&want), "{e}");
    }
}
