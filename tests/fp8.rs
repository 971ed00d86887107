//! `train.fp8` on the CPU: the blocks' linears with operands rounded to FP8 (the emulated path;
//! the FP8 GEMM path's CPU products multiply the same values). A short tiny run in FP8 stays
//! close to the plain run without equalling it; other layouts equal the single-rank FP8 run
//! within the tolerances below; a run resumes bit for bit; the planner prices the rounding.
//!
//! Data, pipeline, ZeRO and expert layouts round the same micro-batches and the same whole
//! weights as one rank, so the first step equals it within tests/parallel.rs's tolerances. Later
//! steps start from weights that differ in the last bits (the order of the gradient sums), and
//! rounding to FP8 turns a last-bit difference that crosses a rounding boundary into a step of
//! 1/16 of that element: the run drifts by more than a plain run does, about 3e-6 of the loss
//! (measured), 100 times less than FP8 moves it from the plain run. Tensor parallelism scales
//! each rank's shard of a weight by the shard's own amax, which changes the first step too
//! (2e-5 of the gradient norm, measured).

use std::path::Path;

use pretrain::recipe::load;
use pretrain::train::{train, RunOutput};

mod common;
use common::{compare, run, Distance, MOE};

const TENSORWISE: &str = "train.fp8.scaling=tensorwise";
const BLOCKWISE: &str = "train.fp8.scaling=blockwise,train.fp8.bf16_first=0,train.fp8.bf16_last=0";

/// The largest distances a layout's FP8 run may have from the single-rank FP8 run: first-step
/// gradient norm, loss at any step, mean final weight (relative, relative, absolute).
const SAME_ROUNDING: (f64, f64, f64) = (1e-6, 2e-5, 5e-6);
const SHARD_SCALES: (f64, f64, f64) = (6e-5, 1.5e-4, 6e-5);

fn assert_close(name: &str, d: Distance, (norm, loss, weight): (f64, f64, f64)) {
    assert!(
        d.grad_norm_first < norm && d.loss < loss && d.weight_mean < weight,
        "{name}: {d:?} outside the tolerances {:?}",
        (norm, loss, weight)
    );
}

#[test]
fn fp8_runs_stay_close_to_the_plain_run() {
    let plain = run("parallel.dp=1");
    for fp8 in [TENSORWISE, BLOCKWISE] {
        let d = compare(fp8, &plain, &run(fp8));
        // Rounded operands change the run by far more than any layout's tolerance (so those
        // comparisons could not pass with FP8 off on one side) ...
        assert!(
            d.loss > 1e-4 && d.weight_mean > 1e-4,
            "{fp8}: hardly moved ({d:?})"
        );
        // ... and by little: FP8's rounding is a few percent per element, averaged by GEMMs.
        assert!(d.loss < 2e-3 && d.grad_norm < 5e-2, "{fp8}: {d:?}");
    }
}

#[test]
fn fp8_layouts_equal_the_single_rank_fp8_run() {
    for fp8 in [TENSORWISE, BLOCKWISE] {
        let base = run(fp8);
        for (layout, tol) in [
            ("parallel.dp=2", SAME_ROUNDING),
            ("parallel.dp=2,parallel.zero=3", SAME_ROUNDING),
            ("parallel.pp=2", SAME_ROUNDING),
            (
                "parallel.pp=2,parallel.virtual_stages=2,parallel.dp=2,parallel.zero=2",
                SAME_ROUNDING,
            ),
            ("parallel.tp=2", SHARD_SCALES),
            (
                "parallel.dp=2,parallel.tp=2,parallel.sequence_parallel=true,parallel.zero=1",
                SHARD_SCALES,
            ),
        ] {
            let name = format!("{fp8},{layout}");
            assert_close(&name, compare(&name, &base, &run(&name)), tol);
        }
    }
    // A mixture of experts: the attention's linears in FP8, the experts in the model dtype.
    let base = run(&format!("{TENSORWISE},{MOE}"));
    let name = format!("{TENSORWISE},{MOE},parallel.dp=2,parallel.ep=2");
    assert_close(&name, compare(&name, &base, &run(&name)), SAME_ROUNDING);
}

