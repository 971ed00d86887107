//! `Parameter` and `ParamSet`: the model's named trainable tensors with their optimiser metadata.

use candle_core::{DType, Device, Result, Tensor, Var};
use parallel::tp::{tp_shard, Shard};

use crate::init::Init;

/// What role a parameter plays; decides weight decay and initialisation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamKind {
    /// Token embedding (and a tied output projection).
    Embedding,
    /// A normalisation gain vector.
    Norm,
    /// A projection matrix.
    Matrix,
}

/// One trainable tensor, named as in Hugging Face (`model.layers.0.self_attn.q_proj.weight`).
#[derive(Debug, Clone)]
pub struct Parameter {
    /// Hugging Face parameter name.
    pub name: String,
    /// The tensor autograd differentiates against.
    pub var: Var,
    /// Its role.
    pub kind: ParamKind,
    /// Shape of the whole (unsharded) tensor.
    pub global_shape: Vec<usize>,
    /// How it is split across tensor-parallel ranks (from the TP plan).
    pub shard: Shard,
    /// `(offset, length)` of this rank's slice along each dimension of `global_shape`.
    pub slice: Vec<(usize, usize)>,
}

/// The ordered list of a model's parameters; indices into it identify parameters everywhere
/// (gradient buffers, optimiser state, checkpoints).
#[derive(Debug, Clone, Default)]
pub struct ParamSet {
    params: Vec<Parameter>,
}

impl ParamSet {
    /// Creates this rank's slice of parameter `name` (whole shape `global_shape`, 1-D or 2-D)
    /// from `init`, split as the TP plan says for tensor-parallel shard `tp.0` of `tp.1`, and
    /// returns its index. The values are exactly that slice of the single-rank tensor.
    #[allow(clippy::too_many_arguments)]
    pub fn add(
        &mut self,
        name: &str,
        global_shape: &[usize],
        kind: ParamKind,
        init: Init,
        seed: u64,
        tp: (usize, usize),
        dtype: DType,
        device: &Device,
    ) -> Result<usize> {
        let shard = tp_shard(name);
        let slice = shard
            .slice_of(global_shape, tp.0, tp.1)
            .map_err(|e| candle_core::Error::Msg(format!("{name}: {e}")))?;
        let local: Vec<usize> = slice.iter().map(|s| s.1).collect();
        let (row0, rows, col0, cols, full_cols) = match slice.as_slice() {
            [(r0, r), (c0, c)] => (*r0, *r, *c0, *c, global_shape[1]),
            [(c0, c)] => (0, 1, *c0, *c, global_shape[0]),
            _ => {
                candle_core::bail!("{name}: parameters are 1-D or 2-D, got shape {global_shape:?}")
            }
        };
        let values = init.block(seed, name, row0, col0, rows, cols, full_cols);
        let t = Tensor::from_vec(values, local.as_slice(), device)?.to_dtype(dtype)?;
        self.params.push(Parameter {
            name: name.to_string(),
            var: Var::from_tensor(&t)?,
            kind,
            global_shape: global_shape.to_vec(),
            shard,
            slice,
        });
        Ok(self.params.len() - 1)
    }

    /// All parameters in creation order.
    pub fn iter(&self) -> impl Iterator<Item = &Parameter> {
        self.params.iter()
    }

    /// Parameter `i`.
    pub fn get(&self, i: usize) -> &Parameter {
        &self.params[i]
    }

    /// Number of parameters (tensors).
    pub fn len(&self) -> usize {
        self.params.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    /// Total number of elements.
    pub fn numel(&self) -> usize {
        self.params.iter().map(|p| p.var.elem_count()).sum()
    }

    /// Index of the parameter called `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.params.iter().position(|p| p.name == name)
    }
}
