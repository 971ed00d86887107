//! What a run shows of itself, through the binary: stragglers named from every rank's compute
//! time (a rank slowed by a test fault is named, an unslowed run names none), and TensorBoard
//! event files read back by a parser written here from the format's description (TFRecord
//! framing with masked CRC-32C, the `Event` protocol buffer), independent of the writer's crates.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

const BASE: &str = "schedule.warmup_steps=1,train.global_batch=16,train.micro_batch=4,\
                    run.log_interval=1";

mod common;

fn pretrain(dir: &Path, set: &str) -> Command {
    common::cli::tiny(dir, BASE, set)
}

fn records(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn a_slowed_rank_is_named_a_straggler_and_an_unslowed_run_names_none() {
    let dir = tempfile::tempdir().unwrap();
    let set = "train.steps=3,train.eval_interval=0,parallel.dp=2";
    // Of two ranks, the median is their mean: a pause `d` names the slow rank (ratio 1.2) while
    // `d` exceeds half the step's compute, which a loaded machine stretches; 1 s leaves room.
    for slow in [None, Some("1:1000")] {
        let run = dir
            .path()
            .join(if slow.is_some() { "slow" } else { "even" });
        let mut cmd = pretrain(&run, set);
        if let Some(s) = slow {
            cmd.env("PRETRAIN_TEST_SLOW_RANK", s);
        }
        let o = cmd.output().unwrap();
        let log =
            String::from_utf8_lossy(&o.stderr).into_owned() + &String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{log}");
        for r in records(&run) {
            let named: Vec<u64> = r["stragglers"]
                .as_array()
                .unwrap_or_else(|| panic!("no stragglers field: {r}"))
                .iter()
                .map(|s| s["rank"].as_u64().unwrap())
                .collect();
            let median = r["compute_median_s"].as_f64().unwrap();
            assert!(median > 0.0, "{r}");
            match slow {
                None => assert!(named.is_empty(), "{r}"),
                Some(_) => {
                    assert_eq!(named, [1], "{r}");
                    assert!(r["stragglers"][0]["ratio"].as_f64().unwrap() > 1.2, "{r}");
                }
            }
        }
        let warned = log.contains("stragglers (compute above 1.2x the median");
        assert_eq!(warned, slow.is_some(), "{log}");
        if slow.is_some() {
            assert!(log.contains("rank 1 "), "{log}");
        }
    }
}

/// CRC-32C, bit by bit (the Castagnoli polynomial, reflected).
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82f6_3b78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn masked(crc: u32) -> u32 {
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// The records of a TFRecord file, each checksum checked.
fn tfrecords(bytes: &[u8]) -> Vec<&[u8]> {
    let (mut out, mut pos) = (Vec::new(), 0);
    let u32_at = |p: usize| u32::from_le_bytes(bytes[p..p + 4].try_into().unwrap());
    while pos < bytes.len() {
        let len_bytes = &bytes[pos..pos + 8];
        assert_eq!(
            u32_at(pos + 8),
            masked(crc32c(len_bytes)),
            "length checksum"
        );
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        let data = &bytes[pos + 12..pos + 12 + len];
        assert_eq!(
            u32_at(pos + 12 + len),
            masked(crc32c(data)),
            "data checksum"
        );
        out.push(data);
        pos += 16 + len;
    }
    out
}

/// A protocol buffer field's value: a varint, 8 or 4 fixed bytes, or a length-delimited run.
enum Field<'a> {
    Varint(u64),
    Fixed64([u8; 8]),
    Fixed32([u8; 4]),
    Bytes(&'a [u8]),
}

/// The fields of a protocol buffer message, as (number, value).
fn fields(mut b: &[u8]) -> Vec<(u64, Field<'_>)> {
    fn varint(b: &mut &[u8]) -> u64 {
        let (mut v, mut shift) = (0u64, 0);
        loop {
            let byte = b[0];
            *b = &b[1..];
            v |= ((byte & 0x7f) as u64) << shift;
            if byte < 0x80 {
                return v;
            }
            shift += 7;
        }
    }
    let mut out = Vec::new();
    while !b.is_empty() {
        let key = varint(&mut b);
        let value = match key & 7 {
            0 => Field::Varint(varint(&mut b)),
            1 => {
                let v = b[..8].try_into().unwrap();
                b = &b[8..];
                Field::Fixed64(v)
            }
            2 => {
                let n = varint(&mut b) as usize;
                let v = &b[..n];
                b = &b[n..];
                Field::Bytes(v)
            }
            5 => {
                let v = b[..4].try_into().unwrap();
                b = &b[4..];
                Field::Fixed32(v)
            }
            w => panic!("wire type {w}"),
        };
        out.push((key >> 3, value));
    }
    out
}

/// One event: its step, file version, session-log status and scalars.
#[derive(Debug, Default)]
struct Event {
    step: i64,
    wall_time: f64,
    file_version: Option<String>,
    session_status: Option<u64>,
    scalars: BTreeMap<String, f32>,
}

fn event(data: &[u8]) -> Event {
    let mut e = Event::default();
    for (n, f) in fields(data) {
        match (n, f) {
            (1, Field::Fixed64(v)) => e.wall_time = f64::from_le_bytes(v),
            (2, Field::Varint(v)) => e.step = v as i64,
            (3, Field::Bytes(v)) => e.file_version = Some(String::from_utf8(v.to_vec()).unwrap()),
            (5, Field::Bytes(summary)) => {
                for (n, value) in fields(summary) {
                    let (1, Field::Bytes(value)) = (n, value) else {
                        panic!("summary field {n}")
                    };
                    let (mut tag, mut x) = (String::new(), None);
                    for (n, f) in fields(value) {
                        match (n, f) {
                            (1, Field::Bytes(t)) => tag = String::from_utf8(t.to_vec()).unwrap(),
                            (2, Field::Fixed32(v)) => x = Some(f32::from_le_bytes(v)),
                            _ => {}
                        }
                    }
                    e.scalars.insert(tag, x.expect("a simple value"));
                }
            }
            (6, Field::Bytes(log)) => {
                for (n, f) in fields(log) {
                    if let (1, Field::Varint(s)) = (n, f) {
                        e.session_status = Some(s);
                    }
                }
            }
            (n, _) => panic!("unexpected Event field {n}"),
        }
    }
    e
}

fn events_of(dir: &Path) -> Vec<Vec<Event>> {
    let mut files: Vec<_> = std::fs::read_dir(dir.join("tensorboard"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files
        .iter()
        .map(|f| {
            let name = f.file_name().unwrap().to_string_lossy().into_owned();
            assert!(name.starts_with("events.out.tfevents."), "{name}");
            let bytes = std::fs::read(f).unwrap();
            tfrecords(&bytes).into_iter().map(event).collect()
        })
        .collect()
}

#[test]
fn tensorboard_events_hold_the_logged_values() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("tb");
    let set = "train.steps=4,train.eval_interval=2,run.tensorboard=true,checkpoint.interval=2";
    let o = pretrain(&run, set).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let files = events_of(&run);
    assert_eq!(files.len(), 1);
    let events = &files[0];
    assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
    assert!(events[0].wall_time > 1.7e9);
    let mut train = BTreeMap::new();
    let mut valid = BTreeMap::new();
    for e in &events[1..] {
        if let Some(l) = e.scalars.get("train/loss") {
            train.insert(e.step, *l);
            for tag in ["train/lr", "train/grad_norm", "throughput/tokens_per_s"] {
                assert!(e.scalars[tag].is_finite(), "{tag}");
            }
            assert!(e.scalars["memory/process_peak_mib"] > 0.0);
        }
        if let Some(l) = e.scalars.get("valid/loss") {
            valid.insert(e.step, *l);
        }
    }
    for r in records(&run) {
        let step = r["step"].as_i64().unwrap();
        if let Some(l) = r["loss"].as_f64() {
            assert_eq!(train[&step], l as f32, "step {step}");
        }
        if let Some(l) = r["val_loss"].as_f64() {
            assert_eq!(valid[&step], l as f32, "step {step}");
        }
    }
    assert_eq!(train.keys().copied().collect::<Vec<_>>(), [1, 2, 3, 4]);
    assert_eq!(valid.keys().copied().collect::<Vec<_>>(), [2, 4]);

    // A resumed run starts a second file whose START event makes TensorBoard drop the first
    // file's events from the resumed step on.
    let o = pretrain(&run, &format!("{set},train.steps=6,checkpoint.resume=auto"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let files = events_of(&run);
    assert_eq!(files.len(), 2);
    let resumed = files
        .iter()
        .find(|f| f.iter().any(|e| e.session_status.is_some()));
    let resumed = resumed.expect("a START event");
    let start = resumed
        .iter()
        .find(|e| e.session_status == Some(1))
        .unwrap();
    assert_eq!(start.step, 5);
    let steps: Vec<i64> = resumed
        .iter()
        .filter(|e| e.scalars.contains_key("train/loss"))
        .map(|e| e.step)
        .collect();
    assert_eq!(steps, [5, 6]);
}

/// A mixture-of-experts run's TensorBoard events hold the router's health as `metrics.jsonl`
/// records it: the means over layers and each layer's balance (coefficient of variation, the
/// busiest and idlest experts against the mean, its balancing loss, with a capacity the
/// dropped share).
#[test]
fn tensorboard_holds_each_moe_layers_balance() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("moe");
    let mut cmd = common::cli::bin();
    cmd.args(["--recipe", "recipes/tiny-moe.yaml", "--set"])
        .arg(format!(
            "{BASE},train.steps=2,train.eval_interval=0,run.tensorboard=true,\
         model.moe_expert_capacity_factor=1.0,run.dir={}",
            run.display()
        ));
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let events = events_of(&run).remove(0);
    let recs = records(&run);
    assert!(!recs.is_empty());
    for r in recs.iter().filter(|r| r["loss"].is_number()) {
        let step = r["step"].as_i64().unwrap();
        let e = events
            .iter()
            .find(|e| e.step == step && e.scalars.contains_key("train/loss"))
            .unwrap_or_else(|| panic!("no event of step {step}"));
        let moe = &r["moe"];
        let cv = moe["cv"].as_f64().unwrap();
        assert!(cv > 0.0, "a random router is not balanced exactly: cv {cv}");
        assert_eq!(e.scalars["moe/cv"], cv as f32, "step {step}");
        assert_eq!(
            e.scalars["moe/dropped"],
            moe["dropped"].as_f64().unwrap() as f32
        );
        let layers = moe["layers"].as_array().unwrap();
        assert!(!layers.is_empty());
        for l in layers {
            let tag = |what: &str| format!("moe/layer_{}/{what}", l["layer"]);
            for what in [
                "cv",
                "max_over_mean",
                "min_over_mean",
                "load_balancing",
                "dropped",
            ] {
                assert_eq!(
                    e.scalars[&tag(what)],
                    l[what].as_f64().unwrap() as f32,
                    "step {step} {}",
                    tag(what)
                );
            }
        }
    }
}
