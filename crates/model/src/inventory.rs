//! The parameters a part of the model holds, without tensors: names, whole shapes, kinds,
//! initialisers and which piece uses which, in construction order.
//!
//! [`Llama::new`](crate::Llama::new) allocates exactly this list, and the planner sizes a rank's
//! gradient buffer, optimizer state and ZeRO shards from it without allocating anything, so a
//! prediction and the trainer's measurement come from the same list.

use std::collections::BTreeMap;
use std::ops::Range;

use parallel::tp::{tp_shard, ShardError};

use crate::config::LlamaConfig;
use crate::init::Init;
use crate::llama::Piece;
use crate::params::ParamKind;

/// One parameter: its Hugging Face name, whole (unsharded) shape, kind and initialiser.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamDecl {
    /// Hugging Face name.
    pub name: String,
    /// Shape of the whole tensor.
    pub global_shape: Vec<usize>,
    /// Optimizer kind (weight decay, clipping accounting).
    pub kind: ParamKind,
    /// Seeded initialiser.
    pub init: Init,
}

impl ParamDecl {
    /// Elements of one tensor-parallel rank's block of it (tensor-parallel plan of
    /// `parallel::tp::tp_shard`).
    pub fn local_numel(&self, tp: usize) -> Result<usize, ShardError> {
        let block = tp_shard(&self.name).block(&self.global_shape, 0, tp)?;
        Ok(block.shape.iter().product())
    }
}

/// Indices of one decoder block's parameters, in construction order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockParams {
    /// `input_layernorm`.
    pub input_layernorm: usize,
    /// `self_attn.q_proj`.
    pub q_proj: usize,
    /// `self_attn.k_proj`.
    pub k_proj: usize,
    /// `self_attn.v_proj`.
    pub v_proj: usize,
    /// `self_attn.o_proj`.
    pub o_proj: usize,
    /// `post_attention_layernorm`.
    pub post_attention_layernorm: usize,
    /// The feed-forward part.
    pub mlp: MlpParams,
}

/// A block's feed-forward parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MlpParams {
    /// A SwiGLU MLP: `mlp.{gate,up,down}_proj`.
    Dense {
        /// `mlp.gate_proj`.
        gate_proj: usize,
        /// `mlp.up_proj`.
        up_proj: usize,
        /// `mlp.down_proj`.
        down_proj: usize,
    },
    /// A mixture of SwiGLU experts (Mixtral's names, `block_sparse_moe.*`).
    Moe(MoeParams),
}

/// A mixture-of-experts layer's parameters held by a rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeParams {
    /// The router `block_sparse_moe.gate` `[E, h]` (every rank holds it whole).
    pub router: usize,
    /// Global index of the first expert held; the experts held are consecutive.
    pub first_expert: usize,
    /// The experts held, in expert order.
    pub experts: Vec<ExpertParams>,
}

/// One SwiGLU expert, `block_sparse_moe.experts.E.*`: `w2(silu(w1 x) · w3 x)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertParams {
    /// `w1`, the gate projection `[f, h]`.
    pub w1: usize,
    /// `w3`, the up projection `[f, h]`.
    pub w3: usize,
    /// `w2`, the down projection `[h, f]`.
    pub w2: usize,
}

impl BlockParams {
    /// All of them, in construction order.
    pub fn all(&self) -> Vec<usize> {
        let mut all = vec![
            self.input_layernorm,
            self.q_proj,
            self.k_proj,
            self.v_proj,
            self.o_proj,
            self.post_attention_layernorm,
        ];
        match &self.mlp {
            MlpParams::Dense {
                gate_proj,
                up_proj,
                down_proj,
            } => all.extend([*gate_proj, *up_proj, *down_proj]),
            MlpParams::Moe(m) => {
                all.push(m.router);
                all.extend(m.experts.iter().flat_map(|e| [e.w1, e.w3, e.w2]));
            }
        }
        all
    }

