//! `ProcessInfo`: where this process sits in a multi-process job, read from the environment the
//! way users already launch Megatron or torchtitan — torchrun (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`) or Slurm (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, with
//! `MASTER_ADDR` / `MASTER_PORT` from the environment or defaults).

/// Default rendezvous port (torchrun's).
pub const DEFAULT_PORT: u16 = 29500;

/// This process's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessInfo {
    /// Global rank.
    pub rank: usize,
    /// Number of processes in the job.
    pub world_size: usize,
    /// Index of this process on its node (its GPU).
    pub local_rank: usize,
    /// Host of rank 0's rendezvous store.
    pub master_addr: String,
    /// Port of rank 0's rendezvous store.
    pub master_port: u16,
    /// Which launcher's variables were used.
    pub launcher: &'static str,
}

fn number(get: &dyn Fn(&str) -> Option<String>, var: &str) -> Result<Option<usize>, String> {
    match get(var) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| format!("{var}={v:?} is not a non-negative integer")),
    }
}

/// Reads the job layout from environment variables through `get` (e.g. `|k| std::env::var(k).ok()`).
/// `Ok(None)` when no launcher variables are set (a single process); an error names the variable
/// that is missing or wrong.
pub fn from_env(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<ProcessInfo>, String> {
    let (rank, world, local, launcher) = if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
        let rank = number(get, "RANK")?.ok_or("WORLD_SIZE is set but RANK is not")?;
        let world = number(get, "WORLD_SIZE")?.ok_or("RANK is set but WORLD_SIZE is not")?;
        (
            rank,
            world,
            number(get, "LOCAL_RANK")?.unwrap_or(rank),
            "torchrun",
        )
    } else if get("SLURM_PROCID").is_some() {
        let rank = number(get, "SLURM_PROCID")?.ok_or("SLURM_PROCID")?;
        let world =
            number(get, "SLURM_NTASKS")?.ok_or("SLURM_PROCID is set but SLURM_NTASKS is not")?;
        (
            rank,
            world,
            number(get, "SLURM_LOCALID")?.unwrap_or(0),
            "slurm",
        )
    } else {
        return Ok(None);
    };
    if world == 0 {
        return Err("WORLD_SIZE must be at least 1".into());
    }
    if rank >= world {
        return Err(format!("rank {rank} is not below the world size {world}"));
    }
    let master_addr = match get("MASTER_ADDR") {
        Some(a) if !a.trim().is_empty() => a.trim().to_string(),
        _ if world == 1 => "127.0.0.1".to_string(),
        _ => {
            return Err(format!(
                "MASTER_ADDR is not set ({launcher} launch of {world} processes)"
            ))
        }
    };
    let master_port = match get("MASTER_PORT") {
        None => DEFAULT_PORT,
        Some(p) => p
            .trim()
            .parse()
            .map_err(|_| format!("MASTER_PORT={p:?} is not a port number"))?,
    };
    Ok(Some(ProcessInfo {
        rank,
        world_size: world,
        local_rank: local,
        master_addr,
        master_port,
        launcher,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(vars: &[(&str, &str)]) -> Result<Option<ProcessInfo>, String> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        from_env(&|k| m.get(k).cloned())
    }

    #[test]
    fn torchrun_variables() {
        let p = parse(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "3"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (
                p.rank,
                p.world_size,
                p.local_rank,
                p.master_addr.as_str(),
                p.master_port
            ),
            (3, 8, 3, "node0", 1234)
        );
        assert_eq!(p.launcher, "torchrun");
    }

    #[test]
    fn slurm_variables() {
        let p = parse(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "1"),
            ("MASTER_ADDR", "n1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (
                p.rank,
                p.world_size,
                p.local_rank,
                p.master_port,
                p.launcher
            ),
            (5, 16, 1, DEFAULT_PORT, "slurm")
        );
    }

    #[test]
    fn no_launcher_means_one_process() {
        assert_eq!(parse(&[("HOME", "/root")]).unwrap(), None);
    }

    #[test]
    fn mistakes_name_the_variable() {
        let e = |v: &[(&str, &str)]| parse(v).unwrap_err();
        assert!(e(&[("RANK", "x"), ("WORLD_SIZE", "2")]).contains("RANK=\"x\""));
        assert!(e(&[("RANK", "1")]).contains("WORLD_SIZE"));
        assert!(
            e(&[("RANK", "4"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "a")])
                .contains("rank 4 is not below the world size 4")
        );
        assert!(e(&[("RANK", "0"), ("WORLD_SIZE", "2")]).contains("MASTER_ADDR"));
        assert!(e(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "99999")
        ])
        .contains("MASTER_PORT"));
        assert!(e(&[("SLURM_PROCID", "0")]).contains("SLURM_NTASKS"));
    }
}
