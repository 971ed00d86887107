//! Every parallel layout trains like one rank: ranks are threads sharing the local communicator,
//! and the loss curve and final weights of each layout are compared with the single-rank run.
//!
//! Tolerance: the layouts compute the same sums in a different order (tensor-parallel partial
//! matmuls added by an all-reduce, data-parallel gradients summed across ranks, vocab-parallel
//! log-sum-exp from partial sums), so results differ by f32 rounding, about 1e-7 relative.
//! - Losses: measured ≤ 1.1e-7 relative; asserted < 1e-6.
//! - Weights: Adam's early updates are `lr · g / (|g| + ε)`, so for the few elements whose gradient
//!   is near zero the rounding noise of `g` is amplified up to a fraction of `lr` (3e-3 here):
//!   measured max 8.6e-5 (tensor parallel) and 7.6e-7 (data parallel), asserted < 3e-4 = lr / 10.
//!   The mean absolute difference stays tiny (measured ≤ 4e-8; asserted < 2e-7).
//! - Reported gradient norms: at step 1 (same weights) measured ≤ 1.3e-8 relative, asserted
//!   < 1e-6; later steps inherit the weights' drift (measured ≤ 1.3e-5, asserted < 1e-4). Counting
//!   tensor-parallel replicas twice moves step 1's norm by 3.9e-5.
//!
//! A real error (a missing all-reduce, a wrong shard, a gradient counted twice, a mis-sliced
//! initialisation) moves losses by 1e-3 or more and a whole tensor's weights by O(lr): both bounds
//! catch it.

use std::collections::BTreeMap;
use std::path::Path;

use pretrain::recipe::load;
use pretrain::train::train;

mod common;
use common::{assert_equivalent, compare, run};

#[test]
fn parallel_layouts_equal_the_single_rank_run() {
    let base = run("parallel.dp=1");
    let mut results = BTreeMap::new();
    for layout in [
        "parallel.tp=2",
        "parallel.tp=4",
        "parallel.dp=2",
        // Small buckets: several per rank, reduce-scattered as they become final.
        "parallel.dp=2,parallel.zero=1,parallel.bucket_size=65536",
        "parallel.dp=2,parallel.tp=2,parallel.sequence_parallel=true",
        "parallel.dp=4,parallel.zero=1",
        // Hybrid sharding: ZeRO-1 within pairs of data-parallel ranks, replicated across pairs.
        "parallel.dp=4,parallel.zero=1,parallel.zero_shard_size=2",
        "parallel.pp=2",
        "parallel.pp=4",
        "parallel.pp=2,parallel.virtual_stages=2",
        // The full 3D layout with small buckets: buckets of later chunks are reduced during the
        // interleaved cool-down, the one holding the tied embedding after the schedule.
        "parallel.dp=2,parallel.tp=2,parallel.pp=2,parallel.virtual_stages=2,parallel.sequence_parallel=true,parallel.zero=1,parallel.bucket_size=65536",
    ] {
        results.insert(layout, compare(layout, &base, &run(layout)));
    }
    for (layout, result) in results {
        assert_equivalent(layout, result);
    }
}

/// Uneven pipeline stages (`parallel.pipeline_layout`) compute the same pieces in the same order
/// as the even ones: the losses equal the even layout's bit for bit, and the runs equal one rank
/// (the 4-layer tiny model as [1, 3] and [3, 1] on pp 2; at pp 4 and at pp 2 × v 2 with an end
/// chunk holding only the embedding or the head).
#[test]
fn uneven_pipeline_layouts_train_like_the_even_one() {
    let base = run("parallel.dp=1");
    let even = run("parallel.pp=2");
    for layout in [
        "parallel.pp=2,parallel.pipeline_layout=[1, 3]",
        "parallel.pp=2,parallel.pipeline_layout=[3, 1]",
        "parallel.pp=4,parallel.pipeline_layout=[0, 2, 2, 0]",
        "parallel.pp=2,parallel.virtual_stages=2,parallel.pipeline_layout=[0, 2, 1, 1]",
    ] {
        let uneven = run(layout);
        assert_equivalent(layout, compare(layout, &base, &uneven));
        if layout.starts_with("parallel.pp=2,parallel.pipeline") {
            let losses = |r: &pretrain::train::RunOutput| -> Vec<f64> {
                r.records.iter().map(|x| x.loss).collect()
            };
            assert_eq!(losses(&uneven), losses(&even), "{layout}");
        }
    }
    let bad = |set: &str| {
        let o = vec![format!("parallel.pp=2,{set}")];
        load(Path::new("recipes/tiny.yaml"), &o)
            .unwrap_err()
            .to_string()
    };
    let e = bad("parallel.pipeline_layout=[1, 2]");
    assert!(
        e.contains("holds 3 layers; model.num_hidden_layers is 4"),
        "{e}"
    );
    let e = bad("parallel.pipeline_layout=[1, 1, 2]");
    assert!(e.contains("has 3 entries") && e.contains("= 2"), "{e}");
    let e = bad("parallel.pp=3,parallel.pipeline_layout=[2, 0, 2]");
    assert!(e.contains("parallel.pipeline_layout[1] is 0"), "{e}");
}

