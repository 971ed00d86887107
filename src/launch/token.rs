//! Job tokens: what keeps strangers out of a job's store and `tcp` mesh. The token is
//! `PRETRAIN_JOB_TOKEN`, or the contents of the owner-only file `PRETRAIN_JOB_TOKEN_FILE` names;
//! `--nproc-per-node` on one node draws a random one. Without any, every process derives the same
//! token from the launcher's public job identity, and rank 0 warns. Also where rank 0's store
//! listens.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::net::ToSocketAddrs;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use parallel::env::ProcessInfo;

use super::TOKEN_VAR;

/// A token no other job will present.
pub(super) fn random_token() -> String {
    let a = RandomState::new().hash_one((std::process::id(), Instant::now()));
    format!("{a:016x}{:016x}", RandomState::new().hash_one(a))
}

/// Environment variable naming a file that holds the job token (readable by its owner only).
pub const TOKEN_FILE_VAR: &str = "PRETRAIN_JOB_TOKEN_FILE";

/// Where a job's token came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobToken {
    /// A secret: `PRETRAIN_JOB_TOKEN`, a token file, or drawn by our own launcher.
    Secret(String),
    /// Derived from the launcher's public job identity: any local user can compute it.
    Derived(String),
}

/// The token every process of a job agrees on without talking (see the module header):
/// `PRETRAIN_JOB_TOKEN`, else the contents of the file `PRETRAIN_JOB_TOKEN_FILE` names (which
/// must not be readable by group or others), else one derived from public values.
pub fn job_token(get: &dyn Fn(&str) -> Option<String>, info: &ProcessInfo) -> Result<JobToken> {
    if let Some(t) = get(TOKEN_VAR).filter(|t| !t.is_empty()) {
        return Ok(JobToken::Secret(t));
    }
    if let Some(path) = get(TOKEN_FILE_VAR).filter(|p| !p.is_empty()) {
        use std::os::unix::fs::PermissionsExt;
        let meta = std::fs::metadata(&path).with_context(|| format!("{TOKEN_FILE_VAR}={path}"))?;
        if meta.permissions().mode() & 0o077 != 0 {
            bail!(
                "{TOKEN_FILE_VAR}={path}: the token file is readable by other users \
                 (mode {:o}); chmod 600 it",
                meta.permissions().mode() & 0o777
            );
        }
        let text =
            std::fs::read_to_string(&path).with_context(|| format!("{TOKEN_FILE_VAR}={path}"))?;
        let t = text.trim();
        if t.is_empty() {
            bail!("{TOKEN_FILE_VAR}={path}: the token file is empty");
        }
        return Ok(JobToken::Secret(t.to_string()));
    }
    let job = get("TORCHELASTIC_RUN_ID")
        .or_else(|| get("SLURM_JOB_ID"))
        .unwrap_or_default();
    Ok(JobToken::Derived(format!(
        "{}:{job}:{}:{}:{}",
        info.launcher, info.master_addr, info.master_port, info.world_size
    )))
}

/// The address rank 0's store listens on: the interface `master_addr` names when it is one of
/// this host's (loopback for a single-node job on 127.0.0.1), every interface only when it is
/// not (e.g. a name that resolves differently inside a container), or when the job `spans_nodes`
/// and `master_addr` is a host name that resolves to loopback here (Debian and Ubuntu map the
/// host's own name to 127.0.1.1): other nodes could never reach a loopback listener, and the
/// job's token keeps strangers out of the open one. An IP address given as such is kept.
///
/// The interface is probed on a free port, never on `port` itself: a listener there, even for an
/// instant, would take in ranks already retrying their connect and reset them when it closes.
pub(super) fn store_bind(master_addr: &str, port: u16, spans_nodes: bool) -> String {
    let resolve = |name: &str| -> Vec<std::net::SocketAddr> {
        (name, port)
            .to_socket_addrs()
            .map(|a| a.collect())
            .unwrap_or_default()
    };
    store_bind_with(master_addr, port, spans_nodes, &resolve)
}

