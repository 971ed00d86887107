//! The traced step's clock: when each action ran on the compute device.
//!
//! On a GPU an action returns once its kernels are queued, so host times say when work was
//! enqueued, not when it ran. [`StepClock`] records a timing CUDA event on the device stream before
//! and after every action and converts them, after the step's one wait for the device, into
//! seconds since the step began: an action starts when the stream reaches it (the work queued
//! before it is done) and ends when its last kernel is done. The origin event is recorded when the
//! executor starts, and is placed on the step's host time line at the moment it was recorded (the
//! stream is idle then: the previous step ended with a wait for the device). Time the GPU spends
//! idle between actions — waiting for the host, or for a peer's transfer (the device stream
//! waits for an NCCL operation's completion event) — shows as a gap. Nothing waits for the device inside the step, so the
//! traced step overlaps host and device work like any other. On the CPU the marks are host times.

use std::time::Instant;

use anyhow::Result;
use candle_core::Device;
use parallel::pipeline::Action;

/// One timed action of a step.
#[derive(Debug, Clone)]
pub struct Timed {
    /// The action.
    pub action: Action,
    /// Start, seconds since the step began.
    pub start: f64,
    /// End, seconds since the step began.
    pub end: f64,
}

/// The timeline of a step's actions: host times, or for the traced step the device's
/// ([`StepClock`]), read once the step is done.
pub struct Timeline {
    start: Instant,
    clock: Option<StepClock>,
    marks: Vec<(Action, Mark, Mark)>,
}

impl Timeline {
    /// The timeline of the step that began at `start`: on `device`'s own clock when given.
    pub fn new(device: Option<&Device>, start: Instant) -> Result<Self> {
        Ok(Self {
            start,
            clock: device.map(|d| StepClock::new(d, start)).transpose()?,
            marks: Vec::new(),
        })
    }

    /// The present point.
    pub fn mark(&self) -> Result<Mark> {
        match &self.clock {
            Some(c) => c.mark(),
            None => Ok(Mark::Host(self.start.elapsed().as_secs_f64())),
        }
    }

    /// Records that `action` ran from `begin` until now.
    pub fn record(&mut self, action: Action, begin: Mark) -> Result<()> {
        let end = self.mark()?;
        self.marks.push((action, begin, end));
        Ok(())
    }

    /// Every action with its start and end (on a device clock this waits for the device to pass
    /// the last mark).
    pub fn finish(self) -> Result<Vec<Timed>> {
        let read = |m: &Mark| match (&self.clock, m) {
            (Some(c), m) => c.seconds(m),
            (None, Mark::Host(t)) => Ok(*t),
            #[cfg(feature = "cuda")]
            (None, Mark::Event(_)) => anyhow::bail!("a device event on a host timeline"),
        };
        self.marks
            .iter()
            .map(|(action, a, b)| {
                Ok(Timed {
                    action: *action,
                    start: read(a)?,
                    end: read(b)?,
                })
            })
            .collect()
    }
}

/// A point on a step's timeline, read with [`StepClock::seconds`].
pub enum Mark {
    /// Seconds since the step began, read on the host.
    Host(f64),
    /// A timing event recorded on the device stream.
    #[cfg(feature = "cuda")]
    Event(candle_core::cuda::cudarc::driver::CudaEvent),
}

/// Marks the actions of a traced step on the device's timeline (see the module docs).
pub struct StepClock {
    /// The step's start on the host.
    start: Instant,
    /// On CUDA: the device stream, the origin event and its host time (seconds since `start`).
    #[cfg(feature = "cuda")]
    cuda: Option<(
        std::sync::Arc<candle_core::cuda::cudarc::driver::CudaStream>,
        candle_core::cuda::cudarc::driver::CudaEvent,
        f64,
    )>,
}

impl StepClock {
    /// A clock on `device` for the step that began at `start`.
    pub fn new(device: &Device, start: Instant) -> Result<Self> {
        #[cfg(feature = "cuda")]
        {
            let cuda = match device {
                Device::Cuda(d) => {
                    let stream = d.cuda_stream();
                    let origin = stream.record_event(Some(timing()))?;
                    Some((stream, origin, start.elapsed().as_secs_f64()))
                }
                _ => None,
            };
            Ok(Self { start, cuda })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = device;
            Ok(Self { start })
        }
    }

    /// The present point: an event behind the work queued so far on a GPU, the host time on the
    /// CPU.
    pub fn mark(&self) -> Result<Mark> {
        #[cfg(feature = "cuda")]
        if let Some((stream, _, _)) = &self.cuda {
            return Ok(Mark::Event(stream.record_event(Some(timing()))?));
        }
        Ok(Mark::Host(self.start.elapsed().as_secs_f64()))
    }

    /// Seconds from the step's start to `mark` (for an event, once the device has passed it:
    /// this waits for it).
    pub fn seconds(&self, mark: &Mark) -> Result<f64> {
        match mark {
            Mark::Host(t) => Ok(*t),
            #[cfg(feature = "cuda")]
            Mark::Event(e) => {
                let Some((_, origin, at)) = &self.cuda else {
                    anyhow::bail!("a device event on a clock of the CPU");
                };
                Ok(at + f64::from(origin.elapsed_ms(e)?) * 1e-3)
            }
        }
    }
}

/// Events that record time (cudarc's default disables timing).
#[cfg(feature = "cuda")]
fn timing() -> candle_core::cuda::cudarc::driver::sys::CUevent_flags {
    candle_core::cuda::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_marks_are_host_times_in_order() {
        let start = Instant::now();
        let clock = StepClock::new(&Device::Cpu, start).unwrap();
        let a = clock.mark().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = clock.mark().unwrap();
        let (a, b) = (clock.seconds(&a).unwrap(), clock.seconds(&b).unwrap());
        assert!(0.0 <= a && a + 0.002 <= b, "{a} {b}");
        assert!(b <= start.elapsed().as_secs_f64());
    }
}
