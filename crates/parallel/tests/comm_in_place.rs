//! The in-place collectives (`Comm::*_in_place`) on the `local` backend, as the data-parallel
//! reductions use them on a bucket of a larger flat buffer: bit for bit the out-of-place results,
//! written where they belong and nowhere else; single-member groups untouched; bad calls refused
//! on every rank; the flight recorder records them as the ordinary collectives.

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use parallel::comm::flight::{FlightRecorder, Recorded};
use parallel::comm::local::{LocalComm, LocalWorld};
use parallel::comm::HandOff;
use parallel::{Comm, CommError, Group, ReduceOp};

const T: Duration = Duration::from_secs(10);

/// Rank `rank`'s flat buffer of `n` f32 values, distinct across ranks and positions.
fn flat(rank: usize, n: usize) -> Tensor {
    let t = Tensor::arange(0u32, n as u32, &Device::Cpu).unwrap();
    let t = t.to_dtype(DType::F64).unwrap();
    let t = t.affine(0.37 + 0.11 * rank as f64, rank as f64).unwrap();
    t.sin().unwrap().to_dtype(DType::F32).unwrap()
}

fn vals(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

/// Runs `f(rank, comm)` on one thread per rank of a world of `n`.
fn with_world<R: Send>(n: usize, f: impl Fn(usize, &Arc<LocalComm>) -> R + Sync) -> Vec<R> {
    let comms = LocalWorld::new(n, T);
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(r, c)| s.spawn(move || f(r, c)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The bucket `[at, at + len)` of a 40-element flat buffer.
const N: usize = 40;
const AT: usize = 6;
const LEN: usize = 24;

#[test]
fn in_place_collectives_equal_the_ordinary_ones_where_they_write() {
    for members in [vec![0, 1, 2], vec![0, 2]] {
        let group = Group::new(members.clone());
        let out = with_world(3, |r, c| {
            let me = group.index_of(r)?;
            let n = group.size();
            let none = HandOff::none();
            // All-reduce (sum, then max) of the bucket, in place.
            let buf = flat(r, N);
            let bucket = buf.narrow(0, AT, LEN).unwrap();
            let want = c.all_reduce(&group, &bucket, ReduceOp::Sum).unwrap();
            c.all_reduce_in_place(&group, &bucket, ReduceOp::Sum, &none)
                .unwrap();
            assert_eq!(vals(&bucket), vals(&want), "all_reduce");
            let want = c.all_reduce(&group, &bucket, ReduceOp::Max).unwrap();
            c.all_reduce_in_place(&group, &bucket, ReduceOp::Max, &none)
                .unwrap();
            assert_eq!(vals(&bucket), vals(&want), "all_reduce max");
            let all = vals(&buf);
            let before = vals(&flat(r, N));
            assert_eq!(all[..AT], before[..AT], "nothing written before the bucket");
            assert_eq!(all[AT + LEN..], before[AT + LEN..], "nor after it");
            // Reduce-scatter: this member's chunk of the bucket becomes its sum.
            let buf = flat(r, N);
            let bucket = buf.narrow(0, AT, LEN).unwrap();
            let want = c.reduce_scatter(&group, &bucket, 0).unwrap();
            let part = c.reduce_scatter_in_place(&group, &bucket, &none).unwrap();
            let chunk = LEN / n;
            assert_eq!(vals(&part), vals(&want), "reduce_scatter");
            let at = AT + me * chunk;
            assert_eq!(vals(&buf)[at..at + chunk], vals(&want)[..], "in its place");
            assert_eq!(vals(&buf)[..AT], vals(&flat(r, N))[..AT]);
            // All-gather: every member's chunk lands in its place.
            let buf = flat(r, N);
            let bucket = buf.narrow(0, AT, LEN).unwrap();
            let own = bucket.narrow(0, me * chunk, chunk).unwrap().copy().unwrap();
            let want = c.all_gather(&group, &own, 0).unwrap();
            c.all_gather_in_place(&group, &bucket, &none).unwrap();
            assert_eq!(vals(&bucket), vals(&want), "all_gather");
            Some(vals(&bucket))
        });
        // Every member gathered the same bucket.
        let got: Vec<_> = out.into_iter().flatten().collect();
        assert!(got.windows(2).all(|w| w[0] == w[1]), "{members:?}");
    }
}

#[test]
fn a_single_member_group_is_left_as_it_is() {
    let out = with_world(2, |r, c| {
        let me = Group::new(vec![r]);
        let none = HandOff::none();
        let buf = flat(r, N);
        c.all_reduce_in_place(&me, &buf, ReduceOp::Sum, &none)
            .unwrap();
        let part = c.reduce_scatter_in_place(&me, &buf, &none).unwrap();
        c.all_gather_in_place(&me, &buf, &none).unwrap();
        vals(&buf) == vals(&flat(r, N)) && vals(&part) == vals(&buf)
    });
    assert_eq!(out, [true, true]);
}

#[test]
fn bad_in_place_calls_are_refused_on_every_rank() {
    let out = with_world(2, |r, c| {
        let world = Group::new(vec![0, 1]);
        let none = HandOff::none();
        let invalid = |e: CommError| matches!(e, CommError::Invalid { .. });
        // 5 rows do not cut into 2 chunks; a transposed tensor is not contiguous.
        let odd = flat(r, 5);
        let strided = flat(r, 12).reshape((3, 4)).unwrap().t().unwrap();
        let e1 = c.reduce_scatter_in_place(&world, &odd, &none).unwrap_err();
        let e2 = c.all_gather_in_place(&world, &strided, &none).unwrap_err();
        // Not a member.
        let other = Group::new(vec![1 - r]);
        let e3 = c
            .all_gather_in_place(&other, &flat(r, 4), &none)
            .unwrap_err();
        [invalid(e1), invalid(e2), invalid(e3)]
    });
    assert_eq!(out, [[true; 3]; 2]);
}

#[test]
fn the_flight_recorder_records_them_as_the_ordinary_collectives() {
    let out = with_world(2, |r, c| {
        let recorder = Arc::new(FlightRecorder::in_memory(16, r, 2));
        let inner: Arc<dyn Comm> = c.clone();
        let rec = Recorded::new(inner, recorder.clone());
        let world = Group::new(vec![0, 1]);
        let after = rec.hand_off().unwrap();
        assert!(after.get::<()>().is_none(), "no device queue, no mark");
        let buf = flat(r, 8);
        rec.all_reduce_in_place(&world, &buf, ReduceOp::Sum, &after)
            .unwrap();
        rec.reduce_scatter_in_place(&world, &buf, &after).unwrap();
        rec.all_gather_in_place(&world, &buf, &after).unwrap();
        let ops = recorder.snapshot().ops;
        let kinds: Vec<_> = ops.iter().map(|o| (o.op.clone(), o.bytes)).collect();
        kinds
    });
    let want = [
        ("all_reduce".to_string(), 32),
        ("reduce_scatter".to_string(), 32),
        ("all_gather".to_string(), 16),
    ];
    assert_eq!(out, [want.to_vec(), want.to_vec()]);
}
