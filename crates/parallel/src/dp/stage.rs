//! The ZeRO stage (Rajbhandari et al. 2020) as a type: which of a rank's persistent state the
//! ranks of a shard group split among themselves instead of replicating, and what that state
//! weighs — one formula that the trainer's layout, the planner and the recipe check all use.

use std::fmt;
use std::ops::{Add, Mul};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// What the data-parallel ranks of a shard group shard (`parallel.zero`, written as its number).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ZeroStage {
    /// 0: nothing; every rank keeps whole state.
    #[default]
    Off,
    /// 1: the optimizer state (fp32 master weights and moments).
    Optimizer,
    /// 2: also the gradients (reduce-scattered after each micro-batch's backward of a piece).
    Gradients,
    /// 3: also the parameters (a piece's are all-gathered before its forward and backward).
    Parameters,
}

/// A persistent training state's bytes (or any measure of them, `T`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StateBytes<T = usize> {
    /// Parameters in the training dtype: whole, or this rank's ZeRO-3 shards.
    pub param_bytes: T,
    /// fp32 gradients: the whole flat buffer, or this rank's ZeRO-2/3 shards.
    pub grad_bytes: T,
    /// fp32 master weights and AdamW moments of the flat ranges this rank owns.
    pub optimizer_bytes: T,
}

impl<T: Copy + Add<Output = T>> StateBytes<T> {
    /// All of it.
    pub fn total(&self) -> T {
        self.param_bytes + self.grad_bytes + self.optimizer_bytes
    }
}

impl ZeroStage {
    /// Every stage, in order.
    pub const ALL: [ZeroStage; 4] = [
        ZeroStage::Off,
        ZeroStage::Optimizer,
        ZeroStage::Gradients,
        ZeroStage::Parameters,
    ];

    /// The stage numbered `n` (0-3).
    pub fn from_number(n: u64) -> Option<Self> {
        Self::ALL.get(usize::try_from(n).ok()?).copied()
    }

    /// Its number, 0-3.
    pub fn number(self) -> u8 {
        self as u8
    }

    /// Whether the optimizer state is sharded (stages 1-3).
    pub fn shards_optimizer(self) -> bool {
        self >= ZeroStage::Optimizer
    }

    /// Whether the gradients are sharded (stages 2 and 3).
    pub fn shards_gradients(self) -> bool {
        self >= ZeroStage::Gradients
    }

    /// Whether the parameters are sharded (stage 3).
    pub fn shards_parameters(self) -> bool {
        self == ZeroStage::Parameters
    }

    /// The state of a rank at this stage: `params` parameter elements held whole, `flat`
    /// elements of the whole gradient buffer (padding included), `owned` the flat elements it
    /// owns (all of them at stage 0), `dtype` bytes per parameter element, `moment` bytes per
    /// AdamW moment element (4 or 2); gradients and master weights are fp32. Exact in `usize`
    /// from a layout, an estimate in `f64` from parameter counts.
    pub fn state_bytes<T>(self, params: T, flat: T, owned: T, dtype: T, moment: T) -> StateBytes<T>
    where
        T: Copy + Mul<Output = T> + Add<Output = T> + From<u8>,
    {
        StateBytes {
            param_bytes: dtype
                * if self.shards_parameters() {
                    owned
                } else {
                    params
                },
            grad_bytes: T::from(4) * if self.shards_gradients() { owned } else { flat },
            optimizer_bytes: (T::from(4) + T::from(2) * moment) * owned,
        }
    }
}

impl fmt::Display for ZeroStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.number())
    }
}

impl Serialize for ZeroStage {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u8(self.number())
    }
}

impl<'de> Deserialize<'de> for ZeroStage {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = u64::deserialize(d)?;
        Self::from_number(n).ok_or_else(|| {
            serde::de::Error::custom(format!("parallel.zero ({n}) must be 0, 1, 2 or 3"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_number_and_shard_cumulatively() {
        for (n, z) in ZeroStage::ALL.iter().enumerate() {
            assert_eq!(ZeroStage::from_number(n as u64), Some(*z));
            assert_eq!(z.number() as usize, n);
            assert_eq!(z.shards_optimizer(), n >= 1);
            assert_eq!(z.shards_gradients(), n >= 2);
            assert_eq!(z.shards_parameters(), n == 3);
        }
        assert_eq!(ZeroStage::from_number(4), None);
    }

    #[test]
    fn state_bytes_follow_the_stage() {
        // 100 bf16 parameters in a flat buffer of 104, 26 owned.
        let b = |z: ZeroStage| z.state_bytes(100usize, 104, 26, 2, 4);
        let off = ZeroStage::Off.state_bytes(100usize, 104, 104, 2, 4);
        assert_eq!(
            (off.param_bytes, off.grad_bytes, off.optimizer_bytes),
            (200, 416, 1248)
        );
        let z1 = b(ZeroStage::Optimizer);
        assert_eq!(
            (z1.param_bytes, z1.grad_bytes, z1.optimizer_bytes),
            (200, 416, 312)
        );
        let z2 = b(ZeroStage::Gradients);
        assert_eq!((z2.param_bytes, z2.grad_bytes), (200, 104));
        let z3 = b(ZeroStage::Parameters);
        assert_eq!((z3.param_bytes, z3.grad_bytes, z3.total()), (52, 104, 468));
        let f = ZeroStage::Parameters.state_bytes(100f64, 104.0, 26.0, 2.0, 4.0);
        assert_eq!(f.total(), 468.0);
        // bf16 moments: 8 bytes of optimizer state per owned element instead of 12.
        let h = ZeroStage::Optimizer.state_bytes(100usize, 104, 26, 2, 2);
        assert_eq!((h.optimizer_bytes, h.param_bytes), (208, 200));
    }

    #[test]
    fn recipes_write_the_number() {
        let z: ZeroStage = serde_json::from_str("2").unwrap();
        assert_eq!(z, ZeroStage::Gradients);
        assert_eq!(serde_json::to_string(&z).unwrap(), "2");
        let e = serde_json::from_str::<ZeroStage>("4")
            .unwrap_err()
            .to_string();
        assert!(e.contains("parallel.zero (4) must be 0, 1, 2 or 3"), "{e}");
    }
}
