//! The mixture-of-experts layer against two independent references, in f64:
//! - finite differences of `Σ y·c + router losses` for every input and weight element;
//! - a dense reference written with candle's primitive ops that runs every expert on every token
//!   and keeps the top-k with a mask (no permutation, no grouping).
//!
//! And a MoE model trained on data- and pipeline-parallel layouts against one rank.

use candle_core::{DType, Device, Tensor, Var, D};
use model::moe::{self, Expert, Router};
use model::MoeConfig;
use parallel::ep::ExpertParallel;

const N: usize = 12; // tokens
const H: usize = 8; // hidden
const E: usize = 4; // experts
const K: usize = 2; // experts per token
const F: usize = 6; // expert width

fn config(norm_topk_prob: bool) -> MoeConfig {
    MoeConfig {
        num_experts: E,
        top_k: K,
        aux_loss_coef: 0.1,
        z_loss_coef: 0.05,
        norm_topk_prob,
        expert_size: F,
        dense_layers: vec![],
        bias_update_rate: 0.0,
        capacity_factor: None,
    }
}

/// Deterministic values in [-scale, scale) from a linear congruential generator.
fn values(n: usize, seed: u64, scale: f64) -> Vec<f64> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// The layer's inputs: `x`, the router, and each expert's `w1, w3, w2`, as variables.
fn inputs() -> Vec<Var> {
    let dev = Device::Cpu;
    let var = |shape: (usize, usize), seed, scale| {
        Var::from_tensor(
            &Tensor::from_vec(values(shape.0 * shape.1, seed, scale), shape, &dev).unwrap(),
        )
        .unwrap()
    };
    let mut v = vec![var((N, H), 1, 1.0), var((E, H), 2, 0.8)];
    for e in 0..E as u64 {
        v.push(var((F, H), 10 + 3 * e, 0.5));
        v.push(var((F, H), 11 + 3 * e, 0.5));
        v.push(var((H, F), 12 + 3 * e, 0.5));
    }
    v
}

fn experts(v: &[Tensor]) -> Vec<Expert> {
    v[2..]
        .chunks(3)
        .map(|w| Expert {
            w1: w[0].clone(),
            w3: w[1].clone(),
            w2: w[2].clone(),
        })
        .collect()
}

/// The layer on inputs `v` (`x`, router, then each expert's three weights) on one rank.
fn layer(v: &[Tensor], cfg: &MoeConfig, index: usize) -> moe::MoeOutput {
    let router = Router::plain(&v[1]);
    let single = ExpertParallel::single();
    moe::forward(&v[0], &router, &experts(v), &single, None, cfg, index).unwrap()
}

/// `Σ y·c + aux` of the layer under test.
fn objective(v: &[Tensor], cfg: &MoeConfig) -> Tensor {
    let out = layer(v, cfg, 0);
    let c = Tensor::from_vec(values(N * H, 99, 1.0), (N, H), &Device::Cpu).unwrap();
    ((out.y * c).unwrap().sum_all().unwrap() + out.aux_loss).unwrap()
}

#[test]
fn gradients_match_finite_differences() {
    // Renormalised or not, and with a capacity of 3 pairs per expert (of 6 on average).
    for (norm, capacity) in [(true, None), (false, None), (true, Some(0.5))] {
        let cfg = MoeConfig {
            capacity_factor: capacity,
            ..config(norm)
        };
        let vars = inputs();
        let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let grads = objective(&tensors, &cfg).backward().unwrap();
        let eps = 1e-6;
        let mut worst = 0f64;
        for (i, var) in vars.iter().enumerate() {
            let analytic = grads
                .get(var.as_tensor())
                .map(|g| g.flatten_all().unwrap().to_vec1::<f64>().unwrap())
                .unwrap_or_else(|| vec![0.0; var.elem_count()]);
            let base = var
                .as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            for j in 0..base.len() {
                let at = |d: f64| {
                    let mut w = base.clone();
                    w[j] += d;
                    let mut t = tensors.clone();
                    t[i] = Tensor::from_vec(w, var.shape(), &Device::Cpu).unwrap();
                    objective(&t, &cfg).to_scalar::<f64>().unwrap()
                };
                let numeric = (at(eps) - at(-eps)) / (2.0 * eps);
                let err = (numeric - analytic[j]).abs() / analytic[j].abs().max(1.0);
                worst = worst.max(err);
                assert!(
                    err < 1e-6,
                    "norm_topk_prob={norm} capacity {capacity:?} input {i} element {j}: finite \
                     difference {numeric}, autograd {}",
                    analytic[j]
                );
            }
        }
        eprintln!("norm_topk_prob={norm} capacity {capacity:?}: worst gradient error {worst:.2e}");
    }
}

