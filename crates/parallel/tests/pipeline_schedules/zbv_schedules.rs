//! The zero-bubble V schedule (zbv): its memory bound, its makespan against the closed form, the
//! V placement of chunks, and an order found for every size, also under lowered caps.

use super::*;

/// zbv's order found for `costs`, within `2·pp` chunk activations per stage.
fn fit(pp: usize, costs: SimCosts) -> zbv::Fit {
    zbv::Fit {
        costs,
        ..zbv::Fit::unit(pp)
    }
}

/// zbv: every size validates and runs over tag-less channels, each stage holding at most
/// `2·pp` chunk activations (1F1B's first stage: `pp` micro-batches of both chunks). With a
/// stage's forward, B and W costing `f`, `b`, `w` (a chunk half of each) and `b = w`, its only
/// idle time is the first micro-batch's way down the stages, `(pp − 1)` chunk forwards:
/// `makespan = m (f + b + w) + (pp − 1) f / 2` for `m >= pp`. Ordered for the costs it runs
/// with (`build_for_costs`) it keeps ahead of 1F1B and about level with zb-h1 or ahead, B
/// costing up to 3× W (the list scheduler is a heuristic: there it leaves 2-3 times the ideal
/// idle time).
#[test]
fn zbv_keeps_1f1b_memory_and_leaves_only_the_forward_ramp_idle() {
    for pp in [2usize, 3, 4, 8] {
        for m in [1usize, 2, 3, 4, 8, 16, 32] {
            let ctx = format!("pp {pp} m {m}");
            let sched = build(ScheduleKind::ZeroBubbleV, pp, 2, m).unwrap();
            assert!(sched.splits_backward(), "{ctx}");
            assert_eq!(check_fifo(&sched), Ok(()), "{ctx}");
            let r = simulate(&sched, SimCosts::split_per_chunk(1.0, 1.0, 1.0, 2)).unwrap();
            assert!(
                r.peak_in_flight.iter().all(|&p| p <= 2 * pp),
                "{ctx}: {r:?}"
            );
            if m >= pp {
                let makespan = 3.0 * m as f64 + (pp as f64 - 1.0) / 2.0;
                assert!(close(r.makespan, makespan), "{ctx}: {}", r.makespan);
            }
            if m < 2 * pp {
                continue;
            }
            for (f, b, w) in [
                (1.0, 1.0, 0.5),
                (1.0, 1.3, 0.7),
                (1.0, 1.5, 0.5),
                (2.0, 1.0, 1.0),
            ] {
                let c = SimCosts {
                    forward: f,
                    backward: b,
                    weight: w,
                };
                let chunk = SimCosts::split_per_chunk(f, b, w, 2);
                let fitted = build_zbv(pp, m, &fit(pp, chunk));
                let v = simulate(&fitted.unwrap(), chunk).unwrap();
                let h1 = build(ScheduleKind::ZeroBubbleH1, pp, 1, m).unwrap();
                let h1 = simulate(&h1, c).unwrap();
                let ofob = build(ScheduleKind::OneFOneB, pp, 1, m).unwrap();
                let ofob = simulate(&ofob, c).unwrap();
                let ctx = format!("{ctx} f {f} b {b} w {w}");
                // A heuristic: within 1% of zb-h1's makespan at worst (pp 3, m 16, b = 1.3 w:
                // 51.4 vs 51.2), and at most 3/4 of 1F1B's bubble (0.46-0.73 of it here).
                let (vm, hm) = (v.makespan, h1.makespan);
                assert!(vm <= 1.01 * hm, "{ctx}: {vm} vs {hm}");
                assert!(v.bubble_fraction < 0.75 * ofob.bubble_fraction, "{ctx}");
            }
        }
    }
    let err = build(ScheduleKind::ZeroBubbleV, 4, 1, 8).unwrap_err();
    assert_eq!(
        err.to_string(),
        "zbv runs two model chunks per pipeline rank (v = 2), got v = 1"
    );
}

/// The V placement: stage 0 holds the first and the last chunk, the last stage hands its first
/// chunk's output to its second without a message, and messages run down the stages for the
/// first chunk and up for the second.
#[test]
fn zbv_places_chunks_as_a_v() {
    let sched = build(ScheduleKind::ZeroBubbleV, 4, 2, 8).unwrap();
    assert_eq!(sched.global_chunk(0, 1), 7);
    assert_eq!(sched.global_chunk(3, 1), 4);
    for (stage, list) in sched.actions.iter().enumerate() {
        for a in list {
            match *a {
                Action::SendActivation { chunk, to, .. } => {
                    let expected = if chunk == 0 { stage + 1 } else { stage - 1 };
                    assert_eq!(to, expected, "stage {stage} {a}");
                    assert!(!(stage == 3 && chunk == 0), "the turn is local: {a}");
                }
                Action::RecvGrad { chunk: 0, .. } if stage == 3 => {
                    panic!("the turn's gradient is local: {a}")
                }
                _ => {}
            }
        }
    }
}

