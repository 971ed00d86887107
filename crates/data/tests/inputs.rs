//! Input-form tests: the same documents as gzip and zstd JSONL and text, and as Parquet (row
//! groups, nullable and nested columns, every codec built in), give byte-identical `.bin/.idx`
//! to plain JSONL; hostile inputs (truncated, bombs, invalid UTF-8, a missing column, nulls) get
//! errors naming the file and the place and leave no dataset behind; shards concatenate to the
//! unsharded dataset.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use data::indexed::{bin_path, idx_path};
use data::{preprocess, DataError, IndexedDataset, PreprocessOptions};
use parquet::basic::{Compression, ZstdLevel};
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;

fn opts(inputs: Vec<PathBuf>, tokenizer: &Path, prefix: &Path) -> PreprocessOptions {
    PreprocessOptions {
        inputs: inputs.iter().map(|p| p.display().to_string()).collect(),
        tokenizer: tokenizer.to_path_buf(),
        output_prefix: prefix.to_path_buf(),
        show_progress: false,
        ..Default::default()
    }
}

/// Documents of up to 4,000 characters with Unicode, an empty one, newlines inside, and one of
/// 300 kB.
fn documents() -> Vec<String> {
    let text = common::small_text();
    let mut docs: Vec<String> = (0..300)
        .map(|i| {
            let body: String = text
                .chars()
                .skip(i * 97 % 20_000)
                .take(i * 131 % 4000)
                .collect();
            format!("Document {i}: {body}")
        })
        .collect();
    docs[7] = String::new();
    docs[8] = "Ünïcödé ✓ — 日本語\nsecond line\r\nthird".into();
    docs[9] = "x ".repeat(150_000);
    docs
}

