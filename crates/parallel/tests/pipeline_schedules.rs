//! Pipeline schedules as data: every schedule kind over a grid of sizes simulates without
//! deadlock and with consistent communication; peak live activations and bubbles match the
//! closed forms; bad sizes give specific errors; the Chrome trace parses; compute orders match
//! Megatron's. (Broken action lists: `pipeline_checks.rs`.)

use std::collections::HashMap;

use parallel::pipeline::{
    build, build_zbv, check_fifo, chrome_trace, interleaved, one_f_one_b, simulate,
    spans_from_timelines, zbv, Action, Schedule, ScheduleError, ScheduleKind, SimCosts, SimReport,
    TraceSpan,
};

const KINDS: [ScheduleKind; 4] = [
    ScheduleKind::AllForwardAllBackward,
    ScheduleKind::OneFOneB,
    ScheduleKind::Interleaved,
    ScheduleKind::ZeroBubbleH1,
];
const PPS: [usize; 3] = [1, 2, 4];
const VS: [usize; 2] = [1, 2];
const MS: [usize; 5] = [1, 2, 3, 4, 8];

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

/// The documented validity rules of `build`.
fn expected_valid(kind: ScheduleKind, pp: usize, v: usize, m: usize) -> bool {
    match kind {
        ScheduleKind::AllForwardAllBackward | ScheduleKind::OneFOneB => v == 1,
        ScheduleKind::ZeroBubbleH1 => v == 1,
        ScheduleKind::ZeroBubbleV => unreachable!("zbv has tests of its own"),
        ScheduleKind::Interleaved => m.is_multiple_of(pp) && (v == 1 || pp >= 2),
    }
}

/// Every valid (kind, pp, v, m) of the grid with its schedule and default-cost simulation.
fn grid() -> Vec<(ScheduleKind, usize, usize, usize, Schedule, SimReport)> {
    let mut out = Vec::new();
    for kind in KINDS {
        for pp in PPS {
            for v in VS {
                for m in MS {
                    let built = build(kind, pp, v, m);
                    assert_eq!(
                        built.is_ok(),
                        expected_valid(kind, pp, v, m),
                        "{kind} pp {pp} v {v} m {m}: {built:?}"
                    );
                    let Ok(sched) = built else { continue };
                    let report = simulate(&sched, SimCosts::default())
                        .unwrap_or_else(|e| panic!("{kind} pp {pp} v {v} m {m}: {e}"));
                    out.push((kind, pp, v, m, sched, report));
                }
            }
        }
    }
    out
}

