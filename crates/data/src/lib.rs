//! The data pipeline of the pretraining framework: byte-level BPE tokenizer training and
//! loading, preprocessing of text, JSONL and Parquet corpora (plain or compressed) into
//! Megatron-LM indexed datasets (`.bin` + `.idx`, byte-compatible with Megatron), a validated
//! memory-mapped reader,
//! GPT-style shuffled sample indices, document-level splits, weighted blending, and the
//! micro-batch loader the trainer consumes.
//!
//! Everything is deterministic: tokenizers train to byte-identical files, and global sample
//! `i` depends only on the datasets, the seed, the sequence length and the split, never on
//! the parallel layout (see [`GptData`] and [`micro_batch_indices`]).

pub mod blend;
pub mod config;
pub mod encode;
pub mod error;
pub mod indexed;
pub mod input;
pub mod loader;
pub mod preprocess;
pub mod reader;
pub mod rng;
pub mod sample_index;
pub mod split;
pub mod tokenizer;

pub use blend::BlendIndex;
pub use config::{DataConfig, DatasetSpec};
pub use error::{DataError, Result};
pub use indexed::{DType, IndexedDatasetWriter};
pub use loader::{
    attention_share, document_starts, micro_batch_indices, Batch, Boundaries, GptData, Split,
};
pub use preprocess::{preprocess, PreprocessOptions, PreprocessSummary, WrittenDataset};
pub use reader::IndexedDataset;
pub use sample_index::SampleIndex;
pub use split::SplitWeights;
pub use tokenizer::{
    bos_id, eod_id, find_bos, find_eod, load_tokenizer, train_tokenizer, TokenizerTrainOptions,
    TokenizerTrainSummary, BOS_TOKENS, EOD_TOKEN, EOD_TOKENS, MAX_TOKENIZER_BYTES,
};
