//! The `local` backend keeps NCCL's rules: a point-to-point direction connects when both ends
//! have posted; grouped ring hops; `prepare` connects what it lists; unprepared channels, two
//! threads inside one channel, self-sends and dtypes NCCL cannot move are refused; a barrier with
//! its own time.

use super::*;

/// NCCL connects a direction when both ends have posted their first operation, and a first send
/// waits for that: a ring whose every member sends before it receives (unprepared) deadlocks,
/// here as on GPUs, and every rank names its first send and the rank it waits for.
#[test]
fn a_ring_that_sends_before_it_receives_deadlocks_as_on_nccl() {
    let n = 3;
    let out = with_world(n, Duration::from_millis(500), |r, c| {
        let x = input(r, &[4], DType::F32, 0.0);
        c.send(&x, (r + 1) % n)?;
        c.recv((r + n - 1) % n, x.shape(), DType::F32)
    });
    for (r, got) in out.iter().enumerate() {
        let e = got.as_ref().unwrap_err().to_string();
        assert!(e.contains(&format!("rank {r}: first send")), "{e}");
        assert!(
            e.contains(&format!("waiting for ranks [{}]", (r + 1) % n)),
            "{e}"
        );
    }
}

/// The same ring through `send_recv` (one grouped operation per hop, as NCCL groups them) runs;
/// hops are matched in the order they were posted, whatever order they are waited in.
#[test]
fn a_grouped_ring_hop_connects_both_directions_together() {
    let n = 3;
    let ring = world(n);
    let out = run_local(n, T, |r, c| -> Result<_> {
        c.prepare(&[Channel::Ring(ring.clone())])?;
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let mut got = vec![];
        for k in 0..4 {
            let first = c.send_recv(&ring, &input(r, &[3], DType::F32, k as f64), next, prev)?;
            let second = c.send_recv(&ring, &input(r, &[5], DType::BF16, k as f64), next, prev)?;
            let late = second.wait()?;
            got.push((vals(&first.wait()?), vals(&late)));
        }
        Ok(got)
    })
    .unwrap();
    for (r, got) in out.iter().enumerate() {
        let prev = (r + n - 1) % n;
        for (k, (a, b)) in got.iter().enumerate() {
            assert_eq!(*a, vals(&input(prev, &[3], DType::F32, k as f64)));
            assert_eq!(*b, vals(&input(prev, &[5], DType::BF16, k as f64)));
        }
    }
    // A hop to this rank or to a non-member is refused.
    let c = &LocalWorld::new(4, T)[0];
    let x = input(0, &[2], DType::F32, 0.0);
    let e = c.send_recv(&world(3), &x, 0, 2).unwrap_err().to_string();
    assert!(
        e.contains("destination rank 0 is not another member"),
        "{e}"
    );
    let e = c.send_recv(&world(3), &x, 1, 3).unwrap_err().to_string();
    assert!(e.contains("source rank 3 is not another member"), "{e}");
}

/// `prepare` connects the directions it lists (both ends wait for each other there, as the NCCL
/// backend's one-byte warm-up does), so the send-first ring then runs.
#[test]
fn prepared_directions_need_no_connection_inside_a_step() {
    let n = 3;
    let out = run_local(n, T, |r, c| -> Result<_> {
        c.prepare(&directions(n))?;
        let x = input(r, &[4], DType::F32, 0.0);
        c.send(&x, (r + 1) % n)?;
        Ok(vals(&c.recv((r + n - 1) % n, x.shape(), DType::F32)?))
    })
    .unwrap();
    for (r, got) in out.iter().enumerate() {
        assert_eq!(*got, vals(&input((r + n - 1) % n, &[4], DType::F32, 0.0)));
    }
}

/// After `prepare`, a channel it did not list is refused (NCCL would create its communicator
/// mid-step); so are an operation on a group while another thread of the rank is inside one on
/// it, a send to oneself and a dtype NCCL cannot move. Threads taking turns are fine.
#[test]
fn what_nccl_would_not_allow_is_refused() {
    let pair = Group::new(vec![0, 1]);
    let out = with_world(2, T, |r, c| {
        c.prepare(&[Channel::Group(pair.clone())]).unwrap();
        let x = input(r, &[2], DType::F32, 0.0);
        c.all_reduce(&pair, &x, ReduceOp::Sum).unwrap();
        let unprepared = c.all_to_all(&pair, &x, &[1, 1], &[1, 1]).unwrap_err();
        // Rank 1 arrives late, so rank 0's main thread is inside the all-reduce when its helper
        // starts one on the same group; then the helper takes its turn.
        let (at_once, in_turn) = std::thread::scope(|s| {
            let helper = (r == 0).then(|| {
                s.spawn(|| {
                    std::thread::sleep(Duration::from_millis(100));
                    c.all_reduce(&pair, &x, ReduceOp::Sum).err()
                })
            });
            if r == 1 {
                std::thread::sleep(Duration::from_millis(400));
            }
            c.all_reduce(&pair, &x, ReduceOp::Sum).unwrap();
            let e = helper.and_then(|h| h.join().unwrap());
            let later = s.spawn(|| c.all_reduce(&pair, &x, ReduceOp::Sum).map(|_| ()));
            (e, later.join().unwrap())
        });
        let to_self = c.send(&x, r).unwrap_err();
        let f8 = x.to_dtype(DType::F8E4M3).unwrap();
        let dtype = c.all_reduce(&pair, &f8, ReduceOp::Sum).unwrap_err();
        (
            [unprepared, to_self, dtype].map(|e| e.to_string()),
            at_once.map(|e| e.to_string()),
            in_turn,
        )
    });
    for (r, (got, at_once, in_turn)) in out.iter().enumerate() {
        let prepared = "all-to-all group [0, 1] was not among the channels this rank prepared";
        assert!(got[0].contains(prepared), "{}", got[0]);
        assert!(got[1].contains("cannot send to itself"), "{}", got[1]);
        assert!(
            got[2].contains("F8E4M3 is not supported by NCCL"),
            "{}",
            got[2]
        );
        in_turn.as_ref().unwrap();
        match r {
            0 => {
                let e = at_once.as_deref().unwrap_or("accepted");
                assert!(
                    e.contains("used by two threads of this rank at once"),
                    "{e}"
                );
            }
            _ => assert!(at_once.is_none()),
        }
    }
}

/// A barrier given its own time (a checkpoint's) waits that long, past the job's timeout, for a
/// slow rank; one that runs out names its own seconds and the rank that never came.
#[test]
fn a_barrier_waits_its_own_time() {
    let g = world(2);
    let out = with_world(2, Duration::from_millis(200), |r, c| {
        if r == 1 {
            std::thread::sleep(Duration::from_millis(600));
        }
        Ok(c.barrier_within(&g, Duration::from_secs(10))?)
    });
    assert!(out.iter().all(Result::is_ok), "{out:?}");
    let out = with_world(2, T, |r, c| match r {
        0 => c
            .barrier_within(&g, Duration::from_millis(300))
            .map_err(|e| e.to_string()),
        _ => Ok(()),
    });
    let e = out[0].as_ref().unwrap_err();
    assert!(
        e.contains("barrier over ranks [0, 1] timed out after 0.3s waiting for ranks [1]"),
        "{e}"
    );
}
