//! Defines what the trainer consumes: [`GptData`] (opened datasets + sample index for one
//! split), [`Batch`], [`Split`] and [`micro_batch_indices`].
//!
//! The only loader state is the number of global samples consumed, which the trainer keeps:
//! global sample `i` is the same for every parallel layout, so resuming from `consumed` or
//! changing the data-parallel size keeps the global sample order identical.

use std::path::{Path, PathBuf};

use crate::blend::BlendIndex;
use crate::config::DataConfig;
use crate::error::{DataError, Result};
use crate::reader::IndexedDataset;
use crate::rng::mix_seed;
use crate::sample_index::SampleIndex;
use crate::split::SplitWeights;
use crate::tokenizer::{find_bos, find_eod, load_tokenizer, missing_eod};

/// Which document range of each dataset to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Split {
    /// The first part of the `split` weights.
    Train,
    /// The second part of the `split` weights.
    Valid,
}

impl Split {
    fn position(self) -> usize {
        match self {
            Split::Train => 0,
            Split::Valid => 1,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Valid => "valid",
        }
    }
}

/// One micro-batch, row-major `[micro_batch, seq_len]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Input token ids.
    pub tokens: Vec<u32>,
    /// Target ids: the inputs shifted left by one.
    pub labels: Vec<u32>,
    /// 1.0 where the loss counts, 0.0 where it is masked (`eod_mask_loss`).
    pub loss_mask: Vec<f32>,
    /// Rows.
    pub micro_batch: usize,
    /// Columns.
    pub seq_len: usize,
    /// With `data.reset_attention_mask` or `data.reset_position_ids`: for every position of the
    /// whole rows `[micro_batch, seq_len]`, the position its document starts at (see
    /// [`Boundaries`]). Kept whole when a rank takes its context-parallel share of the other
    /// fields.
    pub doc_starts: Option<Vec<u32>>,
}

/// The special ids that mark where the documents packed into a sample begin and end.
///
/// A document starts at the row's start, just after each end-of-document id (Megatron-LM's
/// rule), and at each beginning-of-document id: data preprocessed with `--add-bos` and
/// `--append-eod false` (Llama 3's BOS-only form) is kept apart as well as data with both ids,
/// where the two rules give the same starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Boundaries {
    /// The end-of-document id, when the tokenizer has one.
    pub eod: Option<u32>,
    /// The beginning-of-document id, when the tokenizer has one distinct from `eod`.
    pub bos: Option<u32>,
}

impl Boundaries {
    /// Boundaries from the tokenizer's ids; a BOS equal to the EOD (one `<|endoftext|>` for
    /// both, GPT-2 style) counts as an end only.
    pub fn new(eod: Option<u32>, bos: Option<u32>) -> Self {
        Boundaries {
            eod,
            bos: bos.filter(|&b| Some(b) != eod),
        }
    }

    /// Only an end-of-document id.
    pub fn eod(eod: u32) -> Self {
        Boundaries::new(Some(eod), None)
    }
}

/// For each position of the rows of `tokens` (`seq_len` each), where its document starts: at 0,
/// at every beginning-of-document id and just after every end-of-document id of `marks`.
pub fn document_starts(tokens: &[u32], seq_len: usize, marks: Boundaries) -> Vec<u32> {
    let mut starts = Vec::with_capacity(tokens.len());
    for row in tokens.chunks(seq_len.max(1)) {
        let mut start = 0u32;
        for (i, &t) in row.iter().enumerate() {
            if Some(t) == marks.bos {
                start = i as u32;
            }
            starts.push(start);
            if Some(t) == marks.eod {
                start = i as u32 + 1;
            }
        }
    }
    starts
}

/// The share of the causal mask's (query, key) pairs a document mask keeps over `samples`
/// global samples spread evenly over `data` (all of them when there are fewer): the pairs of a
/// position are those from its document's start to itself.
pub fn attention_share(data: &GptData, samples: u64) -> Result<f64> {
    let n = data.num_samples();
    let take = samples.min(n).max(1);
    let (s, marks) = (data.seq_len(), data.boundaries());
    let (mut kept, mut causal) = (0f64, 0f64);
    for i in 0..take {
        let sample = data.sample(i * n / take)?;
        let starts = document_starts(&sample[..s], s, marks);
        kept += starts
            .iter()
            .enumerate()
            .map(|(p, &st)| (p as u64 + 1 - st as u64) as f64)
            .sum::<f64>();
        causal += (s * (s + 1) / 2) as f64;
    }
    Ok(if causal > 0.0 { kept / causal } else { 1.0 })
}

struct Part {
    dataset: IndexedDataset,
    index: SampleIndex,
}

/// Opened datasets and sample index for one split.
pub struct GptData {
    parts: Vec<Part>,
    blend: Option<BlendIndex>,
    seq_len: usize,
    num_samples: u64,
    marks: Boundaries,
    vocab_size: usize,
    eod_mask_loss: bool,
    /// Batches carry their document starts.
    documents: bool,
}

