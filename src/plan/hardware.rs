//! GPU presets for the planner: peak dense bf16 throughput, memory, HBM and interconnect
//! bandwidths from the vendors' data sheets, and the fraction of peak a large GEMM and the
//! attention kernels reach in a training step. Every value can be overridden from the command
//! line.

use serde::Serialize;

/// How many collective communicators' worth of NCCL buffers an all-to-all communicator holds.
pub const ALL_TO_ALL_COMMUNICATORS: f64 = 3.5;

/// A GPU model the planner knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GpuPreset {
    /// NVIDIA A100 SXM 80 GB (DGX A100: NVLink 3, 8 × 200 Gb/s HDR InfiniBand per node).
    #[value(name = "a100-80g")]
    A100_80g,
    /// NVIDIA H100 SXM 80 GB (DGX H100: NVLink 4, 8 × 400 Gb/s NDR InfiniBand per node).
    H100,
    /// NVIDIA H200 SXM 141 GB (H100's compute with more and faster memory).
    H200,
}

/// What the planner assumes of the GPUs and their links.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Hardware {
    /// Preset name.
    pub name: &'static str,
    /// Peak dense bf16 TFLOP/s per GPU.
    pub peak_tflops: f64,
    /// Device memory per GPU, GiB: what CUDA reports as the device's total (less than the
    /// marketing figure: 79.6 of an H100 80GB, 140.4 of an H200 141GB), or what the device read
    /// says ([`Hardware::found`]).
    pub memory_gib: f64,
    /// Memory each process needs outside its memory pool, GiB: the CUDA context, the loaded
    /// kernels and the cuBLAS and cuDNN workspaces. Measured by the process itself
    /// (`device_outside_pool_mib`, docs/perf.md, GPU 2026-11-27 on an H200): 1.16 for a rank of
    /// the 1.1B model, 1.35 with NCCL's one-rank communicator open; 1.5 leaves a margin for more
    /// kernel modules (MoE, Muon) and streams. (The 3.2 read from nvidia-smi before included a
    /// copy of the weights that the end of a run made.) Assumed the same on the other presets.
    pub context_gib: f64,
    /// NCCL buffers of one collective communicator, GiB (public reports: 0.5-0.7 GB per group on
    /// A100, 1.6 GB for one all-reducing communicator; not measured here). A point-to-point
    /// communicator counts half of it and an all-to-all one [`ALL_TO_ALL_COMMUNICATORS`] times it
    /// (one channel per peer pair: 3.3 GB on 8 H100s).
    pub nccl_gib: f64,
    /// HBM bandwidth, GB/s.
    pub hbm_gbps: f64,
    /// Per-GPU bandwidth of collectives inside a node (NVLink, one direction), GB/s.
    pub intra_node_gbps: f64,
    /// Per-GPU bandwidth of collectives across nodes (its InfiniBand share), GB/s.
    pub inter_node_gbps: f64,
    /// GPUs per node.
    pub gpus_per_node: usize,
    /// Fraction of peak a large bf16 GEMM reaches inside a training step (where
    /// [`Hardware::rates`] has no GEMM near the shape).
    pub gemm_efficiency: f64,
    /// Rates measured on the device (`pretrain bench-rates`), if given.
    #[serde(skip)]
    pub rates: Option<&'static super::Rates>,
    /// Fraction of peak the fused causal attention reaches (forward and backward; where
    /// [`Hardware::rates`] has no measurement at the head dim and length).
    pub attention_efficiency: f64,
    /// The host side, for optimizer offload.
    pub host: Host,
}

/// What the planner assumes of a node's host, for `optimizer.offload: cpu`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Host {
    /// Host memory per node, GiB.
    pub memory_gib: f64,
    /// Per-GPU copy bandwidth between host and device, one direction, GB/s: the offloaded
    /// state is pageable memory, which copies at about half a PCIe link's pinned rate (gen4 x16
    /// about 25 GB/s pinned, gen5 about 50).
    pub pcie_gbps: f64,
    /// Host memory bandwidth of a node that the offloaded AdamW update reaches, GB/s, shared by
    /// the node's ranks (two sockets of DDR4-3200 or DDR5-4800 at about 60% of their peak).
    pub memory_gbps: f64,
}

