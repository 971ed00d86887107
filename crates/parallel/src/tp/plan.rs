//! The tensor-parallel plan: which dimension of each parameter is split across the
//! tensor-parallel ranks. One table serves model construction, gradient-norm accounting and
//! checkpoint resharding.
//!
//! | parameter (Hugging Face name suffix) | split | layer kind |
//! |---|---|---|
//! | `self_attn.{q,k,v}_proj.weight` | dim 0 (output features = heads) | column-parallel |
//! | `mlp.{gate,up}_proj.weight` | dim 0 (output features) | column-parallel |
//! | `self_attn.o_proj.weight` | dim 1 (input features = heads) | row-parallel |
//! | `mlp.down_proj.weight` | dim 1 (input features) | row-parallel |
//! | `embed_tokens.weight`, `lm_head.weight` | dim 0 (vocabulary) | vocab-parallel |
//! | `*norm.weight` | none | replicated |

use std::ops::Range;

/// How a parameter is laid out across tensor-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shard {
    /// Every rank holds the whole tensor.
    Replicated,
    /// Rank `i` of `n` holds chunk `i` of `n` equal chunks along this dimension.
    Dim(usize),
}

/// The plan entry for a parameter name.
pub fn tp_shard(name: &str) -> Shard {
    const COLUMN: [&str; 5] = [
        "q_proj.weight",
        "k_proj.weight",
        "v_proj.weight",
        "gate_proj.weight",
        "up_proj.weight",
    ];
    const ROW: [&str; 2] = ["o_proj.weight", "down_proj.weight"];
    const VOCAB: [&str; 2] = ["embed_tokens.weight", "lm_head.weight"];
    if COLUMN.iter().chain(&VOCAB).any(|s| name.ends_with(s)) {
        Shard::Dim(0)
    } else if ROW.iter().any(|s| name.ends_with(s)) {
        Shard::Dim(1)
    } else {
        Shard::Replicated
    }
}

/// A parameter dimension that does not split evenly across the tensor-parallel ranks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("dimension {dim} ({len}) is not divisible by the tensor-parallel size {tp}")]
pub struct ShardError {
    /// The split dimension.
    pub dim: usize,
    /// Its length in the whole tensor.
    pub len: usize,
    /// The tensor-parallel size.
    pub tp: usize,
}

/// The block of a tensor one rank holds: where it starts along each dimension of the whole
/// tensor, and its extent (the local shape).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// First index along each dimension.
    pub offset: Vec<usize>,
    /// Extent along each dimension.
    pub shape: Vec<usize>,
}

impl Block {
    /// The whole of a tensor of `shape`.
    pub fn whole(shape: &[usize]) -> Self {
        Self {
            offset: vec![0; shape.len()],
            shape: shape.to_vec(),
        }
    }

    /// The indices of the whole tensor this block covers along `dim`.
    pub fn range(&self, dim: usize) -> Range<usize> {
        self.offset[dim]..self.offset[dim] + self.shape[dim]
    }
}

impl Shard {
    /// The block tensor-parallel rank `index` of `size` holds of a tensor of `global_shape`, or
    /// an error naming the dimension that does not divide.
    pub fn block(
        &self,
        global_shape: &[usize],
        index: usize,
        size: usize,
    ) -> Result<Block, ShardError> {
        let mut block = Block::whole(global_shape);
        if let Shard::Dim(d) = *self {
            let len = global_shape[d];
            if !len.is_multiple_of(size) {
                return Err(ShardError {
                    dim: d,
                    len,
                    tp: size,
                });
            }
            block.offset[d] = index * len / size;
            block.shape[d] = len / size;
        }
        Ok(block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_covers_llama_parameters() {
        assert_eq!(
            tp_shard("model.layers.0.self_attn.q_proj.weight"),
            Shard::Dim(0)
        );
        assert_eq!(
            tp_shard("model.layers.3.self_attn.o_proj.weight"),
            Shard::Dim(1)
        );
        assert_eq!(
            tp_shard("model.layers.3.mlp.down_proj.weight"),
            Shard::Dim(1)
        );
        assert_eq!(tp_shard("model.layers.3.mlp.up_proj.weight"), Shard::Dim(0));
        assert_eq!(tp_shard("model.embed_tokens.weight"), Shard::Dim(0));
        assert_eq!(tp_shard("lm_head.weight"), Shard::Dim(0));
        assert_eq!(
            tp_shard("model.layers.1.input_layernorm.weight"),
            Shard::Replicated
        );
        assert_eq!(tp_shard("model.norm.weight"), Shard::Replicated);
    }

    #[test]
    fn blocks_split_one_dimension() {
        let b = Shard::Dim(1).block(&[4, 6], 2, 3).unwrap();
        assert_eq!(
            (b.offset.as_slice(), b.shape.as_slice()),
            (&[0, 4][..], &[4, 2][..])
        );
        assert_eq!((b.range(0), b.range(1)), (0..4, 4..6));
        assert_eq!(
            Shard::Replicated.block(&[4], 1, 2).unwrap(),
            Block::whole(&[4])
        );
        assert_eq!(
            Shard::Dim(0).block(&[5, 2], 0, 2),
            Err(ShardError {
                dim: 0,
                len: 5,
                tp: 2
            })
        );
    }
}
