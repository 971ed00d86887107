//! Chrome / Perfetto trace export: [`chrome_trace`] turns a plain list of [`TraceSpan`]s (track,
//! name, start and duration in microseconds) into the JSON "Trace Event Format" that
//! `chrome://tracing` and <https://ui.perfetto.dev> open, one row ("thread") per track: a
//! pipeline stage of the simulator, or a rank (and its data-parallel sync) of a measured step.
//! [`spans_from_timelines`] adapts the simulator's timelines; the real executor feeds its
//! measured timings directly.

use serde_json::{json, Value};

use super::sim::Span;

/// One complete event on one row of the timeline.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceSpan {
    /// The row (shown as the thread id), e.g. a pipeline stage.
    pub track: usize,
    /// Label, e.g. `F c0 m3`.
    pub name: String,
    /// Start time in microseconds.
    pub start_us: f64,
    /// Duration in microseconds.
    pub dur_us: f64,
}

impl From<(usize, String, f64, f64)> for TraceSpan {
    fn from((track, name, start_us, dur_us): (usize, String, f64, f64)) -> Self {
        TraceSpan {
            track,
            name,
            start_us,
            dur_us,
        }
    }
}

/// Converts simulator timelines (stage = index in `timelines`) to trace spans, scaling the
/// simulator's time unit to `us_per_unit` microseconds.
pub fn spans_from_timelines(timelines: &[Vec<Span>], us_per_unit: f64) -> Vec<TraceSpan> {
    timelines
        .iter()
        .enumerate()
        .flat_map(|(stage, spans)| {
            spans.iter().map(move |s| TraceSpan {
                track: stage,
                name: s.action.to_string(),
                start_us: s.start * us_per_unit,
                dur_us: (s.end - s.start) * us_per_unit,
            })
        })
        .collect()
}

/// Renders `spans` as Chrome trace JSON: `{"traceEvents":[...]}` with one `"ph":"X"` event per
/// span (`pid` 0, `tid` = track) plus one `"ph":"M"` thread-name event per track, named by
/// `track_name`.
///
/// Spans whose name starts with `F` get category `forward`, `B` category `backward`, `W`
/// category `weight`, others `other`. Non-finite times are written as `null`.
pub fn chrome_trace(spans: &[TraceSpan], track_name: &dyn Fn(usize) -> String) -> String {
    let mut tracks: Vec<usize> = spans.iter().map(|s| s.track).collect();
    tracks.sort_unstable();
    tracks.dedup();
    let names = tracks.iter().map(|&track| {
        json!({
            "name": "thread_name",
            "ph": "M",
            "pid": 0,
            "tid": track,
            "args": { "name": track_name(track) },
        })
    });
    let events = spans.iter().map(|s| {
        let cat = match s.name.chars().next() {
            Some('F') => "forward",
            Some('B') => "backward",
            Some('W') => "weight",
            _ => "other",
        };
        json!({
            "name": s.name,
            "cat": cat,
            "ph": "X",
            "ts": s.start_us,
            "dur": s.dur_us,
            "pid": 0,
            "tid": s.track,
        })
    });
    let all: Vec<Value> = names.chain(events).collect();
    json!({ "traceEvents": all, "displayTimeUnit": "ms" }).to_string()
}
