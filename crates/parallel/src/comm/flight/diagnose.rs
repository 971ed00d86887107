//! What the flight records say when a job stops making progress: every operation a rank is
//! waiting in, which ranks wait in it with that rank, and for each other member of its group
//! (or the peer of a message) whether it never entered it and what it did last — e.g. "ranks
//! 0-2 wait in all_reduce #513 over ranks [0,1,2,3] (step 41, for 12.3 s); rank 3 never entered
//! it: its last operation was send #40 to rank 1 (step 41, ended 12.5 s ago)".

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use super::slots::{parse, read_file};
use super::{file_name, OpRecord, RankRecord};

/// The findings, one line each.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Diagnosis {
    /// Lines of the report.
    pub lines: Vec<String>,
    /// Operations some rank waits in (or failed in).
    pub waits: usize,
}

impl fmt::Display for Diagnosis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.lines.join("\n"))
    }
}

/// Every readable record of ranks `0..world` in `dir` (a rank whose file is missing,
/// unreadable or not a regular file of a ring's size is left out).
pub fn read_dir(dir: &Path, world: usize) -> Vec<RankRecord> {
    (0..world)
        .filter_map(|r| read_file(&dir.join(file_name(r))))
        .filter_map(|bytes| parse(&bytes))
        .collect()
}

/// `0-2, 5` for ranks 0, 1, 2 and 5.
fn ranges(ranks: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        out.push(if j > i {
            format!("{}-{}", ranks[i], ranks[j])
        } else {
            ranks[i].to_string()
        });
        i = j + 1;
    }
    out.join(", ")
}

/// `all_reduce #513 over ranks [0,1]`, `send #40 to rank 1`, `recv #7 from rank 2`.
fn name(o: &OpRecord) -> String {
    match o.key.split_once(':') {
        Some(("send", peer)) => format!("send #{} to rank {peer}", o.seq),
        Some(("recv", peer)) => format!("recv #{} from rank {peer}", o.seq),
        _ => format!("{} #{} over ranks {}", o.op, o.seq, o.key),
    }
}

/// An operation with its step and time: `… (step 41, ended 12.5 s ago)`.
fn describe(o: &OpRecord, now_ms: f64) -> String {
    let when = match o.end_ms {
        Some(e) => format!(
            "ended {:.1} s ago{}",
            (now_ms - e) / 1e3,
            if o.ok == Some(false) { ", failed" } else { "" }
        ),
        None => format!("waiting for {:.1} s", (now_ms - o.start_ms) / 1e3),
    };
    format!("{} (step {}, {when})", name(o), o.step)
}

/// The members of a collective's group key, when it lists them.
fn members(key: &str) -> Option<Vec<usize>> {
    serde_json::from_str(key).ok()
}

