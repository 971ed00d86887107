//! `Parameter` and `ParamSet`: the model's named trainable tensors with their optimiser metadata.
//!
//! A parameter's tensor sits in a slot that can be emptied and refilled: with ZeRO-3 a rank keeps
//! only a shard of each parameter, and the full tensor is installed just for the pieces that use
//! it ([`Parameter::install`], [`Parameter::release`]). Reading a released parameter is an error
//! naming it, never a silent zero.
//!
//! A slot holds a range of a flat tensor, alone or beside other parameters: the linears that
//! read one input (q, k and v; gate and up) are packed back to back ([`ParamSet::pack`]), and
//! ZeRO-3 installs a gathered bucket's ranges without copying them, so those linears run as one
//! GEMM over their rows ([`ParamSet::span`]), as Megatron's fused `linear_qkv` and `linear_fc1`.

use std::sync::{Mutex, RwLock, RwLockReadGuard};

use candle_core::{DType, Device, Result, Tensor, Var};
use parallel::tp::{tp_shard, Block, Shard, TensorParallel};

mod packing;

use crate::init::Init;
use crate::llama::Fp8Mode;
use crate::ops::Fp8Operand;

/// Most elements one copy into a slot covers (candle's CUDA copies index 32 bits).
const COPY_SPAN: usize = 1 << 31;

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
#[derive(Debug)]
pub struct Parameter {
    /// Hugging Face parameter name.
    pub name: String,
    /// Where its values are (`None` while released); written in place by the optimizer.
    slot: RwLock<Option<Slot>>,
    /// Element type of the tensor.
    pub dtype: DType,
    /// Its device.
    pub device: Device,
    /// Its role.
    pub kind: ParamKind,
    /// Shape of the whole (unsharded) tensor.
    pub global_shape: Vec<usize>,
    /// How it is split across tensor-parallel ranks (from the TP plan).
    pub shard: Shard,
    /// The block of the whole tensor this rank holds.
    pub block: Block,
    /// How it starts.
    pub init: Init,
    /// Its values as the FP8 linears of a mode read them, made on first use and dropped
    /// whenever the values change ([`Parameter::fp8_operand`]).
    fp8: Mutex<Option<(Fp8Mode, Fp8Operand)>>,
}

/// What a parameter is, before any sharding: its name, whole shape, role and initialisation.
#[derive(Debug, Clone, Copy)]
pub struct ParamSpec<'a> {
    /// Hugging Face parameter name.
    pub name: &'a str,
    /// Shape of the whole tensor.
    pub global_shape: &'a [usize],
    /// Its role.
    pub kind: ParamKind,
    /// Initial values.
    pub init: Init,
}

/// Where an installed parameter's values are: elements `offset..offset + numel` of the flat
/// (1-D, contiguous) tensor `base`, which other parameters' slots may share.
#[derive(Debug, Clone)]
pub(crate) struct Slot {
    base: Tensor,
    offset: usize,
}

