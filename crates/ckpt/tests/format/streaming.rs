//! A rank's share written from declared pieces read as the file reaches them, against
//! `safetensors::serialize` and a share given its values up front.

use super::*;

/// A share whose pieces are read while the file is written is the file `safetensors::serialize`
/// makes of the same pieces, byte for byte (f32 before bf16, then by key, the header padded),
/// and so is a share given its values up front; a source that fails, or gives the wrong count
/// or type, fails the write naming the piece.
#[test]
fn a_streamed_share_is_the_file_safetensors_makes() {
    let tmp = tempfile::tempdir().unwrap();
    let b = block("w", &[4, 6], &[0, 0], &[4, 6]);
    let values = |k: usize| -> Values {
        match k % 3 {
            0 => Values::F32((0..7).map(|i| (i * k) as f32 - 0.5).collect()),
            1 => Values::Bf16((0..9).map(|i| bf16::from_f32(i as f32 * 0.25)).collect()),
            _ => Values::F32(vec![k as f32; 5]),
        }
    };
    let ranges = |k: usize| k * 10..k * 10 + values(k).len();
    let kinds = Kind::ADAMW;
    let read = |step: u64, rank: usize| {
        let dir = tmp
            .path()
            .join(format!("{}.tmp", ckpt::step_dir_name(step)));
        std::fs::read(dir.join(format!("rank-{rank:05}.safetensors"))).unwrap()
    };
    // Up front.
    let mut w = RankWriter::new(tmp.path(), 1, 0).unwrap();
    for k in 0..6 {
        w.add(kinds[k % 3], b, ranges(k), values(k));
    }
    w.write().unwrap();
    // Streamed.
    let mut w = RankWriter::new(tmp.path(), 2, 0).unwrap();
    for k in 0..6 {
        assert_eq!(w.declare(kinds[k % 3], b, ranges(k), values(k).dtype()), k);
    }
    w.write_with(|k, _| Ok(values(k))).unwrap();
    // safetensors itself.
    let bytes: Vec<(String, Vec<u8>, safetensors::Dtype)> = (0..6)
        .map(|k| {
            let key = format!("{}/w/{}", kinds[k % 3].as_str(), ranges(k).start);
            let (raw, dtype) = match values(k) {
                Values::F32(v) => (
                    v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                    safetensors::Dtype::F32,
                ),
                Values::Bf16(v) => (
                    v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                    safetensors::Dtype::BF16,
                ),
            };
            (key, raw, dtype)
        })
        .collect();
    let views = bytes.iter().map(|(k, raw, dtype)| {
        let n = raw.len()
            / if *dtype == safetensors::Dtype::F32 {
                4
            } else {
                2
            };
        let view = safetensors::tensor::TensorView::new(*dtype, vec![n], raw).unwrap();
        (k.clone(), view)
    });
    let reference = safetensors::serialize(views, None).unwrap();
    assert_eq!(read(1, 0), reference);
    assert_eq!(read(2, 0), reference);
    // A failing or wrong source.
    for (step, bad) in [(3, 0), (4, 1), (5, 2)] {
        let mut w = RankWriter::new(tmp.path(), step, 0).unwrap();
        w.declare(Kind::Master, b, 0..7, PieceDtype::F32);
        let e = w
            .write_with(|_, _| match bad {
                0 => Err("device lost".into()),
                1 => Ok(Values::F32(vec![0.0; 6])),
                _ => Ok(Values::Bf16(vec![bf16::ZERO; 7])),
            })
            .unwrap_err()
            .to_string();
        let want = [
            "reading master/w/0: device lost",
            "6 F32 values for a piece of 7 F32",
            "7 Bf16 values for a piece of 7 F32",
        ];
        assert!(e.contains(want[bad]), "{e}");
    }
}
