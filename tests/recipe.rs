//! Recipe loading and validation: each class of mistake gives a message naming its field.

use std::path::Path;

use pretrain::recipe::{load, RecipeError};

const TINY: &str = "recipes/tiny.yaml";

fn err(overrides: &[&str]) -> String {
    let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    match load(Path::new(TINY), &o) {
        Ok(_) => panic!("{overrides:?} should be rejected"),
        Err(e) => e.to_string(),
    }
}

fn assert_err(overrides: &[&str], needle: &str) {
    let e = err(overrides);
    assert!(
        e.contains(needle),
        "error for {overrides:?} should mention `{needle}`, got:\n{e}"
    );
}

#[test]
fn shipped_recipes_are_valid() {
    for r in [
        "recipes/tiny.yaml",
        "recipes/tiny-long.yaml",
        "recipes/1b.yaml",
        "recipes/1b-32k.yaml",
        "recipes/7b.yaml",
    ] {
        load(Path::new(r), &[]).unwrap_or_else(|e| panic!("{r}: {e}"));
    }
    let seven = load(Path::new("recipes/7b.yaml"), &[]).unwrap();
    assert_eq!(
        (
            seven.model.num_hidden_layers,
            seven.model.hidden_size,
            seven.model.num_attention_heads
        ),
        (32, 4096, 32)
    );
    assert_eq!(
        (seven.model.intermediate_size, seven.train.seq_len),
        (11008, 4096)
    );
    assert_eq!(
        seven.model.num_params(),
        6_738_415_616,
        "Llama-2-7B has 6.74B parameters"
    );
}

#[test]
fn overrides_apply_and_repeat() {
    let o = vec![
        "train.steps=70".to_string(),
        "parallel.tp=2,parallel.dp=2".to_string(),
    ];
    let r = load(Path::new(TINY), &o).unwrap();
    assert_eq!((r.train.steps, r.parallel.tp, r.parallel.dp), (70, 2, 2));
    assert_eq!(r.grad_accum_steps(), 2, "32 / (8 × 2)");
}

#[test]
fn unknown_keys_are_rejected_with_their_path() {
    assert_err(
        &["model.hiden_size=3"],
        "model.hiden_size: unknown field `hiden_size`",
    );
    assert_err(&["bogus.x=1"], "unknown field `bogus`");
}

#[test]
fn wrong_types_name_the_field() {
    assert_err(&["train.steps=many"], "train.steps");
}

#[test]
fn heads_must_divide_hidden_size() {
    assert_err(
        &["model.hidden_size=130"],
        "model.hidden_size (130) must be divisible by model.num_attention_heads (8)",
    );
}

#[test]
fn kv_heads_must_divide_heads() {
    assert_err(
        &["model.num_key_value_heads=3"],
        "model.num_attention_heads (8) must be divisible by model.num_key_value_heads (3)",
    );
}

#[test]
fn head_dim_must_be_even() {
    assert_err(
        &["model.hidden_size=12,model.num_attention_heads=4,model.num_key_value_heads=4"],
        "must be even",
    );
}

#[test]
fn head_dim_and_rope_scaling_are_checked_by_field() {
    assert_err(&["model.head_dim=0"], "model.head_dim must be positive");
    assert_err(&["model.head_dim=15"], "head dimension (15) must be even");
    // An explicit head dimension lifts the divisibility of hidden_size.
    assert!(load(
        Path::new(TINY),
        &["model.hidden_size=130,model.head_dim=16".into()]
    )
    .is_ok());
    assert_err(
        &["model.rope_scaling.rope_type=yarn,model.rope_scaling.factor=4"],
        "model.rope_scaling.rope_type: unknown variant `yarn`, expected `linear` or `llama3`",
    );
    assert_err(
        &["model.rope_scaling.rope_type=llama3,model.rope_scaling.factor=8"],
        "model.rope_scaling: missing field `low_freq_factor`",
    );
    assert_err(
        &["model.rope_scaling.rope_type=linear,model.rope_scaling.factor=0"],
        "model.rope_scaling.factor (0) must be positive",
    );
    assert_err(
        &["model.rope_scaling={rope_type: llama3, factor: 8, low_freq_factor: 4, high_freq_factor: 1, original_max_position_embeddings: 8192}"],
        "model.rope_scaling.high_freq_factor (1) must exceed low_freq_factor (4)",
    );
    assert_err(
        &["model.eos_token_id=[0,4096]"],
        "model.eos_token_id (4096) must be below model.vocab_size (4096)",
    );
}

#[test]
fn global_batch_must_split_into_micro_batches_and_replicas() {
    assert_err(
        &["train.global_batch=20"],
        "train.global_batch (20) must be divisible by train.micro_batch × parallel.dp (8 × 1 = 8)",
    );
    assert_err(&["parallel.dp=3"], "(8 × 3 = 24)");
}

#[test]
fn tensor_parallel_must_divide_heads_ffn_and_vocab() {
    assert_err(
        &["parallel.tp=3"],
        "parallel.tp (3) must divide model.num_attention_heads",
    );
    assert_err(
        &["parallel.tp=2,model.intermediate_size=385"],
        "parallel.tp (2) must divide model.intermediate_size (385)",
    );
    assert_err(
        &["parallel.tp=2,model.vocab_size=4097"],
        "parallel.tp (2) must divide model.vocab_size (4097)",
    );
}

