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

impl Shard {
    /// The `(offset, length)` along each dimension of shard `index` of `size` of a tensor with
    /// `global_shape`, or an error naming the dimension that does not divide.
    pub fn slice_of(
        &self,
        global_shape: &[usize],
        index: usize,
        size: usize,
    ) -> Result<Vec<(usize, usize)>, String> {
        let mut out: Vec<(usize, usize)> = global_shape.iter().map(|&n| (0, n)).collect();
        if let Shard::Dim(d) = *self {
            let n = global_shape[d];
            if n % size != 0 {
                return Err(format!(
                    "dimension {d} ({n}) is not divisible by the tensor-parallel size {size}"
                ));
            }
            out[d] = (index * n / size, n / size);
        }
        Ok(out)
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
    fn slices_split_one_dimension() {
        assert_eq!(
            Shard::Dim(1).slice_of(&[4, 6], 2, 3).unwrap(),
            vec![(0, 4), (4, 2)]
        );
        assert_eq!(
            Shard::Replicated.slice_of(&[4], 1, 2).unwrap(),
            vec![(0, 4)]
        );
        assert!(Shard::Dim(0).slice_of(&[5, 2], 0, 2).is_err());
    }
}
