//! The zero-bubble schedules, `parallel.schedule: zb-h1 | zbv`: split backwards whose weight
//! actions run later. Each parameter still receives its micro-batches' gradients in the same
//! order, so a zb-h1 run equals the 1F1B run of the same layout bit for bit (losses, reported
//! gradient norms, weights); a zbv run (its V keeps the tied embedding's two uses on the first
//! stage, its order is fitted to measured costs from the second step) equals the same layout
//! without a pipeline and one rank within tests/parallel.rs's tolerances. With tensor,
//! sequence, context, data (ZeRO 1 and 3) and expert parallelism, uneven stages and recompute;
//! resume is bit-identical (zbv's fitted order travels in the checkpoint); a schedule that does
//! not fit the layout is refused by field.

use std::path::Path;

use pretrain::recipe::load;
use pretrain::train::{train, RunOutput};

mod common;
use common::{assert_equivalent, compare, run, MOE};

const ZB: &str = "parallel.schedule=zb-h1";

fn losses(r: &RunOutput) -> Vec<f64> {
    r.records.iter().map(|x| x.loss).collect()
}

fn norms(r: &RunOutput) -> Vec<f64> {
    r.records.iter().map(|x| x.grad_norm).collect()
}

/// zb-h1 at `layout` equals 1F1B at `layout` bit for bit, and one rank (`base`) within the
/// layout tolerances.
fn check(base: &RunOutput, layout: &str) {
    let zb = run(&format!("{layout},{ZB}"));
    let ofob = run(layout);
    assert_eq!(losses(&zb), losses(&ofob), "{layout}: losses");
    assert_eq!(norms(&zb), norms(&ofob), "{layout}: gradient norms");
    assert_eq!(zb.weights, ofob.weights, "{layout}: weights");
    assert_equivalent(layout, compare(layout, base, &zb));
}

#[test]
fn zero_bubble_h1_trains_like_1f1b_and_one_rank() {
    let base = run("parallel.dp=1");
    // Stages defer what fits in 1F1B's memory (`zb_h1_defers_what_fits_in_1f1b_memory`): the
    // layouts below defer up to [0, 1, 2, 0] (pp 4), [0, 0, 1, 3] (pp 4 with the end stages
    // holding only the embedding and the head) and [0, 1] (pp 2 as [3, 1]).
    let short = "parallel.pp=2,parallel.pipeline_layout=[3, 1]";
    for layout in [
        "parallel.pp=2".to_string(),
        "parallel.pp=4".into(),
        short.into(),
        format!("{short},parallel.tp=2,parallel.sequence_parallel=true"),
        "parallel.pp=4,parallel.tp=2,parallel.sequence_parallel=true".into(),
        format!("{short},parallel.dp=2,parallel.zero=1,parallel.bucket_size=65536"),
        format!("{short},parallel.dp=2,parallel.zero=3"),
        format!("{short},parallel.cp=2"),
        "parallel.pp=4,parallel.pipeline_layout=[0, 2, 2, 0]".into(),
        format!("{short},train.recompute=full"),
    ] {
        check(&base, &layout);
    }
    let moe = run(MOE);
    check(&moe, &format!("{MOE},{short},parallel.dp=2,parallel.ep=2"));
}

const ZBV: &str = "parallel.schedule=zbv,parallel.virtual_stages=2";

/// zbv at `pipeline` on top of `layout` equals `layout` without a pipeline and one rank
/// (`base`) within the layout tolerances.
fn check_v(base: &RunOutput, layout: &str, pipeline: &str) -> RunOutput {
    let zbv = run(&format!("{layout},{pipeline},{ZBV}"));
    let flat = run(layout);
    let name = format!("{layout},{pipeline}");
    assert_equivalent(&name, compare(&name, &flat, &zbv));
    assert_equivalent(&name, compare(&name, base, &zbv));
    zbv
}

#[test]
fn zbv_trains_like_the_layout_without_a_pipeline() {
    let base = run("parallel.dp=1");
    for layout in [
        "parallel.dp=1",
        "parallel.tp=2,parallel.sequence_parallel=true",
        "parallel.dp=2,parallel.zero=1,parallel.bucket_size=65536",
        "parallel.dp=2,parallel.zero=3",
        "parallel.cp=2",
        "train.recompute=full",
    ] {
        check_v(&base, layout, "parallel.pp=2");
    }
    // pp 4 × 2 chunks of an 8-layer model, evenly and with the end chunks holding only the
    // embedding and the head.
    let deep = "model.num_hidden_layers=8";
    let deep_base = run(deep);
    check_v(&deep_base, deep, "parallel.pp=4");
    let tp = format!("{deep},parallel.tp=2,parallel.sequence_parallel=true");
    check_v(&deep_base, &tp, "parallel.pp=4");
    check_v(
        &deep_base,
        deep,
        "parallel.pp=4,parallel.pipeline_layout=[0, 1, 1, 2, 2, 1, 1, 0]",
    );
    let moe = run(MOE);
    check_v(
        &moe,
        &format!("{MOE},parallel.dp=2,parallel.ep=2"),
        "parallel.pp=2",
    );
}

