//! The mixture-of-experts part of [`LlamaConfig`]: its settings with defaults resolved
//! ([`MoeConfig`]), which layers are MoE, and their validation.

use crate::config::LlamaConfig;

/// The most routed experts a MoE layer may have (a layer of 16,384 experts plans and checks in a
/// quarter of a second; a million took `pretrain check` 20 s).
pub const MAX_EXPERTS: usize = 16_384;

/// The mixture-of-experts settings of a model, defaults resolved (see the `LlamaConfig` fields of
/// the same names).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Experts per MoE layer (`E`).
    pub num_experts: usize,
    /// Experts per token (`k`).
    pub top_k: usize,
    /// Load-balancing loss weight.
    pub aux_loss_coef: f64,
    /// Router z-loss weight.
    pub z_loss_coef: f64,
    /// Renormalise the top-k weights.
    pub norm_topk_prob: bool,
    /// Width of an expert's SwiGLU.
    pub expert_size: usize,
    /// Layers with a dense MLP.
    pub dense_layers: Vec<usize>,
    /// Step size of the per-expert selection bias (0: no bias).
    pub bias_update_rate: f64,
    /// Expert capacity factor (`None`: dropless).
    pub capacity_factor: Option<f64>,
    /// Which pairs an expert over its capacity keeps, and where the routing runs.
    pub capacity_policy: CapacityPolicy,
}

/// Which `(token, slot)` pairs an expert over its capacity keeps, and how its rows are laid out
/// (`model.moe_capacity_policy`; Megatron's `moe_token_drop_policy` and
/// `moe_pad_expert_input_to_capacity`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CapacityPolicy {
    /// Each expert keeps its most probable pairs (ties: the earlier pair); routed on the host.
    #[default]
    Probs,
    /// Each expert keeps its first pairs in token order; routed on the host.
    Position,
    /// As `position`, with every expert's rows padded to the capacity: the shapes are fixed,
    /// so the routing, the permutation and the statistics stay on the device and a layer reads
    /// nothing back (padding rows are zero and add nothing; they cost their share of GEMM).
    Padded,
}

impl MoeConfig {
    /// Pairs each expert may keep of the `n · k` pairs of `n` routed tokens: `ceil(factor · n ·
    /// k / E)`, or `None` without a capacity (dropless).
    pub fn capacity(&self, n: usize) -> Option<usize> {
        let (pairs, e) = ((n * self.top_k) as f64, self.num_experts as f64);
        self.capacity_factor
            .map(|f| (f * pairs / e).ceil() as usize)
    }

    /// Rows the experts compute for `n` routed tokens: every expert's capacity when padded,
    /// else the `n · k` pairs (an upper bound with a capacity that drops).
    pub fn expert_rows(&self, n: usize) -> usize {
        match (self.capacity(n), self.capacity_policy) {
            (Some(c), CapacityPolicy::Padded) => self.num_experts * c,
            _ => n * self.top_k,
        }
    }
}

impl CapacityPolicy {
    /// Whether each expert keeps its first pairs in token order (else its most probable).
    pub fn by_position(self) -> bool {
        self != CapacityPolicy::Probs
    }
}

impl LlamaConfig {
    /// The mixture-of-experts settings, or `None` for a dense model.
    pub fn moe(&self) -> Option<MoeConfig> {
        let num_experts = self.num_local_experts?;
        Some(MoeConfig {
            num_experts,
            top_k: self.num_experts_per_tok.unwrap_or(2),
            aux_loss_coef: self.router_aux_loss_coef.unwrap_or(0.02),
            z_loss_coef: self.router_z_loss_coef.unwrap_or(0.0),
            norm_topk_prob: self.norm_topk_prob.unwrap_or(true),
            expert_size: self.moe_intermediate_size.unwrap_or(self.intermediate_size),
            dense_layers: self.mlp_only_layers.clone(),
            bias_update_rate: self.router_bias_update_rate.unwrap_or(0.0),
            capacity_factor: self.moe_expert_capacity_factor,
            capacity_policy: self.moe_capacity_policy.unwrap_or_default(),
        })
    }

    /// Number of layers with a mixture-of-experts MLP (in time linear in `mlp_only_layers`, not
    /// in the layer count, which may be untrusted).
    pub fn num_moe_layers(&self) -> usize {
        if self.num_local_experts.is_none() {
            return 0;
        }
        let mut dense: Vec<usize> = self
            .mlp_only_layers
            .iter()
            .copied()
            .filter(|&l| l < self.num_hidden_layers)
            .collect();
        dense.sort_unstable();
        dense.dedup();
        self.num_hidden_layers - dense.len()
    }