/// `p` against `base` (the working directory for recipes), made absolute so that messages name
/// the file that was tried.
fn resolve(base: &Path, p: &Path) -> PathBuf {
    let joined = base.join(p);
    std::path::absolute(&joined).unwrap_or(joined)
}

impl GptData {
    /// Opens every dataset of `cfg` (paths relative to `base_dir`), loads the tokenizer, and
    /// builds the sample index providing `num_samples` samples of `seq_len + 1` tokens for
    /// `split`. The result depends only on the datasets, `seed`, `seq_len` and `split`
    /// (and `num_samples` only decides how far the index reaches).
    pub fn open(
        cfg: &DataConfig,
        base_dir: &Path,
        split: Split,
        seq_len: usize,
        seed: u64,
        num_samples: u64,
    ) -> Result<Self> {
        cfg.validate()?;
        if seq_len == 0 {
            return Err(DataError::config("seq_len", "must be at least 1"));
        }
        let tok_path = resolve(base_dir, &cfg.tokenizer);
        let tokenizer = load_tokenizer(&tok_path)?;
        let marks = Boundaries::new(find_eod(&tokenizer), find_bos(&tokenizer));
        if cfg.eod_mask_loss && marks.eod.is_none() {
            return Err(missing_eod(&tok_path, "data.eod_mask_loss"));
        }
        if cfg.keeps_documents_apart() && marks.eod.is_none() && marks.bos.is_none() {
            return Err(missing_eod(
                &tok_path,
                "data.reset_attention_mask and data.reset_position_ids (it has no \
                 beginning-of-document token either)",
            ));
        }
        let vocab_size = tokenizer.get_vocab_size(true);
        let weights = SplitWeights::parse(&cfg.split, "data.split")?;

        let blend = if cfg.datasets.len() > 1 {
            let w: Vec<f64> = cfg.datasets.iter().map(|d| d.weight).collect();
            Some(BlendIndex::new(&w, num_samples)?)
        } else {
            None
        };
        let split_seed = mix_seed(&[seed, split.position() as u64]);
        let mut parts = Vec::with_capacity(cfg.datasets.len());
        for (i, spec) in cfg.datasets.iter().enumerate() {
            let prefix = resolve(base_dir, &spec.prefix);
            let dataset = IndexedDataset::open(&prefix)?;
            if let Some(max) = dataset.dtype().max_token() {
                if (vocab_size as u64).saturating_sub(1) > max {
                    return Err(DataError::config(
                        format!("data.datasets[{i}].prefix"),
                        format!(
                            "{} stores {} tokens, too narrow for the tokenizer's {vocab_size} ids",
                            prefix.display(),
                            dataset.dtype().name()
                        ),
                    ));
                }
            }
            let needed = blend.as_ref().map_or(num_samples, |b| b.counts()[i]);
            let docs = weights.ranges(dataset.num_documents())[split.position()].clone();
            let di = dataset.document_indices();
            let (first, last) = (di[docs.start] as usize, di[docs.end] as usize);
            if needed > 0 && first == last {
                return Err(DataError::config(
                    "data.split",
                    format!(
                        "`{}` leaves the {} split of {} ({} documents) without documents; \
                         raise that part of the split",
                        cfg.split,
                        split.name(),
                        prefix.display(),
                        dataset.num_documents()
                    ),
                ));
            }
            if let Some((seq, id)) = dataset.find_token_outside(first..last, vocab_size)? {
                return Err(DataError::config(
                    format!("data.datasets[{i}].prefix"),
                    format!(
                        "{}: document {} (sequence {seq}) holds token id {id}, outside the \
                         tokenizer's vocabulary of {vocab_size} ({} split); was it made with \
                         another tokenizer?",
                        prefix.display(),
                        dataset.document_of(seq),
                        split.name()
                    ),
                ));
            }
            let lengths = &dataset.sequence_lengths()[first..last];
            let index = SampleIndex::build(first, lengths, seq_len, split_seed, needed).map_err(
                |e| match e {
                    DataError::Config { message, .. } => DataError::config(
                        format!("data.datasets[{i}]"),
                        format!("{} ({} split): {message}", prefix.display(), split.name()),
                    ),
                    other => other,
                },
            )?;
            parts.push(Part { dataset, index });
        }
        Ok(GptData {
            parts,
            blend,
            seq_len,
            num_samples,
            marks,
            vocab_size,
            eod_mask_loss: cfg.eod_mask_loss,
            documents: cfg.keeps_documents_apart(),
        })
    }

