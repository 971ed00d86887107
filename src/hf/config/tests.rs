//! Tests of `config.json` reading and writing: both RoPE forms, round trips, Mixtral, and
//! refusals by name.

use super::*;
use model::RopeScaling;

fn base() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5
    })
}

fn with(pairs: &[(&str, Value)]) -> Value {
    let mut v = base();
    for (k, x) in pairs {
        v[*k] = x.clone();
    }
    v
}

fn err(v: Value) -> String {
    format!("{:#}", parse(&v).unwrap_err())
}

const LLAMA3: RopeScaling = RopeScaling::Llama3 {
    factor: 8.0,
    low_freq_factor: 1.0,
    high_freq_factor: 4.0,
    original_max_position_embeddings: 64,
};

fn llama3_dict(theta: Option<f64>) -> Value {
    let mut d = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
    if let Some(t) = theta {
        d["rope_theta"] = json!(t);
    }
    d
}

#[test]
fn both_rope_forms_read_the_same() {
    let v4 = with(&[
        ("rope_theta", json!(500000.0)),
        ("rope_scaling", llama3_dict(None)),
    ]);
    let v5 = with(&[("rope_parameters", llama3_dict(Some(500000.0)))]);
    let both = with(&[
        ("rope_theta", json!(500000.0)),
        ("rope_scaling", llama3_dict(None)),
        ("rope_parameters", llama3_dict(Some(500000.0))),
    ]);
    for v in [v4, v5, both] {
        let c = parse(&v).unwrap().config;
        assert_eq!((c.rope_theta, c.rope_scaling), (500000.0, Some(LLAMA3)));
    }
    let plain = with(&[(
        "rope_parameters",
        json!({"rope_type": "default", "rope_theta": 5e5}),
    )]);
    let c = parse(&plain).unwrap().config;
    assert_eq!((c.rope_theta, c.rope_scaling), (500000.0, None));
    let old = with(&[("rope_scaling", json!({"type": "linear", "factor": 2.0}))]);
    let c = parse(&old).unwrap().config;
    assert_eq!(
        (c.rope_theta, c.rope_scaling),
        (DEFAULT_THETA, Some(RopeScaling::Linear { factor: 2.0 }))
    );
    assert_eq!(parse(&base()).unwrap().config.rope_theta, DEFAULT_THETA);
}

#[test]
fn written_config_reads_back() {
    let mut c = parse(&with(&[("head_dim", json!(32))])).unwrap().config;
    c.rope_scaling = Some(LLAMA3);
    c.rope_theta = 500000.0;
    let v = write(&c, Dtype::Bf16, 1, &TokenIds::Many(vec![2, 3])).unwrap();
    let back = parse(&v).unwrap();
    assert_eq!(back.dtype.as_deref(), Some("bfloat16"));
    assert_eq!(back.config.head_dim, Some(32));
    assert_eq!(back.config.bos_token_id, Some(1));
    assert_eq!(back.config.eos_token_id, Some(TokenIds::Many(vec![2, 3])));
    c.bos_token_id = Some(1);
    c.eos_token_id = Some(TokenIds::Many(vec![2, 3]));
    assert_eq!(back.config, c);
}

/// A mixture-of-experts model is written as a Mixtral and reads back as the same model;
/// what Mixtral cannot express is refused by name.
#[test]
fn moe_models_export_as_mixtral() {
    let mut c = parse(&base()).unwrap().config;
    c.num_local_experts = Some(8);
    c.num_experts_per_tok = Some(2);
    c.router_aux_loss_coef = Some(0.02);
    let v = write(&c, Dtype::F32, 0, &TokenIds::One(0)).unwrap();
    assert_eq!(v["architectures"], json!(["MixtralForCausalLM"]));
    assert_eq!(v["model_type"], json!("mixtral"));
    assert_eq!(v["num_local_experts"], json!(8));
    assert!(v.get("mlp_bias").is_none());
    let back = parse(&v).unwrap().config;
    assert_eq!(back.moe(), c.moe());
    assert_eq!(back.num_local_experts, Some(8));

    // The expert width is Mixtral's intermediate_size.
    c.moe_intermediate_size = Some(48);
    let v = write(&c, Dtype::F32, 0, &TokenIds::One(0)).unwrap();
    assert_eq!(v["intermediate_size"], json!(48));
    assert_eq!(parse(&v).unwrap().config.moe().unwrap().expert_size, 48);

    let mut dense_first = c.clone();
    dense_first.mlp_only_layers = vec![0];
    let e = write(&dense_first, Dtype::F32, 0, &TokenIds::One(0)).unwrap_err();
    assert!(format!("{e}").contains("mlp_only_layers"), "{e}");
    let mut unnormalised = c.clone();
    unnormalised.norm_topk_prob = Some(false);
    let e = write(&unnormalised, Dtype::F32, 0, &TokenIds::One(0)).unwrap_err();
    assert!(format!("{e}").contains("norm_topk_prob"), "{e}");

    let mut noisy = write(&c, Dtype::F32, 0, &TokenIds::One(0)).unwrap();
    noisy["router_jitter_noise"] = json!(0.1);
    assert!(err(noisy).contains("router_jitter_noise"));
    let mixed = with(&[("architectures", json!(["MixtralForCausalLM"]))]);
    assert!(err(mixed).contains("with model_type \"llama\""));
}