/// The planner prices what runs: the emulated path's rounding passes, at memory speed, on the
/// layers `train.fp8` covers (so emulated FP8 is slower than the model dtype's GEMMs alone), or
/// with FP8 GEMMs the quantizing passes and faster GEMMs. The `--gpus` search keeps the recipe's
/// choice and never turns FP8 on.
#[test]
fn the_planner_prices_the_rounding_on_the_layers_in_fp8() {
    use pretrain::plan::{plan, GpuPreset};
    let hw = GpuPreset::H100.hardware();
    let compute = |set: &str| {
        let r =
            pretrain::recipe::load(std::path::Path::new("recipes/bench-1b.yaml"), &[set.into()])
                .unwrap();
        plan(&r, &hw).unwrap().step_time.compute_s
    };
    let plain = compute("train.fp8.scaling=none");
    let tensorwise = compute(TENSORWISE);
    let all = compute("train.fp8.scaling=tensorwise,train.fp8.bf16_first=0,train.fp8.bf16_last=0");
    let blockwise = compute("train.fp8.scaling=blockwise");
    assert!(
        plain < tensorwise && tensorwise < blockwise,
        "{plain} {tensorwise} {blockwise}"
    );
    // bench-1b has 22 layers: 20 of them in FP8 add 20/22 of what all 22 add.
    let share = (tensorwise - plain) / (all - plain);
    assert!((share - 20.0 / 22.0).abs() < 1e-9, "{share}");
    // FP8 GEMMs: the linears' GEMMs faster, the operands quantized to codes.
    let lt = compute("train.fp8.scaling=tensorwise,train.fp8.gemm=cublaslt");
    assert!(lt < plain && lt < tensorwise, "{lt} {plain}");
}

/// Rounding is deterministic and keeps no state: a run in FP8 resumed from its checkpoint
/// repeats the uninterrupted run's steps bit for bit, and turning FP8 on at a resume is said,
/// not refused.
#[test]
fn an_fp8_run_resumes_bit_identically() {
    let tmp = tempfile::tempdir().unwrap();
    let run_in = |dir: &str, extra: &[&str]| -> RunOutput {
        let mut o = vec![format!(
            "train.steps=6,schedule.warmup_steps=1,train.eval_interval=0,train.global_batch=16,\
             train.micro_batch=4,run.dir={}",
            tmp.path().join(dir).display()
        )];
        o.extend(extra.iter().map(|s| s.to_string()));
        train(load(Path::new("recipes/tiny.yaml"), &o).unwrap(), true).unwrap()
    };
    let full = run_in("a", &[BLOCKWISE, "checkpoint.interval=3"]);
    let step3 = tmp.path().join("a/checkpoints/step-00000003");
    let resume = format!("checkpoint.resume={}", step3.display());
    let resumed = run_in("b", &[BLOCKWISE, &resume]);
    let losses = |r: &RunOutput| -> Vec<f64> { r.records.iter().map(|x| x.loss).collect() };
    assert_eq!(losses(&resumed), losses(&full)[3..].to_vec());
    assert_eq!(resumed.weights, full.weights, "final weights");
    let plain = run_in("c", &["checkpoint.interval=3"]);
    let plain3 = format!(
        "checkpoint.resume={}",
        tmp.path().join("c/checkpoints/step-00000003").display()
    );
    let switched = run_in("d", &[TENSORWISE, &plain3]);
    assert!(switched.records.iter().all(|r| r.loss.is_finite()));
    assert_ne!(losses(&switched), losses(&plain)[3..].to_vec());
}

/// `train.fp8.gemm: cublaslt` multiplies FP8 codes on CUDA; on the CPU its products multiply
/// the codes' values, which are exactly what the emulated tensorwise path multiplies: the two
/// give the same loss and gradients bit for bit through the step executor and the gradient
/// buffer (the weight gradient's factors travel as operands made in the backward, the input's
/// shared by the linears that read it), with the whole tape kept and with full recompute, with
/// tensorwise and with blockwise scales.
#[test]
fn the_fp8_gemm_path_multiplies_what_the_emulated_path_multiplies() {
    use candle_core::DType;
    use common::small;
    use model::{Fp8Gemm, Fp8Linears, Fp8Scaling, Recompute};
    let c = small::config(false);
    let batches = [small::batch(2, 0), small::batch(2, 40)];
    let run = |gemm: Option<Fp8Gemm>, scaling: Fp8Scaling, recompute: Recompute| {
        let mut m = small::build(&c, DType::F32, 7);
        m.set_fp8(gemm.map(|gemm| Fp8Linears {
            scaling,
            gemm,
            layers: 0..3,
        }));
        small::step(&m, &batches, recompute)
    };
    let (tensorwise, blockwise) = (Fp8Scaling::Tensorwise, Fp8Scaling::Blockwise);
    for (scaling, recompute) in [
        (tensorwise, Recompute::None),
        (tensorwise, Recompute::Full),
        (blockwise, Recompute::None),
    ] {
        let emulated = run(Some(Fp8Gemm::Emulated), scaling, recompute);
        let gemm = run(Some(Fp8Gemm::CublasLt), scaling, recompute);
        let what = format!("{scaling:?}, {recompute:?}");
        assert_eq!(emulated.loss.to_bits(), gemm.loss.to_bits(), "{what}");
        assert_eq!(emulated.grads, gemm.grads, "{what}");
    }
    let plain = run(None, tensorwise, Recompute::None);
    let gemm = run(Some(Fp8Gemm::CublasLt), tensorwise, Recompute::None);
    assert_ne!(plain.grads, gemm.grads, "FP8 changed nothing");
}