/// A head dimension other than hidden / heads (query projection 8 × 32 = 256 wide on a 128-wide
/// model) with Llama 3 RoPE scaling trains alike on one rank and on tp 2 with SP, and learns.
#[test]
fn explicit_head_dim_and_rope_scaling_shard_like_any_model() {
    let model = "model.head_dim=32,model.rope_theta=500000.0,model.rope_scaling.rope_type=llama3,model.rope_scaling.factor=8.0,model.rope_scaling.low_freq_factor=1.0,model.rope_scaling.high_freq_factor=4.0,model.rope_scaling.original_max_position_embeddings=32";
    let base = run(model);
    assert_eq!(
        base.weights["model.layers.0.self_attn.o_proj.weight"].len(),
        128 * 8 * 32
    );
    assert!(
        base.records[2].loss < base.records[0].loss,
        "{:?}",
        base.records.iter().map(|r| r.loss).collect::<Vec<_>>()
    );
    let layout = format!("{model},parallel.tp=2,parallel.sequence_parallel=true");
    assert_equivalent(&layout, compare(&layout, &base, &run(&layout)));
}

#[test]
fn a_failing_rank_stops_every_other_rank_with_an_error_naming_it() {
    use std::time::{Duration, Instant};

    use pretrain::train::{RankCtx, Trainer};

    let o = vec![
        "train.steps=2,schedule.warmup_steps=1,train.eval_interval=0,parallel.dp=2,parallel.tp=2"
            .to_string(),
    ];
    let recipe = load(Path::new("recipes/tiny.yaml"), &o).unwrap();
    let timeout = Duration::from_secs(60);
    let start = Instant::now();
    let peers: std::sync::Mutex<Vec<String>> = Default::default();
    let err = parallel::comm::local::run_local(4, timeout, |rank, comm| {
        let ctx = RankCtx::open(&recipe.parallel, rank, comm, candle_core::Device::Cpu).unwrap();
        let mut trainer = Trainer::new(recipe.clone(), ctx, false).unwrap();
        if rank == 1 {
            // The others are inside their first step, blocked on a collective with this rank.
            std::thread::sleep(Duration::from_millis(300));
            return Err::<(), _>(candle_core::Error::Msg(
                "injected failure in rank 1's step".into(),
            ));
        }
        let e = trainer
            .train_step()
            .expect_err("a peer failed: the step must fail");
        peers.lock().unwrap().push(format!("{e:#}"));
        Err(candle_core::Error::Msg(format!("{e:#}")))
    })
    .expect_err("the job must fail");
    assert!(
        start.elapsed() < timeout / 4,
        "errors must arrive promptly, not at the timeout"
    );
    assert!(
        format!("{err}").contains("rank 1") && format!("{err:?}").contains("injected failure"),
        "{err:?}"
    );
    let peers = peers.into_inner().unwrap();
    assert_eq!(peers.len(), 3);
    for p in peers {
        assert!(
            p.contains("rank 1 failed") && p.contains("injected failure"),
            "{p}"
        );
    }
}

