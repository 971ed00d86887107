//! A rank process joining its job ([`join`]): rank 0 serves the rendezvous store (on
//! [`store_port`]), every rank connects to it with the job token and builds the communicator of
//! its device — `tcp` for CPU ranks, NCCL for CUDA ranks (one GPU per process, see
//! `device::open_local_gpu`).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use candle_core::Device;
use parallel::comm::tcp::TcpComm;
use parallel::env::ProcessInfo;
use parallel::store::{Store, StoreServer};
use parallel::Comm;

use super::token::{job_token, store_bind, JobToken, TOKEN_FILE_VAR};
use super::TOKEN_VAR;
use crate::recipe::{DeviceKind, Recipe};

/// The port of this job's rendezvous store: `PRETRAIN_STORE_PORT` if set; under torchrun, whose
/// agent already serves its own store on `MASTER_PORT` (`TORCHELASTIC_USE_AGENT_STORE`), the
/// next port; otherwise `MASTER_PORT`.
pub fn store_port(get: &dyn Fn(&str) -> Option<String>, info: &ProcessInfo) -> Result<u16> {
    if let Some(p) = get("PRETRAIN_STORE_PORT") {
        return match p.trim().parse::<u16>() {
            Ok(port) if port > 0 => Ok(port),
            _ => bail!("PRETRAIN_STORE_PORT={p:?} is not a port number (1-65535)"),
        };
    }
    if get("TORCHELASTIC_USE_AGENT_STORE").is_some() {
        return info.master_port.checked_add(1).with_context(|| {
            format!(
                "MASTER_PORT {} has no next port for the store; set PRETRAIN_STORE_PORT",
                info.master_port
            )
        });
    }
    Ok(info.master_port)
}

/// A joined job: the communicator and device of this rank, and (on rank 0) the store server,
/// which must outlive the job.
pub struct Job {
    /// This rank's communicator.
    pub comm: Arc<dyn Comm>,
    /// This rank's device.
    pub device: Device,
    _server: Option<StoreServer>,
}

/// Joins the job `info` describes, for `recipe` (whose layout must have `info.world_size` ranks).
pub fn join(info: &ProcessInfo, recipe: &Recipe) -> Result<Job> {
    let world = recipe.parallel.world_size();
    if world != info.world_size {
        bail!(
            "the recipe's layout dp×tp×cp×pp = {}×{}×{}×{} = {world} ranks, but the {} launcher \
             started {} processes (WORLD_SIZE)",
            recipe.parallel.dp,
            recipe.parallel.tp,
            recipe.parallel.cp,
            recipe.parallel.pp,
            info.launcher,
            info.world_size
        );
    }
    let timeout = Duration::from_secs_f64(recipe.parallel.timeout_s);
    let token = match job_token(&|k| std::env::var(k).ok(), info)? {
        JobToken::Secret(t) => t,
        JobToken::Derived(t) => {
            if info.rank == 0 {
                tracing::warn!(
                    "no {TOKEN_VAR} or {TOKEN_FILE_VAR}: the job token is derived from public \
                     values (launcher, job id, address, port), so any user who can reach \
                     {}:{} can join this job and send it data; set a secret token",
                    info.master_addr,
                    info.master_port
                );
            }
            t
        }
    };
    let port = store_port(&|k| std::env::var(k).ok(), info)?;
    let server = if info.rank == 0 {
        let bind = store_bind(&info.master_addr, port);
        let s = StoreServer::start(&bind, &token, timeout)
            .with_context(|| format!("rank 0: serving the rendezvous store on {bind}"))?;
        Some(s)
    } else {
        None
    };
    let addr = format!("{}:{port}", info.master_addr);
    let mut store = Store::connect(&addr, &token, timeout)
        .with_context(|| format!("rank {}: joining the job", info.rank))?;
    let (comm, device): (Arc<dyn Comm>, Device) = match recipe.train.device {
        DeviceKind::Cpu => {
            let comm = TcpComm::connect(info.rank, world, &mut store, &token, timeout)?;
            (comm, Device::Cpu)
        }
        DeviceKind::Cuda => cuda_comm(info, world, store, timeout)?,
    };
    Ok(Job {
        comm,
        device,
        _server: server,
    })
}

#[cfg(feature = "nccl")]
fn cuda_comm(
    info: &ProcessInfo,
    world: usize,
    store: Store,
    timeout: Duration,
) -> Result<(Arc<dyn Comm>, Device)> {
    let device = crate::device::open_local_gpu(info.rank, info.local_rank)?;
    let cuda = device.as_cuda_device()?.clone();
    let comm = parallel::comm::nccl::NcclComm::new(info.rank, world, store, cuda, timeout)
        .with_context(|| format!("rank {}: setting up NCCL", info.rank))?;
    Ok((Arc::new(comm), device))
}

#[cfg(not(feature = "nccl"))]
fn cuda_comm(
    info: &ProcessInfo,
    _world: usize,
    _store: Store,
    _timeout: Duration,
) -> Result<(Arc<dyn Comm>, Device)> {
    // Opening the device first gives the more basic error on a CPU-only build.
    crate::device::open_local_gpu(info.rank, info.local_rank)?;
    bail!("multi-process CUDA jobs need the `nccl` feature (scripts/build-cuda.sh builds it)")
}

#[cfg(test)]
mod tests {
    use super::super::tests::info;
    use super::*;

    #[test]
    fn the_store_avoids_torchruns_own_port() {
        let i = info("torchrun");
        let none = |_: &str| None;
        assert_eq!(store_port(&none, &i).unwrap(), 29500);
        let agent = |k: &str| (k == "TORCHELASTIC_USE_AGENT_STORE").then(|| "True".to_string());
        assert_eq!(store_port(&agent, &i).unwrap(), 29501);
        let set = |k: &str| (k == "PRETRAIN_STORE_PORT").then(|| "4000".to_string());
        assert_eq!(store_port(&set, &i).unwrap(), 4000);
        for v in ["x", "0", "70000"] {
            let bad = |k: &str| (k == "PRETRAIN_STORE_PORT").then(|| v.to_string());
            let e = store_port(&bad, &i).unwrap_err().to_string();
            assert!(e.contains("is not a port number (1-65535)"), "{e}");
        }
    }
}
