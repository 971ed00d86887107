//! Faults the end-to-end tests inject into a real run, read once from `PRETRAIN_TEST_*`
//! variables when the binary starts ([`Faults::load`], called by `main`); the step, the guard and
//! the saver only ask [`faults`]. A process that never loaded them (a library user, the unit
//! tests) injects nothing.
//!
//! | variable | fault |
//! |---|---|
//! | `PRETRAIN_TEST_SLOW_RANK=R:MS` | rank `R` pauses `MS` ms in each forward action |
//! | `PRETRAIN_TEST_NAN_GRADS=STEP:R` | rank `R`'s gradients are NaN at step `STEP` (1-based) |
//! | `PRETRAIN_TEST_LOSS_JUMP=STEP:F` | the guard sees step `STEP`'s loss times `F` on every rank |
//! | `PRETRAIN_TEST_SHARE_DELAY_MS=R:MS` | rank `R` writes its checkpoint share `MS` ms late |
//! | `PRETRAIN_TEST_SAVE_PAUSE_MS=MS` | a save pauses `MS` ms between the shards and the manifest |
//! | `PRETRAIN_TEST_STUCK_AFTER_FAILURE` | a rank process whose run failed hangs instead of exiting |

use std::sync::OnceLock;
use std::time::Duration;

/// The faults of this process.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Faults {
    /// A rank and the pause in each of its forward actions.
    pub slow_rank: Option<(usize, Duration)>,
    /// The step and rank whose gradients are made NaN.
    pub nan_grads: Option<(usize, usize)>,
    /// The step whose loss the guard sees multiplied, and the factor.
    pub loss_jump: Option<(usize, f64)>,
    /// A rank whose checkpoint share is written late, and by how much.
    pub share_delay: Option<(usize, Duration)>,
    /// The pause of a save between its shard files and its manifest.
    pub save_pause: Option<Duration>,
    /// A failed rank process hangs (as a teardown stuck on a dead peer would).
    pub stuck_after_failure: bool,
}

static LOADED: OnceLock<Faults> = OnceLock::new();

/// This process's faults: those [`Faults::load`] read, or none.
pub fn faults() -> &'static Faults {
    static NONE: Faults = Faults {
        slow_rank: None,
        nan_grads: None,
        loss_jump: None,
        share_delay: None,
        save_pause: None,
        stuck_after_failure: false,
    };
    LOADED.get().unwrap_or(&NONE)
}

impl Faults {
    /// Reads the variables (once; later calls keep the first reading).
    pub fn load() {
        LOADED.get_or_init(|| Self::parse(|key| std::env::var(key).ok()));
    }

    /// The faults `var` gives; a malformed value injects nothing.
    pub fn parse(var: impl Fn(&str) -> Option<String>) -> Self {
        fn pair<A: std::str::FromStr, B: std::str::FromStr>(v: &str) -> Option<(A, B)> {
            let (a, b) = v.split_once(':')?;
            Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
        }
        let ms = |(r, ms): (usize, u64)| (r, Duration::from_millis(ms));
        Self {
            slow_rank: var("PRETRAIN_TEST_SLOW_RANK")
                .and_then(|v| pair(&v))
                .map(ms),
            nan_grads: var("PRETRAIN_TEST_NAN_GRADS").and_then(|v| pair(&v)),
            loss_jump: var("PRETRAIN_TEST_LOSS_JUMP").and_then(|v| pair(&v)),
            share_delay: var("PRETRAIN_TEST_SHARE_DELAY_MS")
                .and_then(|v| pair(&v))
                .map(ms),
            save_pause: var("PRETRAIN_TEST_SAVE_PAUSE_MS")
                .and_then(|v| v.trim().parse().ok())
                .map(Duration::from_millis),
            stuck_after_failure: var("PRETRAIN_TEST_STUCK_AFTER_FAILURE").is_some(),
        }
    }

    /// The pause of rank `rank`'s forward actions.
    pub fn slowdown(&self, rank: usize) -> Option<Duration> {
        self.slow_rank.filter(|&(r, _)| r == rank).map(|(_, d)| d)
    }

    /// The factor on step `step`'s loss as the guard sees it (1 when none).
    pub fn loss_factor(&self, step: usize) -> f64 {
        match self.loss_jump {
            Some((at, factor)) if at == step => factor,
            _ => 1.0,
        }
    }

    /// How late rank `rank` writes its checkpoint share.
    pub fn share_delay(&self, rank: usize) -> Option<Duration> {
        self.share_delay.filter(|&(r, _)| r == rank).map(|(_, d)| d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_are_parsed_per_rank_and_step_and_malformed_ones_inject_nothing() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let f = Faults::parse(env(&[
            ("PRETRAIN_TEST_SLOW_RANK", "1:50"),
            ("PRETRAIN_TEST_NAN_GRADS", "2:0"),
            ("PRETRAIN_TEST_LOSS_JUMP", "3:8.5"),
            ("PRETRAIN_TEST_SHARE_DELAY_MS", "3:400"),
            ("PRETRAIN_TEST_SAVE_PAUSE_MS", "60000"),
            ("PRETRAIN_TEST_STUCK_AFTER_FAILURE", ""),
        ]));
        assert_eq!(f.slowdown(1), Some(Duration::from_millis(50)));
        assert_eq!(f.slowdown(0), None);
        assert_eq!(f.nan_grads, Some((2, 0)));
        assert_eq!((f.loss_factor(3), f.loss_factor(2)), (8.5, 1.0));
        assert_eq!(f.share_delay(3), Some(Duration::from_millis(400)));
        assert_eq!(f.share_delay(0), None);
        assert_eq!(f.save_pause, Some(Duration::from_secs(60)));
        assert!(f.stuck_after_failure);
        let bad = Faults::parse(env(&[
            ("PRETRAIN_TEST_SLOW_RANK", "x:50"),
            ("PRETRAIN_TEST_LOSS_JUMP", "3"),
            ("PRETRAIN_TEST_SAVE_PAUSE_MS", "soon"),
        ]));
        assert_eq!(bad, Faults::default());
        assert_eq!(faults(), &Faults::default());
    }
}
