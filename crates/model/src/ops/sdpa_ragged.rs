//! Documents kept apart on cuDNN: a causal call's document floor as cuDNN's ragged batch. Pure
//! logic, in every build, so the CPU tests cover it; `cuda/cudnn.rs` uploads the tables.
//!
//! cuDNN has no document mask, but its fused attention takes a "ragged" batch: sequences of
//! different lengths packed one after another (the THD layout), each addressed by an element
//! offset and masked to its own length (the padding mask). Under the causal document mask every
//! document of a packed row is exactly such a sequence: query `i` of a document starting at `r`
//! sees keys `r..=i`, the causal mask within the document. So a causal call whose floor
//! (`attention_dims.rs`) splits its `b` rows into documents runs as one ragged call over all of
//! them: the `[b, s, h, d]` activations are the packed tokens as they lie, nothing moves.
//!
//! Tables (what a graph run reads on the device): per document its length (`seq_len`, i32) and
//! per tensor the exclusive prefix sums of the lengths in elements (`offsets`, i64, one more
//! entry than documents): tokens × `hq·d` for q, out and their gradients, × `hkv·d` for k, v and
//! theirs, × `hq` for the softmax statistics, which cuDNN then writes token-major (`[b, s, hq]`).
//! The three offset rows lie in one buffer, each padded to an even length ([`offset_row`]) so
//! that every row starts 16-byte aligned, the alignment cuDNN assumes of a tensor.
//! A graph is built for the document count rounded up to a power of two (the entries past the
//! documents have length 0) and for the longest document rounded up to a power of two from 64
//! (cuDNN's tiles) up to the row: a handful of graphs serve every micro-batch, and short documents
//! do not launch the tiles of a whole row each.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use super::attention_dims::{Dims, Floor};

/// The documents of a causal call, in token order across its rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Documents {
    /// Positions of each document.
    lens: Vec<u32>,
    /// Tokens of the call (`b · s`).
    total: usize,
    /// Positions per row.
    row: usize,
}

impl Documents {
    /// The documents of a causal call of `dm` with `floor`: `None` unless every row splits into
    /// runs of equal floor that each start where their floor points (a document that begins at
    /// its own first query), which is what a floor built from document starts over a whole
    /// sequence always is. Other floors (non-causal ring blocks, a row seeing no key) are left to
    /// the project's kernels.
    pub fn from_floor(dm: Dims, floor: Floor<'_>) -> Option<Self> {
        let f = floor?;
        if !dm.causal || dm.s != dm.sk || dm.s == 0 || f.len() != dm.b * dm.s {
            return None;
        }
        let mut lens = Vec::new();
        for row in f.chunks_exact(dm.s) {
            let mut start = 0usize;
            for i in 1..=dm.s {
                if i < dm.s && row[i] == row[start] {
                    continue;
                }
                if row[start] as usize != start {
                    return None;
                }
                lens.push(u32::try_from(i - start).ok()?);
                start = i;
            }
        }
        Some(Self {
            lens,
            total: dm.b * dm.s,
            row: dm.s,
        })
    }

    /// Documents found.
    pub fn count(&self) -> usize {
        self.lens.len()
    }

    /// The batch of the graph that runs them: the count rounded up to a power of two.
    pub fn batch(&self) -> usize {
        self.count().next_power_of_two()
    }

    /// Tokens of the call.
    pub fn total(&self) -> usize {
        self.total
    }

    /// The positions per sequence of the graph that runs them: the longest document rounded up
    /// to a power of two, at least 64 and at most the row.
    pub fn span(&self) -> usize {
        let longest = self.lens.iter().max().map_or(1, |&l| l as usize);
        longest.next_power_of_two().max(64).min(self.row)
    }

    /// The tables of a run with `hq` query and `hkv` kv heads of `d`: per graph batch entry the
    /// length (`[batch]`), and the offsets `[3, offset_row(batch)]` of q/out, k/v and the
    /// statistics (`batch + 1` entries each, then the last repeated to the row's end).
    pub fn tables(&self, hq: usize, hkv: usize, d: usize) -> RaggedTables {
        let batch = self.batch();
        let mut seq_len = Vec::with_capacity(batch);
        let mut tokens = Vec::with_capacity(offset_row(batch));
        let mut at = 0i64;
        tokens.push(0);
        for i in 0..batch {
            let len = self.lens.get(i).copied().unwrap_or(0);
            seq_len.push(len as i32);
            at += i64::from(len);
            tokens.push(at);
        }
        tokens.resize(offset_row(batch), at);
        let offsets = [hq * d, hkv * d, hq]
            .iter()
            .flat_map(|&per| tokens.iter().map(move |&t| t * per as i64))
            .collect();
        RaggedTables { seq_len, offsets }
    }
}

/// Entries of one offset row of a graph batch of `batch`: `batch + 1` rounded up to even, so
/// that rows of i64 start 16-byte aligned (`cudnn/sdpa.cpp` reads them at the same stride).
pub fn offset_row(batch: usize) -> usize {
    (batch + 1).next_multiple_of(2)
}

