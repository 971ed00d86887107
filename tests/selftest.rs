//! `pretrain selftest` on the CPU: every check runs and passes (the same checks a GPU machine runs
//! with `--device cuda`), and asking for CUDA from a CPU build is a clear error; `pretrain
//! bench-attention` and `pretrain bench-rates` on the CPU.

use std::process::Command;

#[test]
fn cpu_selftest_passes_every_check() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("selftest.json");
    let out = Command::new(env!("CARGO_BIN_EXE_pretrain"))
        .args(["selftest", "--device", "cpu", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("all 160 checks passed"), "{stdout}");
    let checks: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    // Forward and backward of the six ops (attention at three head dims, cross-entropy at two
    // vocabularies, the embedding) and of an unmasked ring attention block in f32 and bf16, the
    // residual addition fused with RMSNorm forward and backward (values, f32 and bf16),
    // three optimizer kernels, the masters cast into bf16 parameters and the fused weight-gradient product (f32, bf16), four training
    // comparisons (bf16; dp2 x tp2, cp2 and MoE ep2 thread-ranks), two rank processes over tcp,
    // and the 1B decoder block's output, input gradient and nine weight gradients in f32 and
    // bf16, through its forward and hand-written backward; attention in bf16 against f64 (causal
    // and a ring block, each also with documents kept apart; causal documents twice: up to 400
    // positions and many short ones at the 7B head shape); FP8 rounding (f32 and bf16, two
    // formats, four block shapes), a linear of rounded operands, the three FP8 GEMMs with
    // tensorwise and with blockwise scales, and operands made once for several GEMMs; the
    // grouped linears (forward, input gradient; f32, bf16); the SwiGLU on the fused gate/up
    // output (forward, backward) and a weight gradient from a range of its columns (f32, bf16).
    assert_eq!(checks.len(), 160);
    for c in &checks {
        let (e, t) = (
            c["error"].as_f64().unwrap(),
            c["tolerance"].as_f64().unwrap(),
        );
        assert!(e <= t, "{c}");
    }
    let attention = checks
        .iter()
        .find(|c| c["name"] == "causal_attention grad of input 1 F32")
        .unwrap();
    assert!(attention["error"].as_f64().unwrap() < 1e-5, "{attention}");
    assert!(checks.iter().any(|c| c["name"]
        .as_str()
        .unwrap()
        .starts_with("cp2 thread-ranks (ring attention)")));
    assert!(checks
        .iter()
        .any(|c| c["name"] == "tp2 SP rank processes over tcp on cpu vs one rank (loss)"));
    // The 1B recipes' shapes: head dim 64 with 8 query heads per KV head, vocabulary 32000, and
    // their decoder block (128 positions on the CPU).
    for name in [
        "causal_attention d64 gqa8 s2048 grad of input 1 BF16",
        "cross_entropy v32000 grad of input 0 BF16",
        "1B block s=128 grad of down_proj F32",
        "1B block s=128 grad of the input BF16",
    ] {
        assert!(checks.iter().any(|c| c["name"] == name), "no check {name}");
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_selftest_on_a_cpu_build_is_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_pretrain"))
        .args(["selftest", "--device", "cuda"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("built without the `cuda` feature"), "{err}");
}

/// `pretrain bench-attention` times the project's kernels on the CPU (causal, a ring block, and
/// documents kept apart, whose FLOPs count only the pairs the mask keeps) and refuses what it
/// cannot run, by name.
#[test]
fn attention_bench_runs_on_the_cpu_and_refuses_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("attention.json");
    let bench = |extra: &[&str]| {
        let mut args = vec![
            "bench-attention",
            "--device",
            "cpu",
            "--batch",
            "1",
            "--seq",
            "64",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "32",
            "--iters",
            "1",
        ];
        args.extend_from_slice(extra);
        Command::new(env!("CARGO_BIN_EXE_pretrain"))
            .args(&args)
            .output()
            .unwrap()
    };
    for extra in [
        &[][..],
        &["--keys", "96", "--unmasked"][..],
        &["--documents", "16"][..],
    ] {
        let mut extra = extra.to_vec();
        extra.extend(["--json", json.to_str().unwrap()]);
        let out = bench(&extra);
        assert!(out.status.success(), "{out:?}");
        let rows: Vec<serde_json::Value> =
            serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0]["backend"], "own");
        for key in ["fwd_ms", "bwd_ms", "tflops"] {
            assert!(rows[0][key].as_f64().unwrap() > 0.0, "{key}: {rows:?}");
        }
        let flops =
            rows[0]["fwd_tflops"].as_f64().unwrap() * rows[0]["fwd_ms"].as_f64().unwrap() * 1e9;
        // 4 · b · h · d per (query, key) pair: 64 · 64 / 2 causal pairs, or 4 documents of 16.
        let pairs = if extra.contains(&"--documents") {
            assert!(rows[0]["shape"]
                .as_str()
                .unwrap()
                .contains("documents of 16"));
            4.0 * 16.0 * 16.0 / 2.0
        } else if extra.contains(&"--unmasked") {
            64.0 * 96.0
        } else {
            64.0 * 64.0 / 2.0
        };
        assert!(
            (flops / (4.0 * 4.0 * 32.0 * pairs) - 1.0).abs() < 1e-6,
            "{extra:?}: {flops}"
        );
    }
    for (extra, needle) in [
        (
            &["--backend", "cudnn"][..],
            "--backend cudnn needs --device cuda",
        ),
        (&["--keys", "32"][..], "add --unmasked"),
        (
            &["--backend", "flash"][..],
            "unknown attention backend `flash`",
        ),
        (&["--documents", "0"][..], "--documents must be positive"),
        (
            &["--documents", "8", "--unmasked"][..],
            "cannot be used with",
        ),
    ] {
        let out = bench(extra);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{extra:?}: {err}");
    }
}

