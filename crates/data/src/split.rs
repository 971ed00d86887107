//! Defines the document-level train/valid(/test) split ([`SplitWeights`]), computed like
//! Megatron's `split` option: weights are normalised, each part gets
//! `round_half_even(weight * documents)` contiguous documents, and the last boundary is
//! pinned to the document count.

use std::ops::Range;

use crate::error::{DataError, Result};

/// Parsed `split` string such as `"98,2"` or `"969,30,1"` (train, valid, test; missing
/// parts are 0). The test part is accepted for compatibility and never read.
#[derive(Debug, Clone, PartialEq)]
pub struct SplitWeights {
    weights: [f64; 3],
}

impl SplitWeights {
    /// Parses and normalises a split string; `field` names it in errors.
    pub fn parse(s: &str, field: &str) -> Result<Self> {
        let parts: Vec<&str> = s.split(',').map(str::trim).collect();
        if parts.is_empty() || parts.len() > 3 || parts.iter().any(|p| p.is_empty()) {
            return Err(DataError::config(
                field,
                format!("`{s}` must be 1 to 3 comma-separated numbers (train,valid[,test]), e.g. \"98,2\""),
            ));
        }
        let mut weights = [0.0; 3];
        for (i, p) in parts.iter().enumerate() {
            let w: f64 = p
                .parse()
                .map_err(|_| DataError::config(field, format!("`{p}` in `{s}` is not a number")))?;
            if !w.is_finite() || w < 0.0 {
                return Err(DataError::config(
                    field,
                    format!("`{p}` in `{s}` must be a finite non-negative number"),
                ));
            }
            weights[i] = w;
        }
        if weights.iter().sum::<f64>() <= 0.0 {
            return Err(DataError::config(field, format!("`{s}` sums to 0")));
        }
        let w = normalised(&weights);
        Ok(SplitWeights {
            weights: [w[0], w[1], w[2]],
        })
    }

    /// Normalised weights (train, valid, test).
    pub fn weights(&self) -> [f64; 3] {
        self.weights
    }

    /// Document ranges (train, valid, test) for a dataset of `documents` documents.
    pub fn ranges(&self, documents: usize) -> [Range<usize>; 3] {
        let n = documents as f64;
        let mut bounds = [0usize; 4];
        for i in 0..3 {
            let part = (self.weights[i] * n).round_ties_even() as usize;
            bounds[i + 1] = bounds[i] + part;
        }
        // Shift every boundary after the first by the rounding excess, as Megatron does.
        let excess = bounds[3] as isize - documents as isize;
        for b in bounds.iter_mut().skip(1) {
            *b = (*b as isize - excess).clamp(0, documents as isize) as usize;
        }
        for i in 1..4 {
            bounds[i] = bounds[i].max(bounds[i - 1]);
        }
        [
            bounds[0]..bounds[1],
            bounds[1]..bounds[2],
            bounds[2]..bounds[3],
        ]
    }
}

/// `weights` (finite, not negative, not all 0) divided by their sum, as Megatron normalises
/// them; weights whose sum overflows are first divided by the largest, so `[1e308, 1e308, 1]`
/// keeps its proportions instead of becoming all zeros.
pub(crate) fn normalised(weights: &[f64]) -> Vec<f64> {
    let sum: f64 = weights.iter().sum();
    if sum.is_finite() {
        return weights.iter().map(|w| w / sum).collect();
    }
    let max = weights.iter().copied().fold(0.0, f64::max);
    let scaled: Vec<f64> = weights.iter().map(|w| w / max).collect();
    let sum: f64 = scaled.iter().sum();
    scaled.iter().map(|w| w / sum).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(s: &str, n: usize) -> [Range<usize>; 3] {
        SplitWeights::parse(s, "split").unwrap().ranges(n)
    }

    #[test]
    fn megatron_style_ranges() {
        assert_eq!(r("98,2", 100), [0..98, 98..100, 100..100]);
        assert_eq!(r("969,30,1", 1000), [0..969, 969..999, 999..1000]);
        assert_eq!(r("90,10", 8), [0..7, 7..8, 8..8]);
        // 8 documents at 98/2: the valid part rounds to nothing.
        assert_eq!(r("98,2", 8), [0..8, 8..8, 8..8]);
        assert_eq!(r("100", 5), [0..5, 5..5, 5..5]);
        // Half-to-even rounding gives 2 + 2; the missing document shifts every later boundary.
        assert_eq!(r("1,1", 5), [0..3, 3..5, 5..5]);
        // Weights whose sum overflows keep their proportions.
        assert_eq!(r("1e308,1e308", 100), [0..50, 50..100, 100..100]);
        assert_eq!(normalised(&[1e308, 1e308, 0.0]), [0.5, 0.5, 0.0]);
        assert_eq!(normalised(&[3.0, 1.0]), [0.75, 0.25]);
    }

    #[test]
    fn ranges_partition_the_documents() {
        for n in [1usize, 2, 3, 7, 10, 99, 1001] {
            for s in ["98,2", "1,1,1", "5,3,2", "0,1", "1,0"] {
                let [a, b, c] = r(s, n);
                assert_eq!(a.start, 0);
                assert_eq!(a.end, b.start);
                assert_eq!(b.end, c.start);
                assert_eq!(c.end, n, "{s} {n}");
            }
        }
    }

    #[test]
    fn bad_strings_name_the_field() {
        for s in ["", "a,b", "1,2,3,4", "-1,2", "0,0", "1,,2", "inf,1"] {
            let e = SplitWeights::parse(s, "data.split")
                .unwrap_err()
                .to_string();
            assert!(e.starts_with("data.split:"), "{s}: {e}");
        }
    }
}
