//! The Llama model: configuration, seeded initialisation, parameters, the decoder itself, the
//! segment mechanism that runs it piece by piece, and the fused op library with backward passes.

pub mod config;
pub mod init;
pub mod inventory;
pub mod llama;
pub mod moe;
mod moe_config;
pub mod ops;
pub mod params;
pub mod placement;
pub mod segment;

pub use config::{CapacityPolicy, LlamaConfig, MoeConfig, RopeScaling, TokenIds};
pub use inventory::{Inventory, ParamDecl};
pub use llama::{
    DocumentUse, Fp8Gemm, Fp8Linears, Fp8Scaling, Llama, Piece, Placement, Tape, Targets,
};
pub use ops::AttentionBackend;
pub use parallel::cp::DocumentStarts;
pub use params::{ParamKind, ParamSet, ParamSpec, Parameter};
pub use segment::{Recompute, RecomputeModule, Recomputed};