#[test]
fn a_pipeline_run_writes_a_perfetto_trace_with_every_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let o = vec![format!(
        "train.steps=2,schedule.warmup_steps=1,train.eval_interval=0,parallel.pp=2,parallel.virtual_stages=2,parallel.dp=2,run.trace_step=2,run.dir={}",
        tmp.path().display()
    )];
    let out = train(load(Path::new("recipes/tiny.yaml"), &o).unwrap(), false).unwrap();
    let bubble = out.records[1]
        .time
        .bubble
        .expect("the traced step reports its bubble");
    assert!((0.0..1.0).contains(&bubble), "{bubble}");
    let overlap = out.records[1]
        .time
        .sync_overlap
        .expect("with dp = 2 the traced step reports its gradient sync");
    assert!((0.0..=1.0).contains(&overlap), "{overlap}");
    assert!(out.records[1].time.sync_exposed_s.is_some_and(|s| s >= 0.0));
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("trace.json")).unwrap())
            .unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let spans: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    // 4 ranks; each runs 2 chunks × 2 micro-batches forward and backward, plus the optimizer.
    for rank in 0..4 {
        let mine: Vec<&&serde_json::Value> = spans.iter().filter(|e| e["tid"] == rank).collect();
        let names: Vec<&str> = mine.iter().map(|e| e["name"].as_str().unwrap()).collect();
        assert_eq!(
            names.iter().filter(|n| n.starts_with("F ")).count(),
            4,
            "rank {rank}: {names:?}"
        );
        assert_eq!(
            names.iter().filter(|n| n.starts_with("B ")).count(),
            4,
            "rank {rank}: {names:?}"
        );
        assert!(
            names.contains(&"optimizer") && names.iter().any(|n| n.starts_with("send")),
            "rank {rank}: {names:?}"
        );
        // Each rank's data-parallel bucket reductions, on a row of their own.
        let sync: Vec<&&serde_json::Value> =
            spans.iter().filter(|e| e["tid"] == 4 + rank).collect();
        assert!(
            !sync.is_empty()
                && sync
                    .iter()
                    .all(|e| e["name"].as_str().unwrap().starts_with("dp reduce")),
            "rank {rank}: {sync:?}"
        );
    }
    let rows: Vec<&str> = events
        .iter()
        .filter(|e| e["ph"] == "M")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert!(
        rows.contains(&"rank 3") && rows.contains(&"rank 3 dp sync"),
        "{rows:?}"
    );
}

/// `--gpus N` keeps the recipe's model, batch and optimizer and takes the planner's layout for N
/// devices (thread ranks here): that layout trains like one rank; the binary says what the recipe
/// asked and what runs instead, records the layout it ran in `recipe.yaml`, and for a count no
/// layout uses names the fewest devices that would do.
#[test]
fn training_on_n_devices_takes_the_planners_layout_and_trains_like_one_rank() {
    use pretrain::plan::choose::{choose, Keep};
    use pretrain::plan::Hardware;
    let o = vec!["train.steps=3,schedule.warmup_steps=1,train.eval_interval=0,train.global_batch=16,train.micro_batch=4".to_string()];
    let recipe = load(Path::new("recipes/tiny.yaml"), &o).unwrap();
    let hw = Hardware::found(&recipe, 4);
    let choice = choose(&recipe, &[4], 4, &hw, Keep::Run).expect("a layout for 4 ranks");
    assert_eq!(choice.world, 4);
    let layout = choice.overrides();
    assert_equivalent(
        &layout,
        compare(&layout, &run("parallel.dp=1"), &run(&layout)),
    );

    let tmp = tempfile::tempdir().unwrap();
    let set = format!("{},run.dir={}", o[0], tmp.path().display());
    let out = common::cli::bin()
        .args([
            "--recipe",
            "recipes/tiny.yaml",
            "--gpus",
            "4",
            "--set",
            &set,
        ])
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    let text = common::cli::text(&out);
    assert!(out.status.success(), "{text}");
    let said = format!(
        "--gpus 4: the recipe asks for dp1 tp1 pp1 z0 mb4 on 1 ranks; running {} on 4 ranks instead",
        choice.layout
    );
    assert!(text.contains(&said), "{said}\n{text}");
    let ran = std::fs::read_to_string(tmp.path().join("recipe.yaml")).unwrap();
    let ran: pretrain::recipe::Recipe = serde_yaml::from_str(&ran).unwrap();
    assert_eq!(pretrain::plan::Layout::of(&ran), choice.layout);

    // Five ranks split the tiny model no way (a batch of 16, 4 layers, 8 heads).
    let out = common::cli::bin()
        .args([
            "--recipe",
            "recipes/tiny.yaml",
            "--gpus",
            "5",
            "--set",
            &set,
        ])
        .output()
        .unwrap();
    let text = common::cli::text(&out);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("--gpus 5: no layout of recipes/tiny.yaml uses 5 devices"),
        "{text}"
    );
    assert!(text.contains("the fewest that fit: --gpus 6"), "{text}");
}
