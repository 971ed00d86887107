//! Multi-process jobs, launched the way users launch torchrun jobs.
//!
//! - [`spawn_node`]: `pretrain --nproc-per-node N ...` starts this node's `N` rank processes itself
//!   (same binary, same recipe), giving each `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//!   `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` and the job token, then supervises them: the
//!   first rank to fail is reported and, after a grace period for the others to stop on their own,
//!   any survivors are killed.
//! - [`join`] (`join.rs`): a rank process (started by us, torchrun or Slurm — see
//!   `parallel::env`) joins its job: rank 0 serves the rendezvous store, every rank connects to it
//!   and builds the communicator of its device — `tcp` for CPU ranks, NCCL for CUDA ranks (one GPU
//!   per process: the local rank's among the GPUs it sees, or the only one it sees;
//!   `device::gpu_ordinal`). Before that every rank checks in at the store: its launcher takes
//!   its seat (`--node-rank`; first come, first served) and its launch (`--nnodes`,
//!   `--nproc-per-node`, world, the recipe's layout) is compared with rank 0's, so that launchers
//!   that disagree fail at once on every node, naming the difference.
//!
//! The job token keeps stray connections out of the store and the `tcp` mesh. It is
//! `PRETRAIN_JOB_TOKEN`, or the contents of the owner-only file `PRETRAIN_JOB_TOKEN_FILE` names;
//! `--nproc-per-node` on one node draws a random one. Without any, every process derives the same
//! token from the launcher's job identity (`TORCHELASTIC_RUN_ID` or `SLURM_JOB_ID`) and the
//! rendezvous address — public values, so rank 0 warns that any local user could join. The store
//! listens on the interface of `MASTER_ADDR` (loopback for a single-node job), not on all
//! (`token.rs`). Supervision — waiting, forwarding SIGTERM/SIGINT, naming the root cause — is in
//! `supervise.rs`.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use parallel::env::DEFAULT_PORT;

mod coordinator;
pub mod deadline;
pub mod elastic;
mod join;
pub mod rendezvous;
mod supervise;
mod token;

pub use join::{join, store_port, Job, Refused};
use supervise::supervise;
pub use supervise::JobFailed;
pub use token::{job_token, JobToken, TOKEN_FILE_VAR};
use token::{random_token, store_bind};

/// Environment variable carrying the job token.
pub const TOKEN_VAR: &str = "PRETRAIN_JOB_TOKEN";

/// Set by our launcher for its ranks: its `--node-rank` (the seat its ranks take at check-in).
pub const NODE_RANK_VAR: &str = "PRETRAIN_NODE_RANK";

/// Set by our launcher for its ranks: its id, drawn once (its ranks hold its seat together).
pub const LAUNCHER_ID_VAR: &str = "PRETRAIN_LAUNCHER_ID";

/// Set by a non-elastic launcher of ours for its ranks: its `--nnodes` (with `LOCAL_WORLD_SIZE`,
/// its `--nproc-per-node`), which every node's launcher must share.
pub const NNODES_VAR: &str = "PRETRAIN_NNODES";

/// Exit status of a rank that stopped because another rank failed: the launcher reports the
/// rank that failed first on its own, not the ranks that followed it.
pub const PEER_FAILED_EXIT: u8 = 3;

/// Exit status of a rank that gave up waiting for its peers (`parallel.timeout_s`): the rank
/// that never came — hung, killed by the launcher once the others stopped — is the root cause.
pub const TIMED_OUT_EXIT: u8 = 4;

/// Whether `e` reports that this rank stopped because another rank failed, decided by the
/// error's type ([`parallel::CommError::PeerFailed`] anywhere in its chain), never by its text.
pub fn is_peer_failure(e: &anyhow::Error) -> bool {
    e.chain()
        .filter_map(parallel::CommError::find)
        .any(parallel::CommError::is_peer_failure)
        || e.chain().any(|c| c.is::<Refused>())
}

