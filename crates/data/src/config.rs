//! Defines [`DataConfig`], the `data:` section of a training recipe, and its I/O-free
//! validation.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::{DataError, Result};
use crate::split::SplitWeights;

fn default_weight() -> f64 {
    1.0
}

fn default_split() -> String {
    "98,2".to_string()
}

/// One preprocessed dataset to train on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetSpec {
    /// Path prefix of a Megatron indexed dataset: `<prefix>.bin` and `<prefix>.idx` must exist
    /// (as written by `pretrain preprocess --output-prefix <prefix>`). Relative paths are
    /// resolved against the working directory (as Megatron-LM's `--data-path`).
    pub prefix: PathBuf,
    /// Relative sampling weight when several datasets are blended (positive; default 1.0).
    /// Weights are normalised over all datasets; a dataset with weight 3 next to one with
    /// weight 1 provides 75% of the samples.
    #[serde(default = "default_weight")]
    pub weight: f64,
}

/// The `data:` section of a training recipe.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// Datasets to train on (at least one), each `{ prefix, weight }`. With several datasets
    /// every global sample is drawn from one of them in proportion to the weights.
    pub datasets: Vec<DatasetSpec>,
    /// The `tokenizer.json` the datasets were preprocessed with; it provides the vocabulary
    /// size and the end-of-document (and beginning-of-document) ids. Relative paths are resolved
    /// against the working directory.
    pub tokenizer: PathBuf,
    /// Document-level train/valid split as comma-separated weights, e.g. `"98,2"` (default)
    /// or `"969,30,1"` (a third, test part is accepted and unused). Each dataset's documents
    /// are divided into contiguous ranges in these proportions, rounded to whole documents
    /// like Megatron-LM. Small datasets need a larger valid weight to get any valid
    /// document: the bundled 8-play Shakespeare corpus needs e.g. `"90,10"`.
    #[serde(default = "default_split")]
    pub split: String,
    /// Exclude from the loss every position whose input token is `<|endoftext|>`
    /// (default false), so the model is not trained to predict across document boundaries.
    #[serde(default)]
    pub eod_mask_loss: bool,
    /// Keep the documents packed into a sequence apart: no position attends to an earlier
    /// document (default false). A document starts at the sequence's start, after each
    /// end-of-document token (as in Megatron-LM's `--reset-attention-mask`) and at each
    /// beginning-of-document token (data preprocessed with `--add-bos` alone, Llama 3's form).
    #[serde(default)]
    pub reset_attention_mask: bool,
    /// Restart the RoPE positions at each document (default false), as Megatron-LM's
    /// `--reset-position-ids`.
    #[serde(default)]
    pub reset_position_ids: bool,
    /// With `reset_attention_mask`: the share of the causal mask's (query, key) pairs the
    /// document mask keeps, for the planner's step time and TFLOP/s. Unset (the default),
    /// `pretrain plan` measures it on the training data; set it to plan without the data.
    #[serde(default)]
    pub attention_share: Option<f64>,
}

impl DataConfig {
    /// Whether batches carry where their documents start (either reset flag).
    pub fn keeps_documents_apart(&self) -> bool {
        self.reset_attention_mask || self.reset_position_ids
    }
}

impl DataConfig {
    /// Checks every field without touching the file system; errors name the field
    /// (`data.datasets[1].weight`, `data.split`, …).
    pub fn validate(&self) -> Result<()> {
        if self.datasets.is_empty() {
            return Err(DataError::config(
                "data.datasets",
                "at least one dataset `{ prefix: ..., weight: ... }` is required",
            ));
        }
        if self.datasets.len() > u16::MAX as usize {
            return Err(DataError::config("data.datasets", "at most 65535 datasets"));
        }
        for (i, d) in self.datasets.iter().enumerate() {
            if d.prefix.as_os_str().is_empty() {
                return Err(DataError::config(
                    format!("data.datasets[{i}].prefix"),
                    "must not be empty",
                ));
            }
            if !d.weight.is_finite() || d.weight <= 0.0 {
                return Err(DataError::config(
                    format!("data.datasets[{i}].weight"),
                    format!("must be a positive finite number, found {}", d.weight),
                ));
            }
        }
        if self.tokenizer.as_os_str().is_empty() {
            return Err(DataError::config("data.tokenizer", "must not be empty"));
        }
        SplitWeights::parse(&self.split, "data.split")?;
        if let Some(a) = self.attention_share {
            if !(a.is_finite() && a > 0.0 && a <= 1.0) {
                return Err(DataError::config(
                    "data.attention_share",
                    format!("must be in (0, 1], found {a}"),
                ));
            }
            if !self.reset_attention_mask {
                return Err(DataError::config(
                    "data.attention_share",
                    "applies only with data.reset_attention_mask: true",
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> DataConfig {
        DataConfig {
            datasets: vec![DatasetSpec {
                prefix: "d".into(),
                weight: 1.0,
            }],
            tokenizer: "t.json".into(),
            split: "98,2".into(),
            eod_mask_loss: false,
            reset_attention_mask: false,
            reset_position_ids: false,
            attention_share: None,
        }
    }

    #[test]
    fn defaults_and_unknown_fields() {
        let c: DataConfig =
            serde_json::from_str(r#"{"datasets":[{"prefix":"a"}],"tokenizer":"t.json"}"#).unwrap();
        assert_eq!(c.datasets[0].weight, 1.0);
        assert_eq!(c.split, "98,2");
        assert!(!c.eod_mask_loss);
        let e = serde_json::from_str::<DataConfig>(r#"{"datasets":[],"tokenizer":"t","x":1}"#);
        assert!(e.unwrap_err().to_string().contains("unknown field `x`"));
        let e = serde_json::from_str::<DataConfig>(
            r#"{"datasets":[{"prefix":"a","wieght":2}],"tokenizer":"t"}"#,
        );
        assert!(e.unwrap_err().to_string().contains("wieght"));
    }

    #[test]
    fn validate_names_fields() {
        assert!(cfg().validate().is_ok());
        let mut c = cfg();
        c.datasets.clear();
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .starts_with("data.datasets:"));
        let mut c = cfg();
        c.datasets[0].weight = -1.0;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .starts_with("data.datasets[0].weight:"));
        let mut c = cfg();
        c.split = "x".into();
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .starts_with("data.split:"));
        let mut c = cfg();
        c.tokenizer = "".into();
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .starts_with("data.tokenizer:"));
        let mut c = cfg();
        c.attention_share = Some(0.5);
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("only with data.reset_attention_mask"), "{e}");
        c.reset_attention_mask = true;
        assert!(c.validate().is_ok());
        for bad in [0.0, 1.5, f64::NAN] {
            c.attention_share = Some(bad);
            let e = c.validate().unwrap_err().to_string();
            assert!(
                e.starts_with("data.attention_share: must be in (0, 1]"),
                "{e}"
            );
        }
    }
}