/// What a ragged graph run reads on the device (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RaggedTables {
    /// `[batch]` document lengths, 0 past the documents.
    pub seq_len: Vec<i32>,
    /// `[3, offset_row(batch)]` element offsets of each document in q/out, k/v and the
    /// statistics.
    pub offsets: Vec<i64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(b: usize, s: usize) -> Dims {
        Dims {
            b,
            s,
            sk: s,
            hq: 4,
            hkv: 2,
            d: 8,
            causal: true,
        }
    }

    /// Document starts of each row as the loader builds floors for a whole-sequence call.
    fn floor(rows: &[&[usize]], s: usize) -> Vec<u32> {
        let mut f = Vec::new();
        for starts in rows {
            let mut cur = 0;
            for i in 0..s {
                if starts.contains(&i) {
                    cur = i;
                }
                f.push(cur as u32);
            }
        }
        f
    }

    #[test]
    fn rows_split_into_their_documents_in_token_order() {
        let f = floor(&[&[0, 3, 4], &[0, 5]], 8);
        let docs = Documents::from_floor(dims(2, 8), Some(&f)).unwrap();
        assert_eq!(docs.lens, vec![3, 1, 4, 5, 3]);
        assert_eq!((docs.count(), docs.batch(), docs.total()), (5, 8, 16));
        assert_eq!(docs.span(), 8); // the row is shorter than cuDNN's 64

        // One document per row: a plain causal call as a ragged batch of the rows.
        let f = floor(&[&[0], &[0], &[0]], 6);
        let docs = Documents::from_floor(dims(3, 6), Some(&f)).unwrap();
        assert_eq!(docs.lens, vec![6, 6, 6]);
        assert_eq!(docs.batch(), 4);

        // Every position its own document.
        let f: Vec<u32> = (0..5).collect();
        let docs = Documents::from_floor(dims(1, 5), Some(&f)).unwrap();
        assert_eq!(docs.lens, vec![1; 5]);
    }

    /// The graph's sequence length follows the longest document in powers of two from 64.
    #[test]
    fn the_span_follows_the_longest_document() {
        let span = |starts: &[usize], s: usize| {
            let f = floor(&[starts], s);
            Documents::from_floor(dims(1, s), Some(&f)).unwrap().span()
        };
        assert_eq!(span(&[0, 10, 20], 1024), 1024); // the last runs 1004
        assert_eq!(span(&(0..1024).step_by(100).collect::<Vec<_>>(), 1024), 128);
        assert_eq!(span(&(0..1024).step_by(64).collect::<Vec<_>>(), 1024), 64);
        assert_eq!(span(&(0..1024).step_by(65).collect::<Vec<_>>(), 1024), 128);
        assert_eq!(span(&(0..1024).step_by(3).collect::<Vec<_>>(), 1024), 64);
        assert_eq!(span(&[0, 700], 1000), 1000); // 700 rounds to 1024, past the row
    }

    /// Offsets are the exclusive prefix sums of the lengths in each tensor's elements; the padded
    /// entries have length 0 and sit at the end.
    #[test]
    fn tables_address_each_document_in_place() {
        let f = floor(&[&[0, 3, 4], &[0, 5]], 8);
        let docs = Documents::from_floor(dims(2, 8), Some(&f)).unwrap();
        let t = docs.tables(4, 2, 8);
        assert_eq!(t.seq_len, vec![3, 1, 4, 5, 3, 0, 0, 0]);
        // 9 offsets per row, padded to 10 so that each row starts 16-byte aligned.
        assert_eq!(offset_row(8), 10);
        let tokens = [0i64, 3, 4, 8, 13, 16, 16, 16, 16, 16];
        let per = |n: i64| tokens.iter().map(|t| t * n).collect::<Vec<_>>();
        assert_eq!(t.offsets[..10], per(32)[..]);
        assert_eq!(t.offsets[10..20], per(16)[..]);
        assert_eq!(t.offsets[20..], per(4)[..]);
        // Document j's first token is row-major position tokens[j] of the [b, s] call.
        assert_eq!(t.offsets[3] / 32, 8); // row 1, position 0
        assert_eq!((offset_row(1), offset_row(2), offset_row(256)), (2, 4, 258));
    }

    /// What cuDNN computes from a ragged description, emulated on the CPU from the description
    /// and the tables alone: batch entry `j` is the sequence of `seq_len[j]` positions whose
    /// element `(h, i, e)` lies at `offset[j] + h·stride[1] + i·stride[2] + e·stride[3]` (q and
    /// out with the q offsets and strides, k and v with the kv ones), causal within itself,
    /// query head `h` reading kv head `h / (hq / hkv)`; its statistics at
    /// `stats_offset[j] + h + i·hq` (the strides `{hq·S, 1, hq, 1}` of `cudnn/sdpa.cpp`). The
    /// output and the statistics, taken token-major back to `[b, hq, s]` as `cuda/cudnn.rs`
    /// does, equal the project's kernels with the floor the documents came from.
    #[test]
    fn the_ragged_batch_computes_what_the_floor_masks() {
        use candle_core::{Device, Tensor};

        use crate::ops::sdpa::{AttentionBackend, SdpaDesc};

        let (b, s, hq, hkv, d) = (2, 24, 4, 2, 8);
        let dm = Dims {
            b,
            s,
            sk: s,
            hq,
            hkv,
            d,
            causal: true,
        };
        let f = floor(&[&[0, 5, 6, 17], &[0, 1, 9]], s);
        let docs = Documents::from_floor(dm, Some(&f)).unwrap();
        let desc = SdpaDesc::documents(dm, 0.3, true, &docs).unwrap();
        let t = docs.tables(hq, hkv, d);
        let row = offset_row(desc.b as usize);
        let rand = |n: usize, seed: u64| -> Vec<f64> {
            (0..n)
                .map(|i| ((i as u64 * 2654435761 + seed * 97) % 1000) as f64 / 500.0 - 1.0)
                .collect()
        };
        let (q, k, v) = (
            rand(b * s * hq * d, 1),
            rand(b * s * hkv * d, 2),
            rand(b * s * hkv * d, 3),
        );
        let mut out = vec![f64::NAN; q.len()];
        let mut stats = vec![f64::NAN; b * s * hq];
        let at = |off: i64, st: [i64; 4], h: usize, i: usize, e: usize| {
            (off + h as i64 * st[1] + i as i64 * st[2] + e as i64 * st[3]) as usize
        };
        for j in 0..desc.b as usize {
            let len = t.seq_len[j] as usize;
            let (oq, ok) = (t.offsets[j], t.offsets[row + j]);
            let os = t.offsets[2 * row + j];
            for h in 0..hq {
                let g = h / (hq / hkv);
                for i in 0..len {
                    let scores: Vec<f64> = (0..=i)
                        .map(|kk| {
                            let dot: f64 = (0..d)
                                .map(|e| {
                                    q[at(oq, desc.q_stride, h, i, e)]
                                        * k[at(ok, desc.k_stride, g, kk, e)]
                                })
                                .sum();
                            dot * f64::from(desc.scale)
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = scores.iter().map(|x| (x - m).exp()).sum();
                    stats[os as usize + h + i * hq] = m + sum.ln();
                    for e in 0..d {
                        let o: f64 = (0..=i)
                            .map(|kk| {
                                (scores[kk] - m).exp() / sum * v[at(ok, desc.v_stride, g, kk, e)]
                            })
                            .sum();
                        out[at(oq, desc.o_stride, h, i, e)] = o;
                    }
                }
            }
        }
        let dev = Device::Cpu;
        let tensor = |x: &[f64], h: usize| Tensor::from_slice(x, (b, s, h, d), &dev).unwrap();
        let (want_out, want_lse) = crate::ops::attention::causal_attention_saved(
            (&tensor(&q, hq), &tensor(&k, hkv), &tensor(&v, hkv)),
            f64::from(desc.scale),
            Some(&f),
            AttentionBackend::Own,
        )
        .unwrap();
        let got_lse = Tensor::from_slice(&stats, (b, s, hq), &dev)
            .unwrap()
            .transpose(1, 2)
            .unwrap(); // [b, hq, s]
                       // The largest difference; NaN (an element never written) counts as infinitely far.
        let max_diff = |a: &Tensor, w: &Tensor| {
            let a = a.flatten_all().unwrap().to_vec1::<f64>().unwrap();
            let w = w.flatten_all().unwrap().to_vec1::<f64>().unwrap();
            let far = |m: f64, e: f64| if e.is_nan() { f64::INFINITY } else { m.max(e) };
            a.iter().zip(&w).map(|(x, y)| (x - y).abs()).fold(0.0, far)
        };
        assert!(
            max_diff(&tensor(&out, hq), &want_out) < 1e-12,
            "every output written"
        );
        assert!(
            max_diff(&got_lse, &want_lse) < 1e-12,
            "every statistic written"
        );
    }

    #[test]
    fn floors_that_are_not_documents_stay_with_the_projects_kernels() {
        let d = dims(1, 6);
        assert!(Documents::from_floor(d, None).is_none());
        // A run whose floor is not its own start (a ring block after its document began).
        assert!(Documents::from_floor(d, Some(&[0, 0, 1, 1, 4, 4])).is_none());
        // A row that does not begin a document at 0.
        assert!(Documents::from_floor(d, Some(&[2, 2, 2, 3, 4, 5])).is_none());
        // Wrong length.
        assert!(Documents::from_floor(d, Some(&[0, 0, 0])).is_none());
        // Not causal (a ring block).
        let block = Dims {
            causal: false,
            sk: 12,
            ..d
        };
        assert!(Documents::from_floor(block, Some(&[0; 6])).is_none());
    }
}
