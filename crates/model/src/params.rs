//! `Parameter` and `ParamSet`: the model's named trainable tensors with their optimiser metadata.

use candle_core::{DType, Device, Result, Tensor, Var};

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
}

/// The ordered list of a model's parameters; indices into it identify parameters everywhere
/// (gradient buffers, optimiser state, checkpoints).
#[derive(Debug, Clone, Default)]
pub struct ParamSet {
    params: Vec<Parameter>,
}

impl ParamSet {
    /// Creates parameter `name` of `shape` from `init` (seeded, layout-free) and returns its index.
    pub fn add(
        &mut self,
        name: &str,
        shape: &[usize],
        kind: ParamKind,
        init: Init,
        seed: u64,
        dtype: DType,
        device: &Device,
    ) -> Result<usize> {
        let cols = *shape.last().unwrap_or(&1);
        let rows = shape.iter().product::<usize>() / cols.max(1);
        let values = init.block(seed, name, 0, 0, rows, cols, cols);
        let t = Tensor::from_vec(values, shape, device)?.to_dtype(dtype)?;
        self.params.push(Parameter {
            name: name.to_string(),
            var: Var::from_tensor(&t)?,
            kind,
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
