//! Defines [`BlendIndex`], the deterministic assignment of global samples to datasets when
//! several datasets are blended with weights (like Megatron's `BlendedDataset`).
//!
//! Sample `i` goes to the dataset with the largest deficit `w_d * (i + 1) - n_d`, where `w_d`
//! is the normalised weight and `n_d` the number of earlier samples given to dataset `d`
//! (ties go to the lowest index); it becomes that dataset's sample `n_d`. Realised
//! proportions therefore track the weights within one sample at every prefix.
//!
//! Storage is two bytes per sample plus per-dataset counts every [`BLOCK`] samples.

use crate::error::{DataError, Result};

/// Samples between stored per-dataset count checkpoints.
pub const BLOCK: u64 = 1024;

/// Greedy weighted assignment of global samples to datasets.
#[derive(Debug)]
pub struct BlendIndex {
    datasets: usize,
    choice: Vec<u16>,
    /// For block `b`, `checkpoints[b * datasets + d]` = samples of `d` before `b * BLOCK`.
    checkpoints: Vec<u64>,
    counts: Vec<u64>,
}

impl BlendIndex {
    /// Assigns `num_samples` samples among datasets with positive, finite `weights`.
    pub fn new(weights: &[f64], num_samples: u64) -> Result<Self> {
        if weights.is_empty() || weights.len() > u16::MAX as usize {
            return Err(DataError::config(
                "datasets",
                "need between 1 and 65535 datasets",
            ));
        }
        if let Some(i) = weights.iter().position(|w| !w.is_finite() || *w <= 0.0) {
            return Err(DataError::config(
                format!("datasets[{i}].weight"),
                format!("must be a positive finite number, found {}", weights[i]),
            ));
        }
        let w = crate::split::normalised(weights);
        let n = weights.len();
        let len = usize::try_from(num_samples)
            .map_err(|_| DataError::config("num_samples", "too large for this platform"))?;
        let mut choice = Vec::with_capacity(len);
        let mut checkpoints = Vec::with_capacity((num_samples / BLOCK + 1) as usize * n);
        let mut counts = vec![0u64; n];
        for i in 0..num_samples {
            if i % BLOCK == 0 {
                checkpoints.extend_from_slice(&counts);
            }
            let target = (i + 1) as f64;
            let mut best = 0;
            let mut best_err = f64::NEG_INFINITY;
            for (d, (&wd, &cd)) in w.iter().zip(&counts).enumerate() {
                let err = wd * target - cd as f64;
                if err > best_err {
                    best = d;
                    best_err = err;
                }
            }
            counts[best] += 1;
            choice.push(best as u16);
        }
        Ok(BlendIndex {
            datasets: n,
            choice,
            checkpoints,
            counts,
        })
    }

    /// Number of global samples assigned.
    pub fn len(&self) -> u64 {
        self.choice.len() as u64
    }

    /// True when no samples were assigned.
    pub fn is_empty(&self) -> bool {
        self.choice.is_empty()
    }

    /// Samples assigned to each dataset in total.
    pub fn counts(&self) -> &[u64] {
        &self.counts
    }

    /// `(dataset, sample within that dataset)` for global sample `i`.
    pub fn get(&self, i: u64) -> Result<(usize, u64)> {
        let d = *self.choice.get(i as usize).ok_or(DataError::OutOfRange {
            what: "sample",
            index: i,
            len: self.len(),
        })? as usize;
        let block = i / BLOCK;
        let base = self.checkpoints[block as usize * self.datasets + d];
        let within = self.choice[(block * BLOCK) as usize..i as usize]
            .iter()
            .filter(|&&c| c as usize == d)
            .count() as u64;
        Ok((d, base + within))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn within_indices_are_dense_per_dataset() {
        let b = BlendIndex::new(&[0.5, 0.3, 0.2], 5000).unwrap();
        let mut next = [0u64; 3];
        for i in 0..5000 {
            let (d, j) = b.get(i).unwrap();
            assert_eq!(j, next[d], "sample {i}");
            next[d] += 1;
        }
        assert_eq!(&next[..], b.counts());
        let e = b.get(5000).unwrap_err().to_string();
        assert!(e.contains("sample 5000 out of range (have 5000)"), "{e}");
    }

    #[test]
    fn prefixes_track_the_weights() {
        let w = [3.0, 1.0];
        let b = BlendIndex::new(&w, 4000).unwrap();
        let mut c = [0f64; 2];
        for i in 0..4000u64 {
            c[b.get(i).unwrap().0] += 1.0;
            let expected = 0.75 * (i + 1) as f64;
            assert!((c[0] - expected).abs() <= 1.0, "at {i}: {c:?}");
        }
    }

    #[test]
    fn bad_weights_are_rejected() {
        let e = BlendIndex::new(&[1.0, 0.0], 10).unwrap_err().to_string();
        assert!(
            e.contains("datasets[1].weight: must be a positive finite number, found 0"),
            "{e}"
        );
        let e = BlendIndex::new(&[f64::NAN], 10).unwrap_err().to_string();
        assert!(
            e.contains("datasets[0].weight: must be a positive finite number, found NaN"),
            "{e}"
        );
        let e = BlendIndex::new(&[], 10).unwrap_err().to_string();
        assert!(
            e.contains("datasets: need between 1 and 65535 datasets"),
            "{e}"
        );
    }
}
