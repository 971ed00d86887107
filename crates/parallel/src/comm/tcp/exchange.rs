//! How a [`TcpComm`] call meets its peers: waiting for the frames of a call, and a collective
//! (every member's contribution sent to every other, the result computed in member order with
//! the `local` backend's code).

use std::time::{Duration, Instant};

use candle_core::Tensor;

use crate::comm::Result;

use super::wire::{decode, encode, signature, FrameKind};
use super::{code, group_id, lock, Key, TcpComm};
use crate::comm::collective::{compute, Kind};
use crate::comm::{CommError, Group};

impl TcpComm {
    /// Waits for the frames `keys` (all or nothing), bounded by the timeout.
    pub(super) fn wait(
        &self,
        op: &'static str,
        group: &[usize],
        keys: &[Key],
    ) -> Result<Vec<(u8, Vec<u8>)>> {
        self.wait_within(op, group, keys, self.timeout)
    }

    /// [`TcpComm::wait`] bounded by `timeout`.
    pub(super) fn wait_within(
        &self,
        op: &'static str,
        group: &[usize],
        keys: &[Key],
        timeout: Duration,
    ) -> Result<Vec<(u8, Vec<u8>)>> {
        let deadline = Instant::now() + timeout;
        let mut inbox = lock(&self.shared.inbox);
        loop {
            let peer_failed = |failed: usize, reason: String| {
                self.err(op, group, |me, op, group| CommError::PeerFailed {
                    me,
                    op,
                    group,
                    failed,
                    reason: reason.clone(),
                })
            };
            if let Some((failed, reason)) = inbox.failure.clone() {
                return Err(peer_failed(failed, reason));
            }
            let missing: Vec<usize> = keys
                .iter()
                .filter(|k| !inbox.frames.contains_key(k))
                .map(|k| k.0)
                .collect();
            if missing.is_empty() {
                return Ok(keys.iter().filter_map(|k| inbox.frames.remove(k)).collect());
            }
            if let Some(&gone) = missing.iter().find(|r| inbox.departed.contains(r)) {
                return Err(peer_failed(gone, "it left the job before this call".into()));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let secs = timeout.as_secs_f64();
                return Err(self.err(op, group, |me, op, group| CommError::Timeout {
                    me,
                    op,
                    group,
                    secs,
                    missing: missing.clone(),
                }));
            }
            inbox = self
                .shared
                .cv
                .wait_timeout(inbox, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Runs collective `kind` on `group` with this member's `t`.
    pub(super) fn collective(
        &self,
        group: &Group,
        kind: Kind,
        t: Option<&Tensor>,
    ) -> Result<Option<Tensor>> {
        self.collective_within(group, kind, t, self.timeout)
    }

    /// [`TcpComm::collective`], waiting for the peers up to `timeout`.
    pub(super) fn collective_within(
        &self,
        group: &Group,
        kind: Kind,
        t: Option<&Tensor>,
        timeout: Duration,
    ) -> Result<Option<Tensor>> {
        let (op, ranks) = (kind.name(), group.ranks());
        let Some(me) = group.index_of(self.rank) else {
            return Err(self.invalid(op, ranks, format!("rank {} is not a member", self.rank)));
        };
        let (code, param) = code(kind);
        let mut payload = param.to_le_bytes().to_vec();
        if let Some(t) = t {
            payload.extend(encode(t)?);
        }
        let gid = group_id(group);
        let seq = {
            let mut seqs = lock(&self.seqs);
            let n = seqs.entry(group.clone()).or_insert(0);
            *n += 1;
            *n
        };
        // Who sends to whom: everyone to everyone, except that only the root broadcasts.
        let (send, expect): (bool, Vec<usize>) = match kind {
            Kind::Broadcast(root) if group.index_of(root).is_none() => {
                return Err(self.invalid(op, ranks, format!("root {root} is not a member")));
            }
            Kind::Broadcast(root) if root == self.rank => (true, vec![]),
            Kind::Broadcast(root) => (false, vec![root]),
            _ => (
                true,
                ranks.iter().copied().filter(|&r| r != self.rank).collect(),
            ),
        };
        if send {
            for &peer in ranks.iter().filter(|&&r| r != self.rank) {
                self.send_frame(op, ranks, peer, (FrameKind::Data, code, gid, seq), &payload)?;
            }
        }
        let keys: Vec<Key> = expect.iter().map(|&r| (r, gid, seq)).collect();
        let got = self.wait_within(op, ranks, &keys, timeout)?;
        let mut inputs: Vec<Option<Tensor>> = vec![None; ranks.len()];
        for (&src, (their_code, their)) in expect.iter().zip(got) {
            let mismatch = |what: String| {
                self.invalid(
                    op,
                    ranks,
                    format!("rank {src} does not match this call: {what}"),
                )
            };
            if their_code != code || their.get(..8) != Some(&payload[..8]) {
                return Err(mismatch(
                    "it made a different collective or passed another parameter".into(),
                ));
            }
            let own = t.map(|t| (t.dtype(), t.shape().clone()));
            let theirs = signature(&their[8..]).map(|(d, s, _)| (d, s));
            if own != theirs {
                return Err(mismatch(format!("it passed {theirs:?}, this rank {own:?}")));
            }
            if let (Some(t), Some(i)) = (t, group.index_of(src)) {
                inputs[i] = Some(decode(&their[8..], t.device())?);
            }
        }
        let Some(t) = t else {
            return Ok(None);
        };
        inputs[me] = Some(t.detach());
        let inputs: Vec<Tensor> = inputs
            .into_iter()
            .map(|x| x.unwrap_or_else(|| t.detach()))
            .collect();
        let mut out =
            compute(kind, group, inputs).map_err(|e| self.invalid(op, ranks, e.to_string()))?;
        match out.get_mut(me).and_then(Option::take) {
            Some(r) => Ok(Some(r)),
            None => Err(self.invalid(op, ranks, "no result".into())),
        }
    }

    pub(super) fn tensor_op(&self, group: &Group, kind: Kind, t: &Tensor) -> Result<Tensor> {
        self.collective(group, kind, Some(t))?
            .ok_or_else(|| self.invalid(kind.name(), group.ranks(), "internal: no result".into()))
    }
}