/// Every expert on every token, the top-k kept by a mask: `y = Σₑ wₑ · expertₑ(x)` with
/// `wₑ = pₑ·maskₑ (/ Σ p·mask)`, and the router losses from their definitions.
fn dense_reference(v: &[Tensor], cfg: &MoeConfig) -> (Tensor, Tensor) {
    let (x, router) = (&v[0], &v[1]);
    let logits = x.matmul(&router.t().unwrap()).unwrap(); // [n, E]
    let ex = logits.exp().unwrap();
    let sum = ex.sum_keepdim(D::Minus1).unwrap();
    let probs = ex.broadcast_div(&sum).unwrap();
    // The top-k mask, chosen on the host: strictly larger probability first, lower index on ties.
    let p = probs.to_vec2::<f64>().unwrap();
    let mut mask = vec![0f64; N * E];
    for (t, row) in p.iter().enumerate() {
        let mut idx: Vec<usize> = (0..E).collect();
        idx.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)));
        for &e in &idx[..K] {
            mask[t * E + e] = 1.0;
        }
    }
    let mask = Tensor::from_vec(mask, (N, E), &Device::Cpu).unwrap();
    let mut w = (&probs * &mask).unwrap();
    if cfg.norm_topk_prob {
        w = w.broadcast_div(&w.sum_keepdim(D::Minus1).unwrap()).unwrap();
    }
    let mut y = x.zeros_like().unwrap();
    for (e, ex) in experts(v).iter().enumerate() {
        let g = x.matmul(&ex.w1.t().unwrap()).unwrap().silu().unwrap();
        let u = x.matmul(&ex.w3.t().unwrap()).unwrap();
        let out = (g * u).unwrap().matmul(&ex.w2.t().unwrap()).unwrap(); // [n, h]
        let we = w.narrow(1, e, 1).unwrap(); // [n, 1]
        y = (y + out.broadcast_mul(&we).unwrap()).unwrap();
    }
    let f = mask.mean(0).unwrap(); // share of tokens choosing each expert (sums to k)
    let lb = ((f * probs.mean(0).unwrap()).unwrap().sum_all().unwrap() * E as f64).unwrap();
    let lse = sum.log().unwrap().squeeze(1).unwrap();
    let z = lse.sqr().unwrap().mean_all().unwrap();
    let aux = ((lb * cfg.aux_loss_coef).unwrap() + (z * cfg.z_loss_coef).unwrap()).unwrap();
    (y, aux)
}

/// Largest absolute difference of two f64 tensors of one shape.
fn diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b)
        .and_then(|d| d.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>())
        .unwrap()
}

