//! `optimizer.name: muon` under every layout: the Newton-Schulz iteration runs on each whole
//! matrix whatever shards it, on one rank of the group that holds it (replicated or sharded), so
//! data and tensor parallelism, ZeRO 0, 1 and 3, pipelines and expert parallelism train like
//! one rank (the tolerances of tests/parallel.rs); resume is bit-identical
//! and continues at another layout; switching optimizer on resume needs
//! `checkpoint.accept_changes: [optimizer]`.

use std::path::Path;

use pretrain::recipe::load;
use pretrain::train::{train, RunOutput};

mod common;
use common::{assert_equivalent, compare, run, MOE};

const MUON: &str = "optimizer.name=muon";

#[test]
fn muon_layouts_equal_the_single_rank_run() {
    let base = run(MUON);
    // Muon moves a hidden matrix unlike AdamW (the comparison below could not pass by chance).
    let adamw = run("parallel.dp=1");
    let q = "model.layers.0.self_attn.q_proj.weight";
    let moved = base.weights[q]
        .iter()
        .zip(&adamw.weights[q])
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(moved > 1e-3, "muon and adamw end {moved:.2e} apart");
    for layout in [
        "parallel.tp=2",
        // Replicated state (ZeRO 0): each matrix orthogonalised by one rank and broadcast.
        "parallel.dp=2",
        "parallel.dp=2,parallel.tp=2,parallel.sequence_parallel=true",
        "parallel.dp=2,parallel.tp=2,parallel.sequence_parallel=true,parallel.zero=1",
        "parallel.dp=2,parallel.tp=2,parallel.sequence_parallel=true,parallel.zero=3",
        // Owners spread over four shards, with small buckets that cut through matrices.
        "parallel.dp=4,parallel.zero=1,parallel.bucket_size=20000",
        "parallel.pp=2",
        "parallel.pp=2,parallel.virtual_stages=2,parallel.dp=2,parallel.zero=2",
        // Stages holding only the embedding or the head: no hidden matrix, nothing for Muon.
        "parallel.pp=4,parallel.pipeline_layout=[0, 2, 2, 0]",
    ] {
        let other = run(&format!("{MUON},{layout}"));
        assert_equivalent(layout, compare(layout, &base, &other));
    }
    let moe_base = run(&format!("{MUON},{MOE}"));
    for layout in [
        "parallel.dp=2,parallel.ep=2",
        "parallel.dp=4,parallel.ep=2,parallel.zero=1",
        "parallel.dp=2,parallel.ep=2,parallel.tp=2,parallel.sequence_parallel=true,parallel.zero=3",
    ] {
        let other = run(&format!("{MUON},{MOE},{layout}"));
        assert_equivalent(layout, compare(layout, &moe_base, &other));
    }
}

fn run_in(dir: &Path, extra: &[&str]) -> anyhow::Result<RunOutput> {
    let mut o = vec![format!(
        "train.steps=6,schedule.warmup_steps=1,train.eval_interval=0,train.global_batch=16,train.micro_batch=4,run.dir={}",
        dir.display()
    )];
    o.extend(extra.iter().map(|s| s.to_string()));
    let recipe = load(Path::new("recipes/tiny.yaml"), &o).unwrap();
    train(recipe, true)
}

#[test]
fn muon_resumes_bit_identically_and_a_switch_must_be_accepted() {
    for layout in [
        "parallel.dp=1",
        "parallel.dp=2,parallel.tp=2,parallel.sequence_parallel=true,parallel.zero=3",
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let full = run_in(
            &tmp.path().join("a"),
            &[MUON, layout, "checkpoint.interval=3"],
        )
        .unwrap();
        let step3 = tmp.path().join("a/checkpoints/step-00000003");
        let resume = format!("checkpoint.resume={}", step3.display());
        let resumed = run_in(&tmp.path().join("b"), &[MUON, layout, &resume]).unwrap();
        let losses = |r: &RunOutput| -> Vec<f64> { r.records.iter().map(|x| x.loss).collect() };
        assert_eq!(losses(&resumed), losses(&full)[3..].to_vec(), "{layout}");
        assert_eq!(resumed.weights, full.weights, "{layout}: final weights");
        if layout != "parallel.dp=1" {
            continue;
        }
        // The hidden matrices carry Muon's momentum, the rest AdamW's moments.
        let ck = ckpt::Checkpoint::open(&step3).unwrap();
        let q = "model.layers.0.self_attn.q_proj.weight";
        assert!(ck.has(ckpt::Kind::Momentum, q) && !ck.has(ckpt::Kind::ExpAvg, q));
        let e = "model.embed_tokens.weight";
        assert!(ck.has(ckpt::Kind::ExpAvgSq, e) && !ck.has(ckpt::Kind::Momentum, e));
        // Switching to AdamW is refused, and accepted when asked for.
        let Err(e) = run_in(&tmp.path().join("c"), &[layout, &resume]) else {
            panic!("switching optimizer on resume was not refused");
        };
        let e = format!("{e:#}");
        assert!(
            e.contains("optimizer.name muon, the recipe has adamw")
                && e.contains("accept_changes: [optimizer]"),
            "{e}"
        );
        // Layout-free: the one-rank checkpoint continues at dp 2 × tp 2 + SP with ZeRO-3 on
        // the same curve (tests/parallel.rs's loss bound).
        let moved = run_in(
            &tmp.path().join("e"),
            &[
                MUON,
                "parallel.dp=2,parallel.tp=2,parallel.sequence_parallel=true,parallel.zero=3",
                &resume,
            ],
        )
        .unwrap();
        for (a, b) in losses(&moved).iter().zip(&losses(&full)[3..]) {
            assert!(
                (a - b).abs() / b < 1e-6,
                "resumed at another layout: {a} vs {b}"
            );
        }
        let switched = run_in(
            &tmp.path().join("d"),
            &[layout, &resume, "checkpoint.accept_changes=[optimizer]"],
        )
        .unwrap();
        assert_eq!(switched.records.len(), 3);
        assert!(switched.records.iter().all(|r| r.loss.is_finite()));
    }
}

/// Muon updates exactly the hidden projection matrices: attention's q, k, v and o, the MLP's
/// gate, up and down, and every expert's w1, w2 and w3; never the embedding, the output matrix,
/// the norms or a router.
#[test]
fn muon_selects_exactly_the_hidden_projection_matrices() {
    const HIDDEN: [&str; 10] = [
        ".q_proj.weight",
        ".k_proj.weight",
        ".v_proj.weight",
        ".o_proj.weight",
        ".gate_proj.weight",
        ".up_proj.weight",
        ".down_proj.weight",
        ".w1.weight",
        ".w2.weight",
        ".w3.weight",
    ];
    for recipe in ["recipes/tiny.yaml", "recipes/tiny-moe.yaml"] {
        let c = load(Path::new(recipe), &[]).unwrap().model;
        let layers: Vec<usize> = (0..c.num_hidden_layers).collect();
        let inventory = model::Inventory::new(&c, &layers, true, true);
        let flags = inventory.hidden_matrices();
        assert_eq!(flags.len(), inventory.params.len());
        for (p, &hidden) in inventory.params.iter().zip(&flags) {
            let want = HIDDEN.iter().any(|s| p.name.ends_with(s));
            assert_eq!(hidden, want, "{recipe}: {}", p.name);
        }
    }
}