#[test]
fn every_valid_schedule_runs_each_compute_once_in_order_with_matched_messages() {
    let all = grid();
    assert_eq!(all.len(), 15 + 15 + 15 + 15, "grid coverage");
    for (kind, pp, v, m, sched, report) in &all {
        let ctx = format!("{kind} pp {pp} v {v} m {m}");
        assert_eq!(sched.actions.len(), *pp, "{ctx}");
        // Every built schedule can run over tag-less channels.
        assert_eq!(check_fifo(sched), Ok(()), "{ctx}");
        // Independently of the simulator's own checks: per stage, each (chunk, micro) has one
        // F, one B and (split schedules) one W, F ending before B starts and B before W.
        let split = *kind == ScheduleKind::ZeroBubbleH1;
        assert_eq!(sched.splits_backward(), split, "{ctx}");
        for (stage, spans) in report.timelines.iter().enumerate() {
            let per = if split { 3 } else { 2 };
            assert_eq!(spans.len(), per * v * m, "{ctx} stage {stage}");
            let mut fwd_end = HashMap::new();
            let mut bwd_end = HashMap::new();
            for s in spans {
                let key = (s.action.chunk(), s.action.micro());
                let after = |ends: &HashMap<_, f64>| ends.get(&key).is_some_and(|&e| e <= s.start);
                match s.action {
                    Action::Forward { .. } => {
                        assert!(fwd_end.insert(key, s.end).is_none(), "{ctx}: twice {key:?}");
                    }
                    Action::Backward { .. } => {
                        assert!(after(&fwd_end), "{ctx}: B before F {key:?}");
                        assert!(bwd_end.insert(key, s.end).is_none(), "{ctx}: twice {key:?}");
                    }
                    Action::Weight { .. } => {
                        assert!(after(&bwd_end), "{ctx}: W before B {key:?}");
                    }
                    _ => panic!("{ctx}: non-compute span"),
                }
            }
        }
        // Every send has exactly one receive with the same (payload, consumer chunk, micro).
        let mut balance: HashMap<(bool, usize, usize), i64> = HashMap::new();
        for (stage, list) in sched.actions.iter().enumerate() {
            for a in list {
                let g = sched.global_chunk(stage, a.chunk());
                let (key, delta) = match *a {
                    Action::SendActivation { to, .. } => {
                        assert_eq!(to, (stage + 1) % pp, "{ctx}");
                        ((true, g + 1, a.micro()), 1)
                    }
                    Action::RecvActivation { .. } => ((true, g, a.micro()), -1),
                    Action::SendGrad { to, .. } => {
                        assert_eq!(to, (stage + pp - 1) % pp, "{ctx}");
                        ((false, g - 1, a.micro()), 1)
                    }
                    Action::RecvGrad { .. } => ((false, g, a.micro()), -1),
                    _ => continue,
                };
                *balance.entry(key).or_default() += delta;
            }
        }
        assert!(
            balance.values().all(|&b| b == 0),
            "{ctx}: unmatched messages"
        );
        // Messages: (pp * v - 1) boundaries, m micro-batches, one activation and one gradient.
        assert_eq!(balance.len(), 2 * (pp * v - 1) * m, "{ctx}");
    }
}

#[test]
fn peak_in_flight_activations_match_closed_forms() {
    for (kind, pp, v, m, _, report) in grid() {
        let expected: Vec<usize> = (0..pp)
            .map(|s| match kind {
                ScheduleKind::AllForwardAllBackward => m,
                ScheduleKind::OneFOneB => (pp - s).min(m),
                ScheduleKind::Interleaved => {
                    (interleaved::warmup_forwards(pp, v, m, s) + 1).min(m * v)
                }
                ScheduleKind::ZeroBubbleH1 => pp.min(m),
                ScheduleKind::ZeroBubbleV => unreachable!("not in KINDS"),
            })
            .collect();
        assert_eq!(
            report.peak_in_flight, expected,
            "{kind} pp {pp} v {v} m {m}"
        );
    }
    // Spot values: 1F1B warm-up is min(pp - s - 1, m); interleaved pp 4, v 2, m 8 stage 0 warms
    // up with (4 - 0 - 1) * 2 + (2 - 1) * 4 = 10 forwards, so holds 11 activations at peak.
    assert_eq!(one_f_one_b::warmup_forwards(4, 0, 8), 3);
    assert_eq!(one_f_one_b::warmup_forwards(4, 1, 2), 2);
    assert_eq!(interleaved::warmup_forwards(4, 2, 8, 0), 10);
    assert_eq!(interleaved::warmup_forwards(4, 2, 8, 3), 4);
    assert_eq!(
        interleaved::warmup_forwards(4, 2, 4, 3),
        8,
        "m == pp: all warm-up"
    );
    let sched = build(ScheduleKind::Interleaved, 4, 2, 8).unwrap();
    let report = simulate(&sched, SimCosts::default()).unwrap();
    assert_eq!(report.peak_in_flight, vec![11, 9, 7, 5]);
}

