//! Data-path benchmark on the bundled corpus: how fast the loader assembles micro-batches (sample
//! index, blend and memory-mapped reads of `data/shakespeare/shakespeare.{bin,idx}`), in tokens per
//! second for one process, at the tiny recipe's and the 1B recipes' sequence lengths; how fast
//! `preprocess` tokenizes text (the corpus repeated to 20x its size), in MB of text per second
//! with one worker and with every core; and, for the same text as paragraphs of about 3 kB (web
//! documents' size) in JSONL, gzip and zstd JSONL and zstd Parquet, how fast each form is read
//! (MB of document text per second on one core) and preprocessed with one worker.
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

/// MB of document text per second read from `input` on this thread (no tokenization).
fn read_mb_per_s(input: &Path) -> anyhow::Result<f64> {
    let start = Instant::now();
    let mut bytes = 0usize;
    for doc in data::input::read_documents(input, "text", None)? {
        bytes += std::hint::black_box(doc?).len();
    }
    Ok(bytes as f64 / 1e6 / start.elapsed().as_secs_f64())
}

/// `text` as documents of about 3 kB (whole paragraphs) in every compressed form: JSONL, gzip
/// and zstd JSONL, and Parquet with zstd pages in row groups of 10,000 documents.
fn write_forms(text: &str, dir: &Path) -> anyhow::Result<Vec<std::path::PathBuf>> {
    use parquet::data_type::{ByteArray, ByteArrayType};
    use std::io::Write;
    let mut docs: Vec<String> = vec![String::new()];
    for para in text.split("\n\n").filter(|p| !p.trim().is_empty()) {
        if docs.last().is_some_and(|d| d.len() > 3000) {
            docs.push(String::new());
        }
        let d = docs.last_mut().expect("one document at least");
        d.push_str(para);
        d.push_str("\n\n");
    }
    let jsonl: String = docs
        .iter()
        .map(|d| format!("{}\n", serde_json::json!({ "text": d })))
        .collect();
    let forms = [
        "docs.jsonl",
        "docs.jsonl.gz",
        "docs.jsonl.zst",
        "docs.parquet",
    ]
    .map(|f| dir.join(f));
    std::fs::write(&forms[0], &jsonl)?;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(jsonl.as_bytes())?;
    std::fs::write(&forms[1], gz.finish()?)?;
    std::fs::write(&forms[2], zstd::encode_all(jsonl.as_bytes(), 3)?)?;
    let schema = parquet::schema::parser::parse_message_type(
        "message doc { required binary text (STRING); }",
    )?;
    let props = parquet::file::properties::WriterProperties::builder()
        .set_compression(parquet::basic::Compression::ZSTD(Default::default()))
        .build();
    let file = std::fs::File::create(&forms[3])?;
    let mut w = parquet::file::writer::SerializedFileWriter::new(
        file,
        std::sync::Arc::new(schema),
        std::sync::Arc::new(props),
    )?;
    for group in docs.chunks(10_000) {
        let mut rg = w.next_row_group()?;
        let mut col = rg
            .next_column()?
            .ok_or_else(|| anyhow::anyhow!("no column"))?;
        let values: Vec<ByteArray> = group.iter().map(|d| d.as_str().into()).collect();
        col.typed::<ByteArrayType>()
            .write_batch(&values, None, None)?;
        col.close()?;
        rg.close()?;
    }
    w.close()?;
    Ok(forms.to_vec())
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
    // Each repetition's letters shifted by its number, so the compressors meet text that does
    // not repeat (20 identical copies would compress 50 times).
    let varied: String = text
        .split_inclusive("\n\n\n")
        .enumerate()
        .flat_map(|(i, play)| {
            let shift = (i / plays.len()) as u8;
            play.chars().map(move |c| match c {
                'a'..='z' => ((c as u8 - b'a' + shift) % 26 + b'a') as char,
                'A'..='Z' => ((c as u8 - b'A' + shift) % 26 + b'A') as char,
                _ => c,
            })
        })
        .collect();
    let mut forms = serde_json::Map::new();
    for form in write_forms(&varied, dir.path())? {
        let name = form
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let summary = data::preprocess(&PreprocessOptions {
            inputs: vec![form.display().to_string()],
            tokenizer: root.join("data/shakespeare/tokenizer.json"),
            output_prefix: dir.path().join("forms"),
            workers: Some(1),
            show_progress: false,
            ..PreprocessOptions::default()
        })?;
        forms.insert(
            name,
            serde_json::json!({
                "read_mb_per_s": read_mb_per_s(&form)?,
                "preprocess_mb_per_s_1_worker": summary.mb_per_s,
                "file_mb": summary.input_bytes as f64 / 1e6,
                "documents": summary.documents,
            }),
        );
    }

    println!(
        "{}",
        serde_json::json!({
            "loader_tokens_per_s_seq128_mb8": short,
            "loader_tokens_per_s_seq2048_mb2": long,
            "preprocess_input_mb": text.len() as f64 / 1e6,
            "preprocess_mb_per_s_1_worker": one,
            "preprocess_mb_per_s_all_cores": all,
            "forms_of_the_same_text": forms,
            "cores": cores,
        })
    );
    Ok(())
}
