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

/// An integer variable as C libraries read it (NCCL's parameters: `strtoll(s, NULL, 0)`): an
/// optional sign, then `0x` hex, leading-`0` octal or decimal; `None` unless the whole text
/// (spaces around aside) is one.
pub fn c_integer(s: &str) -> Option<i64> {
    let s = s.trim();
    let (negative, digits) = match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    let (radix, digits) = if let Some(hex) = digits
        .strip_prefix("0x")
        .or_else(|| digits.strip_prefix("0X"))
    {
        (16, hex)
    } else if digits.len() > 1 && digits.starts_with('0') {
        (8, &digits[1..])
    } else {
        (10, digits)
    };
    if digits.starts_with(['+', '-']) {
        return None;
    }
    let v = i64::from_str_radix(digits, radix).ok()?;
    Some(if negative { -v } else { v })
}

/// A launcher variable that is missing, malformed or inconsistent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    /// A variable that must be a number is not.
    #[error("{var}={value:?} is not a non-negative integer")]
    NotANumber { var: &'static str, value: String },
    /// A variable required by another one is missing.
    #[error("{set} is set but {missing} is not")]
    Missing {
        set: &'static str,
        missing: &'static str,
    },
    /// `WORLD_SIZE` (or `SLURM_NTASKS`) is zero.
    #[error("WORLD_SIZE must be at least 1")]
    EmptyWorld,
    /// The rank does not fit the world.
    #[error("rank {rank} is not below the world size {world}")]
    RankOutOfRange { rank: usize, world: usize },
    /// A multi-process job without a rendezvous host.
    #[error("MASTER_ADDR is not set ({launcher} launch of {world} processes)")]
    NoMasterAddr {
        launcher: &'static str,
        world: usize,
    },
    /// `MASTER_PORT` is not a port number (1-65535).
    #[error("MASTER_PORT={0:?} is not a port number (1-65535)")]
    BadPort(String),
}

fn number(
    get: &dyn Fn(&str) -> Option<String>,
    var: &'static str,
) -> Result<Option<usize>, EnvError> {
    match get(var) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| EnvError::NotANumber { var, value: v }),
    }
}

/// Reads the job layout from environment variables through `get` (e.g. `|k| std::env::var(k).ok()`).
/// `Ok(None)` when no launcher variables are set (a single process); an error names the variable
/// that is missing or wrong.
pub fn from_env(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<ProcessInfo>, EnvError> {
    let missing = |set, missing| EnvError::Missing { set, missing };
    let (rank, world, local, launcher) = if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
        let rank = number(get, "RANK")?.ok_or(missing("WORLD_SIZE", "RANK"))?;
        let world = number(get, "WORLD_SIZE")?.ok_or(missing("RANK", "WORLD_SIZE"))?;
        // `pretrain --nproc-per-node` sets torchrun's variables and marks its children.
        let launcher = if get("PRETRAIN_LAUNCHED").is_some() {
            "pretrain --nproc-per-node"
        } else {
            "torchrun"
        };
        (
            rank,
            world,
            number(get, "LOCAL_RANK")?.unwrap_or(rank),
            launcher,
        )
    } else if get("SLURM_PROCID").is_some() {
        let rank = number(get, "SLURM_PROCID")?.ok_or(missing("SLURM_NTASKS", "SLURM_PROCID"))?;
        let world = number(get, "SLURM_NTASKS")?.ok_or(missing("SLURM_PROCID", "SLURM_NTASKS"))?;
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
        return Err(EnvError::EmptyWorld);
    }
    if rank >= world {
        return Err(EnvError::RankOutOfRange { rank, world });
    }
    let master_addr = match get("MASTER_ADDR") {
        Some(a) if !a.trim().is_empty() => a.trim().to_string(),
        _ if world == 1 => "127.0.0.1".to_string(),
        _ => return Err(EnvError::NoMasterAddr { launcher, world }),
    };
    let master_port = match get("MASTER_PORT") {
        None => DEFAULT_PORT,
        Some(p) => match p.trim().parse() {
            Ok(0) | Err(_) => return Err(EnvError::BadPort(p)),
            Ok(port) => port,
        },
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

    #[test]
    fn integers_read_as_c_libraries_read_them() {
        for (text, want) in [
            ("1", Some(1)),
            (" 1 ", Some(1)),
            ("01", Some(1)),
            ("0x1", Some(1)),
            ("+1", Some(1)),
            ("0", Some(0)),
            ("-2", Some(-2)),
            ("010", Some(8)),
            ("0X1f", Some(31)),
            ("", None),
            ("1a", None),
            ("yes", None),
            ("+-1", None),
        ] {
            assert_eq!(c_integer(text), want, "{text:?}");
        }
    }
    use std::collections::HashMap;

    fn parse(vars: &[(&str, &str)]) -> Result<Option<ProcessInfo>, EnvError> {
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
        let e = |v: &[(&str, &str)]| parse(v).unwrap_err().to_string();
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
        // Port 0 would make every rank dial a port nobody listens on until the timeout.
        assert!(e(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "0")
        ])
        .contains("MASTER_PORT=\"0\" is not a port number (1-65535)"));
        assert!(e(&[("SLURM_PROCID", "0")]).contains("SLURM_NTASKS"));
        assert_eq!(
            parse(&[("RANK", "0"), ("WORLD_SIZE", "0")]),
            Err(EnvError::EmptyWorld)
        );
    }
}