#[test]
fn equals_the_dense_masked_reference() {
    for norm in [true, false] {
        let cfg = config(norm);
        let vars = inputs();
        let t: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let out = layer(&t, &cfg, 3);
        let (y_ref, aux_ref) = dense_reference(&t, &cfg);
        assert!(diff(&out.y, &y_ref) < 1e-12, "output");
        assert!(diff(&out.aux_loss, &aux_ref) < 1e-12, "router losses");
        assert_eq!(out.stats.layer, 3);
        assert_eq!(
            out.stats.tokens_per_expert.iter().sum::<u64>(),
            (N * K) as u64
        );
        // Gradients of `Σ y·c + aux` on both sides.
        let c = Tensor::from_vec(values(N * H, 7, 1.0), (N, H), &Device::Cpu).unwrap();
        let loss = |y: Tensor, aux: Tensor| ((y * &c).unwrap().sum_all().unwrap() + aux).unwrap();
        let ours = loss(out.y, out.aux_loss).backward().unwrap();
        let theirs = loss(y_ref, aux_ref).backward().unwrap();
        for (i, v) in vars.iter().enumerate() {
            let zero = v.zeros_like().unwrap();
            let a = ours.get(v.as_tensor()).unwrap_or(&zero);
            let b = theirs.get(v.as_tensor()).unwrap_or(&zero);
            let d = diff(a, b);
            assert!(
                d < 1e-12,
                "norm_topk_prob={norm} input {i}: gradients differ by {d:.2e}"
            );
        }
    }
}

/// The hand-written pass (`moe::forward_saved` + `moe::backward`) against autograd over
/// `moe::forward`, in f64: the same output and statistics, and the gradients of `Σ y·c + w·aux`
/// for the input, the router and every expert — renormalised or not, with a capacity that
/// drops pairs, with an idle expert. Only the order of some sums differs (a token's slots are
/// added by one `index_add`), hence 1e-12 rather than bit equality.
#[test]
fn hand_written_backward_equals_autograd() {
    let aux_weight = 0.37;
    for (norm, capacity) in [(true, None), (false, None), (true, Some(0.5))] {
        let cfg = MoeConfig {
            capacity_factor: capacity,
            ..config(norm)
        };
        for idle in [false, true] {
            let t: Vec<Tensor> = inputs().iter().map(|v| v.as_tensor().clone()).collect();
            // With `idle`, a selection bias keeps every token away from expert 3.
            let bias = [0.0, 0.0, 0.0, -10.0];
            let bias = idle.then_some(&bias[..]);
            let c = Tensor::from_vec(values(N * H, 7, 1.0), (N, H), &Device::Cpu).unwrap();
            let single = ExpertParallel::single();
            let router = Router {
                weight: &t[1],
                bias,
            };
            let out = moe::forward(&t[0], &router, &experts(&t), &single, None, &cfg, 0).unwrap();
            let objective = ((&out.y * &c).unwrap().sum_all().unwrap()
                + (&out.aux_loss * aux_weight).unwrap())
            .unwrap();
            let want = objective.backward().unwrap();

            let detached: Vec<Tensor> = t.iter().map(Tensor::detach).collect();
            let router = Router {
                weight: &detached[1],
                bias,
            };
            let ex = experts(&detached);
            let (y, stats, tape) = moe::forward_saved(
                &detached[0],
                &router,
                &ex,
                &single,
                None,
                &cfg,
                0,
                aux_weight,
            )
            .unwrap();
            assert_eq!(diff(&y, &out.y), 0.0, "output");
            assert_eq!(stats, out.stats);
            if idle {
                assert_eq!(stats.tokens_per_expert[3], 0, "expert 3 is idle");
            }
            let got = moe::backward(tape, &detached[1], &ex, &single, &c).unwrap();
            let case = format!("norm_topk_prob={norm} capacity {capacity:?} idle {idle}");
            let close = |name: &str, a: &Tensor, var: &Tensor| {
                let zero = var.zeros_like().unwrap();
                let b = want.get(var).unwrap_or(&zero);
                let d = diff(a, b);
                assert!(d < 1e-12, "{case} {name}: gradients differ by {d:.2e}");
            };
            close("input", &got.dx, &t[0]);
            close("router", &got.router, &t[1]);
            for (e, g) in got.experts.into_iter().enumerate() {
                let Some(g) = g else {
                    assert!(idle && e == 3, "{case}: expert {e} got no gradient");
                    assert!(want.get(&t[2 + 3 * e]).is_none());
                    continue;
                };
                for (j, g) in g.into_iter().enumerate() {
                    let g = g.into_tensor().unwrap();
                    close(&format!("expert {e} weight {j}"), &g, &t[2 + 3 * e + j]);
                }
            }
        }
    }
}