    /// Global sample `global_index`: `seq_len + 1` token ids. Indices at or beyond
    /// `num_samples` are an error.
    pub fn sample(&self, global_index: u64) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(self.seq_len + 1);
        self.sample_into(global_index, &mut out)?;
        Ok(out)
    }

    fn sample_into(&self, global_index: u64, out: &mut Vec<u32>) -> Result<()> {
        if global_index >= self.num_samples {
            return Err(DataError::OutOfRange {
                what: "sample",
                index: global_index,
                len: self.num_samples,
            });
        }
        let (d, within) = match &self.blend {
            Some(b) => b.get(global_index)?,
            None => (0, global_index),
        };
        let part = &self.parts[d];
        for span in part.index.spans(within)? {
            part.dataset
                .read_into(span.sequence, span.offset, span.len, out)?;
        }
        Ok(())
    }

    /// Builds a micro-batch from global samples: row `r` has `tokens = s[..seq_len]` and
    /// `labels = s[1..]` of sample `global_indices[r]`.
    pub fn batch(&self, global_indices: &[u64]) -> Result<Batch> {
        let (rows, s) = (global_indices.len(), self.seq_len);
        let mut tokens = Vec::with_capacity(rows * s);
        let mut labels = Vec::with_capacity(rows * s);
        let mut sample = Vec::with_capacity(s + 1);
        for &g in global_indices {
            sample.clear();
            self.sample_into(g, &mut sample)?;
            tokens.extend_from_slice(&sample[..s]);
            labels.extend_from_slice(&sample[1..]);
        }
        let loss_mask = tokens
            .iter()
            .map(|&t| {
                if self.eod_mask_loss && Some(t) == self.marks.eod {
                    0.0
                } else {
                    1.0
                }
            })
            .collect();
        let doc_starts = self
            .documents
            .then(|| document_starts(&tokens, s, self.marks));
        Ok(Batch {
            tokens,
            labels,
            loss_mask,
            micro_batch: rows,
            seq_len: s,
            doc_starts,
        })
    }

    /// The tokenizer's end-of-document id, if it has one.
    pub fn eod_id(&self) -> Option<u32> {
        self.marks.eod
    }

    /// The ids that mark documents in the samples.
    pub fn boundaries(&self) -> Boundaries {
        self.marks
    }

    /// Vocabulary size of the tokenizer, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Tokens per row of a batch.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Samples available (`sample(i)` works for `i < num_samples()`).
    pub fn num_samples(&self) -> u64 {
        self.num_samples
    }

    /// Samples per epoch of each dataset's split, in configuration order.
    pub fn samples_per_epoch(&self) -> Vec<u64> {
        self.parts
            .iter()
            .map(|p| p.index.samples_per_epoch())
            .collect()
    }
}

/// Global sample indices of the micro-batches of data-parallel rank `dp_rank` (of
/// `dp_size`) for the global batch `[consumed, consumed + global_batch)`: the rank takes the
/// contiguous slice `[r * global_batch / dp_size, (r + 1) * global_batch / dp_size)` and cuts
/// it into micro-batches of `micro_batch` (a smaller last one if it does not divide).
/// Returns nothing for meaningless arguments (`dp_rank >= dp_size`, zero sizes).
pub fn micro_batch_indices(
    consumed: u64,
    global_batch: usize,
    micro_batch: usize,
    dp_rank: usize,
    dp_size: usize,
) -> Vec<Vec<u64>> {
    if dp_size == 0 || micro_batch == 0 || dp_rank >= dp_size {
        return Vec::new();
    }
    let lo = consumed + (dp_rank * global_batch / dp_size) as u64;
    let hi = consumed + ((dp_rank + 1) * global_batch / dp_size) as u64;
    let all: Vec<u64> = (lo..hi).collect();
    all.chunks(micro_batch).map(<[u64]>::to_vec).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_start_after_an_end_and_at_a_beginning() {
        // Two rows of 6; 9 ends a document, 7 begins one.
        let tokens = [1, 9, 2, 3, 9, 4, 5, 6, 9, 9, 8, 1];
        assert_eq!(
            document_starts(&tokens, 6, Boundaries::eod(9)),
            [0, 0, 2, 2, 2, 5, 0, 0, 0, 3, 4, 4]
        );
        // BOS-only data (`--add-bos --append-eod false`): a document starts at each BOS.
        let bos_only = [7, 1, 2, 7, 3, 4, 5, 7, 7, 1, 7, 2];
        let marks = Boundaries::new(Some(9), Some(7));
        assert_eq!(
            document_starts(&bos_only, 6, marks),
            [0, 0, 0, 3, 3, 3, 0, 1, 2, 2, 4, 4]
        );
        assert_eq!(
            document_starts(&bos_only, 6, Boundaries::new(None, Some(7))),
            document_starts(&bos_only, 6, marks)
        );
        // Both ids around every document: BOS starts where the EOD before it ended one.
        let both = [7, 1, 9, 7, 2, 9, 3, 9, 7, 4, 4, 9];
        let eod_only = document_starts(&both, 6, Boundaries::eod(9));
        assert_eq!(document_starts(&both, 6, marks), eod_only);
        // One id for both (GPT-2's `<|endoftext|>`) counts as an end only.
        assert_eq!(Boundaries::new(Some(9), Some(9)), Boundaries::eod(9));
        assert_eq!(
            document_starts(&tokens, 6, Boundaries::new(Some(9), Some(9))),
            document_starts(&tokens, 6, Boundaries::eod(9))
        );
        assert_eq!(document_starts(&tokens, 6, Boundaries::default()), [0; 12]);
    }
}