fn jsonl(docs: &[String]) -> String {
    docs.iter()
        .map(|d| format!("{}\n", serde_json::json!({ "id": 1, "text": d })))
        .collect()
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

/// Writes `docs` as a Parquet file with `per_group` rows per row group, the text in column
/// `text` (or, `nested`, in `meta.text` of a struct) beside an id column.
fn write_parquet(path: &Path, docs: &[Option<&[u8]>], per_group: usize, codec: Compression) {
    let schema = "message doc { required int64 id; optional binary text (STRING); \
                  optional group meta { optional binary text (STRING); } }";
    let schema = Arc::new(parquet::schema::parser::parse_message_type(schema).unwrap());
    let props = Arc::new(WriterProperties::builder().set_compression(codec).build());
    let file = std::fs::File::create(path).unwrap();
    let mut w = SerializedFileWriter::new(file, schema, props).unwrap();
    for group in docs.chunks(per_group) {
        let mut rg = w.next_row_group().unwrap();
        let ids: Vec<i64> = (0..group.len() as i64).collect();
        let values: Vec<ByteArray> = group.iter().flatten().map(|d| d.to_vec().into()).collect();
        let mut col = rg.next_column().unwrap().unwrap();
        col.typed::<parquet::data_type::Int64Type>()
            .write_batch(&ids, None, None)
            .unwrap();
        col.close().unwrap();
        for max_def in [1i16, 2] {
            let defs: Vec<i16> = group
                .iter()
                .map(|d| if d.is_some() { max_def } else { 0 })
                .collect();
            let mut col = rg.next_column().unwrap().unwrap();
            col.typed::<ByteArrayType>()
                .write_batch(&values, Some(&defs), None)
                .unwrap();
            col.close().unwrap();
        }
        rg.close().unwrap();
    }
    w.close().unwrap();
}

fn dataset_bytes(prefix: &Path) -> (Vec<u8>, Vec<u8>) {
    (
        std::fs::read(bin_path(prefix)).unwrap(),
        std::fs::read(idx_path(prefix)).unwrap(),
    )
}

#[test]
fn every_form_gives_the_plain_jsonl_dataset() {
    let dir = tempfile::tempdir().unwrap();
    let tok = common::small_tokenizer(dir.path());
    let docs = documents();
    let text = jsonl(&docs);
    let d = dir.path();
    std::fs::write(d.join("plain.jsonl"), &text).unwrap();
    let reference = d.join("reference");
    preprocess(&opts(vec![d.join("plain.jsonl")], &tok, &reference)).unwrap();
    let want = dataset_bytes(&reference);

    // gzip in two members (as pigz writes), zstd in two frames.
    let half = text.len() / 2 + text[text.len() / 2..].find('\n').unwrap() + 1;
    let mut gz = gzip(&text.as_bytes()[..half]);
    gz.extend(gzip(&text.as_bytes()[half..]));
    std::fs::write(d.join("a.jsonl.gz"), gz).unwrap();
    let mut zst = zstd::encode_all(&text.as_bytes()[..half], 3).unwrap();
    zst.extend(zstd::encode_all(&text.as_bytes()[half..], 19).unwrap());
    std::fs::write(d.join("a.jsonl.zst"), zst).unwrap();
    let refs: Vec<Option<&[u8]>> = docs.iter().map(|d| Some(d.as_bytes())).collect();
    let codecs = [
        Compression::UNCOMPRESSED,
        Compression::SNAPPY,
        Compression::ZSTD(ZstdLevel::default()),
        Compression::GZIP(Default::default()),
        Compression::LZ4_RAW,
    ];
    for (i, codec) in codecs.into_iter().enumerate() {
        write_parquet(&d.join(format!("p{i}.parquet")), &refs, 7 + 40 * i, codec);
    }
    let mut forms: Vec<(PathBuf, &str)> = vec![
        (d.join("a.jsonl.gz"), "text"),
        (d.join("a.jsonl.zst"), "text"),
    ];
    for i in 0..codecs.len() {
        forms.push((d.join(format!("p{i}.parquet")), "text"));
    }
    forms.push((d.join("p1.parquet"), "meta.text"));
    for (input, key) in forms {
        let prefix = d.join("out");
        let mut o = opts(vec![input.clone()], &tok, &prefix);
        o.json_key = key.into();
        let s = preprocess(&o).unwrap();
        assert_eq!(s.documents, docs.len() as u64);
        assert_eq!(
            s.text_bytes,
            docs.iter().map(|d| d.len() as u64).sum::<u64>()
        );
        assert!(
            dataset_bytes(&prefix) == want,
            "{} `{key}` differs",
            input.display()
        );
    }

    // Text: a compressed file split at a separator equals the plain file.
    let body = docs[..50].join("\n\n=====\n\n");
    std::fs::write(d.join("t.txt"), &body).unwrap();
    std::fs::write(
        d.join("t.txt.zst"),
        zstd::encode_all(body.as_bytes(), 1).unwrap(),
    )
    .unwrap();
    std::fs::write(d.join("u.txt.gz"), gzip(body.as_bytes())).unwrap();
    let mut outs = Vec::new();
    for input in ["t.txt", "t.txt.zst", "u.txt.gz"] {
        let prefix = d.join(input.replace('.', "_"));
        let mut o = opts(vec![d.join(input)], &tok, &prefix);
        o.doc_separator = Some("\n\n=====\n\n".into());
        assert_eq!(
            preprocess(&o).unwrap().documents,
            49,
            "the empty document is dropped"
        );
        outs.push(dataset_bytes(&prefix));
    }
    assert!(outs[0] == outs[1] && outs[1] == outs[2]);

    // Mixed forms through one glob, in sorted order.
    let mixed = d.join("mixed");
    let o = opts(vec![d.join("a.jsonl.*")], &tok, &mixed);
    let s = preprocess(&o).unwrap();
    assert_eq!((s.files, s.documents), (2, 2 * docs.len() as u64));
}

/// Runs `preprocess` on one hostile input over an existing dataset: the error must contain
/// every `needle`, and the existing dataset must survive with no temporary file beside it.
fn refused(dir: &Path, tok: &Path, input: &Path, key: &str, needles: &[&str]) -> DataError {
    let prefix = dir.join("kept");
    let good = dir.join("good.jsonl");
    if !good.exists() {
        std::fs::write(&good, "{\"text\": \"kept\"}\n").unwrap();
        preprocess(&opts(vec![good.clone()], tok, &prefix)).unwrap();
    }
    let before = dataset_bytes(&prefix);
    let mut o = opts(vec![input.to_path_buf()], tok, &prefix);
    o.json_key = key.into();
    let e = preprocess(&o).unwrap_err();
    let msg = e.to_string();
    for n in needles {
        assert!(msg.contains(n), "`{n}` not in: {msg}");
    }
    assert!(dataset_bytes(&prefix) == before, "the dataset changed");
    let tmp: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(tmp.is_empty(), "{tmp:?}");
    e
}

#[test]
fn hostile_inputs_are_refused_by_name_and_place() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tok = common::small_tokenizer(d);
    let docs = documents();
    let refs: Vec<Option<&[u8]>> = docs.iter().map(|d| Some(d.as_bytes())).collect();

    // Parquet: truncated, a missing column, a null, invalid UTF-8, a list column.
    let p = d.join("full.parquet");
    write_parquet(&p, &refs, 50, Compression::SNAPPY);
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(d.join("cut.parquet"), &bytes[..bytes.len() / 2]).unwrap();
    refused(
        d,
        &tok,
        &d.join("cut.parquet"),
        "text",
        &["cut.parquet: footer"],
    );
    let e = refused(
        d,
        &tok,
        &p,
        "body",
        &["no column `body`", "text, meta.text"],
    );
    assert!(e.to_string().contains("full.parquet"), "{e}");
    refused(d, &tok, &p, "id", &["column `id` holds INT64"]);
    refused(
        d,
        &tok,
        &p,
        "meta",
        &["column `meta` is nested", "meta.text"],
    );
    let mut with_null = refs.clone();
    with_null[123] = None;
    write_parquet(&d.join("null.parquet"), &with_null, 50, Compression::SNAPPY);
    refused(
        d,
        &tok,
        &d.join("null.parquet"),
        "text",
        &["null.parquet: row 123", "is null"],
    );
    let mut with_bad = refs.clone();
    with_bad[77] = Some(b"ok \xff\xfe");
    write_parquet(
        &d.join("utf.parquet"),
        &with_bad,
        50,
        Compression::UNCOMPRESSED,
    );
    refused(
        d,
        &tok,
        &d.join("utf.parquet"),
        "text",
        &["utf.parquet: row 77", "UTF-8 at byte 3"],
    );
    // A damaged page header in the second row group's text column.
    use parquet::file::reader::FileReader;
    let reader = parquet::file::reader::SerializedFileReader::new(std::fs::File::open(&p).unwrap());
    let page = reader
        .unwrap()
        .metadata()
        .row_group(1)
        .column(1)
        .data_page_offset() as usize;
    let mut damaged = bytes.clone();
    for b in &mut damaged[page..page + 16] {
        *b ^= 0x5a;
    }
    std::fs::write(d.join("damaged.parquet"), &damaged).unwrap();
    refused(
        d,
        &tok,
        &d.join("damaged.parquet"),
        "text",
        &["damaged.parquet: row 50 (row group 1)"],
    );

    // Compressed: truncated gzip and zstd, bombs, invalid UTF-8 inside.
    let text = jsonl(&docs);
    let gz = gzip(text.as_bytes());
    std::fs::write(d.join("cut.jsonl.gz"), &gz[..gz.len() - 100]).unwrap();
    refused(
        d,
        &tok,
        &d.join("cut.jsonl.gz"),
        "text",
        &[
            "cut.jsonl.gz",
            "gzip stream damaged or truncated near compressed byte",
        ],
    );
    let zst = zstd::encode_all(text.as_bytes(), 3).unwrap();
    std::fs::write(d.join("cut.jsonl.zst"), &zst[..zst.len() - 100]).unwrap();
    refused(
        d,
        &tok,
        &d.join("cut.jsonl.zst"),
        "text",
        &["cut.jsonl.zst", "zstd stream damaged or truncated"],
    );
    // Placed where the decoder was, not at the stream's start: a stream cut inside its first
    // block, which fails in the decoder's first call.
    let big: String = (0..50_000u64)
        .map(|i| format!("{} ", i.wrapping_mul(2_654_435_761) % 1_000_003))
        .collect();
    let long = zstd::encode_all(big.as_bytes(), 3).unwrap();
    let cut = 10_000;
    std::fs::write(d.join("cut.txt.zst"), &long[..cut]).unwrap();
    let e = refused(
        d,
        &tok,
        &d.join("cut.txt.zst"),
        "text",
        &["cut.txt.zst", "zstd stream damaged or truncated"],
    );
    let near: u64 = e
        .to_string()
        .split("near compressed byte ")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok())
        .expect("a compressed byte is named");
    assert!(
        long.len() > 2 * cut && near + 4096 >= cut as u64,
        "near byte {near}, cut at {cut}"
    );
    let zeros = vec![b' '; 256 << 20];
    std::fs::write(d.join("bomb.jsonl.gz"), gzip(&zeros)).unwrap();
    refused(
        d,
        &tok,
        &d.join("bomb.jsonl.gz"),
        "text",
        &["bomb.jsonl.gz", "a decompression bomb?"],
    );
    std::fs::write(
        d.join("bomb.txt.zst"),
        zstd::encode_all(&zeros[..], 1).unwrap(),
    )
    .unwrap();
    refused(
        d,
        &tok,
        &d.join("bomb.txt.zst"),
        "text",
        &["bomb.txt.zst", "over 200x"],
    );
    let mut invalid = b"{\"text\": \"fine\"}\n{\"text\": \"b".to_vec();
    invalid.extend(b"ad \xc3(\"}\n");
    std::fs::write(
        d.join("utf.jsonl.zst"),
        zstd::encode_all(&invalid[..], 1).unwrap(),
    )
    .unwrap();
    refused(
        d,
        &tok,
        &d.join("utf.jsonl.zst"),
        "text",
        &["utf.jsonl.zst:2", "invalid UTF-8 at byte 14"],
    );
    std::fs::write(d.join("utf.txt.gz"), gzip(b"fine\n\nb\xc3(")).unwrap();
    let e = refused(
        d,
        &tok,
        &d.join("utf.txt.gz"),
        "text",
        &["utf.txt.gz: byte 7: invalid UTF-8"],
    );
    assert!(matches!(e, DataError::Corrupt { .. }), "{e:?}");
    std::fs::write(d.join("x.parquet.gz"), gzip(&bytes)).unwrap();
    refused(
        d,
        &tok,
        &d.join("x.parquet.gz"),
        "text",
        &["x.parquet.gz", "compresses its pages itself"],
    );
}

