//! The `local` backend's messages: each rank's mailbox holds one lane per sender and channel, in
//! which the k-th receive takes the k-th message (`LocalWorld::post`, `reserve`, `take`).

use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::Instant;

use candle_core::{DType, Shape, Tensor};

use crate::comm::Result;

use super::{lock, wait_until, Call, LocalWorld};
use crate::comm::collective::fresh;
use crate::comm::Channel;

/// Messages to one rank, one lane per sender and channel.
#[derive(Default)]
pub(super) struct Mailbox {
    pub(super) lanes: Mutex<HashMap<(usize, Channel), Lane>>,
    pub(super) cv: Condvar,
}

/// The messages of one sender on one channel: the `k`-th receive takes the `k`-th message (as
/// NCCL matches a pair's operations), whatever order the receives are waited in.
#[derive(Default)]
pub(super) struct Lane {
    /// Messages posted so far.
    sent: u64,
    /// Receives posted so far.
    taken: u64,
    /// Posted messages not yet received, by number.
    pub(super) waiting: HashMap<u64, Tensor>,
}

impl LocalWorld {
    /// Queues a copy of `t` for rank `dst` from `src` on `channel` (`dst` exists).
    pub(super) fn post(&self, src: usize, dst: usize, channel: Channel, t: &Tensor) -> Result<()> {
        // A copy, so that later in-place updates of `t` by the sender are not seen by `dst`.
        let t = fresh(&t.detach())?;
        let mailbox = &self.mailboxes[dst];
        let mut lanes = lock(&mailbox.lanes);
        let lane = lanes.entry((src, channel)).or_default();
        lane.waiting.insert(lane.sent, t);
        lane.sent += 1;
        mailbox.cv.notify_all();
        Ok(())
    }

    /// Posts a receive of rank `me` from `src` on `channel`: the number of the message it takes.
    pub(super) fn reserve(&self, me: usize, src: usize, channel: Channel) -> u64 {
        let mut lanes = lock(&self.mailboxes[me].lanes);
        let lane = lanes.entry((src, channel)).or_default();
        lane.taken += 1;
        lane.taken - 1
    }

    /// Message `number` that `call.me` receives from `src` on `channel`, which must have
    /// `shape` and `dtype`; waits until `deadline`.
    pub(super) fn take(
        &self,
        call: &Call<'_>,
        (src, channel, number): (usize, Channel, u64),
        (shape, dtype): (&Shape, DType),
        deadline: Instant,
    ) -> Result<Tensor> {
        let mailbox = &self.mailboxes[call.me];
        let key = (src, channel);
        let mut lanes = lock(&mailbox.lanes);
        loop {
            let arrived = lanes.get_mut(&key).and_then(|l| l.waiting.remove(&number));
            if let Some(t) = arrived {
                if t.shape() == shape && t.dtype() == dtype {
                    return Ok(t);
                }
                let (got, got_dtype) = (t.shape(), t.dtype());
                let msg = format!(
                    "expected {shape:?} {dtype:?} from rank {src}, got {got:?} {got_dtype:?}"
                );
                return Err(call.invalid(msg));
            }
            if let Some(e) = call.peer_failed() {
                return Err(e);
            }
            lanes = match wait_until(&mailbox.cv, lanes, deadline) {
                Some(guard) => guard,
                None => return Err(call.timeout(vec![src])),
            };
        }
    }
}