/// Refuses `--nproc-per-node` in a process that already is one rank of a job started by
/// torchrun (its own `TORCHELASTIC_RUN_ID`, `GROUP_RANK`) or by our launcher
/// (`PRETRAIN_LAUNCHED`): it would start a second job of its own. `RANK`/`WORLD_SIZE` alone are
/// no such sign (batch scripts export them before `srun pretrain --nproc-per-node`; the ranks
/// get their own), nor are Slurm's variables.
pub fn check_not_nested(get: &dyn Fn(&str) -> Option<String>) -> Result<()> {
    let set: Vec<String> = ["TORCHELASTIC_RUN_ID", "GROUP_RANK", "PRETRAIN_LAUNCHED"]
        .into_iter()
        .filter_map(|k| get(k).map(|v| format!("{k}={v}")))
        .collect();
    if !set.is_empty() {
        bail!(
            "--nproc-per-node starts this node's ranks, but this process already is a rank of a \
             launched job ({} set): under torchrun drop --nproc-per-node",
            set.join(", ")
        );
    }
    Ok(())
}

/// Where this node's processes sit in the job (torchrun's launcher options).
#[derive(Debug, Clone)]
pub struct NodeLayout {
    /// Rank processes to start on this node.
    pub nproc_per_node: usize,
    /// Nodes in the job.
    pub nnodes: usize,
    /// This node's index in `0..nnodes`.
    pub node_rank: usize,
    /// Host of rank 0 (default 127.0.0.1 on a single node).
    pub master_addr: Option<String>,
    /// Rendezvous port (default: a free port on a single node, 29500 otherwise).
    pub master_port: Option<u16>,
}

/// This launcher's id ([`LAUNCHER_ID_VAR`]).
fn launcher_id() -> &'static str {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ID.get_or_init(random_token)
}

/// A free TCP port on the loopback interface (for single-node jobs).
fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// Starts this node's rank processes running `args` (a `train` command line without launcher
/// options) for a job of `world` ranks (the recipe's layout, checked before anything starts) and
/// waits for them; errors name the first rank that failed and how.
///
/// The ranks run in a process group of their own: SIGTERM and SIGINT reach them only through
/// this launcher, which forwards them (each rank then finishes its step, saves and exits), and a
/// rank whose launcher dies receives SIGTERM from the kernel, so none is left behind.
pub fn spawn_node(
    layout: &NodeLayout,
    args: &[OsString],
    world: usize,
    grace: Duration,
    flight: &std::path::Path,
) -> Result<()> {
    let NodeLayout {
        nproc_per_node: n,
        nnodes,
        node_rank,
        ..
    } = *layout;
    check_layout(layout)?;
    if n.checked_mul(nnodes) != Some(world) {
        bail!(
            "--nproc-per-node {n} × --nnodes {nnodes} processes, but the recipe's layout \
             parallel.dp × parallel.tp × parallel.cp × parallel.pp has {world} ranks"
        );
    }
    let addr = master_addr(layout)?;
    let port = match agreed_port(layout)? {
        Some(p) => p,
        None => free_port()?,
    };
    // The store runs on node 0: a port already taken there fails now, naming the flag, instead
    // of rank 0 failing while the other ranks wait out their timeout. (Another node's rank
    // that connects to this instant's listener is reset and retries, see `Store::connect`.)
    if node_rank == 0 {
        let bind = store_bind(&addr, port, layout.nnodes > 1);
        if let Err(e) = std::net::TcpListener::bind(&bind) {
            bail!(
                "--master-port {port}: cannot serve the rendezvous store on {bind} ({e}); choose \
                 another port (on one node, leaving --master-port unset picks a free one)"
            );
        }
    }
    // One node draws a secret token; several nodes must agree on one without talking, so
    // without PRETRAIN_JOB_TOKEN their ranks derive it from public values (and rank 0 warns).
    let token = match std::env::var(TOKEN_VAR) {
        Ok(t) if !t.is_empty() => Some(t),
        _ if nnodes == 1 => Some(random_token()),
        _ => None,
    };
    let round = Round {
        node: node_rank,
        nnodes: Some(nnodes),
        first_rank: node_rank * n,
        nproc: n,
        world,
        addr,
        port,
        token,
        devices: None,
    };
    start_ranks(&round, args, grace, flight, &mut || false)
}

/// `--nproc-per-node`, `--nnodes` and `--node-rank` that make a job.
fn check_layout(layout: &NodeLayout) -> Result<()> {
    if layout.nproc_per_node == 0 || layout.nnodes == 0 {
        bail!("--nproc-per-node and --nnodes must be at least 1");
    }
    if layout.node_rank >= layout.nnodes {
        bail!(
            "--node-rank {} is not below --nnodes {}",
            layout.node_rank,
            layout.nnodes
        );
    }
    Ok(())
}

