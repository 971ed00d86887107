//! NCCL's rules, kept by the `local` backend so that a pattern that would hang or misbehave on
//! GPUs fails on the CPU first (NCCL 2.28's `group.cc`, `transport.cc`, `init.cc`):
//!
//! - **Point-to-point directions connect lazily, both ends at once.** NCCL connects a
//!   send/receive pair at the first operation on it, and the connection waits for the peer's
//!   first matching operation; on a non-blocking communicator the backend waits for that on the
//!   host. So a rank's *first* `send` to `dst` returns only once `dst` has posted its first
//!   `recv` from it ([`Rules::connect`]): a ring whose every member sends before it receives
//!   deadlocks here as it does on GPUs. Later sends do not wait (the GPU queues them). Grouped
//!   operations (`send_recv`, `all_to_all`) connect all their peers together and never wait
//!   here.
//! - **Communicators are created by all members together.** `Comm::prepare` waits, per channel
//!   in the list's order, until every member has reached it ([`Rules::create`]); a point-to-point
//!   channel is also connected there (the NCCL backend sends one byte over it).
//! - **No communicator is created inside a step.** Once a rank has prepared its channels, an
//!   operation on a group, an all-to-all group or a direction it did not prepare is refused
//!   ([`Rules::check_use`]): NCCL would create the communicator there, waiting for all members in
//!   the middle of the step's other traffic.
//! - **One thread at a time per communicator.** NCCL runs a communicator's operations in the
//!   order they were issued, so two threads of one rank issuing on one channel at the same time
//!   would give each member an order of its own (on GPUs, a deadlock or swapped results): an
//!   operation that starts while another thread of its rank is inside one on the same channel
//!   is refused ([`Rules::enter`]). Threads that take turns, one waiting for the other's work
//!   first, are fine.
//! - Only NCCL's dtypes travel, and no rank sends to itself (checked by the callers).

use std::collections::{HashMap, HashSet};
use std::sync::{Condvar, Mutex};
use std::thread::ThreadId;
use std::time::Instant;

use super::{lock, wait_until, Call};
use crate::comm::{Channel, CommError};

/// Which end of a point-to-point direction posted an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum End {
    Send,
    Recv,
}

/// The state behind the rules of the module documentation, shared by a job's ranks.
#[derive(Default)]
pub(super) struct Rules {
    /// Point-to-point directions `(src, dst)`: whether each end (send, receive) has posted.
    links: Mutex<HashMap<(usize, usize), [bool; 2]>>,
    links_cv: Condvar,
    /// Communicator creations: how often each member reached each channel, over all
    /// `prepare` calls.
    arrivals: Mutex<HashMap<Channel, HashMap<usize, usize>>>,
    arrivals_cv: Condvar,
    /// Per rank: the channels it prepared, once it has called `prepare`.
    prepared: Mutex<HashMap<usize, HashSet<Channel>>>,
    /// The thread inside operations of a rank on a channel, and how many.
    inside: Mutex<HashMap<(usize, Channel), (ThreadId, usize)>>,
}

/// A rank's thread inside an operation on a channel ([`Rules::enter`]); leaves when dropped.
pub(super) struct Inside<'a> {
    rules: &'a Rules,
    key: Option<(usize, Channel)>,
}

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        let Some(key) = self.key.take() else {
            return;
        };
        let mut inside = lock(&self.rules.inside);
        if let Some((_, n)) = inside.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                inside.remove(&key);
            }
        }
    }
}

impl Rules {
    /// Wakes every waiter (after a failure was recorded), taking each lock first so that no
    /// waiter misses the wake-up between its failure check and its wait.
    pub(super) fn wake_all(&self) {
        drop(lock(&self.links));
        self.links_cv.notify_all();
        drop(lock(&self.arrivals));
        self.arrivals_cv.notify_all();
    }