#[test]
fn pipeline_chunks_must_divide_layers() {
    assert_err(
        &["parallel.pp=3"],
        "parallel.pp × parallel.virtual_stages (3 × 1) must divide model.num_hidden_layers (4)",
    );
    assert_err(
        &["parallel.pp=2,parallel.virtual_stages=4"],
        "(2 × 4) must divide",
    );
}

#[test]
fn interleaving_needs_micro_batches_in_multiples_of_pp() {
    assert_err(
        &["parallel.pp=2,parallel.virtual_stages=2,train.global_batch=24"],
        "micro-batches per step (3",
    );
    assert_err(
        &["parallel.virtual_stages=2"],
        "parallel.virtual_stages > 1 needs parallel.pp > 1",
    );
}

#[test]
fn parallel_options_need_their_axis() {
    assert_err(
        &["parallel.zero1=true,parallel.dp=2"],
        "parallel.zero1 was replaced by parallel.zero (0-3); write parallel.zero: 1",
    );
    assert_err(
        &["parallel.zero=4,parallel.dp=2"],
        "parallel.zero (4) must be 0, 1, 2 or 3",
    );
    // A shard size of 1 used to pass and fail at step 1 with an internal error.
    for zero in 1..=3 {
        assert_err(
            &[&format!(
                "parallel.zero={zero},parallel.dp=2,parallel.zero_shard_size=1"
            )],
            "parallel.zero_shard_size is 1, which shards nothing",
        );
    }
    assert_err(
        &["parallel.zero=2,parallel.dp=4,parallel.zero_shard_size=3"],
        "parallel.zero_shard_size (3) must divide parallel.dp × parallel.cp (4 × 1)",
    );
    assert_err(
        &["parallel.dp=4,parallel.zero_shard_size=2"],
        "parallel.zero_shard_size needs parallel.zero >= 1",
    );
    assert_err(&["parallel.dp=0"], "parallel.dp must be at least 1");
    assert_err(
        &["parallel.bucket_size=1073741825"],
        "parallel.bucket_size (1073741825) exceeds 1073741824 elements",
    );
}

#[test]
fn sequence_must_fit_the_position_table() {
    assert_err(
        &["train.seq_len=256"],
        "train.seq_len (256) exceeds model.max_position_embeddings (128)",
    );
}

#[test]
fn schedule_must_fit_the_run() {
    assert_err(
        &["schedule.min_lr=1.0"],
        "schedule.min_lr (1) must be in [0, optimizer.lr",
    );
    assert_err(
        &["schedule.kind=wsd,schedule.decay_fraction=0"],
        "schedule.decay_fraction",
    );
}

#[test]
fn timeouts_are_bounded() {
    assert_err(
        &["parallel.timeout_s=0"],
        "parallel.timeout_s (0) must be positive and at most 1e7 seconds",
    );
    assert_err(
        &["checkpoint.timeout_s=-1"],
        "checkpoint.timeout_s (-1) must be positive and at most 1e7 seconds",
    );
}

#[test]
fn optimizer_hyperparameters_are_checked() {
    assert_err(&["optimizer.lr=0"], "optimizer.lr (0) must be positive");
    // Finite in f64 but not as the f32 the update computes in; and infinity by name.
    assert_err(
        &["optimizer.lr=1e39"],
        "must be positive and finite as an f32",
    );
    assert_err(
        &["optimizer.lr=.inf"],
        "optimizer.lr (inf) must be positive and finite",
    );
    assert_err(
        &["optimizer.beta2=1.0"],
        "optimizer.beta2 (1) must be in [0, 1)",
    );
    assert_err(&["optimizer.weight_decay=-1"], "optimizer.weight_decay");
}

#[test]
fn all_problems_are_reported_at_once() {
    let e = err(&["train.global_batch=20", "optimizer.lr=0"]);
    assert!(
        e.contains("train.global_batch") && e.contains("optimizer.lr"),
        "{e}"
    );
}

#[test]
fn data_section_is_validated() {
    assert_err(&["data.split=abc"], "data.split");
    assert_err(&["data.datasets=[]"], "data.datasets");
}

#[test]
fn malformed_overrides_are_rejected() {
    assert_err(&["steps"], "--set steps: expected key.path=value");
    assert_err(&["train.steps.x=1"], "`train.steps` is not a section");
}

#[test]
fn inherit_merges_and_detects_cycles() {
    let dir = tempfile::tempdir().unwrap();
    let base = std::fs::canonicalize(TINY).unwrap();
    let child = dir.path().join("child.yaml");
    std::fs::write(
        &child,
        format!("inherit: {}\ntrain:\n  steps: 90\n", base.display()),
    )
    .unwrap();
    let r = load(&child, &[]).unwrap();
    assert_eq!(r.train.steps, 90);
    assert_eq!(r.train.global_batch, 32, "inherited");

    let a = dir.path().join("a.yaml");
    let b = dir.path().join("b.yaml");
    std::fs::write(&a, "inherit: b.yaml\n").unwrap();
    std::fs::write(&b, "inherit: a.yaml\n").unwrap();
    assert!(matches!(
        load(&a, &[]),
        Err(RecipeError::InheritCycle { .. })
    ));
}