#[test]
fn shards_concatenate_to_the_whole_dataset() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tok = common::small_tokenizer(d);
    let docs = documents();
    std::fs::write(d.join("c.jsonl"), jsonl(&docs)).unwrap();
    let whole = d.join("whole");
    preprocess(&opts(vec![d.join("c.jsonl")], &tok, &whole)).unwrap();
    let whole = IndexedDataset::open(&whole).unwrap();

    let prefix = d.join("sharded/ds");
    // A shard of an earlier, longer run, which the new run replaces.
    std::fs::create_dir_all(d.join("sharded")).unwrap();
    for ext in ["bin", "idx"] {
        std::fs::write(d.join(format!("sharded/ds_00099.{ext}")), "stale").unwrap();
    }
    let mut o = opts(vec![d.join("c.jsonl")], &tok, &prefix);
    o.shard_bytes = Some(100_000);
    let s = preprocess(&o).unwrap();
    assert!(s.datasets.len() > 2, "{s}");
    assert!(s.to_string().contains("weight:"), "{s}");
    assert!(!d.join("sharded/ds.bin").exists());
    let mut seq = 0;
    for (i, shard) in s.datasets.iter().enumerate() {
        assert_eq!(shard.prefix, data::preprocess::shard_prefix(&prefix, i));
        let ds = IndexedDataset::open(&shard.prefix).unwrap();
        assert_eq!(ds.num_sequences() as u64, shard.documents);
        assert_eq!(ds.num_tokens(), shard.tokens);
        if i + 1 < s.datasets.len() {
            assert!(std::fs::metadata(bin_path(&shard.prefix)).unwrap().len() >= 100_000);
        }
        for k in 0..ds.num_sequences() {
            let len = ds.sequence_lengths()[k] as usize;
            assert_eq!(ds.get(k, 0, len).unwrap(), whole.get(seq, 0, len).unwrap());
            seq += 1;
        }
    }
    assert_eq!(seq, whole.num_sequences());
    // Stale shards are removed from the new last one on while they continue unbroken
    // (`_00099` stays: it follows no shard).
    let last = s.datasets.len();
    for ext in ["bin", "idx"] {
        std::fs::write(d.join(format!("sharded/ds_{last:05}.{ext}")), "stale").unwrap();
    }
    preprocess(&o).unwrap();
    assert!(!d.join(format!("sharded/ds_{last:05}.bin")).exists());
}

/// A Parquet column of large documents is read a few rows at a time (the batch follows their
/// size), every document whole and in order.
#[test]
fn large_parquet_documents_are_read_whole_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("big.parquet");
    let docs: Vec<Vec<u8>> = (0..40u8)
        .map(|i| vec![b'a' + i % 26; (3 << 20) + i as usize])
        .collect();
    let refs: Vec<Option<&[u8]>> = docs.iter().map(|d| Some(&d[..])).collect();
    write_parquet(&p, &refs, 25, Compression::SNAPPY);
    let read: Vec<String> = data::input::read_documents(&p, "text", None)
        .unwrap()
        .collect::<data::Result<_>>()
        .unwrap();
    assert_eq!(read.len(), docs.len());
    for (r, d) in read.iter().zip(&docs) {
        assert_eq!(r.as_bytes(), &d[..]);
    }
}
