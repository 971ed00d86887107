//! Pipeline parallelism's registration: the layers split over `pp × virtual_stages` chunks (evenly,
//! or as `parallel.pipeline_layout` says); the
//! pipeline group, its ends (tied embeddings) and the directions to the next and the previous
//! stage.

use super::{build, build_zb_h1, build_zbv, sim::simulate_built, zbv, ScheduleKind, SimCosts};
use crate::comm::Channel;
use crate::mesh::RankGroups;
use crate::register::{next_in, Dims, Parallelism, LATENCY_S};
use crate::ParallelConfig;

/// Pipeline parallelism, interleaved with virtual stages.
pub struct Pp;

impl Pp {
    /// Planner term: one transfer of `bytes` (an activation or its gradient) to a neighbouring
    /// stage at `bw` bytes/s.
    pub fn transfer_s(bytes: f64, bw: f64) -> f64 {
        bytes / bw + LATENCY_S
    }

    /// Planner term: the idle time per stage of schedule `kind` over `pp` stages of `v` chunks
    /// and `m` micro-batches, a mean stage taking `stage_s` per micro-batch, `bwd_s` of it
    /// backward, of which `wgt_s` weight-gradient GEMMs. GPipe, 1F1B and interleaved 1F1B:
    /// `(pp − 1)/v` stages (their closed form). The zero-bubble schedules: the schedule itself
    /// simulated (up to `4·pp` micro-batches; their idle time does not grow past that) with
    /// forward `stage_s − bwd_s`, B `bwd_s − wgt_s` and W `wgt_s` (zbv ordered for those
    /// costs, as training orders it for measured ones, each stage holding at most `limits[s]`
    /// chunk activations, `2·pp` when empty; zb-h1's stages deferring `limits[s]` weight
    /// actions, the paper's `s` on stage `s` when empty). The limits are what the memory model
    /// allows within 1F1B's activations: a zbv stage allowed few holds micro-batches back.
    pub fn bubble_s(
        kind: ScheduleKind,
        (pp, v, m): (usize, usize, usize),
        (stage_s, bwd_s, wgt_s): (f64, f64, f64),
        limits: &[usize],
    ) -> f64 {
        let closed = (pp as f64 - 1.0) / v as f64 * stage_s;
        let m_sim = m.clamp(1, 4 * pp);
        let costs = SimCosts::split_per_chunk(stage_s - bwd_s, bwd_s - wgt_s, wgt_s, v);
        let schedule = match kind {
            ScheduleKind::ZeroBubbleH1 if limits.len() == pp => {
                let deferred: Vec<usize> = limits.iter().map(|&d| d.min(m_sim)).collect();
                build_zb_h1(pp, m_sim, &deferred)
            }
            ScheduleKind::ZeroBubbleH1 => build(kind, pp, v, m_sim),
            ScheduleKind::ZeroBubbleV => {
                let mut fit = zbv::Fit {
                    costs,
                    ..zbv::Fit::unit(pp)
                };
                if limits.len() == pp {
                    fit.caps = limits.to_vec();
                }
                build_zbv(pp, m_sim, &fit)
            }
            _ => return closed,
        };
        match schedule.map(|s| simulate_built(&s, costs)) {
            Ok(Ok(r)) => (r.makespan - m_sim as f64 * stage_s).max(0.0),
            _ => closed,
        }
    }
}

/// What is wrong with `parallel.pipeline_layout` `l` for `chunks` chunks of `layers` layers.
fn layout_problems(l: &[usize], chunks: usize, layers: usize) -> Vec<String> {
    let mut p = Vec::new();
    if l.len() != chunks {
        p.push(format!(
            "parallel.pipeline_layout has {} entries; it needs one per pipeline chunk, \
             parallel.pp × parallel.virtual_stages = {chunks}",
            l.len()
        ));
    }
    let sum = l.iter().try_fold(0usize, |a, &x| a.checked_add(x));
    if sum != Some(layers) {
        p.push(format!(
            "parallel.pipeline_layout {l:?} holds {} layers; model.num_hidden_layers is {layers}",
            sum.map_or("too many".to_string(), |s| s.to_string())
        ));
    }
    let last = l.len().saturating_sub(1);
    if let Some(i) = (1..last).find(|&i| l[i] == 0) {
        p.push(format!(
            "parallel.pipeline_layout[{i}] is 0: only the first chunk (with the embedding) and \
             the last (with the head) may hold no layer"
        ));
    }
    p
}

impl Parallelism for Pp {
    fn problems(&self, c: &ParallelConfig, d: &Dims) -> Vec<String> {
        let mut p = Vec::new();
        match c.pp.checked_mul(c.virtual_stages) {
            None => p.push(format!(
                "parallel.pp × parallel.virtual_stages ({} × {}) overflows",
                c.pp, c.virtual_stages
            )),
            Some(chunks) => match &c.pipeline_layout {
                None if !d.layers.is_multiple_of(chunks) => p.push(format!(
                    "parallel.pp × parallel.virtual_stages ({} × {}) must divide \
                     model.num_hidden_layers ({}), or parallel.pipeline_layout must say how \
                     many layers each chunk holds",
                    c.pp, c.virtual_stages, d.layers
                )),
                None => {}
                Some(l) => p.extend(layout_problems(l, chunks, d.layers)),
            },
        }
        if c.virtual_stages > 1 && c.pp == 1 {
            p.push("parallel.virtual_stages > 1 needs parallel.pp > 1".into());
        }
        match (c.schedule_kind(), c.virtual_stages) {
            (ScheduleKind::Interleaved, 1) => p.push(
                "parallel.schedule interleaved needs parallel.virtual_stages >= 2 (with one \
                 chunk per stage use 1f1b or zb-h1)"
                    .into(),
            ),
            (ScheduleKind::ZeroBubbleV, 2) => {}
            (ScheduleKind::ZeroBubbleV, v) => p.push(format!(
                "parallel.schedule zbv runs two model chunks per stage (a V): it needs \
                 parallel.virtual_stages: 2, not {v}"
            )),
            (ScheduleKind::Interleaved, _) | (_, 1) => {}
            (kind, v) => p.push(format!(
                "parallel.schedule {} runs one model chunk per stage; parallel.virtual_stages is \
                 {v} (use interleaved, or virtual_stages: 1)",
                kind.recipe_name()
            )),
        }
        p
    }

    fn channels(&self, rank: usize, g: &RankGroups) -> Vec<Channel> {
        let mut out = vec![
            Channel::Group(g.pp.clone()),
            Channel::Group(g.pipeline_ends.clone()),
        ];
        let n = g.pp.size();
        out.extend(next_in(rank, &g.pp, 1));
        out.extend(next_in(rank, &g.pp, n.saturating_sub(1)));
        out
    }

    fn describe(&self, c: &ParallelConfig) -> String {
        let layout = c
            .pipeline_layout
            .as_ref()
            .map_or(String::new(), |l| format!(" layers {l:?}"));
        let schedule = match c.schedule {
            Some(k) => format!(" {}", k.recipe_name()),
            None => String::new(),
        };
        match c.virtual_stages {
            1 => format!("pp={}{layout}{schedule}", c.pp),
            v => format!("pp={} (virtual {v}){layout}{schedule}", c.pp),
        }
    }
}
