//! The FP8 conversions against a brute-force reference (nearest finite value, ties to the even
//! code, saturating), the scale rule, and the block rounding against a per-block reference.

use super::*;

const FORMATS: [Fp8Format; 2] = [Fp8Format::E4M3, Fp8Format::E5M2];

/// The finite non-negative values of `f`, with their codes, in increasing order.
fn finite_codes(f: Fp8Format) -> Vec<(f32, u8)> {
    let mut v: Vec<(f32, u8)> = (0u8..0x80)
        .map(|c| (f.decode(c), c))
        .filter(|(x, _)| x.is_finite())
        .collect();
    v.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
    v
}

/// The code of `x` by search: the nearest finite value (ties to the even code), the largest for
/// anything beyond it, NaN for NaN.
fn reference_encode(f: Fp8Format, x: f32) -> Option<u8> {
    if x.is_nan() {
        return None;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs() as f64;
    let codes = finite_codes(f);
    let mut best = codes[0];
    for &(v, c) in &codes {
        let (d, db) = ((a - v as f64).abs(), (a - best.0 as f64).abs());
        if d < db || (d == db && c & 1 == 0) {
            best = (v, c);
        }
    }
    Some(best.1 | sign)
}

#[test]
fn every_finite_code_decodes_and_encodes_back() {
    for f in FORMATS {
        for c in 0u8..=255 {
            let v = f.decode(c);
            if v.is_finite() {
                assert_eq!(f.encode(v), c, "{f:?} code {c:#04x} = {v}");
            }
        }
    }
}

#[test]
fn the_formats_have_their_published_extremes() {
    use Fp8Format::*;
    assert_eq!(
        (E4M3.decode(0x7E), E4M3.decode(0x01)),
        (448.0, 2f32.powi(-9))
    );
    assert_eq!(
        (E5M2.decode(0x7B), E5M2.decode(0x01)),
        (57344.0, 2f32.powi(-16))
    );
    assert!(E4M3.decode(0x7F).is_nan() && E5M2.decode(0x7C).is_infinite());
    assert_eq!(E4M3.encode(f32::INFINITY), 0x7E, "saturates");
    assert_eq!(E5M2.encode(f32::NEG_INFINITY), 0xFB, "saturates");
    assert_eq!(E4M3.encode(1e9), 0x7E);
    assert!(E4M3.decode(E4M3.encode(f32::NAN)).is_nan());
}

#[test]
fn encoding_is_nearest_even_with_saturation() {
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for f in FORMATS {
        let codes = finite_codes(f);
        let mut xs: Vec<f32> = Vec::new();
        // Every value, every midpoint between neighbours (the ties), and just around them.
        for w in codes.windows(2) {
            let mid = (w[0].0 + w[1].0) / 2.0;
            xs.extend([w[0].0, mid, f32::from_bits(mid.to_bits() + 1)]);
            if mid > 0.0 {
                xs.push(f32::from_bits(mid.to_bits() - 1));
            }
        }
        // Beyond the largest value, tiny values, and random magnitudes over the whole range.
        let max = f.max();
        xs.extend([max * 1.03, max * 1.1, max * 4.0, 1e-30, 2f32.powi(-20)]);
        for _ in 0..20_000 {
            let e = (next() % 40) as i32 - 24;
            let m = 1.0 + (next() % 1_000_000) as f32 / 1e6;
            xs.push(m * 2f32.powi(e));
        }
        for x in xs {
            for x in [x, -x] {
                assert_eq!(Some(f.encode(x)), reference_encode(f, x), "{f:?} {x:e}");
            }
        }
    }
}

#[test]
fn a_scale_is_the_largest_power_of_two_that_fits() {
    for f in FORMATS {
        let max = f.max();
        for amax in [1e-30f32, 3e-5, 0.1, 1.0, 447.0, 448.0, 449.0, 6e4, 3e38] {
            let s = fp8_scale(amax, max);
            assert_eq!(
                s.to_bits() & 0x007F_FFFF,
                0,
                "{amax}: {s} is a power of two"
            );
            assert!(amax * s <= max, "{f:?} {amax}: {s} overflows");
            assert!(
                (amax as f64) * (2.0 * s as f64) > max as f64,
                "{amax}: {s} is not the largest"
            );
        }
        for amax in [0.0, f32::INFINITY, f32::NAN] {
            assert_eq!(fp8_scale(amax, max), 1.0);
        }
    }
}

/// [`round_cpu`] by definition: each element's block found by its coordinates.
fn reference_round(x: &[f32], cols: usize, q: Fp8Quant) -> Vec<f32> {
    let rows = x.len() / cols;
    let (br, bc) = q.blocks.dims(rows, cols);
    let block = |r: usize, c: usize| (r / br, c / bc);
    let mut amax = std::collections::HashMap::new();
    for r in 0..rows {
        for c in 0..cols {
            let a: &mut f32 = amax.entry(block(r, c)).or_insert(0.0);
            let v = x[r * cols + c].abs();
            if v > *a {
                *a = v;
            }
        }
    }
    (0..rows * cols)
        .map(|i| {
            let s = fp8_scale(amax[&block(i / cols, i % cols)], q.format.max());
            q.format.decode(q.format.encode(x[i] * s)) / s
        })
        .collect()
}

#[test]
fn block_rounding_matches_its_definition() {
    let (rows, cols) = (300, 260); // ragged edge blocks both ways
    let x: Vec<f32> = (0..rows * cols)
        .map(|i| {
            let t = i as f32;
            // Magnitudes that differ by block, a few zeros and outliers.
            (t * 0.37).sin() * (1.0 + (i / 4096) as f32) * if i % 997 == 0 { 300.0 } else { 1.0 }
        })
        .collect();
    for format in FORMATS {
        for blocks in [
            Fp8Blocks::Tensor,
            Fp8Blocks::Rows,
            Fp8Blocks::Cols,
            Fp8Blocks::Tiles,
        ] {
            let q = Fp8Quant { format, blocks };
            let mut got = x.clone();
            round_cpu(&mut got, cols, q);
            let want = reference_round(&x, cols, q);
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{q:?}"
            );
            // Every value is an FP8 value times its block's power of two: within half a step of
            // the input (relative), or of the smallest subnormal step at the widest scale.
            let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
            let (tol, floor) = match format {
                Fp8Format::E4M3 => (1.0 / 16.0, amax * 2f32.powi(-16)),
                Fp8Format::E5M2 => (1.0 / 8.0, amax * 2f32.powi(-30)),
            };
            for (a, b) in got.iter().zip(&x) {
                assert!((a - b).abs() <= tol * b.abs() + floor, "{q:?}: {b} → {a}");
            }
        }
    }
}