/// An expert capacity drops each expert's least probable pairs beyond it (they contribute
/// nothing, as in a dense reference without them); a capacity above every expert's load changes
/// nothing at all.
#[test]
fn capacity_drops_the_least_probable_pairs() {
    let t: Vec<Tensor> = inputs().iter().map(|v| v.as_tensor().clone()).collect();
    let run = |capacity: Option<f64>| {
        let cfg = MoeConfig {
            capacity_factor: capacity,
            ..config(true)
        };
        layer(&t, &cfg, 0)
    };
    let (free, roomy, tight) = (run(None), run(Some(4.0)), run(Some(0.5)));
    assert_eq!(diff(&roomy.y, &free.y), 0.0);
    assert_eq!((free.stats.dropped, roomy.stats.dropped), (0, 0));
    // Capacity ceil(0.5 · 24 / 4) = 3 per expert.
    let loads = &free.stats.tokens_per_expert;
    let want: u64 = loads.iter().map(|&c| c.saturating_sub(3)).sum();
    assert!(want > 0, "{loads:?}: the case drops nothing");
    assert_eq!(tight.stats.dropped, want);
    assert_eq!(
        tight.stats.tokens_per_expert, *loads,
        "loads are counted before the capacity"
    );
    // Tokens whose pairs were all kept have the dropless output; some token changed.
    let changed = (&tight.y - &free.y)
        .unwrap()
        .abs()
        .unwrap()
        .sum(1)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    assert!(changed.iter().any(|&c| c > 0.0));
    assert!(changed.iter().filter(|&&c| c == 0.0).count() > 0);
}

/// The layer in f32 and bf16 follows the f64 layer (same routing on these inputs).
#[test]
fn lower_precision_follows_f64() {
    let cfg = config(true);
    let t: Vec<Tensor> = inputs().iter().map(|v| v.as_tensor().clone()).collect();
    let want = layer(&t, &cfg, 0);
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 5e-2)] {
        let low: Vec<Tensor> = t.iter().map(|x| x.to_dtype(dtype).unwrap()).collect();
        let got = layer(&low, &cfg, 0);
        assert_eq!(got.y.dtype(), dtype);
        assert_eq!(
            got.stats.tokens_per_expert, want.stats.tokens_per_expert,
            "{dtype:?}"
        );
        let d = diff(&got.y.to_dtype(DType::F64).unwrap(), &want.y);
        assert!(d < tol, "{dtype:?}: output differs by {d:.2e}");
    }
}

mod common;

use common::{routing_differences, MOE};

