//! Data-path benchmark on the bundled corpus: how fast the loader assembles micro-batches (sample
//! index, blend and memory-mapped reads of `data/shakespeare/shakespeare.{bin,idx}`), in tokens per
//! second for one process, at the tiny recipe's and the 1B recipes' sequence lengths; and how
//! fast `preprocess` tokenizes text (the corpus repeated to 20x its size), in MB of input per
//! second with one worker and with every core.
//!
//! Run: `cargo bench --bench data -- [seconds per loader measurement]`; prints one JSON line.

use std::path::Path;
use std::time::Instant;

use data::{micro_batch_indices, DataConfig, GptData, PreprocessOptions, Split};

#[global_allocator]
static GLOBAL: pretrain::Allocator = pretrain::Allocator {};

/// Tokens per second of micro-batches of `micro_batch` × `seq_len` drawn in training order for
/// about `seconds`.
fn loader_tokens_per_s(seq_len: usize, micro_batch: usize, seconds: f64) -> anyhow::Result<f64> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cfg: DataConfig = serde_yaml::from_str(
        "datasets:\n  - prefix: data/shakespeare/shakespeare\ntokenizer: data/shakespeare/tokenizer.json\nsplit: \"95,5\"\n",
    )?;
    let global_batch = micro_batch * 4;
    let steps = 1u64 << 16; // then the same steps again: the index is built, reads are what count
    let data = GptData::open(
        &cfg,
        root,
        Split::Train,
        seq_len,
        1234,
        steps * global_batch as u64,
    )?;
    let (start, mut tokens, mut step) = (Instant::now(), 0usize, 0u64);
    while start.elapsed().as_secs_f64() < seconds {
        let consumed = step % steps * global_batch as u64;
        for ix in micro_batch_indices(consumed, global_batch, micro_batch, 0, 1) {
            let b = std::hint::black_box(data.batch(&ix)?);
            tokens += b.tokens.len();
        }
        step += 1;
    }
    Ok(tokens as f64 / start.elapsed().as_secs_f64())
}

/// MB (10^6 bytes) of text per second through `preprocess` with `workers` threads.
fn preprocess_mb_per_s(input: &Path, out: &Path, workers: usize) -> anyhow::Result<f64> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let summary = data::preprocess(&PreprocessOptions {
        inputs: vec![input.display().to_string()],
        tokenizer: root.join("data/shakespeare/tokenizer.json"),
        output_prefix: out.join(format!("bench-{workers}")),
        doc_separator: Some("\n\n\n".into()),
        workers: Some(workers),
        show_progress: false,
        ..PreprocessOptions::default()
    })?;
    Ok(summary.mb_per_s)
}

fn main() -> anyhow::Result<()> {
    pretrain::process_defaults();
    let seconds: f64 = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .map_or(Ok(3.0), |s| s.parse())?;
    let short = loader_tokens_per_s(128, 8, seconds)?;
    let long = loader_tokens_per_s(2048, 2, seconds)?;

    // The corpus 20 times over, as one text file of documents separated by blank lines.
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir()?;
    let mut text = String::new();
    let mut plays: Vec<_> = std::fs::read_dir(root.join("data/shakespeare"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with("_gut.txt"))
        .collect();
    plays.sort();
    for _ in 0..20 {
        for p in &plays {
            text.push_str(&std::fs::read_to_string(p)?);
            text.push_str("\n\n\n");
        }
    }
    let input = dir.path().join("corpus.txt");
    std::fs::write(&input, &text)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let one = preprocess_mb_per_s(&input, dir.path(), 1)?;
    let all = preprocess_mb_per_s(&input, dir.path(), cores)?;

    println!(
        "{}",
        serde_json::json!({
            "loader_tokens_per_s_seq128_mb8": short,
            "loader_tokens_per_s_seq2048_mb2": long,
            "preprocess_input_mb": text.len() as f64 / 1e6,
            "preprocess_mb_per_s_1_worker": one,
            "preprocess_mb_per_s_all_cores": all,
            "cores": cores,
        })
    );
    Ok(())
}