#[test]
fn the_op_rounds_every_dtype_alike() -> Result<()> {
    let dev = candle_core::Device::Cpu;
    let x = Tensor::randn(0f32, 3.0, (4, 70, 256), &dev)?;
    let q = Fp8Quant {
        format: Fp8Format::E4M3,
        blocks: Fp8Blocks::Rows,
    };
    let f32_out = fp8_round(&x, q)?;
    // bf16 holds every rounded value exactly: rounding the bf16 input gives the same where the
    // input was already bf16.
    let xb = x.to_dtype(DType::BF16)?;
    let via_f32 = fp8_round(&xb.to_dtype(DType::F32)?, q)?;
    let direct = fp8_round(&xb, q)?;
    assert_eq!(direct.dtype(), DType::BF16);
    let (a, b) = (
        direct
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?,
        via_f32.flatten_all()?.to_vec1::<f32>()?,
    );
    assert_eq!(a, b);
    assert_eq!(f32_out.dims(), x.dims());
    // A transposed (non-contiguous) input is rounded as its contiguous copy.
    let t = x.transpose(1, 2)?;
    let (a, b) = (fp8_round(&t, q)?, fp8_round(&t.contiguous()?, q)?);
    assert_eq!(
        a.flatten_all()?.to_vec1::<f32>()?,
        b.flatten_all()?.to_vec1::<f32>()?
    );
    Ok(())
}
