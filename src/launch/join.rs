//! A rank process joining its job ([`join`]): rank 0 serves the rendezvous store (on
//! [`store_port`]), every rank connects to it with the job token, checks in ([`check_in`]) and
//! builds the communicator of its device — `tcp` for CPU ranks, NCCL for CUDA ranks (one GPU per
//! process, see `device::open_local_gpu`).
//!
//! Check-in keys: `join/node/N` (or `join/rank/R` under another launcher: the seat, claimed
//! first come, first served, holding who took it), `join/launch` (rank 0's [`Launch`]),
//! `join/count`, `join/in/R` (rank R checked in), `join/verdict` (claimed once: empty when all
//! ranks are in, else `R why` from rank R, which found a disagreement), `join/seen` (ranks that
//! read the verdict: rank 0 serves a refusal until those that checked in have read it).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::Device;
use parallel::comm::tcp::TcpComm;
use parallel::env::ProcessInfo;
use parallel::store::{Store, StoreServer};
use parallel::Comm;
use serde::{Deserialize, Serialize};

use super::token::{job_token, store_bind, JobToken, TOKEN_FILE_VAR};
use super::{LAUNCHER_ID_VAR, NNODES_VAR, NODE_RANK_VAR, TOKEN_VAR};
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
        // Ranks beyond this node's (or an unknown count of them) are on other nodes.
        let local = std::env::var("LOCAL_WORLD_SIZE")
            .ok()
            .and_then(|v| v.parse().ok());
        let spans_nodes = local.is_none_or(|n: usize| n < info.world_size);
        let bind = store_bind(&info.master_addr, port, spans_nodes);
        let s = StoreServer::start_for(&bind, &token, timeout, info.world_size)
            .with_context(|| format!("rank 0: serving the rendezvous store on {bind}"))?;
        Some(s)
    } else {
        None
    };
    let addr = format!("{}:{port}", info.master_addr);
    let mut store = Store::connect(&addr, &token, timeout)
        .with_context(|| format!("rank {}: joining the job", info.rank))?;
    check_in(&mut store, info, recipe, &|k| std::env::var(k).ok())
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

/// The start of a job that another rank refused at check-in: this rank only follows it (exit
/// status `PEER_FAILED_EXIT`, see `super::is_peer_failure`).
#[derive(Debug, thiserror::Error)]
#[error("the job cannot start (rank {by} found it): {message}")]
pub struct Refused {
    /// The rank that found the disagreement.
    pub by: usize,
    /// What it found.
    pub message: String,
}

/// What a rank says of its launch at check-in; every rank's must agree with rank 0's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Launch {
    /// Its launcher's id ([`LAUNCHER_ID_VAR`]), or its own under another launcher.
    id: String,
    /// `node 1 at 10.0.0.6 (launcher pid 4242)`, or `rank 3 at 10.0.0.6 (pid 4242)` under
    /// another launcher (the address is the interface that reaches the store).
    by: String,
    /// The `--node-rank` of our launcher ([`NODE_RANK_VAR`]).
    node: Option<usize>,
    /// `--nnodes` and `--nproc-per-node` of our non-elastic launcher ([`NNODES_VAR`],
    /// `LOCAL_WORLD_SIZE`).
    shape: Option<(usize, usize)>,
    /// Ranks of the job (`WORLD_SIZE`, equal to the recipe's layout's).
    world: usize,
    /// The recipe's layout and global batch.
    layout: String,
}