/// The rendezvous port the nodes agree on: `--master-port`, else 29500 across nodes; `None`
/// on one node without it (any free port will do).
fn agreed_port(layout: &NodeLayout) -> Result<Option<u16>> {
    Ok(match (layout.master_port, layout.nnodes) {
        (None | Some(0), 1) => None,
        (Some(0), _) => {
            bail!("--master-port 0 cannot be used with several nodes: they must agree on one port")
        }
        (Some(p), _) => Some(p),
        (None, _) => Some(DEFAULT_PORT),
    })
}

/// The host of rank 0 (and of an elastic job's launcher store): `--master-addr`, or loopback
/// on a single node.
fn master_addr(layout: &NodeLayout) -> Result<String> {
    match (&layout.master_addr, layout.nnodes) {
        (Some(a), _) => Ok(a.clone()),
        (None, 1) => Ok("127.0.0.1".to_string()),
        (None, n) => bail!("--master-addr is required with --nnodes {n}"),
    }
}

/// One round of node `node`'s rank processes: global ranks `first_rank..first_rank + nproc` of
/// a job of `world`, meeting at rank 0's store on `addr:port` with `token` (derived by the ranks
/// when `None`); with `devices`, local rank `i` gets `CUDA_VISIBLE_DEVICES=devices[i]`. `nnodes`
/// is set for a non-elastic job, whose nodes must all run `nproc` ranks.
pub(crate) struct Round {
    pub node: usize,
    pub nnodes: Option<usize>,
    pub first_rank: usize,
    pub nproc: usize,
    pub world: usize,
    pub addr: String,
    pub port: u16,
    pub token: Option<String>,
    pub devices: Option<Vec<String>>,
}

/// Starts `round`'s rank processes running `args` and supervises them to the end; when `stop`
/// returns true they are asked to finish their step, save and stop (SIGTERM).
pub(crate) fn start_ranks(
    round: &Round,
    args: &[OsString],
    grace: Duration,
    flight: &std::path::Path,
    stop: &mut dyn FnMut() -> bool,
) -> Result<()> {
    let (n, world) = (round.nproc, round.world);
    let exe = std::env::current_exe().context("locating the pretrain binary")?;
    crate::job::signals::install_for_launcher()?;
    crate::job::flight::install_usr1()?;
    let launcher_pid = std::process::id() as libc::pid_t;
    let mut children: Vec<(usize, Child)> = Vec::with_capacity(n);
    for local in 0..n {
        let rank = round.first_rank + local;
        let mut cmd = Command::new(&exe);
        cmd.process_group(0);
        // SAFETY: only async-signal-safe calls (prctl, getppid) run between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != launcher_pid {
                    // The launcher died before the death signal was armed.
                    return Err(std::io::Error::other("the launcher has exited"));
                }
                Ok(())
            });
        }
        cmd.args(args)
            .env("PRETRAIN_LAUNCHED", "1")
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", &round.addr)
            .env("MASTER_PORT", round.port.to_string())
            .env(NODE_RANK_VAR, round.node.to_string())
            .env(LAUNCHER_ID_VAR, launcher_id());
        match round.nnodes {
            Some(nnodes) => cmd.env(NNODES_VAR, nnodes.to_string()),
            None => cmd.env_remove(NNODES_VAR),
        };
        if let Some(t) = &round.token {
            cmd.env(TOKEN_VAR, t);
        }
        if let Some(d) = round.devices.as_ref().and_then(|d| d.get(local)) {
            cmd.env("CUDA_VISIBLE_DEVICES", d);
        }
        let spawned = cmd.spawn();
        match spawned {
            Ok(c) => children.push((rank, c)),
            Err(e) => {
                for (_, c) in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                bail!("cannot start rank {rank} ({}): {e}", exe.display());
            }
        }
    }
    supervise(children, grace, (flight, world), stop)
}

#[cfg(test)]
mod tests {
    use parallel::env::ProcessInfo;

    use super::*;

    /// A rank's view of a 4-rank job on `node0:29500` started by `launcher`.
    pub(super) fn info(launcher: &'static str) -> ProcessInfo {
        ProcessInfo {
            rank: 1,
            world_size: 4,
            local_rank: 1,
            master_addr: "node0".into(),
            master_port: 29500,
            launcher,
        }
    }

