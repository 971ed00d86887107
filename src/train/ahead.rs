//! How far a rank's host may run ahead of its GPU: before it enqueues a forward, the host waits
//! until the forward [`FORWARDS_AHEAD`] forwards back has run on the device.
//!
//! Kernels return once queued, so without a bound the compute thread enqueues until the driver's
//! launch queue is full and then blocks inside a launch. A communication thread (ZeRO-3's
//! gathers, the data-parallel buckets) launching NCCL kernels can then block behind that same
//! full queue while a peer waits for its collective: a slow rank can close a cycle across ranks.
//! With the bound the queue holds at most a few micro-batches of work, which keeps the device
//! busy (the next forward and the backwards between are queued while one runs) without filling
//! the launch queue. On the CPU work runs as it is issued, and nothing is recorded.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use std::collections::VecDeque;

use anyhow::Result;
use candle_core::Device;

/// Forwards the host may have queued beyond those the device has finished.
pub const FORWARDS_AHEAD: usize = 2;

/// Marks of the forwards queued and not yet waited for, oldest first, at most `depth`.
#[derive(Debug)]
pub(super) struct Bound<M> {
    queued: VecDeque<M>,
    depth: usize,
}

impl<M> Bound<M> {
    pub(super) fn new(depth: usize) -> Self {
        Self {
            queued: VecDeque::new(),
            depth: depth.max(1),
        }
    }

    /// Before a forward: waits (`wait`) for the oldest marks until fewer than `depth` remain.
    pub(super) fn admit(&mut self, mut wait: impl FnMut(M) -> Result<()>) -> Result<()> {
        while self.queued.len() >= self.depth {
            if let Some(m) = self.queued.pop_front() {
                wait(m)?;
            }
        }
        Ok(())
    }

    /// After a forward was queued: its mark.
    pub(super) fn push(&mut self, mark: M) {
        self.queued.push_back(mark);
    }
}

/// The bound of one rank's step on its device (see the module docs).
pub(super) struct RunAhead {
    #[cfg(feature = "cuda")]
    cuda: Option<(
        std::sync::Arc<candle_core::cuda::cudarc::driver::CudaStream>,
        Bound<candle_core::cuda::cudarc::driver::CudaEvent>,
    )>,
}

impl Default for RunAhead {
    /// No bound (the CPU's).
    fn default() -> Self {
        Self::on(&Device::Cpu)
    }
}

impl RunAhead {
    /// The bound on `device` (none on the CPU).
    pub(super) fn on(device: &Device) -> Self {
        #[cfg(feature = "cuda")]
        {
            let cuda = match device {
                Device::Cuda(d) => Some((d.cuda_stream(), Bound::new(FORWARDS_AHEAD))),
                _ => None,
            };
            Self { cuda }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = device;
            Self {}
        }
    }

    /// Before enqueueing a forward: waits for the device to finish the forward
    /// [`FORWARDS_AHEAD`] back.
    pub(super) fn before_forward(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some((_, bound)) = &mut self.cuda {
            bound.admit(|e| Ok(e.synchronize()?))?;
        }
        Ok(())
    }

    /// After enqueueing a forward: marks its end on the device stream.
    pub(super) fn after_forward(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some((stream, bound)) = &mut self.cuda {
            bound.push(stream.record_event(None)?);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With a depth of 2 the third forward waits for the first, the fourth for the second: the
    /// host never has more than two forwards queued beyond the device's.
    #[test]
    fn a_forward_waits_for_the_one_two_back() {
        let mut bound = Bound::new(2);
        let mut waited = Vec::new();
        for f in 0..5 {
            bound
                .admit(|m| {
                    waited.push((f, m));
                    Ok(())
                })
                .unwrap();
            bound.push(f);
        }
        assert_eq!(waited, vec![(2, 0), (3, 1), (4, 2)]);
        // A failed wait is the step's error.
        let e = bound.admit(|_| anyhow::bail!("device lost")).unwrap_err();
        assert_eq!(e.to_string(), "device lost");
    }
}
