//! Recipe options with a closed set of values (the non-finite policy, resume, the attention
//! backend, the optimizer state's dtype, recompute modules) and bounded recipe files: each bad
//! value is named with its field.

use super::*;

#[test]
fn the_nonfinite_policy_is_checked() {
    assert_err(&["train.on_nonfinite=retry"], "train.on_nonfinite");
    assert_err(
        &["train.spike_factor=0.5"],
        "train.spike_factor (0.5) must be a finite factor above 1",
    );
    let r = load(
        Path::new(TINY),
        &["train.on_nonfinite=skip,train.spike_factor=3".to_string()],
    )
    .unwrap();
    assert_eq!(r.train.on_nonfinite, pretrain::recipe::OnNonFinite::Skip);
    assert_eq!(r.train.spike_factor, Some(3.0));
    assert_err(
        &["checkpoint.accept_changes=[layout]"],
        "checkpoint.accept_changes",
    );
}

/// `checkpoint.resume` takes `none`, `auto` or a path; anything else is named.
#[test]
fn resume_values_are_named() {
    let r = load(Path::new(TINY), &["checkpoint.resume=auto".to_string()]).unwrap();
    assert_eq!(r.checkpoint.resume, pretrain::recipe::Resume::Auto);
    let r = load(Path::new(TINY), &["checkpoint.resume=some/dir".to_string()]).unwrap();
    assert_eq!(
        r.checkpoint.resume,
        pretrain::recipe::Resume::Path("some/dir".into())
    );
    let e = err(&["checkpoint.resume=[1]"]);
    assert!(
        e.contains("checkpoint.resume") && !e.contains("untagged"),
        "{e}"
    );
}

