//! Sizes and outputs checked before any work: more rank processes than a node runs, attention
//! calls no device holds, and outputs that would replace a command's input or write through a
//! link.

use super::{assert_says, bin, text, train};

#[test]
fn an_elastic_job_refuses_more_rank_processes_than_a_node_runs() {
    for n in ["18446744073709551615", "4294967296", "100000"] {
        let o = bin()
            .args(["--nproc-per-node", n, "--elastic", "1", "--recipe"])
            .args(["recipes/tiny.yaml", "--set", "parallel.dp=2"])
            .output()
            .unwrap();
        assert!(!o.status.success(), "{}", text(&o));
        assert!(!text(&o).contains("panicked"), "{}", text(&o));
        assert_says(
            &o,
            &format!("--nproc-per-node {n} is more rank processes than this node runs"),
        );
    }
}

#[test]
fn bench_attention_refuses_sizes_no_call_has() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().display().to_string();
    let cases: [(&[&str], &str); 6] = [
        (
            &["--batch", "18446744073709551615", "--seq", "64"],
            "overflow",
        ),
        (
            &["--seq", "64", "--heads", "0"],
            "--heads must be at least 1",
        ),
        (
            &["--seq", "64", "--heads", "3", "--kv-heads", "2"],
            "is not a multiple of --kv-heads 2",
        ),
        (
            &[
                "--batch",
                "4294967296",
                "--seq",
                "4294967296",
                "--heads",
                "2",
                "--kv-heads",
                "1",
            ],
            "overflow",
        ),
        (&["--seq", "1000000000"], "GiB free on the device"),
        (&["--seq", "64", "--json", &dir], "is a directory"),
    ];
    for (args, says) in cases {
        let o = bin()
            .args(["bench-attention", "--device", "cpu", "--iters", "1"])
            .args(args)
            .output()
            .unwrap();
        assert!(!o.status.success(), "{args:?}: {}", text(&o));
        assert!(!text(&o).contains("panicked"), "{}", text(&o));
        assert_says(&o, says);
        assert!(
            !text(&o).contains("forward"),
            "{args:?} was timed: {}",
            text(&o)
        );
    }
}

#[test]
fn outputs_never_replace_an_input_or_write_through_a_link() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let o = train(&run, "train.steps=2,checkpoint.interval=2");
    assert!(o.status.success(), "{}", text(&o));
    let ck = run.join("checkpoints/step-00000002");
    let corpus = tmp.path().join("corpus.txt");
    std::fs::write(
        &corpus,
        "To be, or not to be, that is the question.\n".repeat(40),
    )
    .unwrap();
    let eval = |out: &std::path::Path| {
        bin()
            .args(["eval", "--checkpoint"])
            .arg(&ck)
            .arg("--input")
            .arg(&corpus)
            .arg("--logits-out")
            .arg(out)
            .output()
            .unwrap()
    };
    let kept = std::fs::read(&corpus).unwrap();
    let o = eval(&corpus);
    assert!(!o.status.success(), "{}", text(&o));
    assert_says(&o, "is also an input");
    assert_eq!(std::fs::read(&corpus).unwrap(), kept);

    // Outputs planted as links are replaced, their targets untouched.
    let victim = tmp.path().join("victim");
    std::fs::write(&victim, "precious data").unwrap();
    let link = tmp.path().join("logits.safetensors");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    let o = eval(&link);
    assert!(o.status.success(), "{}", text(&o));
    let plan_out = tmp.path().join("plan.json");
    std::os::unix::fs::symlink(&victim, &plan_out).unwrap();
    let o = bin()
        .args(["plan", "--recipe", "recipes/tiny.yaml", "--json-out"])
        .arg(&plan_out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious data");
    for out in [&link, &plan_out] {
        let meta = std::fs::symlink_metadata(out).unwrap();
        assert!(meta.is_file(), "{out:?} was replaced by a regular file");
    }
}

#[test]
fn one_export_at_a_time_writes_a_directory_and_the_earlier_export_survives() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let o = train(&run, "train.steps=2,checkpoint.interval=2");
    assert!(o.status.success(), "{}", text(&o));
    let ck = run.join("checkpoints/step-00000002");
    let out = tmp.path().join("hf");
    let export = || {
        let mut cmd = bin();
        cmd.args(["export-hf", "--overwrite", "--checkpoint"])
            .arg(&ck)
            .arg("--output")
            .arg(&out);
        cmd
    };
    let o = export().output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let earlier = std::fs::read(out.join("model.safetensors")).unwrap();

    // While another export holds the directory, a second one is refused and changes nothing.
    let held = std::fs::File::open(&out).unwrap();
    held.lock().unwrap();
    let o = export().output().unwrap();
    assert!(!o.status.success(), "{}", text(&o));
    assert_says(&o, "is being written by another export-hf");
    assert_eq!(
        std::fs::read(out.join("model.safetensors")).unwrap(),
        earlier
    );
    held.unlock().unwrap();

    // Two at once: each finishes or is refused; the directory holds one whole export.
    let start = || {
        let piped = || std::process::Stdio::piped();
        export().stdout(piped()).stderr(piped()).spawn().unwrap()
    };
    let (a, b) = (start(), start());
    let outs = [a.wait_with_output().unwrap(), b.wait_with_output().unwrap()];
    assert!(
        outs.iter().any(|o| o.status.success()),
        "{}",
        text(&outs[0])
    );
    for o in outs.iter().filter(|o| !o.status.success()) {
        assert_says(o, "is being written by another export-hf");
    }
    assert_eq!(
        std::fs::read(out.join("model.safetensors")).unwrap(),
        earlier
    );
    assert!(out.join("config.json").is_file() && !out.join(".export-hf.partial").exists());
}

/// The planner's search takes time in proportion to the layers: a model deeper than any trained
/// decoder is refused by name before it (100,000 layers searched for minutes).
#[test]
fn plan_refuses_models_deeper_than_the_layer_bound() {
    let o = bin()
        .args([
            "plan",
            "--recipe",
            "recipes/tiny.yaml",
            "--gpus",
            "1024",
            "--set",
        ])
        .arg("model.num_hidden_layers=100000")
        .output()
        .unwrap();
    assert!(!o.status.success(), "{}", text(&o));
    assert_says(&o, "model.num_hidden_layers (100000) exceeds 1024");
}

/// A hardware number out of range is echoed in scientific notation, not as 300 digits.
#[test]
fn plan_echoes_an_absurd_hardware_number_briefly() {
    let o = bin()
        .args([
            "plan",
            "--recipe",
            "recipes/tiny.yaml",
            "--peak-tflops",
            "1e-300",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success(), "{}", text(&o));
    assert_says(&o, "got 1.000e-300");
    assert!(text(&o).len() < 400, "{}", text(&o));
}
