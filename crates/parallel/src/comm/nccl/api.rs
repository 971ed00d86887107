//! The [`Comm`] interface of [`NcclComm`]: host tensors staged on the GPU, every collective (in
//! place too), point-to-point transfer and barrier, hand-off marks, communicator preparation,
//! and abort.

use candle_core::{DType, Device, Shape, Tensor};

use crate::comm::Result;

use super::layout::CommKey;
use super::NcclComm;
use crate::comm::in_place::through_copies;
use crate::comm::{Channel, Comm, Group, HandOff, ReduceOp, Transfer};

/// Runs `f` (operation `op` on `group`) on `t` where NCCL can reach it: a host tensor (small
/// scalars the trainer reduces on the CPU) is staged on this rank's GPU and the result brought
/// back to the host. Bringing it back waits for the device stream, hence for the operation; an
/// operation the watchdog aborted meanwhile completes with a meaningless result, so a failure of
/// the job by then is this call's error.
fn staged(
    comm: &NcclComm,
    op: &'static str,
    group: &Group,
    t: &Tensor,
    f: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    if t.device().is_cuda() {
        return f(t);
    }
    let gpu = Device::Cuda(comm.shared.device.clone());
    let out = f(&t.to_device(&gpu)?)?.to_device(t.device())?;
    if let Some((failed, reason)) = comm.shared.failure() {
        let call = comm.call(op, group.ranks().to_vec(), vec![]);
        return Err(call.peer_failed(failed, reason));
    }
    Ok(out)
}

impl Comm for NcclComm {
    fn rank(&self) -> usize {
        self.shared.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn all_reduce(&self, group: &Group, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        staged(self, "all_reduce", group, t, |t| {
            self.all_reduce_in(group, t, op, true)
        })
    }

    fn all_gather(&self, group: &Group, t: &Tensor, dim: usize) -> Result<Tensor> {
        staged(self, "all_gather", group, t, |t| {
            self.all_gather_in(group, t, dim, true)
        })
    }

    fn reduce_scatter(&self, group: &Group, t: &Tensor, dim: usize) -> Result<Tensor> {
        staged(self, "reduce_scatter", group, t, |t| {
            self.reduce_scatter_in(group, t, dim, true)
        })
    }

    fn broadcast(&self, group: &Group, t: &Tensor, root: usize) -> Result<Tensor> {
        staged(self, "broadcast", group, t, |t| {
            self.broadcast_in(group, t, root, true)
        })
    }

    fn all_to_all(
        &self,
        group: &Group,
        t: &Tensor,
        send: &[usize],
        recv: &[usize],
    ) -> Result<Tensor> {
        staged(self, "all_to_all", group, t, |t| {
            self.all_to_all_in(group, t, send, recv)
        })
    }

    /// Host tensors are staged on the GPU; the receiver gets a GPU tensor.
    fn send(&self, t: &Tensor, dst: usize) -> Result<()> {
        if t.device().is_cuda() {
            self.send_to(t, dst)
        } else {
            self.send_to(
                &t.to_device(&Device::Cuda(self.shared.device.clone()))?,
                dst,
            )
        }
    }

    /// The tensor arrives on this rank's GPU.
    fn recv(&self, src: usize, shape: &Shape, dtype: DType) -> Result<Tensor> {
        self.recv_from(src, shape, dtype)
    }

    fn barrier(&self, group: &Group) -> Result<()> {
        self.barrier_in(group, true, self.shared.timeout)
    }

    fn barrier_within(&self, group: &Group, timeout: std::time::Duration) -> Result<()> {
        self.barrier_in(group, true, timeout)
    }

    /// One NCCL group on the group's communicator; host tensors are staged on the GPU.
    fn send_recv(&self, group: &Group, t: &Tensor, dst: usize, src: usize) -> Result<Transfer> {
        if t.device().is_cuda() {
            self.send_recv_in(group, t, dst, src)
        } else {
            let t = t.to_device(&Device::Cuda(self.shared.device.clone()))?;
            self.send_recv_in(group, &t, dst, src)
        }
    }

    /// A CUDA event recorded on the device stream now.
    fn hand_off(&self) -> Result<HandOff> {
        self.mark()
    }

    /// NCCL's in-place all-reduce for CUDA tensors (host tensors go through copies).
    fn all_reduce_in_place(
        &self,
        group: &Group,
        t: &Tensor,
        op: ReduceOp,
        after: &HandOff,
    ) -> Result<()> {
        if !t.device().is_cuda() {
            return through_copies::all_reduce(self, group, t, op);
        }
        self.all_reduce_in_place_in(group, t, op, after, true)
    }

    /// NCCL's in-place reduce-scatter for CUDA tensors (host tensors go through copies).
    fn reduce_scatter_in_place(
        &self,
        group: &Group,
        t: &Tensor,
        after: &HandOff,
    ) -> Result<Tensor> {
        if !t.device().is_cuda() {
            return through_copies::reduce_scatter(self, group, t);
        }
        self.reduce_scatter_in_place_in(group, t, after, true)
    }

    /// NCCL's in-place all-gather for CUDA tensors (host tensors go through copies).
    fn all_gather_in_place(&self, group: &Group, t: &Tensor, after: &HandOff) -> Result<()> {
        if !t.device().is_cuda() {
            return through_copies::all_gather(self, group, t);
        }
        self.all_gather_in_place_in(group, t, after, true)
    }

    /// Creates the communicator of every channel with this rank and another member, in order
    /// (single-member groups never use one), and connects each point-to-point direction (see
    /// [`NcclComm::connect`]) and each ring's and all-to-all's ([`NcclComm::warm_up`]).
    fn prepare(&self, channels: &[Channel]) -> Result<()> {
        let me = self.shared.rank;
        for channel in channels.iter().filter(|c| c.includes(me)) {
            let key = match channel {
                Channel::Group(g) if g.size() > 1 => CommKey::Group(g.clone()),
                Channel::AllToAll(g) if g.size() > 1 => CommKey::AllToAll(g.clone()),
                Channel::Ring(g) if g.size() > 1 => CommKey::Ring(g.clone()),
                Channel::P2p { src, dst } if src != dst => CommKey::P2p {
                    src: *src,
                    dst: *dst,
                },
                _ => continue,
            };
            let members = key.members();
            let others = members.iter().copied().filter(|&r| r != me).collect();
            let call = self.call("prepare", members, others);
            self.start(&call)?;
            let comm = self.shared.comm(&call, &key)?;
            match &key {
                CommKey::P2p { src, .. } => self.connect(&call, &comm, *src == me)?,
                CommKey::Ring(g) | CommKey::AllToAll(g) => self.warm_up(&key, g)?,
                CommKey::Group(_) => {}
            }
        }
        Ok(())
    }

    fn abort(&self, reason: &str) {
        let (failed, reason) = self.shared.publish_abort(reason);
        self.shared.fail(failed, reason);
    }
}