#[test]
fn yaml_syntax_errors_name_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.yaml");
    std::fs::write(&p, "model:\n  hidden_size: [1,\n").unwrap();
    let e = load(&p, &[]).unwrap_err().to_string();
    assert!(e.contains("bad.yaml") && e.contains("line"), "{e}");
    let e = load(&dir.path().join("missing.yaml"), &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing.yaml"), "{e}");
}

#[test]
fn stored_recipes_of_earlier_versions_still_load() {
    let old = std::fs::read_to_string(TINY)
        .unwrap()
        .replace("parallel:\n", "parallel:\n  zero1: true\n");
    let origin = Path::new("checkpoint/manifest.json");
    let dp2 = ["parallel.dp=2".to_string()];
    let r = pretrain::recipe::load_stored(&old, origin, &dp2).unwrap();
    assert_eq!(r.parallel.zero, parallel::dp::ZeroStage::Optimizer);
    let e = pretrain::recipe::load_str(&old, origin, &dp2).unwrap_err();
    assert!(e.to_string().contains("write parallel.zero: 1"), "{e}");
    // `train.backward` (removed: the pieces have one hand-written pass) is dropped from stored
    // recipes and refused, with the reason, in a user's.
    let old = std::fs::read_to_string(TINY)
        .unwrap()
        .replace("train:\n", "train:\n  backward: hand_written\n");
    assert!(old.contains("backward: hand_written"));
    pretrain::recipe::load_stored(&old, origin, &[]).unwrap();
    let e = pretrain::recipe::load_str(&old, origin, &[]).unwrap_err();
    assert!(e.to_string().contains("train.backward was removed"), "{e}");
    assert_err(
        &["train.backward=autograd"],
        "train.backward was removed: every model piece runs one forward and its hand-written \
         backward",
    );
}

/// Options that do nothing at one rank are switched off with a warning, as in Megatron-LM.
#[test]
fn options_that_do_nothing_at_this_scale_are_switched_off() {
    let o = |s: &str| vec![s.to_string()];
    let r = load(Path::new(TINY), &o("parallel.sequence_parallel=true")).unwrap();
    assert!(!r.parallel.sequence_parallel);
    let r = load(
        Path::new(TINY),
        &o("parallel.zero=2,parallel.zero_shard_size=1"),
    )
    .unwrap();
    assert_eq!(
        (r.parallel.zero, r.parallel.zero_shard_size),
        (parallel::dp::ZeroStage::Off, None)
    );
    let r = load(Path::new(TINY), &o("schedule.warmup_steps=500")).unwrap();
    assert_eq!(r.schedule.warmup_steps, 500, "reported, kept");
}

/// The kv-heads half of the tensor-parallel rule on its own (the attention heads divide).
#[test]
fn tensor_parallel_must_divide_the_kv_heads() {
    assert_err(
        &["model.num_key_value_heads=2,parallel.tp=4"],
        "parallel.tp (4) must divide model.num_attention_heads (8) and model.num_key_value_heads (2)",
    );
}

/// Products that wrap around in release builds are reported by field, never a panic.
#[test]
fn overflowing_products_are_named_not_panics() {
    let big = usize::MAX / 2 + 1;
    assert_err(
        &[&format!("train.micro_batch={big},parallel.dp=2")],
        "train.micro_batch × parallel.dp",
    );
    assert_err(
        &[&format!("parallel.pp=2,parallel.virtual_stages={big}")],
        "parallel.pp × parallel.virtual_stages",
    );
    assert_err(
        &["parallel.pp=0,parallel.virtual_stages=2"],
        "parallel.pp must be at least 1",
    );
    assert_err(
        &["train.steps=100000000000"],
        "train.steps × train.global_batch (100000000000 × 32 = 3200000000000)",
    );
    assert_err(
        &["train.steps=2305843009213693952"],
        "exceeds the 4294967296 samples",
    );
    assert_err(
        &["train.global_batch=18446744073709551612,train.micro_batch=4"],
        "train.global_batch × train.seq_len",
    );
}

/// Sizes whose memory cannot exist are refused before anything is allocated.
#[test]
fn impossible_model_sizes_are_refused() {
    assert_err(&["model.vocab_size=1000000000000"], "the model would have");
    assert_err(&["model.num_hidden_layers=100000000000"], "more than 1e13");
    // 4e11 parameters: 7.3 TiB of state on one rank; over tp 4 × pp 4 it is 0.46 TiB.
    let big = "model.hidden_size=16384,model.intermediate_size=65536,model.num_hidden_layers=100,model.max_position_embeddings=128";
    assert_err(&[big], "TiB per rank");
    load(
        Path::new(TINY),
        &[big.to_string(), "parallel.tp=4,parallel.pp=4".to_string()],
    )
    .unwrap();
}

#[path = "recipe/options.rs"]
mod options;