impl Launch {
    /// This rank's, from its launcher's variables (read through `get`).
    fn of(
        store: &Store,
        info: &ProcessInfo,
        recipe: &Recipe,
        get: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self> {
        let var = |k: &str| get(k)?.trim().parse::<usize>().ok();
        let ours = get("PRETRAIN_LAUNCHED").is_some();
        let node = var(NODE_RANK_VAR).filter(|_| ours);
        let host = store.local_addr().context("the store connection")?.ip();
        let by = match node {
            Some(n) => format!(
                "node {n} at {host} (launcher pid {})",
                std::os::unix::process::parent_id()
            ),
            None => format!("rank {} at {host} (pid {})", info.rank, std::process::id()),
        };
        let layout = serde_json::to_string(&crate::plan::Layout::of(recipe))?;
        Ok(Self {
            id: get(LAUNCHER_ID_VAR)
                .filter(|_| ours)
                .unwrap_or_else(super::random_token),
            by,
            node,
            shape: var(NNODES_VAR)
                .filter(|_| ours)
                .zip(var("LOCAL_WORLD_SIZE")),
            world: info.world_size,
            layout: format!("{layout} global_batch={}", recipe.train.global_batch),
        })
    }

    /// Why this launch cannot join rank 0's (`zero`), if it cannot.
    fn disagrees(&self, zero: &Launch) -> Option<String> {
        let said = |l: &Launch| {
            let shape = l.shape.map_or(String::new(), |(nnodes, nproc)| {
                format!(" with --nnodes {nnodes} --nproc-per-node {nproc}")
            });
            format!(
                "{}{shape} runs {} ranks, layout {}",
                l.by, l.world, l.layout
            )
        };
        let shapes_differ = matches!((self.shape, zero.shape), (Some(a), Some(b)) if a != b);
        (self.world != zero.world || self.layout != zero.layout || shapes_differ).then(|| {
            format!(
                "the launches disagree: {}, but {}; start every node with the same --nnodes, \
                 --nproc-per-node and recipe layout",
                said(self),
                said(zero)
            )
        })
    }
}

/// Meets the other ranks at rank 0's store before any communicator is built: this rank's
/// launcher takes its seat (its `--node-rank`; the rank itself under another launcher) unless
/// another launcher holds it, and its launch is compared with rank 0's. A rank that disagrees
/// fails, and so does every rank still checking in ([`Refused`]), at once and naming the
/// difference; otherwise the ranks go on once all have checked in (bounded by the store's
/// timeout, naming the ranks that never came).
fn check_in(
    store: &mut Store,
    info: &ProcessInfo,
    recipe: &Recipe,
    get: &dyn Fn(&str) -> Option<String>,
) -> Result<()> {
    let me = Launch::of(store, info, recipe, get)?;
    let seat = match me.node {
        Some(n) => (format!("join/node/{n}"), format!("--node-rank {n}")),
        None => (
            format!("join/rank/{}", info.rank),
            format!("rank {}", info.rank),
        ),
    };
    // `ID who`: the id tells launchers apart, the rest is for the message.
    let mine = format!("{} {}", me.id, me.by);
    let holder = store.claim(&seat.0, mine.as_bytes())?;
    let holder = String::from_utf8_lossy(&holder);
    let (id, who) = holder.split_once(' ').unwrap_or((&holder, &holder));
    if id != me.id {
        // The job that seat belongs to is left alone: only this launcher's ranks stop.
        bail!(
            "{} is taken by another launcher: {who}; {} gives up (each node needs its own \
             --node-rank)",
            seat.1,
            me.by
        );
    }
    let zero: Launch = if info.rank == 0 {
        store.set("join/launch", &serde_json::to_vec(&me)?)?;
        me.clone()
    } else {
        serde_json::from_slice(&store.get("join/launch")?).context("rank 0's launch")?
    };
    if let Some(why) = me.disagrees(&zero) {
        store.claim("join/verdict", format!("{} {why}", info.rank).as_bytes())?;
        bail!("{why}");
    }
    store.set(&format!("join/in/{}", info.rank), b"")?;
    if store.add("join/count", 1)? as usize == info.world_size {
        store.claim("join/verdict", b"")?;
    }
    let verdict = match store.get("join/verdict") {
        Ok(v) => v,
        Err(e) => {
            let mut missing = Vec::new();
            for r in 0..info.world_size {
                if store.try_get(&format!("join/in/{r}"))?.is_none() {
                    missing.push(r);
                }
            }
            return Err(anyhow!("ranks {missing:?} did not check in ({e})"));
        }
    };
    let verdict = String::from_utf8_lossy(&verdict).into_owned();
    let seen = store.add("join/seen", 1)?;
    if info.rank == 0 && verdict.contains(' ') {
        // Rank 0 serves the store: before it fails, the ranks that checked in read the
        // refusal (else they would report the store closing instead of the disagreement).
        let start = std::time::Instant::now();
        let mut seen = seen;
        while seen < store.add("join/count", 0)? && start.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
            seen = store.add("join/seen", 0)?;
        }
    }
    match verdict.split_once(' ') {
        None => Ok(()),
        Some((by, why)) => Err(Refused {
            by: by.parse().unwrap_or(0),
            message: why.to_string(),
        }
        .into()),
    }
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
    use std::path::Path;