    /// The linears that read one input and run as one GEMM in the model dtype: q, k and v;
    /// gate and up of a dense MLP.
    pub fn fused(&self) -> Vec<Vec<usize>> {
        let mut groups = vec![vec![self.q_proj, self.k_proj, self.v_proj]];
        if let MlpParams::Dense {
            gate_proj, up_proj, ..
        } = &self.mlp
        {
            groups.push(vec![*gate_proj, *up_proj]);
        }
        groups
    }
}

/// The parameters of a model part (see [`crate::Placement`]) and the pieces using them.
#[derive(Debug, Clone, PartialEq)]
pub struct Inventory {
    /// Every parameter, in construction order (the flat-buffer order).
    pub params: Vec<ParamDecl>,
    /// The token embedding: on the first stage, and on a last stage with a tied head (its own
    /// copy of the output matrix).
    pub embed_tokens: Option<usize>,
    /// Each held layer's parameters.
    pub blocks: BTreeMap<usize, BlockParams>,
    /// The final norm (with the head).
    pub norm: Option<usize>,
    /// The output matrix (the embedding's index when tied and present).
    pub lm_head: Option<usize>,
}

impl Inventory {
    /// The parameters of the part holding `layers`, the embedding if `embedding` and the head if
    /// `head`, with every expert of its MoE layers.
    pub fn new(config: &LlamaConfig, layers: &[usize], embedding: bool, head: bool) -> Self {
        let all = config.moe().map_or(0, |m| m.num_experts);
        Self::with_experts(config, layers, embedding, head, 0..all)
    }

    /// [`Inventory::new`] holding only the experts `experts` of each MoE layer (this rank's
    /// share under expert parallelism).
    pub fn with_experts(
        config: &LlamaConfig,
        layers: &[usize],
        embedding: bool,
        head: bool,
        experts: Range<usize>,
    ) -> Self {
        let (h, f, v) = (
            config.hidden_size,
            config.intermediate_size,
            config.vocab_size,
        );
        let (kv, q) = (
            config.num_key_value_heads * config.head_dim(),
            config.q_dim(),
        );
        let std = config.init_std;
        let out_std = std / (2.0 * config.num_hidden_layers as f64).sqrt();
        let (one, w, wo) = (
            Init::Constant(1.0),
            Init::Normal { std },
            Init::Normal { std: out_std },
        );
        let mut params = Vec::new();
        let mut add = |name: String, shape: &[usize], kind: ParamKind, init: Init| {
            params.push(ParamDecl {
                name,
                global_shape: shape.to_vec(),
                kind,
                init,
            });
            params.len() - 1
        };
        // The tied output matrix is the embedding: a last stage without the embedding keeps its own
        // copy (same name, same initial values) whose gradient is summed with the first stage's.
        let embed_tokens = (embedding || (head && config.tie_word_embeddings)).then(|| {
            add(
                "model.embed_tokens.weight".into(),
                &[v, h],
                ParamKind::Embedding,
                w,
            )
        });
        let moe = config.moe();
        let mut blocks = BTreeMap::new();
        for &i in layers {
            let n = |s: &str| format!("model.layers.{i}.{s}.weight");
            let (norm, matrix) = (ParamKind::Norm, ParamKind::Matrix);
            let block = BlockParams {
                input_layernorm: add(n("input_layernorm"), &[h], norm, one),
                q_proj: add(n("self_attn.q_proj"), &[q, h], matrix, w),
                k_proj: add(n("self_attn.k_proj"), &[kv, h], matrix, w),
                v_proj: add(n("self_attn.v_proj"), &[kv, h], matrix, w),
                o_proj: add(n("self_attn.o_proj"), &[h, q], matrix, wo),
                post_attention_layernorm: add(n("post_attention_layernorm"), &[h], norm, one),
                mlp: match &moe {
                    Some(m) if config.is_moe_layer(i) => {
                        let n = |s: &str| format!("model.layers.{i}.block_sparse_moe.{s}.weight");
                        let (e, fe) = (m.num_experts, m.expert_size);
                        let router = add(n("gate"), &[e, h], matrix, w);
                        let held = experts
                            .clone()
                            .map(|j| ExpertParams {
                                w1: add(n(&format!("experts.{j}.w1")), &[fe, h], matrix, w),
                                w3: add(n(&format!("experts.{j}.w3")), &[fe, h], matrix, w),
                                w2: add(n(&format!("experts.{j}.w2")), &[h, fe], matrix, wo),
                            })
                            .collect();
                        MlpParams::Moe(MoeParams {
                            router,
                            first_expert: experts.start,
                            experts: held,
                        })
                    }
                    _ => MlpParams::Dense {
                        gate_proj: add(n("mlp.gate_proj"), &[f, h], matrix, w),
                        up_proj: add(n("mlp.up_proj"), &[f, h], matrix, w),
                        down_proj: add(n("mlp.down_proj"), &[h, f], matrix, wo),
                    },
                },
            };
            blocks.insert(i, block);
        }
        let (norm, lm_head) = if head {
            let norm = add("model.norm.weight".into(), &[h], ParamKind::Norm, one);
            let lm_head = match (config.tie_word_embeddings, embed_tokens) {
                (true, Some(e)) => e,
                _ => add("lm_head.weight".into(), &[v, h], ParamKind::Matrix, w),
            };
            (Some(norm), Some(lm_head))
        } else {
            (None, None)
        };
        Self {
            params,
            embed_tokens,
            blocks,
            norm,
            lm_head,
        }
    }