#[test]
fn disagreeing_or_unsupported_configs_are_refused_by_name() {
    let cases = [
        (
            with(&[
                ("rope_theta", json!(10000.0)),
                ("rope_parameters", llama3_dict(Some(500000.0))),
            ]),
            "describe different RoPE",
        ),
        (
            // transformers 4 reads plain RoPE here, transformers 5 llama3.
            with(&[
                ("rope_theta", json!(500000.0)),
                ("rope_parameters", llama3_dict(Some(500000.0))),
            ]),
            "(θ = 500000, no scaling) describe different RoPE",
        ),
        (
            with(&[
                ("rope_scaling", Value::Null),
                ("rope_theta", json!(10000.0)),
                (
                    "rope_parameters",
                    json!({"rope_type": "default", "rope_theta": 5e5}),
                ),
            ]),
            "θ = 500000",
        ),
        (
            with(&[("model_type", json!("mistral"))]),
            "model_type: \"mistral\"",
        ),
        (
            with(&[("architectures", json!(["Qwen2ForCausalLM"]))]),
            "Qwen2ForCausalLM",
        ),
        (with(&[("sliding_window", json!(16))]), "sliding_window"),
        (with(&[("attention_bias", json!(true))]), "attention_bias"),
        (with(&[("mlp_bias", json!(true))]), "mlp_bias"),
        (with(&[("use_qk_norm", json!(true))]), "use_qk_norm"),
        (with(&[("hidden_act", json!("gelu"))]), "hidden_act"),
        (
            with(&[("partial_rotary_factor", json!(0.5))]),
            "partial_rotary_factor",
        ),
        (
            with(&[("rope_scaling", json!({"rope_type": "yarn", "factor": 4.0}))]),
            "rope_scaling: rope_type \"yarn\"",
        ),
        (
            with(&[(
                "rope_parameters",
                json!({"rope_type": "dynamic", "factor": 2.0}),
            )]),
            "rope_parameters: rope_type \"dynamic\"",
        ),
        (
            with(&[(
                "rope_scaling",
                json!({"rope_type": "llama3", "factor": 8.0}),
            )]),
            "low_freq_factor is missing",
        ),
        (
            with(&[(
                "rope_scaling",
                json!({"rope_type": "linear", "factor": 2.0, "beta": 1}),
            )]),
            "beta is not a parameter",
        ),
        (
            with(&[(
                "rope_parameters",
                json!({"full_attention": {"rope_type": "default"}}),
            )]),
            "per-layer-type",
        ),
        (
            with(&[
                ("dtype", json!("float16")),
                ("torch_dtype", json!("bfloat16")),
            ]),
            "disagree",
        ),
        (with(&[("eos_token_id", json!(999))]), "eos_token_id (999)"),
        (
            with(&[("hidden_size", json!(-1))]),
            "hidden_size: expected a non-negative",
        ),
        (json!({"hidden_size": 64}), "names neither"),
    ];
    for (v, want) in cases {
        let e = err(v);
        assert!(e.contains(want), "wanted {want:?} in: {e}");
    }
}

/// A config naming only the architecture: every omitted key takes the default of transformers'
/// `LlamaConfig`.
#[test]
fn omitted_keys_take_transformers_llama_defaults() {
    let m = parse(&json!({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})).unwrap();
    let c = &m.config;
    assert_eq!(
        (
            c.vocab_size,
            c.hidden_size,
            c.intermediate_size,
            c.num_hidden_layers
        ),
        (32000, 4096, 11008, 32)
    );
    assert_eq!((c.num_attention_heads, c.num_key_value_heads), (32, 32));
    assert_eq!((c.max_position_embeddings, c.head_dim), (2048, None));
    assert_eq!(
        (c.rms_norm_eps, c.init_std, c.rope_theta),
        (1e-6, 0.02, 10000.0)
    );
    assert_eq!((c.tie_word_embeddings, c.rope_scaling), (false, None));
    let m = parse(&with(&[("num_attention_heads", json!(8))])).unwrap();
    assert_eq!(m.config.num_key_value_heads, 2, "given, not defaulted");
    let mut v = base();
    v.as_object_mut().unwrap().remove("num_key_value_heads");
    assert_eq!(
        parse(&v).unwrap().config.num_key_value_heads,
        4,
        "defaults to the heads"
    );
}