/// `pretrain bench-rates` measures each projection's three products (with FP8 on, the block's
/// again as its FP8 linears run them), the attention and the element-wise bandwidth on the CPU
/// and writes a table that `pretrain plan --rates` prices the step from: a table of very slow
/// GEMMs lengthens the planned step, and a damaged one is refused naming the file and the
/// entry.
#[test]
fn rates_bench_writes_the_table_the_planner_reads() {
    let dir = tempfile::tempdir().unwrap();
    let table = dir.path().join("rates.json");
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_pretrain"))
            .args(args)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    };
    let tiny = ["--recipe", "recipes/tiny.yaml"];
    let t = table.to_str().unwrap();
    let bench = [
        &tiny[..],
        &["--tp", "1", "--micro-batch", "4", "--iters", "2"],
    ]
    .concat();
    let (ok, text) = run(&[&["bench-rates"], &bench[..], &["--json-out", t]].concat());
    assert!(ok, "{text}");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&table).unwrap()).unwrap();
    let gemms = json["gemms"].as_array().unwrap();
    // q, k/v, o, head, gate/up, down: forward, input and weight gradient each (shapes that
    // coincide are measured once).
    assert!(gemms.len() >= 12 && gemms.len() <= 18, "{text}");
    assert!(gemms.iter().all(|g| g["tflops"].as_f64().unwrap() > 0.0));
    assert!(text.contains("gate/up tp1 mb4 dw"), "{text}");
    let attention = &json["attention"][0];
    assert_eq!(attention["head_dim"], 16, "{text}");
    assert!(attention["fwd_tflops"].as_f64().unwrap() > 0.0, "{text}");
    assert!(json["bandwidth_gbps"].as_f64().unwrap() > 0.0, "{text}");
    assert!(json.get("fp8_gemms").is_none(), "FP8 is off: {text}");
    // With FP8 on, the block's projections again as its FP8 linears run them (not the head).
    let fp8_table = dir.path().join("rates-fp8.json");
    let fp8 = ["--set", "train.fp8.scaling=tensorwise", "--json-out"];
    let (ok, text) = run(&[
        &["bench-rates"],
        &bench[..],
        &fp8[..],
        &[fp8_table.to_str().unwrap()],
    ]
    .concat());
    assert!(ok, "{text}");
    let fp8_json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&fp8_table).unwrap()).unwrap();
    let fp8_gemms = fp8_json["fp8_gemms"].as_array().unwrap();
    assert!(fp8_gemms.len() >= 9 && fp8_gemms.len() <= 15, "{text}");
    assert!(
        text.contains("q tp1 mb4 fp8 fwd") && !text.contains("head tp1 mb4 fp8"),
        "{text}"
    );

    let step = |extra: &[&str]| {
        let plan = [
            "plan",
            "--recipe",
            "recipes/tiny.yaml",
            "--set",
            "train.micro_batch=4",
        ];
        let (ok, text) = run(&[&plan[..], extra].concat());
        assert!(ok, "{text}");
        let line = text
            .lines()
            .find(|l| l.starts_with("step "))
            .unwrap()
            .to_string();
        line.split_whitespace()
            .nth(1)
            .unwrap()
            .parse::<f64>()
            .unwrap()
    };
    let preset = step(&[]);
    for g in json["gemms"].as_array_mut().unwrap() {
        g["tflops"] = serde_json::json!(1e-3);
    }
    std::fs::write(&table, json.to_string()).unwrap();
    let slow = step(&["--rates", t]);
    assert!(slow > 100.0 * preset, "{slow} against {preset}");

    json["gemms"][2]["tflops"] = serde_json::json!(-1.0);
    std::fs::write(&table, json.to_string()).unwrap();
    let plan = ["plan", "--recipe", "recipes/tiny.yaml", "--rates", t];
    let (ok, text) = run(&plan);
    assert!(
        !ok && text.contains("rates.json") && text.contains("gemms[2]: tflops"),
        "{text}"
    );
}