/// With a stage's work costing `f` forward and `b` backward per micro-batch (split evenly over
/// its `v` chunks), every schedule here finishes in exactly
/// `makespan = m (f + b) + (pp - 1) (f + b) / v`,
/// so each stage idles `(pp - 1)(f + b) / v` and the bubble fraction is
/// `(pp - 1) / (v m + pp - 1)` (for v = 1: GPipe's and 1F1B's `(pp - 1) / (m + pp - 1)`).
/// The simulator gives this exactly for all the sizes below, including b < f and the interleaved
/// all-warm-up case m == pp.
#[test]
fn makespan_and_bubble_match_closed_forms() {
    let costs = [(1.0, 2.0), (1.0, 1.0), (2.0, 3.0), (3.0, 1.0)];
    let mut checked = 0;
    for kind in &KINDS[..3] {
        let kind = *kind;
        for pp in [1usize, 2, 3, 4, 8] {
            for v in [1usize, 2, 4] {
                for m in [1usize, 2, 3, 4, 8, 16] {
                    let Ok(sched) = build(kind, pp, v, m) else {
                        continue;
                    };
                    for (f, b) in costs {
                        let r = simulate(&sched, SimCosts::per_chunk(f, b, v)).unwrap();
                        let (mf, ppf, vf) = (m as f64, pp as f64, v as f64);
                        let makespan = mf * (f + b) + (ppf - 1.0) * (f + b) / vf;
                        let ctx = format!("{kind} pp {pp} v {v} m {m} f {f} b {b}");
                        assert!(close(r.makespan, makespan), "{ctx}: {}", r.makespan);
                        let bubble = (ppf - 1.0) / (vf * mf + ppf - 1.0);
                        assert!(close(r.bubble_fraction, bubble), "{ctx}");
                        assert!(r.bubble.iter().all(|&x| close(x, bubble)), "{ctx}");
                        assert!(r.compute_time.iter().all(|&c| close(c, mf * (f + b))));
                        checked += 1;
                    }
                }
            }
        }
    }
    assert!(checked > 300, "{checked}");
    // The brief's unit-cost statement for 1F1B: makespan (m + pp - 1) * 3 with f = 1, b = 2.
    let r = simulate(
        &build(ScheduleKind::OneFOneB, 4, 1, 8).unwrap(),
        SimCosts::default(),
    );
    let r = r.unwrap();
    assert!(close(r.makespan, 33.0) && close(r.bubble_fraction, 3.0 / 11.0));
}

#[test]
fn invalid_sizes_give_specific_errors() {
    use ScheduleKind::*;
    let err = |kind, pp, v, m| build(kind, pp, v, m).unwrap_err();
    assert_eq!(
        err(Interleaved, 4, 2, 6),
        ScheduleError::MicroBatchesNotMultipleOfPp { m: 6, pp: 4 }
    );
    assert_eq!(
        err(Interleaved, 4, 2, 6).to_string(),
        "interleaved 1F1B needs the number of micro-batches (6) to be a multiple of parallel.pp (4)"
    );
    assert_eq!(
        err(Interleaved, 1, 2, 4),
        ScheduleError::VirtualNeedsPipeline { v: 2, pp: 1 }
    );
    assert!(err(Interleaved, 1, 2, 4)
        .to_string()
        .contains("parallel.pp >= 2"));
    for kind in [AllForwardAllBackward, OneFOneB] {
        assert_eq!(
            err(kind, 2, 2, 4),
            ScheduleError::VirtualNotSupported { kind, v: 2 }
        );
    }
    assert_eq!(
        err(AllForwardAllBackward, 2, 2, 4).to_string(),
        "all-forward-all-backward supports only one model chunk per pipeline rank (v = 1), got v = 2"
    );
    for kind in KINDS {
        assert_eq!(err(kind, 0, 1, 4), ScheduleError::ZeroStages);
        assert_eq!(err(kind, 2, 0, 4), ScheduleError::ZeroVirtualStages);
        assert_eq!(err(kind, 2, 1, 0), ScheduleError::ZeroMicroBatches);
        assert!(matches!(
            err(kind, usize::MAX, 1, 2),
            ScheduleError::TooLarge { .. }
        ));
    }
    assert!(matches!(
        err(OneFOneB, 4096, 1, 8192),
        ScheduleError::TooLarge { .. }
    ));
    // A non-interleaved kind with v > 1 names its own restriction even when pp == 1.
    assert_eq!(
        err(OneFOneB, 1, 2, 4),
        ScheduleError::VirtualNotSupported {
            kind: OneFOneB,
            v: 2
        }
    );
    assert_eq!(err(OneFOneB, 0, 1, 4).to_string(), "pp must be at least 1");
    assert_eq!(
        err(OneFOneB, 2, 1, 0).to_string(),
        "m (micro-batches per step) must be at least 1"
    );
}