    /// Records that `end` of direction `(src, dst)` posted an operation; with `wait`, returns
    /// only once the other end has posted too (the connection NCCL makes at the first use).
    pub(super) fn connect(
        &self,
        call: &Call<'_>,
        (src, dst): (usize, usize),
        end: End,
        wait: bool,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let (mine, theirs) = match end {
            End::Send => (0, 1),
            End::Recv => (1, 0),
        };
        let mut links = lock(&self.links);
        let link = links.entry((src, dst)).or_default();
        if !link[mine] {
            link[mine] = true;
            self.links_cv.notify_all();
        }
        if !wait {
            return Ok(());
        }
        loop {
            if links.get(&(src, dst)).is_some_and(|l| l[theirs]) {
                return Ok(());
            }
            if let Some(e) = call.peer_failed() {
                return Err(e);
            }
            links = match wait_until(&self.links_cv, links, deadline) {
                Some(guard) => guard,
                None => {
                    let (op, peer) = match end {
                        End::Send => (
                            "first send (NCCL connects a direction once the receiver has posted \
                             its first recv)",
                            dst,
                        ),
                        End::Recv => (
                            "first recv (NCCL connects a direction once the sender has posted \
                             its first send)",
                            src,
                        ),
                    };
                    return Err(CommError::Timeout {
                        me: call.me,
                        op,
                        group: call.group.to_vec(),
                        secs: call.timeout.as_secs_f64(),
                        missing: vec![peer],
                    });
                }
            };
        }
    }

    /// Waits until every member of `channel` (`call.group`) has reached it as often as rank
    /// `me` has (the communicator creation of `prepare`); records that `me` prepared it.
    pub(super) fn create(
        &self,
        call: &Call<'_>,
        me: usize,
        channel: &Channel,
        deadline: Instant,
    ) -> Result<(), CommError> {
        self.mark_prepared(me, Some(channel));
        let mut arrivals = lock(&self.arrivals);
        let times = {
            let n = arrivals
                .entry(channel.clone())
                .or_default()
                .entry(me)
                .or_default();
            *n += 1;
            *n
        };
        self.arrivals_cv.notify_all();
        loop {
            let late: Vec<usize> = {
                let seen = arrivals.get(channel);
                let count = |r: &usize| seen.and_then(|s| s.get(r)).copied().unwrap_or(0);
                call.group
                    .iter()
                    .copied()
                    .filter(|r| count(r) < times)
                    .collect()
            };
            if late.is_empty() {
                return Ok(());
            }
            if let Some(e) = call.peer_failed() {
                return Err(e);
            }
            arrivals = match wait_until(&self.arrivals_cv, arrivals, deadline) {
                Some(guard) => guard,
                None => return Err(call.timeout(late)),
            };
        }
    }

    /// Records that rank `me` called `prepare`, and prepared `channel` if given.
    pub(super) fn mark_prepared(&self, me: usize, channel: Option<&Channel>) {
        let mut prepared = lock(&self.prepared);
        let mine = prepared.entry(me).or_default();
        mine.extend(channel.cloned());
    }

    /// Checks that rank `me` may use `channel` (prepared, once `me` has prepared at all) and
    /// that no other thread of `me` is inside an operation on it; the calling thread is inside
    /// one until the returned guard drops.
    pub(super) fn enter(
        &self,
        call: &Call<'_>,
        me: usize,
        channel: &Channel,
    ) -> Result<Inside<'_>, CommError> {
        if let Some(mine) = lock(&self.prepared).get(&me) {
            if !mine.contains(channel) {
                return Err(call.invalid(format!(
                    "{} was not among the channels this rank prepared (Comm::prepare): NCCL \
                     would create its communicator here, in the middle of the step",
                    describe(channel)
                )));
            }
        }
        let this = std::thread::current().id();
        let key = (me, channel.clone());
        let mut inside = lock(&self.inside);
        let (thread, n) = inside.entry(key.clone()).or_insert((this, 0));
        if *thread != this {
            let name = std::thread::current()
                .name()
                .unwrap_or("unnamed")
                .to_string();
            return Err(call.invalid(format!(
                "{} is used by two threads of this rank at once (this one is {name}): NCCL runs \
                 a communicator's operations in the order they are issued, so each member \
                 would get an order of its own",
                describe(channel)
            )));
        }
        *n += 1;
        Ok(Inside {
            rules: self,
            key: Some(key),
        })
    }
}

/// A channel in an error message.
fn describe(channel: &Channel) -> String {
    match channel {
        Channel::Group(g) => format!("the group {g:?}"),
        Channel::AllToAll(g) => format!("the all-to-all group {g:?}"),
        Channel::Ring(g) => format!("the ring {g:?}"),
        Channel::P2p { src, dst } => format!("the direction {src} -> {dst}"),
    }
}
