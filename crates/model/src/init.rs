//! Seeded, layout-free parameter initialisation.
//!
//! Element `i` of parameter `name` is a pure function of `(seed, name, i)` (a counter-based
//! generator: SplitMix64 finalisers over the counter, Box–Muller for normals). Any rank can
//! therefore produce exactly its slice of a tensor-parallel shard, and every layout starts from
//! bit-identical weights.

/// SplitMix64's output function: a bijective 64-bit mixer.
fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// 64-bit FNV-1a of a parameter name, mixed with the run seed.
fn stream_key(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix64(h ^ mix64(seed))
}

/// A uniform in (0, 1] from 53 random bits.
fn unit(bits: u64) -> f64 {
    ((bits >> 11) as f64 + 1.0) * (1.0 / (1u64 << 53) as f64)
}

/// Standard-normal sample number `index` of the stream `(seed, name)`.
pub fn normal(seed: u64, name: &str, index: u64) -> f64 {
    normal_of_key(stream_key(seed, name), index)
}

/// Standard-normal sample number `index` of the stream whose key is `key` (see [`stream_key`]).
fn normal_of_key(key: u64, index: u64) -> f64 {
    let u1 = unit(mix64(key ^ mix64(2 * index)));
    let u2 = unit(mix64(key ^ mix64(2 * index + 1)));
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// Elements per parallel task of [`Init::block`] (below it, one thread fills the block).
const PARALLEL_CHUNK: usize = 1 << 16;

/// How a parameter starts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Every element equals the value (norm weights: 1).
    Constant(f64),
    /// Independent normals with mean 0 and this standard deviation.
    Normal { std: f64 },
}

impl Init {
    /// Values of the elements of the row-major block `rows × cols` that starts at (`row0`, `col0`)
    /// of a parameter whose full rows have `full_cols` columns. A whole tensor is
    /// `block(seed, name, 0, 0, rows, cols, cols)`; a tensor-parallel shard is a sub-block.
    #[allow(clippy::too_many_arguments)]
    pub fn block(
        &self,
        seed: u64,
        name: &str,
        row0: usize,
        col0: usize,
        rows: usize,
        cols: usize,
        full_cols: usize,
    ) -> Vec<f32> {
        use rayon::prelude::*;
        let key = stream_key(seed, name);
        let value = |r: usize, c: usize| match *self {
            Init::Constant(v) => v as f32,
            Init::Normal { std } => (std * normal_of_key(key, (r * full_cols + c) as u64)) as f32,
        };
        let mut out = vec![0f32; rows * cols];
        if cols == 0 {
            return out;
        }
        // Each element is a pure function of its coordinates, so rows are filled in parallel with
        // the same values as a serial loop (billions of draws for a 1B model: seconds, not minutes).
        let rows_per_task = (PARALLEL_CHUNK / cols).max(1);
        out.par_chunks_mut(rows_per_task * cols)
            .enumerate()
            .for_each(|(t, chunk)| {
                for (i, row) in chunk.chunks_mut(cols).enumerate() {
                    let r = row0 + t * rows_per_task + i;
                    for (j, x) in row.iter_mut().enumerate() {
                        *x = value(r, col0 + j);
                    }
                }
            });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normals_have_unit_moments_and_depend_on_name_and_seed() {
        let n = 200_000;
        let xs: Vec<f64> = (0..n).map(|i| normal(7, "w", i)).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.01, "var {var}");
        assert_ne!(normal(7, "w", 0), normal(8, "w", 0));
        assert_ne!(normal(7, "w", 0), normal(7, "v", 0));
        assert_eq!(normal(7, "w", 5), normal(7, "w", 5));
    }

    #[test]
    fn a_block_is_the_slice_of_the_whole() {
        let init = Init::Normal { std: 0.02 };
        let full = init.block(1, "p", 0, 0, 6, 8, 8);
        let part = init.block(1, "p", 2, 3, 3, 4, 8);
        for r in 0..3 {
            for c in 0..4 {
                assert_eq!(part[r * 4 + c], full[(r + 2) * 8 + c + 3]);
            }
        }
    }
}
