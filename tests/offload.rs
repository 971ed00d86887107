//! CPU optimizer offload (`optimizer.offload: cpu`) trains exactly as the state on the device
//! does: the same losses, gradient norms and master weights bit for bit at every ZeRO stage
//! and with bf16 moments, and a resume crosses it both ways, at the same layout and resharded.
//! On the CPU the "host" state is a separate buffer the gradients are copied into and the
//! parameters copied out of, as on a GPU. The planner fits a 7B on one H100 this way.

mod common;

use std::path::Path;

use common::short::{masters, output, pretrain, stderr};

/// Each step's `(loss, grad_norm, lr)` of a run, exactly as logged.
fn curve(dir: &Path) -> Vec<(u64, u64, u64)> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let bits = |k: &str| v[k].as_f64().unwrap().to_bits();
            (bits("loss"), bits("grad_norm"), bits("lr"))
        })
        .collect()
}

/// Trains `set` (6 steps, a checkpoint every 3) into `dir`, asserting success; what it logged.
fn train(dir: &Path, set: &str) -> String {
    let o = output(pretrain(
        dir,
        &format!("train.steps=6,checkpoint.interval=3,{set}"),
    ));
    assert!(o.status.success(), "{set}: {}", stderr(&o));
    common::cli::text(&o)
}

#[test]
fn offloaded_adamw_trains_like_the_state_on_the_device_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    for layout in [
        "parallel.dp=1",
        "parallel.dp=1,optimizer.state_dtype=bf16,optimizer.offload_threads=3",
        "parallel.dp=2,parallel.zero=1",
        "parallel.dp=2,parallel.zero=2",
        "parallel.dp=2,parallel.zero=3",
        "parallel.dp=2,parallel.pp=2,parallel.zero=1",
    ] {
        let (device, host) = (tmp.path().join("device"), tmp.path().join("host"));
        for d in [&device, &host] {
            let _ = std::fs::remove_dir_all(d);
        }
        train(&device, layout);
        let log = train(&host, &format!("{layout},optimizer.offload=cpu"));
        assert!(log.contains("MiB in host memory, updated on"), "{log}");
        assert_eq!(curve(&device), curve(&host), "{layout}: the curves differ");
        let last = |d: &Path| masters(&d.join("checkpoints/step-00000006"));
        assert!(last(&device) == last(&host), "{layout}: the masters differ");
    }
}

#[test]
fn a_resume_crosses_offload_both_ways() {
    let tmp = tempfile::tempdir().unwrap();
    let layout = "parallel.dp=2,parallel.zero=1";
    let (device, host) = (tmp.path().join("device"), tmp.path().join("host"));
    train(&device, layout);
    train(&host, &format!("{layout},optimizer.offload=cpu"));
    for (from, then) in [(&device, "cpu"), (&host, "none")] {
        let dir = tmp.path().join(format!("to-{then}"));
        let step3 = from.join("checkpoints/step-00000003");
        let o = output(pretrain(
            &dir,
            &format!(
                "train.steps=6,checkpoint.interval=3,{layout},optimizer.offload={then},\
                 checkpoint.resume={}",
                step3.display()
            ),
        ));
        let log = common::cli::text(&o);
        assert!(o.status.success(), "{log}");
        assert!(log.contains("resume: optimizer.offload changed"), "{log}");
        let step6 = |d: &Path| masters(&d.join("checkpoints/step-00000006"));
        assert!(
            step6(&device) == step6(&dir),
            "resumed with offload {then}: the masters differ from the uninterrupted run's"
        );
        assert_eq!(curve(&device)[3..], curve(&dir)[..], "offload {then}");
    }
    // Resharded: each checkpoint resumed on one rank, with and without offload, alike.
    let one = |from: &Path, offload: &str| {
        let dir = tmp.path().join(format!("one-{offload}"));
        let step3 = from.join("checkpoints/step-00000003");
        let set = format!(
            "train.steps=6,checkpoint.interval=3,parallel.dp=1,optimizer.offload={offload},\
             checkpoint.resume={}",
            step3.display()
        );
        let o = output(pretrain(&dir, &set));
        assert!(o.status.success(), "{}", stderr(&o));
        (curve(&dir), masters(&dir.join("checkpoints/step-00000006")))
    };
    assert!(
        one(&device, "none") == one(&host, "cpu"),
        "resharded to one rank"
    );
}