    /// Indices of the parameters piece `piece` uses (empty for a piece this part lacks).
    pub fn piece_params(&self, piece: Piece) -> Vec<usize> {
        match piece {
            Piece::Embedding => self.embed_tokens.into_iter().collect(),
            Piece::Block(i) => self
                .blocks
                .get(&i)
                .map(BlockParams::all)
                .unwrap_or_default(),
            Piece::Head => self.norm.into_iter().chain(self.lm_head).collect(),
        }
    }

    /// Whether parameter `i` is a routed expert's, which a micro-batch may leave without a
    /// gradient (no token chose the expert).
    pub fn is_expert(&self, i: usize) -> bool {
        self.blocks.values().any(|b| match &b.mlp {
            MlpParams::Moe(m) => m.experts.iter().any(|e| [e.w1, e.w3, e.w2].contains(&i)),
            MlpParams::Dense { .. } => false,
        })
    }

    /// For every parameter, whether it is a routed expert's ([`Inventory::is_expert`]).
    pub fn expert_flags(&self) -> Vec<bool> {
        let mut flags = vec![false; self.params.len()];
        for b in self.blocks.values() {
            if let MlpParams::Moe(m) = &b.mlp {
                for e in &m.experts {
                    for i in [e.w1, e.w3, e.w2] {
                        flags[i] = true;
                    }
                }
            }
        }
        flags
    }

    /// Whether each parameter is read back to back with the next one by a fused GEMM (q with
    /// k, k with v; gate with up): a flat layout keeps them in one bucket.
    pub fn joined_flags(&self) -> Vec<bool> {
        let mut flags = vec![false; self.params.len()];
        for group in self.blocks.values().flat_map(BlockParams::fused) {
            for pair in group.windows(2) {
                if pair[1] == pair[0] + 1 {
                    flags[pair[0]] = true;
                }
            }
        }
        flags
    }

    /// Whether each parameter is a hidden projection matrix: attention's q, k, v and o, the
    /// MLP's gate, up and down, every expert's w1, w3 and w2 (what Muon updates; the embedding,
    /// the output matrix, norms and routers are not).
    pub fn hidden_matrices(&self) -> Vec<bool> {
        let mut flags = self.expert_flags();
        for b in self.blocks.values() {
            for i in [b.q_proj, b.k_proj, b.v_proj, b.o_proj] {
                flags[i] = true;
            }
            if let MlpParams::Dense {
                gate_proj,
                up_proj,
                down_proj,
            } = b.mlp
            {
                for i in [gate_proj, up_proj, down_proj] {
                    flags[i] = true;
                }
            }
        }
        flags
    }

    /// Elements of each parameter on one tensor-parallel rank of `tp`, in construction order.
    pub fn local_numels(&self, tp: usize) -> Result<Vec<usize>, ShardError> {
        self.params.iter().map(|p| p.local_numel(tp)).collect()
    }
}