/// Recipe files are read with a size bound, and deep nesting is refused before parsing.
#[test]
fn recipe_files_are_bounded() {
    let e = load(Path::new("/dev/zero"), &[]).unwrap_err().to_string();
    assert!(e.contains("not a regular file"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big.yaml");
    std::fs::write(&big, format!("# {}\n", "x".repeat(2 << 20))).unwrap();
    let e = load(&big, &[]).unwrap_err().to_string();
    assert!(e.contains("larger than 1048576 bytes"), "{e}");
    let deep = dir.path().join("deep.yaml");
    std::fs::write(&deep, format!("model: {}", "[".repeat(100_000))).unwrap();
    let start = std::time::Instant::now();
    let e = load(&deep, &[]).unwrap_err().to_string();
    assert!(e.contains("nesting deeper than 64"), "{e}");
    assert!(start.elapsed().as_secs() < 5, "refused before parsing");
    let child = dir.path().join("child.yaml");
    std::fs::write(&child, "inherit: /dev/zero\n").unwrap();
    let e = load(&child, &[]).unwrap_err().to_string();
    assert!(
        e.contains("/dev/zero") && e.contains("not a regular file"),
        "{e}"
    );
}

#[test]
fn the_attention_backend_defaults_by_device_and_cudnn_needs_cuda() {
    use model::AttentionBackend;
    use pretrain::recipe::DeviceKind;
    let read = |o: &[&str]| {
        let o: Vec<String> = o.iter().map(|s| s.to_string()).collect();
        load(Path::new(TINY), &o).unwrap().train
    };
    let cpu = read(&[]);
    assert_eq!((cpu.device, cpu.attention), (DeviceKind::Cpu, None));
    assert_eq!(cpu.attention_backend(), AttentionBackend::Own);
    let cuda = read(&["train.device=cuda"]);
    assert_eq!(cuda.attention_backend(), AttentionBackend::Cudnn);
    let own = read(&["train.device=cuda,train.attention=own"]);
    assert_eq!(own.attention_backend(), AttentionBackend::Own);
    assert_eq!(
        read(&["train.device=cuda,train.attention=cudnn"]).attention_backend(),
        AttentionBackend::Cudnn
    );
    assert_err(
        &["train.attention=cudnn"],
        "train.attention is cudnn, which needs train.device cuda",
    );
    assert_err(&["train.attention=flash"], "train.attention");
    // Deterministic unless asked: `false` takes cuDNN's non-deterministic backward, and is
    // refused where it would change nothing (the project's kernels), naming why.
    assert!(cuda.deterministic && cuda.attention_backend().deterministic());
    let fast = read(&["train.device=cuda,train.deterministic=false"]);
    assert_eq!(
        fast.attention_backend(),
        AttentionBackend::CudnnNondeterministic
    );
    assert!(!fast.attention_backend().deterministic());
    assert!(fast
        .attention_backend()
        .runs_cudnn(candle_core::DType::BF16, 64));
    for own in [
        "train.deterministic=false",
        "train.device=cuda,train.attention=own,train.deterministic=false",
    ] {
        assert_err(
            &[own],
            "train.deterministic is false, which changes only cuDNN's",
        );
    }
    // Not a name a recipe can give.
    assert_err(
        &["train.attention=cudnnnondeterministic"],
        "train.attention",
    );
}

#[test]
fn optimizer_state_dtype_is_fp32_by_default_and_names_bad_values() {
    use pretrain::recipe::StateDtype;
    let read = |o: &[&str]| {
        let o: Vec<String> = o.iter().map(|s| s.to_string()).collect();
        load(Path::new(TINY), &o).unwrap().optimizer.state_dtype
    };
    assert_eq!(read(&[]), StateDtype::Fp32);
    assert_eq!(read(&["optimizer.state_dtype=bf16"]), StateDtype::Bf16);
    assert_eq!(read(&["optimizer.state_dtype=f32"]), StateDtype::Fp32);
    assert_err(
        &["optimizer.state_dtype=fp16"],
        "optimizer.state_dtype: unknown variant `fp16`, expected one of `f32`, `fp32`, `bf16`",
    );
}

#[test]
fn step_timing_overlaps_by_default_and_names_bad_values() {
    use pretrain::recipe::StepTiming;
    let read = |o: &[&str]| {
        let o: Vec<String> = o.iter().map(|s| s.to_string()).collect();
        load(Path::new(TINY), &o).unwrap().run.timing
    };
    assert_eq!(read(&[]), StepTiming::Overlapped);
    assert_eq!(read(&["run.timing=synchronized"]), StepTiming::Synchronized);
    assert_err(
        &["run.timing=exact"],
        "run.timing: unknown variant `exact`, expected `overlapped` or `synchronized`",
    );
}

#[test]
fn recompute_modules_apply_to_selective_recompute_only() {
    use model::{Recompute, Recomputed};
    let read = |o: &[&str]| {
        let o: Vec<String> = o.iter().map(|s| s.to_string()).collect();
        load(Path::new(TINY), &o).unwrap().train
    };
    let t = read(&["train.recompute=selective"]);
    assert_eq!(t.recompute, Recompute::Selective);
    let want = Recomputed {
        layernorm: true,
        mlp_act: true,
        moe_act: true,
        core_attn: false,
    };
    assert_eq!(t.recomputed(), want);
    let t = read(&["train.recompute=selective,train.recompute_modules=[core_attn]"]);
    assert!(t.recomputed().core_attn && !t.recomputed().layernorm);
    assert_eq!(
        read(&["train.recompute=full"]).recomputed(),
        Recomputed::default()
    );
    assert_err(
        &["train.recompute_modules=[layernorm]"],
        "train.recompute_modules is set but train.recompute is none",
    );
    assert_err(
        &["train.recompute=selective,train.recompute_modules=[]"],
        "train.recompute_modules is empty",
    );
    assert_err(
        &["train.recompute=selective,train.recompute_modules=[mlp]"],
        "unknown variant `mlp`, expected one of `layernorm`, `mlp_act`, `moe_act`, `core_attn`",
    );
}