/// zbv's list scheduler finds an order for every size up to pp 16 and m 48 on unit costs, and
/// for the costs it is fitted to in practice (B up to 3× W, forwards up to twice a B).
#[test]
fn zbv_orders_every_size() {
    let fitted = [
        (1.0, 1.0, 0.5),
        (2.0, 1.0, 1.0),
        (1.0, 1.5, 0.5),
        (0.5, 1.0, 1.0),
    ];
    for pp in 2..=16 {
        for m in 1..=48 {
            let sched = build(ScheduleKind::ZeroBubbleV, pp, 2, m)
                .unwrap_or_else(|e| panic!("pp {pp} m {m}: {e}"));
            simulate(&sched, SimCosts::default()).unwrap();
            for (f, b, w) in fitted {
                let c = SimCosts::split_per_chunk(f, b, w, 2);
                let s = build_zbv(pp, m, &fit(pp, c))
                    .unwrap_or_else(|e| panic!("pp {pp} m {m} {f} {b} {w}: {e}"));
                check_fifo(&s).unwrap();
                simulate(&s, c).unwrap();
            }
        }
    }
}

/// zbv under lowered caps (a stage whose activations weigh more holds fewer): every size still
/// finds an order within them — also when the first stage keeps `2·pp` and a later one is
/// lowered (a layout with empty first and last chunks: pp 2, m 6, caps [4, 3] used to stall).
#[test]
fn zbv_orders_within_lowered_caps() {
    for pp in 2..=8 {
        for m in [1, pp, 2 * pp, 3 * pp + 1] {
            for low in 2..=2 * pp {
                for lowered in [
                    vec![low; pp],
                    (0..pp).map(|s| if s == 0 { low } else { 2 * pp }).collect(),
                    (0..pp).map(|s| if s == 0 { 2 * pp } else { low }).collect(),
                    (0..pp)
                        .map(|s| if s + 1 == pp { low } else { 2 * pp })
                        .collect(),
                ] {
                    let f = zbv::Fit {
                        caps: lowered.clone(),
                        ..zbv::Fit::unit(pp)
                    };
                    let s = build_zbv(pp, m, &f)
                        .unwrap_or_else(|e| panic!("pp {pp} m {m} caps {lowered:?}: {e}"));
                    let r = simulate(&s, SimCosts::default()).unwrap();
                    for (st, (&peak, &cap)) in r.peak_in_flight.iter().zip(&lowered).enumerate() {
                        assert!(
                            peak <= cap,
                            "pp {pp} m {m} caps {lowered:?}: stage {st} {peak}"
                        );
                    }
                }
            }
        }
    }
    let bad = zbv::Fit {
        caps: vec![1, 4],
        ..zbv::Fit::unit(2)
    };
    assert!(build_zbv(2, 4, &bad).is_err());
}

/// zbv's weight actions follow its input-gradient actions: on every stage the W actions visit
/// the (chunk, micro-batch) pairs in the order the B actions did (the oldest W still owed runs
/// first), so each parameter sums its micro-batches in micro-batch order, on unit costs and on
/// costs fitted with B at twice W.
#[test]
fn zbv_runs_each_stages_weight_actions_in_its_backward_order() {
    for pp in 2usize..=4 {
        for m in [2 * pp, 3 * pp + 1] {
            let costs = [
                zbv::Fit::unit(pp),
                fit(pp, SimCosts::split_per_chunk(1.0, 2.0, 1.0, 2)),
            ];
            for (k, f) in costs.iter().enumerate() {
                let sched = build_zbv(pp, m, f).unwrap();
                for (s, actions) in sched.actions.iter().enumerate() {
                    let of = |want_w: bool| -> Vec<(usize, usize)> {
                        actions
                            .iter()
                            .filter_map(|a| match *a {
                                Action::Backward { chunk, micro } if !want_w => {
                                    Some((chunk, micro))
                                }
                                Action::Weight { chunk, micro } if want_w => Some((chunk, micro)),
                                _ => None,
                            })
                            .collect()
                    };
                    assert_eq!(of(true), of(false), "pp {pp} m {m} costs {k} stage {s}");
                }
            }
        }
    }
}