/// A MoE model trains alike on one rank and on data- and pipeline-parallel layouts, with ZeRO
/// and recompute (tolerances of `tests/parallel.rs`: the same sums in another order), and every
/// layout reports the same routing.
#[test]
fn moe_layouts_equal_the_single_rank_run() {
    let base = common::run(MOE);
    let first = base.records[0].moe.as_ref().unwrap();
    assert_eq!(first.layers.len(), 4);
    assert!(
        first.load_balancing >= 1.9 && first.max_over_mean >= 1.0,
        "{first:?}"
    );
    assert!(base
        .weights
        .contains_key("model.layers.3.block_sparse_moe.experts.3.w2.weight"));
    let mut failures = Vec::new();
    for layout in [
        "parallel.dp=2",
        "parallel.dp=2,parallel.zero=1",
        "parallel.dp=2,parallel.zero=3",
        "parallel.pp=2",
        "parallel.pp=2,parallel.virtual_stages=2",
        "parallel.dp=2,parallel.pp=2,parallel.zero=1",
        "train.recompute=full",
    ] {
        let set = format!("{MOE},{layout}");
        let other = common::run(&set);
        let d = common::compare(&set, &base, &other);
        failures.extend(routing_differences(layout, &base, &other));
        common::assert_equivalent(&set, d);
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Experts that no token of a micro-batch chose get no gradient there, and training goes on
/// (32 experts, top-1: some experts stay idle in some micro-batches of the first steps).
#[test]
fn idle_experts_are_allowed() {
    let out = common::run(
        "model.num_local_experts=32,model.num_experts_per_tok=1,model.intermediate_size=48,model.norm_topk_prob=false",
    );
    let idle = out
        .records
        .iter()
        .flat_map(|r| &r.moe.as_ref().unwrap().layers)
        .filter(|l| l.min_over_mean == 0.0)
        .count();
    assert!(
        idle > 0,
        "every expert got tokens in every step: the case is not exercised"
    );
    assert!(out.records.iter().all(|r| r.loss.is_finite()));
}

/// MoE settings are checked by name: without experts, with an impossible top-k, a dense layer
/// that does not exist, a layout that does not split MoE layers yet, or expert parallelism that
/// does not divide the data-parallel ranks or the experts.
#[test]
fn bad_moe_settings_are_refused_by_name() {
    let cases = [
        (
            "model.num_experts_per_tok=2",
            "model.num_experts_per_tok is a mixture-of-experts setting",
        ),
        (
            "model.num_local_experts=4,model.num_experts_per_tok=5",
            "must be between 1 and model.num_local_experts (4)",
        ),
        (
            "model.num_local_experts=1",
            "model.num_local_experts (1) must be at least 2",
        ),
        (
            "model.num_local_experts=4,model.mlp_only_layers=[7]",
            "names layer 7",
        ),
        (
            "model.num_local_experts=4,model.router_aux_loss_coef=-1",
            "router_aux_loss_coef (-1) must be",
        ),
        (
            "model.num_local_experts=4,parallel.cp=2",
            "parallel.cp = 2 with mixture-of-experts",
        ),
        (
            "model.num_local_experts=4,parallel.dp=3,parallel.ep=2",
            "parallel.ep (2) must divide parallel.dp (3)",
        ),
        (
            "model.num_local_experts=6,parallel.dp=4,parallel.ep=4",
            "parallel.ep (4) must divide model.num_local_experts (6)",
        ),
        (
            "parallel.dp=2,parallel.ep=2",
            "parallel.ep = 2 needs mixture-of-experts layers",
        ),
        (
            "model.num_local_experts=4,parallel.dp=4,parallel.ep=2,parallel.zero=1,parallel.zero_shard_size=2",
            "expert parallelism runs without hybrid sharding",
        ),
        ("model.num_local_experts=4,parallel.ep=0", "parallel.ep must be at least 1"),
        (
            "model.num_local_experts=4,model.moe_expert_capacity_factor=0",
            "model.moe_expert_capacity_factor (0) must be a number > 0",
        ),
        (
            "model.num_local_experts=4,model.moe_expert_capacity_factor=1.5,parallel.tp=2,parallel.sequence_parallel=true",
            "model.moe_expert_capacity_factor with parallel.sequence_parallel",
        ),
        (
            "model.moe_expert_capacity_factor=1.5",
            "model.moe_expert_capacity_factor is a mixture-of-experts setting",
        ),
    ];
    for (set, want) in cases {
        let e = pretrain::recipe::load(
            std::path::Path::new("recipes/tiny.yaml"),
            &[set.to_string()],
        )
        .map(|_| ())
        .unwrap_err();
        let e = format!("{e:#}");
        assert!(e.contains(want), "{set}: wanted {want:?} in {e}");
    }
    let ok = pretrain::recipe::load(std::path::Path::new("recipes/tiny-moe.yaml"), &[]).unwrap();
    assert_eq!(ok.model.moe().unwrap().top_k, 4);
}