fn run_in(dir: &Path, extra: &[&str]) -> anyhow::Result<RunOutput> {
    let mut o = vec![format!(
        "train.steps=6,schedule.warmup_steps=1,train.eval_interval=0,train.global_batch=16,train.micro_batch=4,run.dir={}",
        dir.display()
    )];
    o.extend(extra.iter().map(|s| s.to_string()));
    let recipe = load(Path::new("recipes/tiny.yaml"), &o)?;
    train(recipe, true)
}

#[test]
fn zero_bubble_schedules_resume_bit_identically() {
    for (schedule, layout) in [
        (
            ZB,
            "parallel.pp=2,parallel.pipeline_layout=[3, 1],parallel.dp=2,parallel.zero=3",
        ),
        (ZBV, "parallel.pp=2,parallel.dp=2,parallel.zero=3"),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let at = [schedule, layout, "checkpoint.interval=3"];
        let full = run_in(&tmp.path().join("a"), &at).unwrap();
        let step3 = tmp.path().join("a/checkpoints/step-00000003");
        let resume = format!("checkpoint.resume={}", step3.display());
        let resumed = run_in(&tmp.path().join("b"), &[schedule, layout, &resume]).unwrap();
        assert_eq!(losses(&resumed), losses(&full)[3..].to_vec(), "{schedule}");
        assert_eq!(resumed.weights, full.weights, "{schedule}: final weights");
        // zbv's order was fitted to step 2's measured costs, which the checkpoint keeps for
        // the resumed run.
        let trainer = ckpt::Checkpoint::open(&step3)
            .unwrap()
            .manifest()
            .trainer
            .clone();
        let costs = &trainer["schedule_costs"];
        if schedule == ZBV {
            let c: Vec<f64> = serde_json::from_value(costs.clone()).unwrap();
            assert!(c.len() == 3 && c.iter().all(|&x| x > 0.0), "{trainer}");
        } else {
            assert!(costs.is_null(), "{trainer}");
        }
    }
}

#[test]
fn a_schedule_that_does_not_fit_the_layout_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let refused = |extra: &[&str]| -> String {
        match run_in(tmp.path(), extra) {
            Ok(_) => panic!("{extra:?} was accepted"),
            Err(e) => format!("{e:#}"),
        }
    };
    let e = refused(&["parallel.pp=2,parallel.virtual_stages=2", ZB]);
    assert!(
        e.contains("parallel.schedule zb-h1 runs one model chunk per stage")
            && e.contains("parallel.virtual_stages is 2"),
        "{e}"
    );
    let e = refused(&["parallel.pp=2,parallel.schedule=interleaved"]);
    assert!(
        e.contains("parallel.schedule interleaved needs parallel.virtual_stages >= 2"),
        "{e}"
    );
    let e = refused(&["parallel.pp=2,parallel.schedule=zbv"]);
    assert!(
        e.contains("parallel.schedule zbv runs two model chunks per stage")
            && e.contains("parallel.virtual_stages: 2, not 1"),
        "{e}"
    );
    let e = refused(&["parallel.pp=2,parallel.schedule=zb-v"]);
    assert!(e.contains("zb-v") && e.contains("zbv"), "{e}");
}

/// zb-h1 defers on each stage as many weight actions as keep it within 1F1B's peak
/// activations: on the tiny model at pp 2 the last stage, which holds the head's logits, defers
/// none when it holds half the layers, and one when it holds a quarter of them.
#[test]
fn zb_h1_defers_what_fits_in_1f1b_memory() {
    let recipe = |layout: &str| {
        let o = vec![format!(
            "train.global_batch=16,train.micro_batch=4,{ZB},{layout}"
        )];
        load(Path::new("recipes/tiny.yaml"), &o).unwrap()
    };
    let deferrals = |layout| pretrain::plan::memory::zb_h1_deferrals(&recipe(layout)).unwrap();
    assert_eq!(deferrals("parallel.pp=2"), vec![0, 0]);
    assert_eq!(
        deferrals("parallel.pp=2,parallel.pipeline_layout=[3, 1]"),
        vec![0, 1]
    );
}