/// Position of `action` in `stage`'s list.
#[test]
fn chrome_trace_parses_with_one_span_per_compute() {
    let sched = build(ScheduleKind::Interleaved, 4, 2, 8).unwrap();
    let report = simulate(&sched, SimCosts::per_chunk(1.0, 2.0, 2)).unwrap();
    let spans = spans_from_timelines(&report.timelines, 1000.0);
    let stage = |s: usize| format!("stage {s}");
    let json: serde_json::Value = serde_json::from_str(&chrome_trace(&spans, &stage)).unwrap();
    let events = json["traceEvents"].as_array().unwrap();
    let complete: Vec<_> = events.iter().filter(|e| e["ph"] == "X").collect();
    let computes: usize = sched
        .actions
        .iter()
        .map(|l| l.iter().filter(|a| a.is_compute()).count())
        .sum();
    assert_eq!(complete.len(), computes);
    assert_eq!(complete.len(), 4 * 2 * 2 * 8);
    let first = complete
        .iter()
        .find(|e| e["tid"] == 0 && e["name"] == "F c0 m0")
        .unwrap();
    assert_eq!(first["ts"], 0.0);
    assert_eq!(first["dur"], 500.0);
    assert_eq!(first["pid"], 0);
    let ends = complete
        .iter()
        .map(|e| e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap());
    assert!(close(ends.fold(0.0, f64::max), report.makespan * 1000.0));
    // Measured timings go through the same function.
    let measured = [TraceSpan::from((1, "B c0 m0".to_string(), 10.0, 2.5))];
    let json: serde_json::Value = serde_json::from_str(&chrome_trace(&measured, &stage)).unwrap();
    assert_eq!(json["traceEvents"][0]["args"]["name"], "stage 1");
    assert_eq!(json["traceEvents"][1]["tid"], 1);
    assert_eq!(json["traceEvents"][1]["cat"], "backward");
}

/// The executor's channels carry no tags: a schedule whose receives do not follow the send order
/// of their channel is refused, naming the channel and the two actions, even though it is
/// otherwise valid (every message has one send and one receive).
/// The compute order of each stage, written as `F c0 m1` / `B c1 m0`.
fn compute_order(sched: &Schedule) -> Vec<Vec<String>> {
    sched
        .actions
        .iter()
        .map(|stage| {
            stage
                .iter()
                .filter(|a| a.is_compute())
                .map(|a| a.to_string())
                .collect()
        })
        .collect()
}

fn order(s: &str) -> Vec<String> {
    s.split(", ").map(str::to_string).collect()
}

/// The exact compute order of small schedules, pinned against Megatron-LM's: 1F1B warms up with
/// `pp − stage − 1` forwards, then alternates one forward and one backward; interleaved 1F1B
/// warms up with `(pp − stage − 1)·2 + (v − 1)·pp` forwards over the virtual micro-batches
/// (chunk `(k / pp) mod v`, micro-batch `(k / (pp·v))·pp + k mod pp`; backwards visit the chunks
/// in reverse). Any reordering, even one that keeps the simulated timing, fails here.
#[test]
fn compute_orders_match_megatron() {
    let one_f_one_b = build(ScheduleKind::OneFOneB, 2, 1, 4).unwrap();
    assert_eq!(
        compute_order(&one_f_one_b),
        vec![
            order("F c0 m0, F c0 m1, B c0 m0, F c0 m2, B c0 m1, F c0 m3, B c0 m2, B c0 m3"),
            order("F c0 m0, B c0 m0, F c0 m1, B c0 m1, F c0 m2, B c0 m2, F c0 m3, B c0 m3"),
        ]
    );
    let interleaved = build(ScheduleKind::Interleaved, 2, 2, 4).unwrap();
    assert_eq!(
        compute_order(&interleaved),
        vec![
            order(
                "F c0 m0, F c0 m1, F c1 m0, F c1 m1, F c0 m2, B c1 m0, F c0 m3, B c1 m1, \
                 F c1 m2, B c0 m0, F c1 m3, B c0 m1, B c1 m2, B c1 m3, B c0 m2, B c0 m3"
            ),
            order(
                "F c0 m0, F c0 m1, F c1 m0, B c1 m0, F c1 m1, B c1 m1, F c0 m2, B c0 m0, \
                 F c0 m3, B c0 m1, F c1 m2, B c1 m2, F c1 m3, B c1 m3, B c0 m2, B c0 m3"
            ),
        ]
    );
}

