//! The mixture-of-experts layer against two independent references, in f64:
//! - finite differences of `Σ y·c + router losses` for every input and weight element;
//! - a dense reference written with candle's primitive ops that runs every expert on every token
//!   and keeps the top-k with a mask (no permutation, no grouping).
//!
//! And a MoE model trained on data- and pipeline-parallel layouts against one rank.

use candle_core::{DType, Device, Tensor, Var};
use model::moe::{self, Expert, Router};
use model::{CapacityPolicy, MoeConfig};
use parallel::ep::ExpertParallel;
use parallel::tp::TensorParallel;

#[path = "moe/capacity.rs"]
mod capacity;
mod common;

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
        capacity_policy: CapacityPolicy::Probs,
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

/// The layer's forward on inputs `v` (`x`, router, then each expert's three weights) on one rank,
/// with the selection `bias` and the balancing losses at weight 1 in the objective.
fn layer(
    v: &[Tensor],
    cfg: &MoeConfig,
    index: usize,
    bias: Option<&[f32]>,
) -> (Tensor, moe::LayerStats, moe::MoeTape) {
    let router = Router {
        weight: &v[1],
        bias,
    };
    let (ep, tp) = (ExpertParallel::single(), TensorParallel::single());
    moe::forward(&v[0], &router, &experts(v), &ep, &tp, cfg, index, 1.0).unwrap()
}

/// The balancing losses' weighted sum, from the layer's statistics.
fn aux(stats: &moe::LayerStats, cfg: &MoeConfig) -> f64 {
    cfg.aux_loss_coef * stats.load_balancing().unwrap() + cfg.z_loss_coef * stats.z_loss().unwrap()
}

/// The weights `c` of the objective `Σ y·c + aux`.
fn weights(seed: u64) -> Tensor {
    Tensor::from_vec(values(N * H, seed, 1.0), (N, H), &Device::Cpu).unwrap()
}

/// The hand-written backward's gradients of `Σ y·c + aux` for every input of `v` (`None` for an
/// expert no token chose).
fn hand_written(v: &[Tensor], cfg: &MoeConfig, bias: Option<&[f32]>) -> Vec<Option<Tensor>> {
    let (_, _, tape) = layer(v, cfg, 0, bias);
    let g = moe::backward(
        tape,
        &v[1],
        &experts(v),
        &ExpertParallel::single(),
        &weights(99),
    )
    .unwrap();
    let mut out = vec![Some(g.dx), Some(g.router)];
    for e in g.experts {
        match e {
            Some(ws) => out.extend(ws.map(|w| Some(w.into_tensor().unwrap()))),
            None => out.extend([None, None, None]),
        }
    }
    out
}

#[test]
fn gradients_match_finite_differences() {
    // Renormalised or not, and with a capacity of 3 pairs per expert (of 6 on average), each
    // keeping its most probable pairs, its first, or its first with its rows padded.
    use CapacityPolicy::{Padded, Position, Probs};
    let cases = [
        (true, None, Probs),
        (false, None, Probs),
        (true, Some(0.5), Probs),
        (true, Some(0.5), Position),
        (false, Some(0.5), Padded),
    ];
    for (norm, capacity, policy) in cases {
        let cfg = MoeConfig {
            capacity_factor: capacity,
            capacity_policy: policy,
            ..config(norm)
        };
        let tensors: Vec<Tensor> = inputs().iter().map(|v| v.as_tensor().clone()).collect();
        let objective = |t: &[Tensor]| {
            let (y, stats, _) = layer(t, &cfg, 0, None);
            (y * weights(99))
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
                + aux(&stats, &cfg)
        };
        let grads = hand_written(&tensors, &cfg, None);
        let eps = 1e-6;
        let mut worst = 0f64;
        for (i, var) in tensors.iter().enumerate() {
            let analytic = grads[i]
                .as_ref()
                .map(|g| g.flatten_all().unwrap().to_vec1::<f64>().unwrap())
                .unwrap_or_else(|| vec![0.0; var.elem_count()]);
            let base = var.flatten_all().unwrap().to_vec1::<f64>().unwrap();
            for j in 0..base.len() {
                let at = |d: f64| {
                    let mut w = base.clone();
                    w[j] += d;
                    let mut t = tensors.clone();
                    t[i] = Tensor::from_vec(w, var.shape(), &Device::Cpu).unwrap();
                    objective(&t)
                };
                let numeric = (at(eps) - at(-eps)) / (2.0 * eps);
                let err = (numeric - analytic[j]).abs() / analytic[j].abs().max(1.0);
                worst = worst.max(err);
                assert!(
                    err < 1e-6,
                    "norm_topk_prob={norm} capacity {capacity:?} {policy:?} input {i} element \
                     {j}: finite difference {numeric}, hand-written {}",
                    analytic[j]
                );
            }
        }
        eprintln!(
            "norm_topk_prob={norm} capacity {capacity:?} {policy:?}: worst gradient error \
             {worst:.2e}"
        );
    }
}

