//! The schedule checks catch what a broken action list would do at run time: a missing or
//! duplicated compute, a backward before its forward, unmatched sends and receives, a deadlock
//! (`validate`, the simulator), and channels that deliver out of send order (`check_fifo`).

use parallel::pipeline::{
    build, check_fifo, simulate, validate, Action, Schedule, ScheduleKind, SimCosts, SimError,
};

fn pos(sched: &Schedule, stage: usize, action: Action) -> usize {
    sched.actions[stage]
        .iter()
        .position(|a| *a == action)
        .unwrap()
}

#[test]
fn broken_action_lists_are_caught() {
    let good = build(ScheduleKind::OneFOneB, 2, 1, 4).unwrap();
    let run = |s: &Schedule| simulate(s, SimCosts::default()).unwrap_err();

    // Stage 0 posts its first gradient receive before its first forward: it waits for a
    // gradient that needs its own activation -> deadlock naming both stages.
    let mut s = good.clone();
    let recv = Action::RecvGrad {
        chunk: 0,
        micro: 0,
        from: 1,
    };
    let i = pos(&s, 0, recv);
    s.actions[0].remove(i);
    s.actions[0].insert(0, recv);
    let e = run(&s);
    assert!(matches!(e, SimError::Deadlock { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("stage 0 waiting at `recv-grad c0 m0 <- 1`"),
        "{msg}"
    );
    assert!(
        msg.contains("stage 1 waiting at `recv-act c0 m0 <- 0`"),
        "{msg}"
    );

    // Swap two activation receives on stage 1: micro 1's input is received before micro 0's
    // forward, which then runs without its input.
    let mut s = good.clone();
    let a = pos(
        &s,
        1,
        Action::RecvActivation {
            chunk: 0,
            micro: 0,
            from: 0,
        },
    );
    let b = pos(
        &s,
        1,
        Action::RecvActivation {
            chunk: 0,
            micro: 1,
            from: 0,
        },
    );
    s.actions[1].swap(a, b);
    let e = run(&s);
    assert_eq!(
        e.to_string(),
        "stage 1 runs `F c0 m0` before its input was received"
    );

    // A receive naming the wrong micro-batch: micro 1 is received twice, micro 0 never.
    let mut s = good.clone();
    let a = pos(
        &s,
        1,
        Action::RecvActivation {
            chunk: 0,
            micro: 0,
            from: 0,
        },
    );
    s.actions[1][a] = Action::RecvActivation {
        chunk: 0,
        micro: 1,
        from: 0,
    };
    // The first unmatched end in schedule order is reported: micro 0's send.
    let send0 = Action::SendActivation {
        chunk: 0,
        micro: 0,
        to: 1,
    };
    let e = run(&s);
    assert_eq!(
        e,
        SimError::UnmatchedSend {
            stage: 0,
            action: send0
        }
    );
    assert_eq!(
        e.to_string(),
        "stage 0 `send-act c0 m0 -> 1` has no matching receive"
    );

    // An extra receive has no send.
    let mut s = good.clone();
    let extra = Action::RecvGrad {
        chunk: 0,
        micro: 3,
        from: 1,
    };
    s.actions[0].push(extra);
    assert_eq!(
        run(&s),
        SimError::UnmatchedRecv {
            stage: 0,
            action: extra
        }
    );

    // A dropped receive leaves its send unmatched.
    let mut s = good.clone();
    s.actions[1].remove(a);
    assert!(matches!(run(&s), SimError::UnmatchedSend { stage: 0, .. }));

    // A receive from the wrong stage.
    let mut s = build(ScheduleKind::OneFOneB, 4, 1, 4).unwrap();
    let a = pos(
        &s,
        2,
        Action::RecvActivation {
            chunk: 0,
            micro: 0,
            from: 1,
        },
    );
    s.actions[2][a] = Action::RecvActivation {
        chunk: 0,
        micro: 0,
        from: 3,
    };
    let e = run(&s);
    assert!(matches!(e, SimError::Misrouted { stage: 2, .. }), "{e}");

    // Backward moved before its forward; a missing and a duplicated compute.
    let mut s = build(ScheduleKind::OneFOneB, 1, 1, 2).unwrap();
    s.actions[0].swap(0, 1);
    assert!(matches!(
        run(&s),
        SimError::BackwardBeforeForward { stage: 0, .. }
    ));
    let mut s = build(ScheduleKind::OneFOneB, 1, 1, 2).unwrap();
    s.actions[0].pop();
    assert!(matches!(run(&s), SimError::MissingCompute { stage: 0, .. }));
    let mut s = build(ScheduleKind::OneFOneB, 1, 1, 2).unwrap();
    s.actions[0].push(Action::Forward { chunk: 0, micro: 0 });
    let e = run(&s);
    assert_eq!(e.to_string(), "stage 0 runs `F c0 m0` more than once");

    // Out-of-range indices, wrong stage count, bad costs.
    let mut s = good.clone();
    s.actions[0].push(Action::Forward { chunk: 1, micro: 0 });
    assert!(matches!(run(&s), SimError::OutOfRange { stage: 0, .. }));
    let mut s = good.clone();
    s.actions.pop();
    assert_eq!(run(&s), SimError::StageCount { pp: 2, got: 1 });
    // The static checks alone (no execution) catch structural problems but not ordering.
    assert!(validate(&good).is_ok());
    assert!(matches!(validate(&s), Err(SimError::StageCount { .. })));
    let huge = Schedule {
        pp: 1,
        v: 1,
        m: usize::MAX,
        actions: vec![Vec::new()],
        placement: Default::default(),
    };
    assert!(matches!(
        validate(&huge),
        Err(SimError::MissingCompute { .. })
    ));
    let bad = SimCosts {
        forward: f64::NAN,
        backward: 1.0,
        weight: 1.0,
    };
    assert!(matches!(
        simulate(&good, bad),
        Err(SimError::InvalidCosts { .. })
    ));
}

#[test]
fn channels_must_receive_in_send_order() {
    let good = build(ScheduleKind::OneFOneB, 2, 1, 4).unwrap();
    assert_eq!(check_fifo(&good), Ok(()));
    let send = |micro| Action::SendActivation {
        chunk: 0,
        micro,
        to: 1,
    };
    let recv = |micro| Action::RecvActivation {
        chunk: 0,
        micro,
        from: 0,
    };
    // Stage 0 sends micro-batches 0 and 1 in the opposite order.
    let mut s = good.clone();
    let (a, b) = (pos(&s, 0, send(0)), pos(&s, 0, send(1)));
    s.actions[0].swap(a, b);
    assert!(validate(&s).is_ok(), "structurally still valid");
    let e = check_fifo(&s).unwrap_err();
    assert_eq!(
        e,
        SimError::OutOfOrder {
            from: 0,
            to: 1,
            position: 0,
            sent: send(1),
            received: recv(0)
        }
    );
    assert!(
        e.to_string().starts_with(
            "channel stage 0 -> stage 1: message 0 is sent by `send-act c0 m1 -> 1` but received \
             by `recv-act c0 m0 <- 0`"
        ),
        "{e}"
    );
    // The same for gradients: stage 0 receives micro-batch 2's gradient before micro-batch 1's.
    let grad = |micro| Action::RecvGrad {
        chunk: 0,
        micro,
        from: 1,
    };
    let mut s = good.clone();
    let (a, b) = (pos(&s, 0, grad(1)), pos(&s, 0, grad(2)));
    s.actions[0].swap(a, b);
    assert!(matches!(
        check_fifo(&s),
        Err(SimError::OutOfOrder { from: 1, to: 0, .. })
    ));
    // An interleaved schedule's wrap-around channel (last stage -> first) is checked too.
    let mut s = build(ScheduleKind::Interleaved, 2, 2, 4).unwrap();
    assert_eq!(check_fifo(&s), Ok(()));
    let wrap = |micro| Action::RecvActivation {
        chunk: 1,
        micro,
        from: 1,
    };
    let (a, b) = (pos(&s, 0, wrap(0)), pos(&s, 0, wrap(1)));
    s.actions[0].swap(a, b);
    assert!(matches!(
        check_fifo(&s),
        Err(SimError::OutOfOrder { from: 1, to: 0, .. })
    ));
}

/// A split schedule must run exactly one weight action per (chunk, micro), after its backward.
#[test]
fn broken_weight_actions_are_caught() {
    let good = build(ScheduleKind::ZeroBubbleH1, 2, 1, 4).unwrap();
    assert!(good.splits_backward());
    let run = |s: &Schedule| simulate(s, SimCosts::default()).unwrap_err();
    let w = |micro| Action::Weight { chunk: 0, micro };

    // A W moved before its B.
    let mut s = good.clone();
    let i = pos(&s, 1, w(2));
    s.actions[1].remove(i);
    s.actions[1].insert(0, w(2));
    let e = run(&s);
    assert_eq!(
        e,
        SimError::WeightBeforeBackward {
            stage: 1,
            action: w(2)
        }
    );
    assert_eq!(e.to_string(), "stage 1 runs `W c0 m2` before its backward");

    // A W left out, and one run twice.
    let mut s = good.clone();
    let i = pos(&s, 0, w(3));
    s.actions[0].remove(i);
    assert_eq!(
        validate(&s),
        Err(SimError::MissingCompute {
            stage: 0,
            action: w(3)
        })
    );
    s.actions[0].push(w(1));
    assert!(matches!(
        validate(&s),
        Err(SimError::DuplicateCompute { stage: 0, .. })
    ));
}