/// The diagnosis of `records` of a job of `world` ranks at time `now_ms`.
pub fn diagnose(records: &[RankRecord], world: usize, now_ms: f64) -> Diagnosis {
    let by_rank: BTreeMap<usize, &RankRecord> = records.iter().map(|r| (r.rank, r)).collect();
    let mut lines = Vec::new();
    let silent: Vec<usize> = (0..world).filter(|r| !by_rank.contains_key(r)).collect();
    // Operations waited in — still running, or failed (a timeout, or a peer's failure while
    // waiting): (key, op, seq) -> the ranks in it and their earliest start.
    type Entry<'a> = (Vec<(usize, &'a OpRecord)>, &'a OpRecord);
    let mut waits: BTreeMap<(String, String, u64), Entry> = BTreeMap::new();
    for r in records {
        for o in r.ops.iter().filter(|o| o.ok != Some(true)) {
            let e = waits
                .entry((o.key.clone(), o.op.clone(), o.seq))
                .or_insert((Vec::new(), o));
            e.0.push((r.rank, o));
            if o.start_ms < e.1.start_ms {
                e.1 = o;
            }
        }
    }
    let count = waits.len();
    let mut order: Vec<_> = waits.into_iter().collect();
    order.sort_by(|a, b| a.1 .1.start_ms.total_cmp(&b.1 .1.start_ms));
    // The last operation of a rank on `key`, and its very last.
    let last_on = |rank: usize, key: &str| -> Option<&OpRecord> {
        by_rank[&rank].ops.iter().rev().find(|o| o.key == key)
    };
    let last = |rank: usize| by_rank[&rank].ops.last();
    // `failed`: the wait ended in a failure (the rank never entered the operation), else it
    // still runs (the rank has not entered it yet).
    let about = |rank: usize, seq: u64, key: &str, what: &str, failed: bool| -> String {
        let Some(rec) = by_rank.get(&rank) else {
            return format!(
                "rank {rank} left no flight record (stopped or killed before it started?)"
            );
        };
        let mine = last_on(rank, key);
        let doing = last(rank).map_or("none recorded".to_string(), |o| describe(o, now_ms));
        match mine {
            Some(m) if m.seq >= seq => match rec.ops.iter().rev().find(|o| o.ok != Some(true)) {
                Some(p) => format!("rank {rank} passed it and waits in {}", describe(p, now_ms)),
                None => format!("rank {rank} passed it; its last operation: {doing}"),
            },
            _ => format!(
                "rank {rank} {} {what}; its last operation was {doing}",
                if failed {
                    "never entered"
                } else {
                    "has not entered"
                }
            ),
        }
    };
    for ((key, _op, seq), (entered, first)) in &order {
        // A rank that entered only after another had given up (timed out) arrived too late.
        let gave_up = entered
            .iter()
            .filter(|(_, o)| o.failure.as_deref() == Some("timeout"))
            .filter_map(|(_, o)| o.end_ms)
            .fold(f64::INFINITY, f64::min);
        let (late, on_time): (Vec<_>, Vec<_>) =
            entered.iter().partition(|(_, o)| o.start_ms > gave_up);
        let ranks: Vec<usize> = on_time.iter().map(|(r, _)| *r).collect();
        let ranks = &ranks;
        let failed = entered.iter().any(|(_, o)| o.ok == Some(false));
        let waited = match (first.end_ms, first.failure.as_deref()) {
            (Some(end), Some("timeout")) => {
                format!("{:.1} s until it timed out", (end - first.start_ms) / 1e3)
            }
            (Some(end), Some("peer")) => format!(
                "{:.1} s until another rank's failure ended it",
                (end - first.start_ms) / 1e3
            ),
            (Some(end), _) => format!("{:.1} s until it failed", (end - first.start_ms) / 1e3),
            (None, _) => format!("{:.1} s", (now_ms - first.start_ms) / 1e3),
        };
        let waiting = format!(
            "rank{} {} wait{} in {} (step {}, for {waited})",
            if ranks.len() > 1 { "s" } else { "" },
            ranges(ranks),
            if ranks.len() > 1 { "" } else { "s" },
            name(first),
            first.step,
        );
        let mut found = Vec::new();
        match key.split_once(':') {
            Some(("recv", peer)) => {
                if let Ok(p) = peer.parse::<usize>() {
                    for &r in ranks {
                        found.push(about(
                            p,
                            *seq,
                            &format!("send:{r}"),
                            &format!("send #{seq} to rank {r}"),
                            failed,
                        ));
                    }
                }
            }
            Some(("send", peer)) => {
                if let Ok(p) = peer.parse::<usize>() {
                    for &r in ranks {
                        found.push(about(
                            p,
                            *seq,
                            &format!("recv:{r}"),
                            &format!("recv #{seq} from rank {r}"),
                            failed,
                        ));
                    }
                }
            }
            _ => {
                let group = members(key).unwrap_or_else(|| by_rank.keys().copied().collect());
                let entered: Vec<usize> = entered.iter().map(|(r, _)| *r).collect();
                for m in group.into_iter().filter(|m| !entered.contains(m)) {
                    found.push(about(m, *seq, key, "it", failed));
                }
            }
        }
        for (r, o) in &late {
            found.push(format!(
                "rank {r} entered it {:.1} s after rank {} and too late: the wait had already \
                 given up",
                (o.start_ms - first.start_ms) / 1e3,
                ranks.first().copied().unwrap_or(*r)
            ));
        }
        found.dedup();
        lines.push(waiting);
        lines.extend(found.into_iter().map(|f| format!("  {f}")));
    }
    if lines.is_empty() {
        lines.push("no rank waits in a communication operation".to_string());
        for (rank, rec) in &by_rank {
            if let Some(o) = rec.ops.last() {
                lines.push(format!("  rank {rank}: last {}", describe(o, now_ms)));
            }
        }
    }
    if !silent.is_empty() {
        lines.push(format!("no flight record from rank(s) {}", ranges(&silent)));
    }
    Diagnosis {
        lines,
        waits: count,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(
        n: u64,
        seq: u64,
        op: &str,
        key: &str,
        step: u64,
        start: f64,
        end: Option<f64>,
    ) -> OpRecord {
        OpRecord {
            n,
            seq,
            op: op.into(),
            key: key.into(),
            bytes: 4,
            step,
            queued_ms: None,
            start_ms: start,
            end_ms: end,
            ok: end.map(|_| true),
            failure: None,
        }
    }

    fn rank(rank: usize, ops: Vec<OpRecord>) -> RankRecord {
        RankRecord {
            rank,
            world: 4,
            pid: 1,
            ops,
        }
    }

    #[test]
    fn names_the_rank_that_never_entered_the_collective() {
        let g = "[0,1,2,3]";
        let waiting = |r| {
            rank(
                r,
                vec![
                    op(1, 512, "all_reduce", g, 41, 1000.0, Some(1001.0)),
                    op(2, 513, "all_reduce", g, 41, 2000.0 + r as f64, None),
                ],
            )
        };
        let stopped = rank(
            3,
            vec![
                op(1, 512, "all_reduce", g, 41, 1000.0, Some(1001.0)),
                op(2, 40, "send", "send:1", 41, 1500.0, Some(1500.5)),
            ],
        );
        let d = diagnose(&[waiting(0), waiting(1), waiting(2), stopped], 4, 14_300.0);
        let text = d.to_string();
        assert_eq!(
            d.lines[0],
            "ranks 0-2 wait in all_reduce #513 over ranks [0,1,2,3] (step 41, for 12.3 s)"
        );
        assert!(
            text.contains("rank 3 has not entered it; its last operation was send #40 to rank 1 (step 41, ended 12.8 s ago)"),
            "{text}"
        );
        assert_eq!(d.waits, 1);
        // A wait that ended in a timeout still counts, with how long it lasted.
        let mut timed_out = waiting(2);
        timed_out.ops[1].end_ms = Some(7002.0);
        timed_out.ops[1].ok = Some(false);
        timed_out.ops[1].failure = Some("timeout".into());
        let d = diagnose(&[timed_out, rank(3, vec![])], 4, 14_300.0).to_string();
        assert!(d.contains("rank 2 waits in all_reduce #513 over ranks [0,1,2,3] (step 41, for 5.0 s until it timed out)"), "{d}");
        assert!(
            d.contains("rank 3 never entered it; its last operation was none recorded"),
            "{d}"
        );
        // Without rank 3's record it is still named.
        let d = diagnose(&[waiting(0), waiting(1), waiting(2)], 4, 14_300.0).to_string();
        assert!(d.contains("rank 3 left no flight record"), "{d}");
        assert!(d.contains("no flight record from rank(s) 3"), "{d}");
    }

    #[test]
    fn a_rank_that_arrives_after_the_timeout_is_late() {
        let g = "[0,1]";
        let mut first = op(1, 2, "all_reduce", g, 1, 1000.0, Some(3000.0));
        (first.ok, first.failure) = (Some(false), Some("timeout".into()));
        let mut second = op(1, 2, "all_reduce", g, 1, 5000.0, Some(5000.1));
        (second.ok, second.failure) = (Some(false), Some("peer".into()));
        let d = diagnose(&[rank(0, vec![first]), rank(1, vec![second])], 2, 6000.0).to_string();
        assert!(d.contains("rank 0 waits in all_reduce #2 over ranks [0,1] (step 1, for 2.0 s until it timed out)"), "{d}");
        assert!(
            d.contains("rank 1 entered it 4.0 s after rank 0 and too late"),
            "{d}"
        );
    }

    #[test]
    fn a_receive_names_the_sender_that_never_sent() {
        let a = rank(1, vec![op(1, 7, "recv", "recv:0", 3, 100.0, None)]);
        let b = rank(
            0,
            vec![
                op(1, 6, "send", "send:1", 3, 50.0, Some(51.0)),
                op(2, 9, "all_reduce", "[0,2]", 3, 60.0, None),
            ],
        );
        let d = diagnose(&[a, b], 2, 1100.0).to_string();
        assert!(
            d.contains("rank 1 waits in recv #7 from rank 0 (step 3, for 1.0 s)"),
            "{d}"
        );
        assert!(
            d.contains("rank 0 has not entered send #7 to rank 1"),
            "{d}"
        );
        assert_eq!(ranges(&[0, 1, 2, 5, 7, 8]), "0-2, 5, 7-8");
    }

    #[test]
    fn a_send_names_the_receiver_that_never_received() {
        let a = rank(1, vec![op(1, 7, "send", "send:0", 3, 100.0, None)]);
        let b = rank(0, vec![op(1, 6, "recv", "recv:1", 3, 50.0, Some(51.0))]);
        let d = diagnose(&[a, b], 2, 1100.0).to_string();
        assert!(d.contains("rank 1 waits in send #7 to rank 0"), "{d}");
        assert!(
            d.contains("rank 0 has not entered recv #7 from rank 1"),
            "{d}"
        );
    }
}
