//! [`Transfer`]: the pending half of [`Comm::send_recv`](super::Comm::send_recv), a grouped send
//! and receive whose received tensor is taken only when the caller needs it, so that the transfer
//! runs while the work queued before that point computes.

use candle_core::Tensor;

use crate::comm::Result;

type Wait = Box<dyn FnOnce() -> Result<Tensor> + Send>;

/// A posted transfer; [`Transfer::wait`] gives the received tensor. Dropping it without waiting
/// is allowed (a failing step): the backend keeps what the transfer still uses until it is done.
#[must_use = "a transfer's received tensor must be waited for"]
pub struct Transfer {
    wait: Wait,
}

impl Transfer {
    /// A transfer whose tensor `wait` produces (blocking the calling thread, or ordering the
    /// device's stream after the transfer, as the backend does).
    pub fn new(wait: impl FnOnce() -> Result<Tensor> + Send + 'static) -> Self {
        Self {
            wait: Box::new(wait),
        }
    }

    /// A transfer that has already arrived.
    pub fn ready(t: Tensor) -> Self {
        Self::new(move || Ok(t))
    }

    /// The received tensor: on the host it is there; on a GPU the device's stream is ordered
    /// after the transfer, so kernels queued from here on read it when it has arrived.
    pub fn wait(self) -> Result<Tensor> {
        (self.wait)()
    }
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Transfer")
    }
}