#[test]
fn offload_refuses_muon() {
    let tmp = tempfile::tempdir().unwrap();
    let o = output(pretrain(
        tmp.path(),
        "optimizer.name=muon,optimizer.offload=cpu",
    ));
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("optimizer.offload: cpu updates AdamW's state on the host"),
        "{}",
        stderr(&o)
    );
}

/// The planner: a 7B fits one H100 80GB only with its optimizer on the host, in at most 60 GiB
/// of the GPU, and names the host memory it takes; a host too small for fp32 moments takes bf16
/// ones, and one too small for either fits nothing.
#[test]
fn the_planner_fits_a_7b_on_one_h100_with_the_optimizer_on_the_host() {
    use pretrain::plan::{candidates, GpuPreset, GIB};
    use pretrain::recipe::{Offload, StateDtype};

    let r = pretrain::recipe::load(Path::new("recipes/7b.yaml"), &[]).unwrap();
    let mut hw = GpuPreset::H100.hardware();
    let fitting = |hw: &pretrain::plan::Hardware| -> Vec<pretrain::plan::Plan> {
        candidates(&r, hw, 1)
            .into_iter()
            .map(|c| c.plan)
            .filter(|p| p.fits)
            .collect()
    };
    let fit = fitting(&hw);
    assert!(!fit.is_empty(), "no 7B layout fits one H100");
    assert!(fit.iter().all(|p| p.layout.offload == Offload::Cpu));
    let best = &fit[0];
    let gpu = (best.memory_bytes.total + best.headroom_bytes) as f64 / GIB;
    assert!(gpu <= 60.0, "{}: {gpu:.1} GiB of the GPU", best.layout);
    // fp32 masters and moments: 12 bytes a parameter, and a few buckets on their way.
    let params = r.model.num_params() as f64;
    let host = best.memory_bytes.host as f64;
    assert_eq!(best.memory_bytes.optimizer, 0);
    assert!(
        host > 12.0 * params && host < 12.0 * params + 2.0 * GIB,
        "{host}"
    );
    // The update and its copies, at 256K tokens a step, take at most 15% of it.
    let share = best.step_time.optimizer_s / (best.step_time_s / 16.0);
    assert!(
        share < 0.15,
        "offloaded update: {share:.3} of a 256K-token step"
    );

    hw.host.memory_gib = 64.0;
    let fit = fitting(&hw);
    assert!(!fit.is_empty());
    assert!(fit
        .iter()
        .all(|p| p.layout.state_dtype == StateDtype::Bf16 && p.layout.offload == Offload::Cpu));
    hw.host.memory_gib = 16.0;
    assert!(fitting(&hw).is_empty());
}

/// The planner's host bytes hold what an offloaded rank measures of its optimizer state, and
/// none of it is counted on the device.
#[test]
fn planned_host_memory_holds_the_measured_offloaded_state() {
    use pretrain::train::{RankCtx, Trainer};
    use std::time::Duration;

    for layout in [
        "parallel.dp=1",
        "parallel.dp=2,parallel.zero=1,optimizer.state_dtype=bf16",
        "parallel.dp=2,parallel.zero=3,parallel.pp=2",
    ] {
        let o = vec![
            "train.steps=1,schedule.warmup_steps=1,train.eval_interval=0,\
             train.global_batch=16,train.micro_batch=4,optimizer.offload=cpu"
                .to_string(),
            layout.to_string(),
        ];
        let recipe = pretrain::recipe::load(Path::new("recipes/tiny.yaml"), &o).unwrap();
        let predicted = pretrain::plan::memory::stages(&recipe).unwrap();
        let world = recipe.parallel.world_size();
        let measured =
            parallel::comm::local::run_local(world, Duration::from_secs(120), |rank, comm| {
                let ctx = RankCtx::open(&recipe.parallel, rank, comm, candle_core::Device::Cpu)?;
                let stage = ctx.coords.pp;
                let mut trainer = Trainer::new(recipe.clone(), ctx, false)?;
                let rec = trainer.train_step()?;
                Ok::<_, anyhow::Error>((stage, rec.memory.state.optimizer_bytes as u64))
            })
            .unwrap_or_else(|e| panic!("{e}: {:#}", e.error));
        for (stage, bytes) in measured {
            let want = &predicted[stage].bytes;
            assert_eq!(want.optimizer, 0, "{layout}");
            assert!(
                bytes > 0 && bytes <= want.host && want.host < 2 * bytes + (1 << 20),
                "{layout} stage {stage}: measured {bytes} bytes of state, planned {} on the host",
                want.host
            );
        }
    }
}