    /// Whether layer `i` has a mixture-of-experts MLP.
    pub fn is_moe_layer(&self, i: usize) -> bool {
        self.num_local_experts.is_some() && !self.mlp_only_layers.contains(&i)
    }

    pub(crate) fn validate_moe(&self) -> Result<(), String> {
        let Some(m) = self.moe() else {
            let set = [
                ("num_experts_per_tok", self.num_experts_per_tok.is_some()),
                ("router_aux_loss_coef", self.router_aux_loss_coef.is_some()),
                ("router_z_loss_coef", self.router_z_loss_coef.is_some()),
                ("norm_topk_prob", self.norm_topk_prob.is_some()),
                (
                    "moe_intermediate_size",
                    self.moe_intermediate_size.is_some(),
                ),
                ("mlp_only_layers", !self.mlp_only_layers.is_empty()),
                (
                    "router_bias_update_rate",
                    self.router_bias_update_rate.is_some(),
                ),
                (
                    "moe_expert_capacity_factor",
                    self.moe_expert_capacity_factor.is_some(),
                ),
                ("moe_capacity_policy", self.moe_capacity_policy.is_some()),
            ];
            return match set.iter().find(|(_, set)| *set) {
                Some((field, _)) => Err(format!(
                    "model.{field} is a mixture-of-experts setting: set model.num_local_experts \
                     too, or remove it"
                )),
                None => Ok(()),
            };
        };
        if m.num_experts < 2 {
            return Err(format!(
                "model.num_local_experts ({}) must be at least 2 (remove it for a dense model)",
                m.num_experts
            ));
        }
        if m.num_experts > MAX_EXPERTS {
            return Err(format!(
                "model.num_local_experts ({}) is above {MAX_EXPERTS}, the most experts a layer \
                 may have here: tokens choose among all of a layer's experts, and every expert is \
                 a parameter set of its own (published MoE models have 8 to 384)",
                m.num_experts
            ));
        }
        if m.top_k == 0 || m.top_k > m.num_experts {
            return Err(format!(
                "model.num_experts_per_tok ({}) must be between 1 and model.num_local_experts ({})",
                m.top_k, m.num_experts
            ));
        }
        if m.expert_size == 0 {
            return Err("model.moe_intermediate_size must be positive".to_string());
        }
        for (field, v) in [
            ("router_aux_loss_coef", m.aux_loss_coef),
            ("router_z_loss_coef", m.z_loss_coef),
            ("router_bias_update_rate", m.bias_update_rate),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(format!("model.{field} ({v}) must be a number >= 0"));
            }
        }
        if let Some(f) = m.capacity_factor.filter(|f| !(f.is_finite() && *f > 0.0)) {
            return Err(format!(
                "model.moe_expert_capacity_factor ({f}) must be a number > 0 (remove it for \
                 dropless routing)"
            ));
        }
        if m.capacity_factor.is_none() && self.moe_capacity_policy.is_some() {
            return Err("model.moe_capacity_policy is a capacity setting: set \
                        model.moe_expert_capacity_factor too, or remove it"
                .to_string());
        }
        let most = crate::moe::MAX_PADDED_EXPERTS;
        if m.capacity_policy == CapacityPolicy::Padded && m.num_experts > most {
            return Err(format!(
                "model.moe_capacity_policy: padded routes on the device, which sorts a token's \
                 experts in one thread block: at most {most} experts, not {} (use position)",
                m.num_experts
            ));
        }
        if let Some(&bad) = m
            .dense_layers
            .iter()
            .find(|&&l| l >= self.num_hidden_layers)
        {
            return Err(format!(
                "model.mlp_only_layers names layer {bad}, but the model has {} layers (0..{})",
                self.num_hidden_layers, self.num_hidden_layers
            ));
        }
        Ok(())
    }

    /// Every parameter of the whole model in Hugging Face naming, with its shape, in model order.
    pub fn tensor_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let layers: Vec<usize> = (0..self.num_hidden_layers).collect();
        crate::Inventory::new(self, &layers, true, true)
            .params
            .into_iter()
            .map(|p| (p.name, p.global_shape))
            .collect()
    }
}
