//! Documents kept apart inside packed sequences (`data.reset_attention_mask`,
//! `data.reset_position_ids`): where each position's document starts ([`DocumentStarts`]), and
//! what an attention call over keys at known positions needs from it, the first key each query
//! may see ([`DocumentStarts::floor`]).
//!
//! A document starts at position 0 and after every end-of-document token (which ends its own
//! document), as in Megatron-LM's `--reset-attention-mask`. Under the causal document mask a
//! query at position `p` sees the keys at positions `start(p)..=p`; with positions reset, RoPE
//! rotates it by `p − start(p)`.

use std::sync::Arc;

use candle_core::{bail, Result};

/// For an attention call: `[b · rows]`, the first key each query row may see, counted in the
/// call's keys (the keys before it belong to earlier documents); `None` for plain causal
/// attention.
pub type Floor<'a> = Option<&'a [u32]>;

/// The document start of every position of a micro-batch's `b` whole sequences of `seq_len`.
#[derive(Clone, Debug, PartialEq)]
pub struct DocumentStarts {
    starts: Arc<Vec<u32>>, // [b, seq_len]
    b: usize,
    seq_len: usize,
}

impl DocumentStarts {
    /// From the document start of every position of `b` rows of `seq_len` (`starts.len() / seq_len`
    /// rows): each row begins a document at 0, and each later position continues its
    /// predecessor's document or begins one at itself.
    pub fn new(starts: Vec<u32>, seq_len: usize) -> Result<Self> {
        if seq_len == 0 || !starts.len().is_multiple_of(seq_len) {
            bail!(
                "document starts: {} positions are not whole rows of {seq_len}",
                starts.len()
            )
        }
        for (r, row) in starts.chunks_exact(seq_len).enumerate() {
            for (i, &st) in row.iter().enumerate() {
                let prev = if i == 0 { 0 } else { row[i - 1] };
                if st != prev && st as usize != i {
                    bail!(
                        "document starts: row {r} position {i} starts at {st}, neither its \
                         predecessor's document ({prev}) nor a new one ({i})"
                    )
                }
            }
        }
        Ok(Self {
            b: starts.len() / seq_len,
            starts: Arc::new(starts),
            seq_len,
        })
    }

    /// Samples.
    pub fn batch(&self) -> usize {
        self.b
    }

    /// Positions per sample.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// The start of the document of every position, `[b, seq_len]`.
    pub fn starts(&self) -> &[u32] {
        &self.starts
    }

    /// For queries at global positions `q_pos` and keys at `k_pos` (each increasing): per sample
    /// and query, how many of the keys lie before the query's document starts, `[b · q_pos.len()]`.
    pub fn floor(&self, q_pos: &[usize], k_pos: &[usize]) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.b * q_pos.len());
        for row in self.starts.chunks_exact(self.seq_len) {
            out.extend(q_pos.iter().map(|&p| {
                let start = row[p] as usize;
                k_pos.partition_point(|&k| k < start) as u32
            }));
        }
        out
    }

    /// Each row's position in its document, for queries at global positions `q_pos`,
    /// `[b · q_pos.len()]`.
    pub fn positions(&self, q_pos: &[usize]) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.b * q_pos.len());
        for row in self.starts.chunks_exact(self.seq_len) {
            out.extend(q_pos.iter().map(|&p| p as u32 - row[p]));
        }
        out
    }

    /// The (query, key) pairs the causal document mask keeps over the micro-batch, against
    /// `b · s (s + 1) / 2` for the plain causal mask: the attention work done.
    pub fn pairs(&self) -> u64 {
        let mut n = 0u64;
        for row in self.starts.chunks_exact(self.seq_len) {
            n += row
                .iter()
                .enumerate()
                .map(|(p, &s)| p as u64 + 1 - s as u64)
                .sum::<u64>();
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floors_positions_and_pairs_follow_the_starts() {
        // Two samples of 6: documents [0..3, 3..5, 5..6] and [0..1, 1..6].
        let d = DocumentStarts::new(vec![0, 0, 0, 3, 3, 5, 0, 1, 1, 1, 1, 1], 6).unwrap();
        assert_eq!(d.positions(&[0, 2, 3, 5]), [0, 2, 0, 0, 0, 1, 2, 4]);
        // Queries 3..6 against keys at 0, 1, 4, 5: keys before their document's start.
        assert_eq!(d.floor(&[3, 4, 5], &[0, 1, 4, 5]), [2, 2, 3, 1, 1, 1]);
        assert_eq!(d.pairs(), (1 + 2 + 3 + 1 + 2 + 1) + (1 + 1 + 2 + 3 + 4 + 5));
        assert!(DocumentStarts::new(vec![0, 0, 0], 2).is_err());
        assert!(DocumentStarts::new(vec![0, 0, 1, 1], 4).is_err());
        assert!(DocumentStarts::new(vec![1, 1], 2).is_err());
    }
}