/// ZB-H1 with forward, B and W costing `f`, `b`, `w` (`w <= b`, `m >= pp`) finishes in
/// `m (f + b + w) + (pp - 1)(f + b - w)`, against 1F1B's `(m + pp - 1)(f + b + w)` on the
/// same costs: with equal costs a third of 1F1B's idle time per stage. Stage `s` holds at most
/// `pp` micro-batches (1F1B's stage 0), and defers `s` weight actions into its cool-down.
#[test]
fn zero_bubble_h1_makespan_matches_its_closed_form() {
    let costs = [
        (1.0, 1.0, 1.0),
        (1.0, 1.3, 0.7),
        (2.0, 1.0, 1.0),
        (1.0, 2.0, 0.5),
    ];
    let mut checked = 0;
    for pp in [1usize, 2, 3, 4, 8] {
        for m in [1usize, 2, 4, 8, 16] {
            let zb = build(ScheduleKind::ZeroBubbleH1, pp, 1, m).unwrap();
            let ofob = build(ScheduleKind::OneFOneB, pp, 1, m).unwrap();
            for (f, b, w) in costs {
                let c = SimCosts {
                    forward: f,
                    backward: b,
                    weight: w,
                };
                let (z, o) = (simulate(&zb, c).unwrap(), simulate(&ofob, c).unwrap());
                let (mf, ppf) = (m as f64, pp as f64);
                let ctx = format!("pp {pp} m {m} f {f} b {b} w {w}");
                assert!(close(o.makespan, (mf + ppf - 1.0) * (f + b + w)), "{ctx}");
                assert!(
                    z.makespan <= o.makespan + 1e-9,
                    "{ctx}: never slower than 1F1B"
                );
                if m >= pp {
                    let makespan = mf * (f + b + w) + (ppf - 1.0) * (f + b - w);
                    assert!(close(z.makespan, makespan), "{ctx}: {}", z.makespan);
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 50, "{checked}");
    // p = 4, m = 8, equal costs: 1F1B idles 9 of 33 units per stage, ZB-H1 3 of 27.
    let unit = SimCosts::default();
    let z = simulate(&build(ScheduleKind::ZeroBubbleH1, 4, 1, 8).unwrap(), unit).unwrap();
    assert!(close(z.makespan, 27.0) && close(z.bubble_fraction, 3.0 / 27.0));
    assert_eq!(z.peak_in_flight, vec![4, 4, 4, 4]);
}

/// The orders ZB-H1 runs at pp 4, m 6: 1F1B's forwards and B actions, each stage's W actions
/// `s` B actions late.
#[test]
fn zero_bubble_h1_orders() {
    let sched = build(ScheduleKind::ZeroBubbleH1, 4, 1, 6).unwrap();
    let order = |s: usize| -> String {
        let names: Vec<String> = sched.actions[s]
            .iter()
            .filter(|a| a.is_compute())
            .map(|a| {
                let n = a.to_string();
                format!("{}{}", &n[..1], a.micro())
            })
            .collect();
        names.join(" ")
    };
    assert_eq!(
        order(0),
        "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5"
    );
    assert_eq!(
        order(2),
        "F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 B5 W3 W4 W5"
    );
    assert_eq!(
        order(3),
        "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 W3 W4 W5"
    );
}

#[path = "pipeline_schedules/zbv_schedules.rs"]
mod zbv_schedules;