/// Largest absolute difference of two f64 tensors of one shape.
fn diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b)
        .and_then(|d| d.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>())
        .unwrap()
}

/// The layer against the dense masked reference (`common::reference::dense_moe`), in f64: the
/// same output and balancing losses, and the hand-written backward's gradients of `Σ y·c + aux`
/// equal autograd's over the reference for the input, the router and every expert —
/// renormalised or not, with an idle expert (a selection bias keeps every token away from it).
/// Only the order of some sums differs (a token's slots are added by one `index_add`), hence
/// 1e-12 rather than bit equality.
#[test]
fn equals_the_dense_masked_reference() {
    for norm in [true, false] {
        for idle in [false, true] {
            let cfg = config(norm);
            let bias = [0.0, 0.0, 0.0, -10.0];
            let bias = idle.then_some(&bias[..]);
            let case = format!("norm_topk_prob={norm} idle {idle}");
            let vars = inputs();
            let t: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
            let (y, stats, _) = layer(&t, &cfg, 3, bias);
            let ex: Vec<[&Tensor; 3]> = vars[2..]
                .chunks(3)
                .map(|w| [w[0].as_tensor(), w[1].as_tensor(), w[2].as_tensor()])
                .collect();
            let (y_ref, aux_ref) = common::reference::dense_moe(
                vars[0].as_tensor(),
                vars[1].as_tensor(),
                bias,
                &ex,
                &cfg,
            )
            .unwrap();
            assert!(diff(&y, &y_ref) < 1e-12, "{case}: output");
            let aux_ref_value = aux_ref.to_scalar::<f64>().unwrap();
            assert!(
                (aux(&stats, &cfg) - aux_ref_value).abs() < 1e-12,
                "{case}: router losses"
            );
            assert_eq!(stats.layer, 3);
            assert_eq!(
                stats.tokens_per_expert().unwrap().iter().sum::<u64>(),
                (N * K) as u64
            );
            if idle {
                assert_eq!(stats.tokens_per_expert().unwrap()[3], 0, "expert 3 is idle");
            }
            let objective = ((y_ref * weights(99)).unwrap().sum_all().unwrap() + aux_ref).unwrap();
            let want = objective.backward().unwrap();
            for (i, (v, got)) in vars.iter().zip(hand_written(&t, &cfg, bias)).enumerate() {
                let Some(got) = got else {
                    assert!(idle && i >= 2 + 3 * 3, "{case}: input {i} got no gradient");
                    continue;
                };
                let d = diff(&got, want.get(v.as_tensor()).unwrap());
                assert!(d < 1e-12, "{case} input {i}: gradients differ by {d:.2e}");
            }
        }
    }
}

/// The layer in f32 and bf16 follows the f64 layer (same routing on these inputs).
#[test]
fn lower_precision_follows_f64() {
    let cfg = config(true);
    let t: Vec<Tensor> = inputs().iter().map(|v| v.as_tensor().clone()).collect();
    let want = layer(&t, &cfg, 0, None);
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 5e-2)] {
        let low: Vec<Tensor> = t.iter().map(|x| x.to_dtype(dtype).unwrap()).collect();
        let got = layer(&low, &cfg, 0, None);
        assert_eq!(got.0.dtype(), dtype);
        assert_eq!(
            got.1.tokens_per_expert().unwrap(),
            want.1.tokens_per_expert().unwrap(),
            "{dtype:?}"
        );
        let d = diff(&got.0.to_dtype(DType::F64).unwrap(), &want.0);
        assert!(d < tol, "{dtype:?}: output differs by {d:.2e}");
    }
}

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
        (
            "model.num_local_experts=4,model.moe_capacity_policy=padded",
            "model.moe_capacity_policy is a capacity setting",
        ),
        (
            "model.num_local_experts=8193,model.moe_expert_capacity_factor=1,model.moe_capacity_policy=padded",
            "at most 8192 experts, not 8193",
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