    #[test]
    fn bad_layouts_are_errors() {
        let layout = |n, nnodes, node_rank, addr: Option<&str>| NodeLayout {
            nproc_per_node: n,
            nnodes,
            node_rank,
            master_addr: addr.map(str::to_string),
            master_port: None,
        };
        let g = Duration::from_secs(1);
        let e =
            spawn_node(&layout(0, 1, 0, None), &[], 1, g, std::path::Path::new(".")).unwrap_err();
        assert!(e.to_string().contains("at least 1"), "{e}");
        let e = spawn_node(
            &layout(2, 2, 2, Some("h")),
            &[],
            4,
            g,
            std::path::Path::new("."),
        )
        .unwrap_err();
        assert!(e.to_string().contains("--node-rank 2"), "{e}");
        let e =
            spawn_node(&layout(2, 2, 0, None), &[], 4, g, std::path::Path::new(".")).unwrap_err();
        assert!(e.to_string().contains("--master-addr"), "{e}");
        // Checked before anything is spawned: no fork storm for a wrong count.
        let e = spawn_node(
            &layout(100_000, 1, 0, None),
            &[],
            2,
            g,
            std::path::Path::new("."),
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("has 2 ranks") && e.to_string().contains("100000"),
            "{e}"
        );
        let e = spawn_node(
            &layout(usize::MAX, 2, 0, Some("h")),
            &[],
            2,
            g,
            std::path::Path::new("."),
        )
        .unwrap_err();
        assert!(e.to_string().contains("has 2 ranks"), "{e}");
        let mut zero_port = layout(2, 2, 0, Some("h"));
        zero_port.master_port = Some(0);
        let e = spawn_node(&zero_port, &[], 4, g, std::path::Path::new(".")).unwrap_err();
        assert!(e.to_string().contains("--master-port 0"), "{e}");
    }

    #[test]
    fn a_rank_of_another_launcher_starts_no_job_of_its_own() {
        let torchrun = |k: &str| {
            matches!(
                k,
                "RANK" | "WORLD_SIZE" | "GROUP_RANK" | "TORCHELASTIC_RUN_ID"
            )
            .then(|| "1".to_string())
        };
        let e = check_not_nested(&torchrun).unwrap_err().to_string();
        assert!(e.contains("TORCHELASTIC_RUN_ID=1, GROUP_RANK=1 set"), "{e}");
        let ours = |k: &str| (k == "PRETRAIN_LAUNCHED").then(|| "1".to_string());
        check_not_nested(&ours).unwrap_err();
        // A batch script's exports and Slurm's own variables start nothing nested.
        let exported =
            |k: &str| matches!(k, "RANK" | "WORLD_SIZE" | "SLURM_PROCID").then(|| "0".to_string());
        check_not_nested(&exported).unwrap();
        check_not_nested(&|_| None).unwrap();
    }

    #[test]
    fn peer_failures_are_recognised_by_type_not_text() {
        let peer = parallel::CommError::PeerFailed {
            me: 0,
            op: "all_reduce",
            group: vec![0, 1],
            failed: 1,
            reason: "boom".into(),
        };
        let text = peer.to_string();
        // Through candle (as model code and the gradient-sync thread return it) and anyhow
        // context layers.
        let wrapped = candle_core::Error::from(peer)
            .context("backward of segment Block(3)")
            .bt();
        let e = anyhow::Error::from(wrapped)
            .context("synchronising gradients")
            .context("rank 0");
        assert!(is_peer_failure(&e), "{e:#}");
        // The same words from anything else are not a peer failure.
        let imitation = anyhow::anyhow!("{text}").context("rank 0");
        assert!(!is_peer_failure(&imitation));
        let own = anyhow::Error::from(candle_core::Error::from(parallel::CommError::Timeout {
            me: 0,
            op: "recv",
            group: vec![0, 1],
            secs: 1.0,
            missing: vec![1],
        }));
        assert!(
            !is_peer_failure(&own),
            "a timeout is this rank's own failure"
        );
        let itself =
            anyhow::Error::from(candle_core::Error::from(parallel::CommError::PeerFailed {
                me: 1,
                op: "send",
                group: vec![0, 1],
                failed: 1,
                reason: "its own send failed".into(),
            }));
        assert!(
            !is_peer_failure(&itself),
            "a rank that failed itself is the root cause"
        );
        // A rank told by another that the launches disagree only follows it.
        let told = anyhow::Error::from(Refused {
            by: 1,
            message: "the launches disagree".into(),
        })
        .context("rank 0: joining the job");
        assert!(is_peer_failure(&told), "{told:#}");
    }
}
