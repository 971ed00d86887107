//! Admission: before a job allocates anything, the planner's prediction of its memory is
//! compared with what the machine has, so a model that cannot fit is refused with the numbers
//! instead of aborting in an allocation or driving the host into the kernel's OOM killer.
//!
//! The need is the most loaded rank's predicted bytes (parameters, gradients, optimizer state,
//! activations, ZeRO buffers and temporaries: `plan::memory`) times the ranks sharing the device
//! (thread ranks share the process; on a GPU, ranks sharing it), plus a headroom for what the
//! planner's memory pool does not hold: the process itself, allocator arenas and the data loader
//! on the CPU; on a GPU the planner's headroom (the CUDA context, library workspaces and, for a
//! rank of a multi-process job, its NCCL communicators' buffers: `Hardware::headroom_bytes`). It is compared with the
//! host's `MemAvailable` or the GPU's free memory (`device::capacity`). `pretrain check` prints
//! the same comparison as a warning.

use anyhow::{bail, Result};
use candle_core::Device;

use crate::plan::{cheapest_fit, GpuPreset, GIB};
use crate::recipe::Recipe;

/// What a CPU job needs beyond the planned bytes.
pub const CPU_HEADROOM: u64 = 512 << 20;

/// A job's memory against its device's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Assessment {
    /// Predicted bytes of the most loaded rank.
    pub per_rank: u64,
    /// Ranks sharing the device.
    pub ranks: usize,
    /// What the device needs beyond the planned bytes: on a GPU the planner's headroom
    /// (`Hardware::headroom_bytes`: context, libraries and, for a rank of a multi-process job,
    /// its NCCL communicators' buffers), on the CPU [`CPU_HEADROOM`].
    pub headroom: u64,
    /// `per_rank × ranks` + the headroom.
    pub need: u64,
    /// What the device has.
    pub have: u64,
}

impl Assessment {
    /// Whether the job fits.
    pub fn fits(&self) -> bool {
        self.need <= self.have
    }

    /// The comparison in words, with the fastest memory levers that would make it fit.
    pub fn describe(&self, recipe: &Recipe, device: &Device) -> String {
        let gib = |b: u64| b as f64 / GIB;
        let headroom = self.headroom;
        let what = if device.is_cuda() {
            "this GPU's free memory"
        } else {
            "this machine's available memory (MemAvailable)"
        };
        let mut s = format!(
            "the job needs about {:.2} GiB ({} rank(s) × {:.2} GiB planned by `pretrain plan` + \
             {:.2} GiB headroom), more than {what}, {:.2} GiB",
            gib(self.need),
            self.ranks,
            gib(self.per_rank),
            gib(headroom),
            gib(self.have)
        );
        // What each rank may plan for, the headroom already set aside.
        let mut hw = GpuPreset::H100.hardware();
        hw.memory_gib = gib(self.have.saturating_sub(headroom)) / self.ranks.max(1) as f64;
        (hw.context_gib, hw.nccl_gib) = (0.0, 0.0);
        match cheapest_fit(recipe, &hw) {
            Some(p) => {
                let own = crate::plan::Layout::of(recipe);
                s += &format!("; it fits with {}", own.lever_flags(&p.layout));
            }
            None => {
                s += "; no ZeRO stage, recompute or moments' dtype makes this layout fit: \
                          a smaller model or train.micro_batch, or more ranks on more machines \
                          (`pretrain plan --gpus N` ranks the layouts)"
            }
        }
        s
    }
}

/// The job of `recipe` with `ranks` ranks on `device` against its capacity; `None` when the
/// capacity cannot be read.
pub fn assess(recipe: &Recipe, ranks: usize, device: &Device) -> Result<Option<Assessment>> {
    let Some(have) = crate::device::capacity(device) else {
        return Ok(None);
    };
    let stages = crate::plan::memory::stages(recipe)?;
    // On the CPU an offloaded state shares the ranks' memory (on a GPU, see `admit`).
    let on_host = |b: &crate::plan::MemoryBytes| if device.is_cuda() { 0 } else { b.host };
    let per_rank = (stages.iter())
        .map(|s| s.bytes.total + on_host(&s.bytes))
        .max()
        .unwrap_or(0);
    let headroom = if device.is_cuda() {
        // Thread ranks sharing one GPU talk through host memory; one rank per process uses NCCL.
        let comms = if ranks < recipe.parallel.world_size() {
            parallel::register::most_communicators(&recipe.parallel)?
        } else {
            parallel::register::Communicators::default()
        };
        GpuPreset::H100.hardware().headroom_bytes(&comms)
    } else {
        CPU_HEADROOM
    };
    let need = per_rank
        .saturating_mul(ranks as u64)
        .saturating_add(headroom);
    Ok(Some(Assessment {
        per_rank,
        ranks,
        headroom,
        need,
        have,
    }))
}

/// Refuses the job of `recipe` when its `ranks` ranks on `device` do not fit.
pub fn admit(recipe: &Recipe, ranks: usize, device: &Device) -> Result<()> {
    if let Some(a) = assess(recipe, ranks, device)? {
        if !a.fits() {
            bail!("{}", a.describe(recipe, device));
        }
    }
    let stages = crate::plan::memory::stages(recipe)?;
    let host = stages.iter().map(|s| s.bytes.host).max().unwrap_or(0);
    let available = crate::device::capacity(&Device::Cpu);
    if let Some(have) = available.filter(|_| device.is_cuda() && host > 0) {
        let need = host.saturating_mul(ranks as u64);
        let gib = |b: u64| b as f64 / GIB;
        if need > have {
            bail!(
                "optimizer.offload: cpu keeps {:.1} GiB of optimizer state per rank in host \
                 memory, {:.1} GiB for this process's {ranks} ranks; the host has {:.1} GiB \
                 available (optimizer.state_dtype: bf16 takes a third less; more ranks shard it \
                 with parallel.zero)",
                gib(host),
                gib(need),
                gib(have)
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job short of memory is told the fastest levers that make it fit.
    #[test]
    fn a_job_that_does_not_fit_is_told_what_would() {
        let o = ["parallel.dp=1,parallel.zero=0".to_string()];
        let r = crate::recipe::load(std::path::Path::new("recipes/1b.yaml"), &o).unwrap();
        let stages = crate::plan::memory::stages(&r).unwrap();
        let per_rank = stages.iter().map(|s| s.bytes.total).max().unwrap();
        let a = Assessment {
            per_rank,
            ranks: 1,
            headroom: CPU_HEADROOM,
            need: per_rank + CPU_HEADROOM,
            have: per_rank + CPU_HEADROOM - (1 << 30),
        };
        assert!(!a.fits());
        let text = a.describe(&r, &Device::Cpu);
        assert!(text.contains("it fits with --set"), "{text}");
        assert!(text.contains("MemAvailable"), "{text}");
        let hopeless = Assessment { have: 1 << 20, ..a };
        let text = hopeless.describe(&r, &Device::Cpu);
        assert!(
            text.contains("no ZeRO stage, recompute or moments' dtype"),
            "{text}"
        );
    }
}
