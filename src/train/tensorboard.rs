//! TensorBoard event files (`run.tensorboard: true`): the scalars of every step and validation
//! written to `<run.dir>/tensorboard/events.out.tfevents.<seconds>.<host>.<pid>`, readable by
//! `tensorboard --logdir <run.dir>`.
//!
//! The format is TensorFlow's: a file of records, each a little-endian `u64` length, the masked
//! CRC-32C of those eight bytes, the payload and its masked CRC-32C; every payload is a
//! serialized `tensorflow.Event` protocol buffer (encoded with `prost`). The first event names
//! the file version; a resumed run then writes a `SessionLog` START at its first step, on which
//! TensorBoard drops the earlier run's events from that step on, so a redone step shows once.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// `tensorflow.Event` (the fields written here).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    /// Seconds since the Unix epoch.
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    /// The training step.
    #[prost(int64, tag = "2")]
    pub step: i64,
    /// `"brain.Event:2"` in a file's first event.
    #[prost(string, optional, tag = "3")]
    pub file_version: Option<String>,
    /// Scalars.
    #[prost(message, optional, tag = "5")]
    pub summary: Option<Summary>,
    /// A run (re)starting.
    #[prost(message, optional, tag = "6")]
    pub session_log: Option<SessionLog>,
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    /// The values.
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value` with a scalar.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryValue {
    /// The scalar's name, e.g. `train/loss`.
    #[prost(string, tag = "1")]
    pub tag: String,
    /// The scalar.
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
}

/// `tensorflow.SessionLog`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SessionLog {
    /// 1: START.
    #[prost(int32, tag = "1")]
    pub status: i32,
}

/// TFRecord's checksum: CRC-32C rotated right by 15 bits plus a constant.
pub fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Appends events to one event file.
pub struct EventWriter {
    out: BufWriter<File>,
    path: PathBuf,
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl EventWriter {
    /// Creates a new event file under `dir/tensorboard/` for a run that starts after step
    /// `start` (0 for a fresh run).
    pub fn create(dir: &Path, start: usize) -> Result<Self> {
        let folder = dir.join("tensorboard");
        std::fs::create_dir_all(&folder)
            .with_context(|| format!("creating {}", folder.display()))?;
        let host = hostname();
        let path = folder.join(format!(
            "events.out.tfevents.{}.{host}.{}",
            now() as u64,
            std::process::id()
        ));
        let mut options = File::options();
        options.create_new(true).write(true);
        let f = crate::files::open_regular(&path, &mut options, "the TensorBoard event file")?;
        let mut w = EventWriter {
            out: BufWriter::new(f),
            path,
        };
        w.write(&Event {
            wall_time: now(),
            file_version: Some("brain.Event:2".into()),
            ..Default::default()
        })?;
        if start > 0 {
            w.write(&Event {
                wall_time: now(),
                step: start as i64 + 1,
                session_log: Some(SessionLog { status: 1 }),
                ..Default::default()
            })?;
        }
        Ok(w)
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes the scalars `(tag, value)` of `step` as one event; non-finite values are written
    /// as they are (TensorBoard shows them).
    pub fn scalars(&mut self, step: usize, values: &[(&str, f64)]) -> Result<()> {
        let value = values
            .iter()
            .map(|&(tag, v)| SummaryValue {
                tag: tag.to_string(),
                simple_value: Some(v as f32),
            })
            .collect();
        self.write(&Event {
            wall_time: now(),
            step: step as i64,
            summary: Some(Summary { value }),
            ..Default::default()
        })
    }

    fn write(&mut self, event: &Event) -> Result<()> {
        let data = prost::Message::encode_to_vec(event);
        let len = (data.len() as u64).to_le_bytes();
        let mut record = Vec::with_capacity(data.len() + 16);
        record.extend_from_slice(&len);
        record.extend_from_slice(&masked_crc(&len).to_le_bytes());
        record.extend_from_slice(&data);
        record.extend_from_slice(&masked_crc(&data).to_le_bytes());
        self.out
            .write_all(&record)
            .and_then(|_| self.out.flush())
            .with_context(|| format!("writing {}", self.path.display()))
    }
}

/// This machine's name, for the file name (`localhost` when unknown).
fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it or fails.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let name = if rc == 0 {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        String::new()
    };
    let name: String = name
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .collect();
    if name.is_empty() {
        "localhost".into()
    } else {
        name
    }
}
