//! CPU optimizer offload (`optimizer.offload: cpu`) trains exactly as the state on the device
//! does: the same losses, gradient norms and master weights bit for bit at every ZeRO stage
//! and with bf16 moments, and a resume crosses it both ways. On the CPU the "host" state is a
//! separate buffer the gradients are copied into and the parameters copied out of, as on a GPU.

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