impl Parameter {
    fn slot(&self) -> RwLockReadGuard<'_, Option<Slot>> {
        // A poisoned lock only means a panic elsewhere mid-update; the slot itself is intact.
        self.slot.read().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn installed(&self) -> Result<Slot> {
        self.slot().clone().ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "parameter {} is not on this rank right now (released after its use; ZeRO-3 \
                 gathers it before the pieces that need it)",
                self.name
            ))
        })
    }

    /// A copy of the parameter as an autograd variable: for reference computations that
    /// differentiate through candle's graph (tests). The model itself reads
    /// [`Parameter::tensor`].
    pub fn var(&self) -> Result<Var> {
        Var::from_tensor(&self.tensor()?.copy()?)
    }

    /// The parameter's tensor (this rank's block, shape `block.shape`; a view of its slot),
    /// carrying no autograd graph: nothing computed from it builds one.
    pub fn tensor(&self) -> Result<Tensor> {
        let Slot { base, offset } = self.installed()?;
        base.narrow(0, offset, self.numel())?
            .reshape(self.block.shape.as_slice())
    }

    /// The initial values (run seed `seed`) of elements `range` of this rank's block, in row-major
    /// order, as f32 (the parameter holds them in its dtype). Any range costs only its own rows.
    pub fn initial_values(&self, seed: u64, range: std::ops::Range<usize>) -> Vec<f32> {
        let (global, offset, shape) = (&self.global_shape, &self.block.offset, &self.block.shape);
        let (row0, col0, cols, full_cols) = match (global.as_slice(), offset.as_slice()) {
            ([_, full], [r0, c0]) => (*r0, *c0, shape[1], *full),
            ([full], [c0]) => (0, *c0, shape[0], *full),
            _ => unreachable!("ParamSet::declare admits 1-D and 2-D parameters only"),
        };
        if range.is_empty() || cols == 0 {
            return Vec::new();
        }
        let (first, last) = (range.start / cols, (range.end - 1) / cols);
        let mut rows = self.init.block(
            seed,
            &self.name,
            row0 + first,
            col0,
            last + 1 - first,
            cols,
            full_cols,
        );
        let at = first * cols;
        rows.truncate(range.end - at);
        rows.drain(..range.start - at);
        rows
    }

    /// Elements of this rank's block.
    pub fn numel(&self) -> usize {
        self.block.shape.iter().product()
    }

    /// Whether the tensor is installed.
    pub fn is_installed(&self) -> bool {
        self.slot().is_some()
    }

    /// Installs `t` (this rank's block, any layout; cast to the parameter's dtype) in a slot of
    /// its own: a copy, never a view of `t`'s storage.
    pub fn install(&self, t: &Tensor) -> Result<()> {
        if t.elem_count() != self.numel() {
            candle_core::bail!(
                "{}: installing {} values into a block of {}",
                self.name,
                t.elem_count(),
                self.numel()
            );
        }
        let base = t.flatten_all()?.to_dtype(self.dtype)?.copy()?; // [numel]
        self.put(Some(Slot { base, offset: 0 }));
        Ok(())
    }

    /// Installs elements `offset..offset + numel` of the flat tensor `base` (a gathered
    /// bucket): in place, sharing `base`'s storage, when it already has the parameter's dtype
    /// and device; else a cast copy of them.
    pub fn install_from(&self, base: &Tensor, offset: usize) -> Result<()> {
        let n = self.numel();
        if base.rank() != 1 || offset + n > base.elem_count() {
            candle_core::bail!(
                "{}: elements {offset}..{} of a tensor of shape {:?}",
                self.name,
                offset + n,
                base.dims()
            );
        }
        let kept = base.dtype() == self.dtype
            && base.device().same_device(&self.device)
            && base.is_contiguous()
            && self.views_are_cheap();
        if !kept {
            return self.install(&base.narrow(0, offset, n)?);
        }
        self.put(Some(Slot {
            base: base.clone(),
            offset,
        }));
        Ok(())
    }

    /// Whether the parameter may be a view of a larger tensor without slowing what reads it:
    /// candle's CPU matmul widens a 16-bit operand's whole storage to f32, so there a 16-bit
    /// parameter keeps a storage of its own (a q, k, v or gate, up group excepted: the fused
    /// GEMM reads all of it).
    pub(crate) fn views_are_cheap(&self) -> bool {
        self.device.is_cuda() || matches!(self.dtype, DType::F32 | DType::F64)
    }

    /// Drops the slot (the memory is freed once no slot or tape holds it).
    pub fn release(&self) {
        self.put(None);
    }

    /// Replaces the slot, dropping any FP8 operand of the old values.
    pub(crate) fn put(&self, slot: Option<Slot>) {
        let mut kept = self.fp8_kept(); // held across the write: no operand of the old values
        *kept = None;
        *self.slot.write().unwrap_or_else(|e| e.into_inner()) = slot;
    }

    /// The parameter as the FP8 linears of `mode` read it, made by `make` from its values on
    /// first use and kept until they change (`set`, `install`, `release`): every micro-batch of
    /// a step, and the forward and input gradient of each, read one quantization of a weight.
    pub fn fp8_operand(
        &self,
        mode: Fp8Mode,
        make: impl FnOnce(&Tensor) -> Result<Fp8Operand>,
    ) -> Result<Fp8Operand> {
        let mut kept = self.fp8_kept();
        if let Some((m, op)) = kept.as_ref() {
            if *m == mode {
                return Ok(op.clone());
            }
        }
        let op = make(&self.tensor()?)?;
        *kept = Some((mode, op.clone()));
        Ok(op)
    }

    /// Bytes of the FP8 operand kept (0 when none is).
    pub fn fp8_bytes(&self) -> usize {
        self.fp8_kept().as_ref().map_or(0, |(_, op)| op.bytes())
    }

    /// The kept FP8 operand's slot. Writers of the values hold it across the write, and it is
    /// taken before the variable's lock, as [`Parameter::fp8_operand`] takes them.
    pub(crate) fn fp8_kept(&self) -> std::sync::MutexGuard<'_, Option<(Fp8Mode, Fp8Operand)>> {
        // A poisoned lock only means a panic elsewhere; an operand is dropped on any write.
        self.fp8.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Overwrites the installed tensor's values in place with `t` (same number of elements;
    /// cast to the parameter's dtype).
    pub fn set(&self, t: &Tensor) -> Result<()> {
        // Cast where the values are (on the host when the optimizer state is offloaded: half the
        // bytes to copy), then moved to the parameter's device.
        let t = t
            .reshape(self.block.shape.as_slice())?
            .to_dtype(self.dtype)?;
        let moved = parallel::dp::moved(&t, &self.device)?;
        let mut kept = self.fp8_kept();
        *kept = None;
        let dst = self.tensor()?.flatten_all()?; // [numel], a view of the slot
        let src = match packing::same_storage(&dst, &moved) {
            // A value read from a parameter sharing this slot's storage: copied out first.
            true => moved.copy()?,
            false => moved,
        }
        .flatten_all()?;
        // candle's copy kernels index 32 bits: at most 2^31 elements a copy.
        let n = self.numel();
        for at in (0..n).step_by(COPY_SPAN) {
            let len = COPY_SPAN.min(n - at);
            dst.narrow(0, at, len)?
                .slice_set(&src.narrow(0, at, len)?, 0, 0)?;
        }
        Ok(())
    }
}

