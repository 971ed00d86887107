//! Learning-rate schedules (the recipe's `schedule:` section): linear warmup, then constant,
//! cosine or warmup–stable–decay (WSD).

use crate::recipe::{LrCurve, ScheduleConfig};

/// Learning rate of 0-based `step` out of `total` steps with peak `lr`.
pub fn lr_at(s: &ScheduleConfig, lr: f64, step: usize, total: usize) -> f64 {
    if step < s.warmup_steps {
        return lr * (step + 1) as f64 / s.warmup_steps as f64;
    }
    match s.kind {
        LrCurve::Constant => lr,
        LrCurve::Cosine => {
            let span = total.saturating_sub(s.warmup_steps + 1).max(1) as f64;
            let t = ((step - s.warmup_steps) as f64 / span).min(1.0);
            s.min_lr + 0.5 * (lr - s.min_lr) * (1.0 + (std::f64::consts::PI * t).cos())
        }
        LrCurve::Wsd => {
            let decay_steps = ((total as f64 * s.decay_fraction).round() as usize).max(1);
            let start = total.saturating_sub(decay_steps).max(s.warmup_steps);
            if step < start {
                lr
            } else {
                let span = total.saturating_sub(start + 1).max(1) as f64;
                let t = ((step - start) as f64 / span).min(1.0);
                lr + (s.min_lr - lr) * t
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(kind: LrCurve, warmup: usize) -> ScheduleConfig {
        ScheduleConfig {
            kind,
            warmup_steps: warmup,
            min_lr: 0.1,
            decay_fraction: 0.5,
        }
    }

    #[test]
    fn warmup_is_linear_to_the_peak() {
        let c = cfg(LrCurve::Constant, 4);
        let lrs: Vec<f64> = (0..6).map(|i| lr_at(&c, 1.0, i, 10)).collect();
        assert_eq!(lrs, vec![0.25, 0.5, 0.75, 1.0, 1.0, 1.0]);
    }

    #[test]
    fn cosine_ends_at_min_lr_and_decreases() {
        let c = cfg(LrCurve::Cosine, 2);
        let lrs: Vec<f64> = (0..12).map(|i| lr_at(&c, 1.0, i, 12)).collect();
        assert!((lrs[2] - 1.0).abs() < 1e-12);
        assert!((lrs[11] - 0.1).abs() < 1e-12);
        assert!(lrs[2..].windows(2).all(|w| w[1] <= w[0]));
    }

    #[test]
    fn wsd_holds_then_decays_linearly() {
        let c = cfg(LrCurve::Wsd, 1);
        let lrs: Vec<f64> = (0..10).map(|i| lr_at(&c, 1.0, i, 10)).collect();
        assert_eq!(&lrs[1..5], &[1.0; 4]);
        assert!((lrs[9] - 0.1).abs() < 1e-12);
        assert!(lrs[5..].windows(2).all(|w| w[1] < w[0]));
    }
}