impl GpuPreset {
    /// The preset's values.
    pub fn hardware(self) -> Hardware {
        match self {
            GpuPreset::A100_80g => Hardware {
                name: "a100-80g",
                peak_tflops: 312.0,
                memory_gib: 80.0,
                context_gib: 1.5,
                nccl_gib: 1.0,
                hbm_gbps: 2039.0,
                intra_node_gbps: 300.0,
                inter_node_gbps: 25.0,
                gpus_per_node: 8,
                gemm_efficiency: 0.62,
                attention_efficiency: 0.20,
                rates: None,
                // DGX A100: 2 TB, PCIe gen4, two EPYC 7742 (2 × 205 GB/s peak).
                host: Host {
                    memory_gib: 1907.0,
                    pcie_gbps: 12.0,
                    memory_gbps: 240.0,
                },
            },
            GpuPreset::H100 => Hardware {
                name: "h100",
                peak_tflops: 989.0,
                // 81,559 MiB.
                memory_gib: 79.6,
                context_gib: 1.5,
                nccl_gib: 1.0,
                hbm_gbps: 3350.0,
                intra_node_gbps: 450.0,
                inter_node_gbps: 50.0,
                gpus_per_node: 8,
                gemm_efficiency: 0.55,
                attention_efficiency: 0.20,
                rates: None,
                // DGX H100: 2 TB, PCIe gen5, two Xeon 8480C (2 × 307 GB/s peak).
                host: Host {
                    memory_gib: 1907.0,
                    pcie_gbps: 22.0,
                    memory_gbps: 370.0,
                },
            },
            GpuPreset::H200 => Hardware {
                name: "h200",
                peak_tflops: 989.0,
                // 143,771 MiB (docs/perf.md, the H200 of 2026-11-27).
                memory_gib: 140.4,
                context_gib: 1.5,
                nccl_gib: 1.0,
                hbm_gbps: 4800.0,
                intra_node_gbps: 450.0,
                inter_node_gbps: 50.0,
                gpus_per_node: 8,
                gemm_efficiency: 0.57,
                attention_efficiency: 0.20,
                rates: None,
                // DGX H200: as DGX H100.
                host: Host {
                    memory_gib: 1907.0,
                    pcie_gbps: 22.0,
                    memory_gbps: 370.0,
                },
            },
        }
    }
}

impl Hardware {
    /// Whether this is a GPU (not the CPU [`Hardware::found`] describes for thread ranks).
    pub fn is_gpu(&self) -> bool {
        self.name != "cpu"
    }

    /// The hardware a job of `recipe` finds here, `per_node` ranks to a node: on CUDA the preset
    /// of the first GPU's model (an unknown model is planned as an H100) with the memory the
    /// device reports; on the CPU the H100's rates (only the ranking of layouts matters there)
    /// with the host's available memory shared by the node's `per_node` thread or process ranks.
    pub fn found(recipe: &crate::recipe::Recipe, per_node: usize) -> Hardware {
        let per_node = per_node.max(1);
        if recipe.train.device == crate::recipe::DeviceKind::Cuda {
            let mut hw = match crate::device::gpu_facts() {
                Some(f) => Self::of_gpu(&f.name, f.total),
                None => GpuPreset::H100.hardware(),
            };
            if let Some(total) = host_memory_bytes() {
                hw.host.memory_gib = total as f64 / super::GIB;
            }
            return hw;
        }
        let available = crate::device::capacity(&candle_core::Device::Cpu).unwrap_or(0);
        Hardware {
            name: "cpu",
            memory_gib: available as f64 / super::GIB / per_node as f64,
            context_gib: 0.0,
            nccl_gib: 0.0,
            gpus_per_node: per_node,
            ..GpuPreset::H100.hardware()
        }
    }

    /// The preset of a GPU named `name` (as the driver names it) with `total` bytes.
    pub fn of_gpu(name: &str, total: u64) -> Hardware {
        let upper = name.to_uppercase();
        let preset = if upper.contains("H200") {
            GpuPreset::H200
        } else if upper.contains("A100") {
            GpuPreset::A100_80g
        } else {
            GpuPreset::H100
        };
        Hardware {
            memory_gib: total as f64 / super::GIB,
            ..preset.hardware()
        }
    }

    /// Whether the host memory of a node holds `bytes` per rank for its ranks (a node runs
    /// `gpus_per_node` of them, or the whole job when it is smaller); on the CPU the ranks'
    /// device memory is host memory and [`Hardware::memory_gib`] already their share of it.
    pub fn host_holds(&self, bytes: u64, world: usize) -> bool {
        let ranks = self.gpus_per_node.min(world).max(1) as f64;
        !self.is_gpu() || bytes as f64 * ranks <= self.host.memory_gib * super::GIB
    }

    /// Bytes a rank holding `comms` NCCL communicators needs outside its memory pool.
    pub fn headroom_bytes(&self, comms: &parallel::register::Communicators) -> u64 {
        let nccl = comms.groups as f64
            + 0.5 * comms.p2p as f64
            + comms.rings as f64
            + ALL_TO_ALL_COMMUNICATORS * comms.all_to_all as f64;
        ((self.context_gib + self.nccl_gib * nccl) * super::GIB) as u64
    }
}

/// This machine's host memory (`MemTotal` of `/proc/meminfo`), bytes.
fn host_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}
