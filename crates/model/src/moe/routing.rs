//! Routing a micro-batch's tokens to experts, on the host: top-k choice ([`route`]), the
//! grouping of the chosen `(token, slot)` pairs by expert ([`expert_order`]) and the expert
//! capacity ([`apply_capacity`]), plus the [`Plan`] a MoE layer's forward (either pass) follows.

use std::cmp::Ordering;

use candle_core::{DType, Result, Tensor};

use super::Router;
use crate::config::{CapacityPolicy, MoeConfig};

/// The experts chosen for each token: `experts[t · k + j]` is token `t`'s `j`-th choice (in
/// descending probability; ties go to the lower expert index), `counts[e]` the tokens routed to
/// expert `e`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routing {
    /// `[n · k]` expert ids.
    pub experts: Vec<u32>,
    /// `[E]` tokens per expert.
    pub counts: Vec<usize>,
}

/// Top-`k` of each row of `probs` (`[n, e]`, row-major), ranked by `probs + bias` when a bias
/// `[e]` is given.
pub fn route(probs: &[f32], bias: Option<&[f32]>, e: usize, k: usize) -> Routing {
    let n = probs.len() / e;
    let mut experts = Vec::with_capacity(n * k);
    let mut counts = vec![0usize; e];
    let mut best: Vec<u32> = Vec::with_capacity(k + 1);
    let mut biased = vec![0f32; if bias.is_some() { e } else { 0 }];
    for row in probs.chunks_exact(e) {
        let row = match bias {
            Some(b) => {
                for ((s, &p), &b) in biased.iter_mut().zip(row).zip(b) {
                    *s = p + b;
                }
                &biased[..]
            }
            None => row,
        };
        best.clear();
        for (j, &p) in row.iter().enumerate() {
            // Insert j after every kept expert with a probability >= p (stable: lower index
            // first on ties; NaN sorts last).
            let at = best
                .iter()
                .position(|&b| {
                    row[b as usize]
                        .partial_cmp(&p)
                        .is_none_or(|o| o == Ordering::Less)
                })
                .unwrap_or(best.len());
            if at < k {
                best.insert(at, j as u32);
                best.truncate(k);
            }
        }
        for &b in &best {
            counts[b as usize] += 1;
        }
        experts.extend_from_slice(&best);
    }
    Routing { experts, counts }
}

/// The order of the `(token, slot)` pairs grouped by expert (stable within an expert):
/// `order[i]` is the pair at permuted row `i`.
pub fn expert_order(r: &Routing) -> Vec<u32> {
    expert_order_of(&r.experts, &r.counts, None)
}

/// [`expert_order`] of the pairs `kept` (all without), `counts` being the kept pairs per expert.
fn expert_order_of(experts: &[u32], counts: &[usize], kept: Option<&[bool]>) -> Vec<u32> {
    let mut next: Vec<usize> = counts
        .iter()
        .scan(0, |at, &c| {
            let start = *at;
            *at += c;
            Some(start)
        })
        .collect();
    let mut order = vec![0u32; counts.iter().sum()];
    for (pair, &e) in experts.iter().enumerate() {
        if kept.is_some_and(|k| !k[pair]) {
            continue;
        }
        order[next[e as usize]] = pair as u32;
        next[e as usize] += 1;
    }
    order
}

/// Expert capacity: which `(token, slot)` pairs of `r` each expert keeps when it takes at most
/// `capacity` of them — those with the highest probability (`probs` `[n, e]`, row-major; ties
/// to the lower pair), or with `by_position` its first pairs — and the kept pairs per expert.
pub fn apply_capacity(
    r: &Routing,
    probs: &[f32],
    (e, k): (usize, usize),
    capacity: usize,
    by_position: bool,
) -> (Vec<bool>, Vec<usize>) {
    let mut kept = vec![true; r.experts.len()];
    let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); e];
    for (pair, &x) in r.experts.iter().enumerate() {
        by_expert[x as usize].push(pair);
    }
    let prob = |pair: usize| probs[pair / k * e + r.experts[pair] as usize];
    for pairs in by_expert.iter_mut().filter(|p| p.len() > capacity) {
        if !by_position {
            pairs.sort_by(|&a, &b| prob(b).total_cmp(&prob(a)).then(a.cmp(&b)));
        }
        for &dropped in &pairs[capacity..] {
            kept[dropped] = false;
        }
    }
    let counts = by_expert.iter().map(|p| p.len().min(capacity)).collect();
    (kept, counts)
}

/// How many pairs chose each expert (before any capacity) and how many the capacity dropped:
/// counted on the host, or still on the device (`[E + 1]` f32, the drops last) until the
/// step's statistics are read.
#[derive(Debug, Clone)]
pub(super) enum Loads {
    Host {
        per_expert: Vec<usize>,
        dropped: u64,
    },
    Device(Tensor),
}

/// How one micro-batch's tokens are routed: the top-k choice, what the expert capacity keeps,
/// and the permutation grouping the kept `(token, slot)` pairs by expert, as index tensors on
/// the device. A gather by `tokens` or `order` may read the row past the inputs' last (a
/// padding row, [`Plan::padded`]) and one by `inverse` the row past the last permuted row (a
/// dropped pair, [`Plan::may_drop`]): their callers append a zero row.
pub(super) struct Plan {
    /// The chosen experts `[n, k]` (u32).
    pub chosen: Tensor,
    /// The token of each permuted row `[rows]` (u32; padding: `n`).
    pub tokens: Tensor,
    /// The pair of each permuted row `[rows]` (u32; padding: `n·k`).
    pub order: Tensor,
    /// The permuted row of each pair `[n·k]` (u32; a dropped pair: `rows`).
    pub inverse: Tensor,
    /// Rows per expert (known on the host: the grouped GEMMs' sizes).
    pub counts: Vec<usize>,
    /// The loads and drops, for the statistics and the balancing loss.
    pub loads: Loads,
    /// Tokens.
    pub n: usize,
    /// Experts per token.
    pub k: usize,
    /// Every expert's rows padded to its capacity (routed on the device, `padded.rs`).
    pub padded: bool,
}