/// [`store_bind`] with the name resolution given.
fn store_bind_with(
    master_addr: &str,
    port: u16,
    spans_nodes: bool,
    resolve: &dyn Fn(&str) -> Vec<std::net::SocketAddr>,
) -> String {
    let ip = resolve(master_addr).into_iter().find(|a| a.is_ipv4());
    let named = master_addr.parse::<std::net::IpAddr>().is_err();
    if let Some(a) = ip.filter(|a| spans_nodes && named && a.ip().is_loopback()) {
        tracing::warn!(
            "the rendezvous address {master_addr} resolves to {} here, which other nodes cannot \
             reach: serving the store on every interface (give --master-addr / MASTER_ADDR as \
             an address the other nodes reach to avoid this)",
            a.ip()
        );
        return format!("0.0.0.0:{port}");
    }
    match ip {
        // An address of another host (not bindable here) is served on every interface; one of
        // this host's is kept even when its port is taken, so the error names it.
        Some(a) => match std::net::TcpListener::bind((a.ip(), 0)) {
            Err(e) if e.kind() == std::io::ErrorKind::AddrNotAvailable => {
                format!("0.0.0.0:{port}")
            }
            _ => a.to_string(),
        },
        None => format!("0.0.0.0:{port}"),
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::info;
    use super::*;

    #[test]
    fn tokens_agree_across_processes_and_differ_across_jobs() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                vars.iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let a = job_token(&env(&[("SLURM_JOB_ID", "77")]), &info("slurm")).unwrap();
        let b = job_token(&env(&[("SLURM_JOB_ID", "77")]), &info("slurm")).unwrap();
        let c = job_token(&env(&[("SLURM_JOB_ID", "78")]), &info("slurm")).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(
            matches!(a, JobToken::Derived(_)),
            "public values are no secret"
        );
        let explicit = job_token(&env(&[(TOKEN_VAR, "s3cret")]), &info("torchrun")).unwrap();
        assert_eq!(explicit, JobToken::Secret("s3cret".into()));
        assert_ne!(random_token(), random_token());
    }

    #[test]
    fn a_token_file_must_be_private() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("token");
        std::fs::write(&path, "t0ken\n").unwrap();
        let p = path.display().to_string();
        let get = |k: &str| (k == TOKEN_FILE_VAR).then(|| p.clone());
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = job_token(&get, &info("torchrun")).unwrap_err().to_string();
        assert!(
            e.contains("readable by other users") && e.contains("644"),
            "{e}"
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(
            job_token(&get, &info("torchrun")).unwrap(),
            JobToken::Secret("t0ken".into())
        );
    }

    #[test]
    fn the_store_listens_on_the_master_interface() {
        assert_eq!(store_bind("127.0.0.1", 0, false), "127.0.0.1:0");
        assert_eq!(store_bind("localhost", 0, false), "127.0.0.1:0");
        // An address that is not this host's: every interface.
        assert_eq!(store_bind("192.0.2.1", 0, true), "0.0.0.0:0");
        // Two launchers on one machine given the loopback address itself keep it.
        assert_eq!(store_bind("127.0.0.1", 0, true), "127.0.0.1:0");
    }

    #[test]
    fn a_host_name_that_resolves_to_loopback_serves_other_nodes_on_every_interface() {
        // `/etc/hosts` of Debian and Ubuntu: `127.0.1.1 node0`.
        let hosts = |name: &str| match name {
            "node0" => vec![std::net::SocketAddr::from(([127, 0, 1, 1], 29500))],
            _ => vec![],
        };
        assert_eq!(
            store_bind_with("node0", 29500, true, &hosts),
            "0.0.0.0:29500"
        );
        assert_eq!(
            store_bind_with("node0", 29500, false, &hosts),
            "127.0.1.1:29500"
        );
    }

    #[test]
    fn probing_the_interface_leaves_the_store_port_alone() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::time::{Duration, Instant};
        // A rank retrying its connect while rank 0 works out where to listen must be refused
        // until the store listens, never taken in by a probe's listener that then closes (it
        // would see its greeting reset). Probing the port itself let about 3 connects a second in.
        let port = {
            let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            free.local_addr().unwrap().port()
        };
        let (stop, started) = (AtomicBool::new(false), AtomicBool::new(false));
        let taken_in = std::thread::scope(|s| {
            let client = s.spawn(|| {
                let target = std::net::SocketAddr::from(([127, 0, 0, 1], port));
                let mut taken_in = 0;
                while !stop.load(Ordering::SeqCst) {
                    started.store(true, Ordering::SeqCst);
                    let c =
                        std::net::TcpStream::connect_timeout(&target, Duration::from_millis(50));
                    // A connect given the target port as its own connects to itself.
                    let own = |c: &std::net::TcpStream| c.local_addr().ok() == c.peer_addr().ok();
                    taken_in += c.is_ok_and(|c| !own(&c)) as usize;
                }
                taken_in
            });
            while !started.load(Ordering::SeqCst) {
                std::thread::yield_now();
            }
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(1) {
                assert_eq!(
                    store_bind("127.0.0.1", port, false),
                    format!("127.0.0.1:{port}")
                );
            }
            stop.store(true, Ordering::SeqCst);
            client.join().unwrap()
        });
        assert_eq!(
            taken_in, 0,
            "connects to port {port} taken in while probing"
        );
    }
}