/// ZeRO-3 installs and releases parameters through their slots.
impl parallel::dp::ParamSlots for ParamSet {
    fn install(&self, i: usize, bucket: &Tensor, offset: usize) -> Result<()> {
        self.get(i).install_from(bucket, offset)
    }

    fn release(&self, i: usize) {
        self.get(i).release();
    }
}

/// The ordered list of a model's parameters; indices into it identify parameters everywhere
/// (gradient buffers, optimiser state, checkpoints).
#[derive(Debug, Default)]
pub struct ParamSet {
    params: Vec<Parameter>,
}

impl ParamSet {
    /// Declares this rank's block of parameter `spec.name` (whole shape `spec.global_shape`,
    /// 1-D or 2-D), split across the tensor-parallel group `tp` as the TP plan says, without
    /// allocating it (its slot starts released), and returns its index.
    pub fn declare(
        &mut self,
        spec: ParamSpec<'_>,
        tp: &TensorParallel,
        dtype: DType,
        device: &Device,
    ) -> Result<usize> {
        let ParamSpec {
            name,
            global_shape,
            kind,
            init,
        } = spec;
        if !(1..=2).contains(&global_shape.len()) {
            candle_core::bail!("{name}: parameters are 1-D or 2-D, got shape {global_shape:?}");
        }
        let shard = tp_shard(name);
        let block = shard
            .block(global_shape, tp.index(), tp.size())
            .map_err(|e| candle_core::Error::Msg(format!("{name}: {e}")))?;
        self.params.push(Parameter {
            name: name.to_string(),
            slot: RwLock::new(None),
            dtype,
            device: device.clone(),
            kind,
            global_shape: global_shape.to_vec(),
            shard,
            block,
            init,
            fp8: Mutex::new(None),
        });
        Ok(self.params.len() - 1)
    }

    /// [`ParamSet::declare`]s parameter `spec.name` and installs its initial values: exactly
    /// this rank's block of the single-rank tensor built with `seed`.
    pub fn add(
        &mut self,
        spec: ParamSpec<'_>,
        seed: u64,
        tp: &TensorParallel,
        dtype: DType,
        device: &Device,
    ) -> Result<usize> {
        let i = self.declare(spec, tp, dtype, device)?;
        let p = &self.params[i];
        let values = p.initial_values(seed, 0..p.numel());
        p.install(&Tensor::from_vec(values, p.numel(), device)?)?;
        Ok(i)
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
        self.params.iter().map(Parameter::numel).sum()
    }

    /// Index of the parameter called `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.params.iter().position(|p| p.name == name)
    }
}
