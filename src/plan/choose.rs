//! One answer to "which layout": the planner's choice of a recipe's layout for the devices a job
//! has, shared by `pretrain --gpus N` (`cli/train.rs`) and elastic restarts (`launch::elastic`).
//! The choice is the fastest candidate of [`candidates`] that fits (memory, and the trainer's
//! start-up limits: [`Plan::refused`]), keeps what the caller must keep ([`Keep`]) and can be
//! placed on the nodes so that every tensor- and context-parallel group lies inside one node
//! ([`placeable`]): those groups' collectives run at NVLink's rate, and a group split across
//! nodes would run them over the network at a tenth of it.

use super::{candidates, plan, Hardware, Layout, Plan, GIB};
use crate::recipe::Recipe;

/// What a chosen layout keeps of the recipe's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// What the user's run is: model, sequence, global batch and optimizer (its moments'
    /// dtype); the recipe's own layout only where it fits (`--gpus`).
    Run,
    /// Also the memory and schedule levers: micro-batch, recompute, the ZeRO stage (when it
    /// shards), sequence parallelism (where tp > 1) and a zero-bubble schedule; the recipe's own
    /// layout whenever its size matches (elastic restarts: the run goes on as it was set up).
    Levers,
}

impl Keep {
    /// Whether `l` keeps what this asks of `own`.
    fn allows(self, own: &Layout, l: &Layout) -> bool {
        if l.state_dtype != own.state_dtype {
            return false;
        }
        match self {
            Keep::Run => true,
            Keep::Levers => {
                l.micro_batch == own.micro_batch
                    && l.recompute == own.recompute
                    && (l.zero == own.zero || !own.zero.shards_optimizer())
                    && l.sequence_parallel == (own.sequence_parallel && l.tp > 1)
                    && (l.pp == 1 || zero_bubble(l.schedule) == zero_bubble(own.schedule))
            }
        }
    }
}

/// Whether `kind` splits backwards.
fn zero_bubble(kind: parallel::pipeline::ScheduleKind) -> bool {
    use parallel::pipeline::ScheduleKind as K;
    matches!(kind, K::ZeroBubbleH1 | K::ZeroBubbleV)
}

/// Ranks of whole units of `unit` ranks that `nodes` (slots per node) hold.
pub fn capacity(nodes: &[usize], unit: usize) -> usize {
    nodes.iter().map(|s| s / unit.max(1) * unit.max(1)).sum()
}

/// Whether `world` ranks of layout `l` can be placed on `nodes` (slots per node, node 0 first)
/// with every tensor- and context-parallel group inside one node: each node runs whole units of
/// `tp · cp` consecutive ranks (the mesh orders tp fastest, then cp), and node 0, whose host
/// serves rank 0's store, at least one.
pub fn placeable(l: &Layout, nodes: &[usize], world: usize) -> bool {
    let unit = l.tp * l.cp;
    nodes.first().is_some_and(|&n| n >= unit) && capacity(nodes, unit) >= world
}

/// A layout of a recipe for a number of ranks.
#[derive(Debug, Clone)]
pub struct Choice {
    /// Ranks it uses.
    pub world: usize,
    /// The layout.
    pub layout: Layout,
    /// `parallel.pipeline_layout` when its stages are uneven.
    pub pipeline_layout: Option<Vec<usize>>,
    /// Its plan (memory per rank, step time).
    pub plan: Plan,
    /// Whether it is the recipe's own layout.
    pub own: bool,
}

impl PartialEq for Choice {
    fn eq(&self, other: &Self) -> bool {
        (self.world, &self.layout, &self.pipeline_layout)
            == (other.world, &other.layout, &other.pipeline_layout)
    }
}

impl Choice {
    /// The overrides that give the recipe this layout.
    pub fn overrides(&self) -> String {
        let l = &self.layout;
        let mut s = format!(
            "parallel.dp={},parallel.tp={},parallel.cp={},parallel.pp={},parallel.ep={},\
             parallel.virtual_stages={},parallel.sequence_parallel={},parallel.zero={},\
             parallel.schedule={},train.micro_batch={},train.recompute={},\
             optimizer.state_dtype={}",
            l.dp,
            l.tp,
            l.cp,
            l.pp,
            l.ep,
            l.virtual_stages,
            l.sequence_parallel,
            l.zero,
            l.schedule.recipe_name(),
            l.micro_batch,
            l.recompute,
            l.state_dtype
        );
        match &self.pipeline_layout {
            Some(p) => s.push_str(&format!(",parallel.pipeline_layout={p:?}")),
            None => s.push_str(",parallel.pipeline_layout=null"),
        }
        s
    }