impl Plan {
    /// Routes the rows of the router's probabilities `probs` `[n, E]` with `router`'s
    /// selection bias and `cfg`'s capacity: on the device with `moe_capacity_policy: padded`,
    /// else read on the host.
    pub fn new(probs: &Tensor, router: &Router, cfg: &MoeConfig, layer: usize) -> Result<Self> {
        let (n, e) = probs.dims2()?;
        let k = cfg.top_k;
        if let Some(b) = router.bias.filter(|b| b.len() != e) {
            candle_core::bail!(
                "MoE layer {layer}: {} selection biases for {e} experts",
                b.len()
            );
        }
        let capacity = cfg.capacity(n);
        if let (Some(c), CapacityPolicy::Padded) = (capacity, cfg.capacity_policy) {
            return super::padded::route(probs, router.bias, k, c);
        }
        let host = probs
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let routing = route(&host, router.bias, e, k);
        // With a capacity, each expert keeps its most probable (or first) pairs; the others are
        // dropped.
        let (kept, counts) = match capacity {
            Some(c) => {
                let by_position = cfg.capacity_policy.by_position();
                let (kept, counts) = apply_capacity(&routing, &host, (e, k), c, by_position);
                (Some(kept), counts)
            }
            None => (None, routing.counts.clone()),
        };
        let order = expert_order_of(&routing.experts, &counts, kept.as_deref());
        let rows = order.len();
        let mut inverse = vec![rows as u32; n * k];
        for (row, &pair) in order.iter().enumerate() {
            inverse[pair as usize] = row as u32;
        }
        let tokens: Vec<u32> = order.iter().map(|&p| p / k as u32).collect();
        let dev = probs.device();
        Ok(Self {
            chosen: Tensor::from_slice(&routing.experts, (n, k), dev)?,
            tokens: Tensor::from_vec(tokens, rows, dev)?,
            order: Tensor::from_vec(order, rows, dev)?,
            inverse: Tensor::from_vec(inverse, n * k, dev)?,
            counts,
            loads: Loads::Host {
                per_expert: routing.counts,
                dropped: (n * k - rows) as u64,
            },
            n,
            k,
            padded: false,
        })
    }

    /// Permuted rows: the kept pairs, or with padding every expert's capacity.
    pub fn rows(&self) -> usize {
        self.counts.iter().sum()
    }

    /// Whether a pair may have been dropped (its `inverse` is `rows`).
    pub fn may_drop(&self) -> bool {
        self.padded || self.rows() < self.n * self.k
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_keeps_each_experts_most_probable_pairs() {
        // Four tokens, top-1 over two experts: expert 0 is chosen three times.
        let probs = [0.9, 0.1, 0.6, 0.4, 0.6, 0.4, 0.2, 0.8];
        let r = route(&probs, None, 2, 1);
        assert_eq!(r.experts, vec![0, 0, 0, 1]);
        let (kept, counts) = apply_capacity(&r, &probs, (2, 1), 2, false);
        // Expert 0 keeps 0.9 and the first of the tied 0.6s.
        assert_eq!(kept, vec![true, true, false, true]);
        assert_eq!(counts, vec![2, 1]);
        let order = expert_order_of(&r.experts, &counts, Some(&kept));
        assert_eq!(order, vec![0, 1, 3]);
        // The least probable pair first: dropped by probability, kept by position.
        let probs = [0.55, 0.45, 0.9, 0.1, 0.6, 0.4, 0.2, 0.8];
        let r = route(&probs, None, 2, 1);
        assert_eq!(r.experts, vec![0, 0, 0, 1]);
        let by_probs = apply_capacity(&r, &probs, (2, 1), 2, false).0;
        assert_eq!(by_probs, vec![false, true, true, true]);
        let by_position = apply_capacity(&r, &probs, (2, 1), 2, true).0;
        assert_eq!(by_position, vec![true, true, false, true]);
    }

    #[test]
    fn top_k_is_stable_and_counts() {
        // Three tokens over four experts, k = 2; the second row has a tie (0.3, 0.3).
        let probs = [
            0.1,
            0.6,
            0.2,
            0.1, //
            0.3,
            0.1,
            0.3,
            0.3, //
            f32::NAN,
            0.5,
            0.4,
            0.1,
        ];
        let r = route(&probs, None, 4, 2);
        assert_eq!(r.experts, vec![1, 2, 0, 2, 1, 2]);
        assert_eq!(r.counts, vec![1, 2, 3, 0]);
        let order = expert_order(&r);
        // Expert 0: pair 2; expert 1: pairs 0, 4; expert 2: pairs 1, 3, 5.
        assert_eq!(order, vec![2, 0, 4, 1, 3, 5]);
        // A bias moves the choice, not the probabilities: expert 3 now wins the first row.
        let r = route(&probs, Some(&[0.0, 0.0, 0.0, 0.55]), 4, 2);
        assert_eq!(&r.experts[..2], &[3, 1]);
    }
}