/// zbv with empty first and last chunks (stage 0 holds little more than the embedding and the
/// head, so only later stages' caps are lowered) finds an order for every step size, within its
/// caps: the first stage used to fill its `2·pp` slots with first-chunk forwards while a lowered
/// stage held back the second chunk's inputs (from `m = 2·pp + 1` on).
#[test]
fn zbv_orders_a_layout_with_empty_end_chunks() {
    use parallel::pipeline;
    use pretrain::plan::memory;
    for layout in [
        "parallel.pp=2,parallel.pipeline_layout=[0, 2, 2, 0]",
        "parallel.pp=2,parallel.pipeline_layout=[0, 3, 1, 0]",
        "parallel.pp=2,parallel.pipeline_layout=[0, 2, 1, 1]",
        "parallel.pp=4,model.num_hidden_layers=8,parallel.pipeline_layout=[0, 1, 1, 2, 2, 1, 1, 0]",
    ] {
        for global_batch in [8, 16, 24, 32] {
            let o = vec![format!(
                "train.global_batch={global_batch},train.micro_batch=2,{ZBV},{layout}"
            )];
            let r = load(Path::new("recipes/tiny.yaml"), &o).unwrap();
            let ctx = format!("{layout} global_batch {global_batch}");
            let m = r.grad_accum_steps();
            let caps = memory::zbv_caps(&r).unwrap_or_else(|e| panic!("{ctx}: {e}"));
            let s = memory::schedule(&r, m).unwrap_or_else(|e| panic!("{ctx}: {e}"));
            pipeline::validate(&s).unwrap();
            pipeline::check_fifo(&s).unwrap();
            let sim = pipeline::simulate(&s, pipeline::SimCosts::default()).unwrap();
            for (st, (&peak, &cap)) in sim.peak_in_flight.iter().zip(&caps).enumerate() {
                assert!(peak <= cap, "{ctx}: stage {st} holds {peak} > {cap}");
            }
            memory::stages(&r).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        }
    }
}

/// The traced step shows each stage's weight actions as `W` spans (category `weight`), in the
/// order of the schedule: stage 1 of pp 2 (a quarter of the layers) runs micro-batch 0's W
/// after micro-batch 1's B.
#[test]
fn the_trace_shows_weight_actions() {
    let tmp = tempfile::tempdir().unwrap();
    let layout = "train.steps=2,parallel.pp=2,parallel.pipeline_layout=[3, 1],run.trace_step=2";
    let out = run_in(tmp.path(), &[layout, ZB]).unwrap();
    assert!(out.records[1]
        .time
        .bubble
        .is_some_and(|b| (0.0..1.0).contains(&b)));
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("trace.json")).unwrap())
            .unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    for rank in 0..2 {
        let names: Vec<&str> = events
            .iter()
            .filter(|e| e["ph"] == "X" && e["tid"] == rank)
            .map(|e| e["name"].as_str().unwrap())
            .collect();
        let weights: Vec<&&str> = names.iter().filter(|n| n.starts_with("W ")).collect();
        assert_eq!(weights.len(), 4, "rank {rank}: {names:?}");
        let at = |n: &str| names.iter().position(|x| *x == n).unwrap();
        if rank == 1 {
            assert!(at("W c0 m0") > at("B c0 m1"), "{names:?}");
        } else {
            assert!(at("W c0 m0") < at("B c0 m1"), "{names:?}");
        }
    }
    assert!(events
        .iter()
        .any(|e| e["cat"] == "weight" && e["ph"] == "X"));
}

/// Where 1F1B's activation memory lets zbv's stages hold few chunks (a model whose head's
/// logits outweigh its layers: the first stage keeps them too), zbv idles more than 1F1B. The
/// planner prices zbv with those limits, so it never ranks it above 1F1B there, and training
/// says so once it has measured the costs.
#[test]
fn zbv_held_back_by_memory_is_priced_as_such_and_named_in_the_log() {
    use pretrain::plan::{plan, GpuPreset};
    let base = "model.num_hidden_layers=8,train.micro_batch=4,parallel.pp=2";
    let hw = GpuPreset::H100.hardware();
    let at = |schedule: &str| {
        let r = load(
            Path::new("recipes/tiny.yaml"),
            &[format!("{base},{schedule}")],
        )
        .unwrap();
        plan(&r, &hw).unwrap()
    };
    let (zbv, plain) = (at(ZBV), at("parallel.schedule=1f1b"));
    assert!(
        zbv.step_time_s > plain.step_time_s,
        "zbv {} s, 1F1B {} s",
        zbv.step_time_s,
        plain.step_time_s
    );
    let o = common::cli::bin()
        .args(["--recipe", "recipes/tiny.yaml", "--set"])
        .arg(format!(
            "{base},{ZBV},train.steps=3,train.eval_interval=0,run.dir={}",
            tempfile::tempdir().unwrap().path().display()
        ))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", common::cli::text(&o));
    common::cli::assert_says(&o, "is above 1F1B's");
    common::cli::assert_says(
        &o,
        "parallel.schedule 1f1b or zb-h1 runs this layout faster",
    );
}