    use super::super::tests::info;
    use super::*;

    /// Rank `rank` of `world` started by "our" launcher of node `node` (`nproc` ranks a node,
    /// `id`) checking in at `addr` with the tiny recipe at `dp`.
    fn checks_in(
        addr: &str,
        (rank, world, dp): (usize, usize, usize),
        (node, nproc, id): (&str, &str, &str),
    ) -> Result<()> {
        let o = format!("parallel.dp={dp},train.global_batch=16,train.micro_batch=2");
        let recipe = crate::recipe::load(Path::new("recipes/tiny.yaml"), &[o]).unwrap();
        let info = ProcessInfo {
            rank,
            world_size: world,
            local_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 0,
            launcher: "pretrain --nproc-per-node",
        };
        let get = |k: &str| {
            match k {
                "PRETRAIN_LAUNCHED" => Some("1"),
                NODE_RANK_VAR => Some(node),
                NNODES_VAR => Some("2"),
                "LOCAL_WORLD_SIZE" => Some(nproc),
                LAUNCHER_ID_VAR => Some(id),
                _ => None,
            }
            .map(str::to_string)
        };
        let mut store = Store::connect(addr, "t", Duration::from_secs(5)).unwrap();
        check_in(&mut store, &info, &recipe, &get)
    }

    #[test]
    fn launches_that_disagree_fail_on_every_rank() {
        let server = StoreServer::start("127.0.0.1:0", "t", Duration::from_secs(5)).unwrap();
        let addr = server.addr().to_string();
        // Node 0: 2 ranks a node, world 4; node 1: 1 rank a node, world 2 (the report's job).
        let (zero, one) = std::thread::scope(|s| {
            let zero = s.spawn(|| checks_in(&addr, (0, 4, 4), ("0", "2", "a")));
            let one = s.spawn(|| checks_in(&addr, (1, 2, 2), ("1", "1", "b")));
            (zero.join().unwrap(), one.join().unwrap())
        });
        let (zero, one) = (zero.unwrap_err(), one.unwrap_err());
        assert!(
            format!("{one:#}").contains("with --nnodes 2 --nproc-per-node 1 runs 2 ranks")
                && format!("{one:#}").contains("with --nnodes 2 --nproc-per-node 2 runs 4 ranks"),
            "{one:#}"
        );
        assert!(
            !super::super::is_peer_failure(&one),
            "rank 1 found it: the root cause"
        );
        assert!(
            format!("{zero:#}").contains("the job cannot start (rank 1 found it): the launches"),
            "{zero:#}"
        );
        assert!(super::super::is_peer_failure(&zero), "rank 0 only follows");
    }

    #[test]
    fn a_node_rank_held_by_another_launcher_is_refused() {
        let server = StoreServer::start("127.0.0.1:0", "t", Duration::from_secs(5)).unwrap();
        let addr = server.addr().to_string();
        std::thread::scope(|s| {
            let zero = s.spawn(|| checks_in(&addr, (0, 2, 2), ("0", "1", "a")));
            checks_in(&addr, (1, 2, 2), ("1", "1", "b")).unwrap();
            zero.join().unwrap().unwrap();
        });
        let e = checks_in(&addr, (1, 2, 2), ("1", "1", "c"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--node-rank 1 is taken by another launcher: node 1 at 127.0.0.1"),
            "{e}"
        );
    }

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