    /// `4 ranks: dp=2 tp=2 …` for the log.
    pub fn describe(&self) -> String {
        let l = &self.layout;
        let mut s = format!(
            "{} ranks: dp={} tp={} cp={} pp={} ep={} zero={}",
            self.world,
            l.dp,
            l.tp,
            l.cp,
            l.pp,
            l.ep,
            l.zero.number()
        );
        if let Some(p) = &self.pipeline_layout {
            s.push_str(&format!(" pipeline_layout={p:?}"));
        }
        s
    }

    /// Why it runs: the memory of its most loaded rank against the device's and, on GPUs, its
    /// predicted step, on `hw` (the CPU's ranking uses GPU rates, so no time is claimed there).
    pub fn reason(&self, hw: &Hardware) -> String {
        let p = &self.plan;
        let memory = format!(
            "{:.2} GiB per rank of {:.1} ({})",
            (p.memory_bytes.total + p.headroom_bytes) as f64 / GIB,
            hw.memory_gib,
            hw.name
        );
        match hw.is_gpu() {
            true => format!("{memory}, {:.3} s per step predicted", p.step_time_s),
            false => memory,
        }
    }
}

/// The layout `recipe` runs on `nodes` (slots per node, node 0 first) on `hw`, using between
/// `min` and all of the slots: the recipe's own when it takes exactly all of them and can be
/// placed (for [`Keep::Run`], also fits), else the fastest fitting candidate that keeps what
/// `keep` says and can be placed, with as many ranks as any has. `None` when nothing qualifies.
pub fn choose(
    recipe: &Recipe,
    nodes: &[usize],
    min: usize,
    hw: &Hardware,
    keep: Keep,
) -> Option<Choice> {
    let total: usize = nodes.iter().sum();
    let own = Layout::of(recipe);
    if recipe.parallel.world_size() == total && placeable(&own, nodes, total) {
        let p = plan(recipe, hw).ok();
        let own_fits = p.as_ref().is_some_and(|p| p.fits);
        if let Some(p) = p.filter(|_| keep == Keep::Levers || own_fits) {
            return Some(Choice {
                world: total,
                layout: own,
                pipeline_layout: recipe.parallel.pipeline_layout.clone(),
                plan: p,
                own: true,
            });
        }
    }
    // Rank counts beyond what any layout of the recipe uses have no candidates: not walked.
    let most = total.min(most_ranks(recipe, hw));
    (min.max(1)..=most).rev().find_map(|n| {
        candidates(recipe, hw, n)
            .into_iter()
            .map(|c| c.plan)
            .filter(|p| p.fits && placeable(&p.layout, nodes, n) && keep.allows(&own, &p.layout))
            .map(|p| Choice {
                world: n,
                layout: p.layout,
                pipeline_layout: p.pipeline_layout.clone(),
                own: p.layout == own,
                plan: p,
            })
            .next()
    })
}

/// An upper bound of the ranks any layout of `recipe` uses on `hw`: a replica per sample, tensor
/// parallelism up to the heads and a node, the recipe's context parallelism, a stage per layer.
fn most_ranks(recipe: &Recipe, hw: &Hardware) -> usize {
    let c = &recipe.model;
    let tp = c.num_attention_heads.min(hw.gpus_per_node).max(1);
    recipe
        .train
        .global_batch
        .saturating_mul(tp)
        .saturating_mul(recipe.parallel.cp.max(1))
        .saturating_mul(c.num_hidden_layers.max(1))
}

/// Slots per node for `n` devices on nodes of `per_node`: full nodes, the rest on the last.
pub fn nodes_of(n: usize, per_node: usize) -> Vec<usize> {
    let per_node = per_node.max(1);
    let mut out = vec![per_node; n / per_node];
    if !n.is_multiple_of(per_node) {
        out.push(n % per_node);
    }
    out
}

/// The fewest devices above `n` (on nodes of `hw.gpus_per_node`) on which some layout of
/// `recipe` that keeps what `keep` says fits, looked for up to 4096: every count to 16, then
/// multiples of 8. `None` when none does.
pub fn smallest_fit(recipe: &Recipe, hw: &Hardware, keep: Keep, n: usize) -> Option<usize> {
    let counts = (n + 1..=16).chain((8..=4096).step_by(8).filter(|&c| c > n.max(16)));
    counts
        .into_iter()
        .find(|&c| choose(recipe, &nodes_of(c, hw.gpus_per_node), c, hw, keep).is_some())
}
