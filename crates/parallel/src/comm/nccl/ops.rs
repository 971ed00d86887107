//! The operations of [`NcclComm`]: collectives (with or without the single-member shortcut),
//! point-to-point transfers and the one-GPU self-check.

use std::sync::Arc;
use std::time::Instant;

use candle_core::cuda::cudarc::nccl::{result as nc, sys};
use candle_core::{DType, Device, Shape, Tensor};

use crate::comm::Result;

use super::layout::CommKey;
use super::raw::{alloc, cuda_err, device_addr};
use super::state::PendingOp;
use super::{fresh, NcclComm, Order};
use crate::comm::flat::{gathered, scatter_input};
use crate::comm::thread::CommThread;
use crate::comm::{
    all_to_all_p2p, check_all_to_all, check_send_recv, Group, HandOff, ReduceOp, Transfer,
};

/// The collectives; `copy_single`: answer single-member groups with a copy, without NCCL.
impl NcclComm {
    /// Runs `x` through NCCL's all-reduce (sum, then max), all-gather and reduce-scatter (along
    /// the last dimension) and broadcast, then a barrier, on the group of this rank alone — a
    /// one-rank NCCL communicator, which the [`Comm`](crate::comm::Comm) methods skip (they
    /// copy for single-member groups) — and returns the result, equal to `x` when NCCL works.
    /// For `pretrain selftest` on a single GPU: it exercises the store rendezvous, communicator
    /// creation, every collective's launch and the bounded waits (not send/recv: two GPUs).
    ///
    /// Then the in-place forms on a copy of the result: from this thread with a hand-off mark,
    /// and on a communication thread (as the data-parallel reductions run) with a mark taken
    /// before the hand-over and without one.
    pub fn self_check(self: &Arc<Self>, x: &Tensor) -> Result<Tensor> {
        let me = Group::new(vec![self.shared.rank]);
        let dim = x.rank().saturating_sub(1);
        let y = self.all_reduce_in(&me, x, ReduceOp::Sum, false)?;
        let y = self.all_reduce_in(&me, &y, ReduceOp::Max, false)?;
        let y = self.all_gather_in(&me, &y, dim, false)?;
        let y = self.reduce_scatter_in(&me, &y, dim, false)?;
        let y = self.broadcast_in(&me, &y, self.shared.rank, false)?;
        self.barrier_in(&me, false, self.shared.timeout)?;
        let z = y.flatten_all()?.copy()?;
        let mark = self.mark()?;
        self.all_reduce_in_place_in(&me, &z, ReduceOp::Sum, &mark, false)?;
        let thread = CommThread::new(format!("nccl-self-check-{}", self.shared.rank))?;
        let after = self.mark()?;
        let (comm, group, w) = (self.clone(), me.clone(), z.clone());
        let z = thread
            .submit(move || {
                let part = comm.reduce_scatter_in_place_in(&group, &w, &after, false)?;
                comm.all_gather_in_place_in(&group, &part, &after, false)?;
                comm.all_reduce_in_place_in(&group, &w, ReduceOp::Max, &HandOff::none(), false)?;
                Ok(w)
            })?
            .wait()?;
        Ok(z.reshape(y.shape())?)
    }

    pub(super) fn all_reduce_in(
        &self,
        group: &Group,
        t: &Tensor,
        op: ReduceOp,
        copy_single: bool,
    ) -> Result<Tensor> {
        let call = self.begin("all_reduce", group)?;
        if copy_single && group.size() == 1 {
            return fresh(t);
        }
        self.check_tensor(&call, t)?;
        let red = match op {
            ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
            ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        };
        let (n, key) = (t.elem_count(), CommKey::Group(group.clone()));
        self.run(
            &call,
            key,
            Some(t),
            t.shape().clone(),
            t.dtype(),
            Order::Stream,
            |l| unsafe {
                // SAFETY: both buffers hold `n` elements of `l.dtype` on this device.
                nc::all_reduce(l.send, l.recv, n, l.dtype, red, l.comm, l.stream)
            },
        )
    }

    pub(super) fn all_gather_in(
        &self,
        group: &Group,
        t: &Tensor,
        dim: usize,
        copy_single: bool,
    ) -> Result<Tensor> {
        let call = self.begin("all_gather", group)?;
        if dim >= t.rank() {
            let msg = format!("dim {dim} out of range for shape {:?}", t.shape());
            return Err(call.invalid(msg));
        }
        if copy_single && group.size() == 1 {
            return fresh(t);
        }
        self.check_tensor(&call, t)?;
        let (n, count) = (group.size(), t.elem_count());
        let key = CommKey::Group(group.clone());
        let flat = self.run(
            &call,
            key,
            Some(t),
            (n * count,).into(),
            t.dtype(),
            Order::Stream,
            |l| unsafe {
                // SAFETY: the send buffer holds `count` elements, the receive buffer `n * count`.
                nc::all_gather(l.send, l.recv, count, l.dtype, l.comm, l.stream)
            },
        )?;
        Ok(gathered(&flat, t.dims(), n, dim)?)
    }

    pub(super) fn reduce_scatter_in(
        &self,
        group: &Group,
        t: &Tensor,
        dim: usize,
        copy_single: bool,
    ) -> Result<Tensor> {
        let call = self.begin("reduce_scatter", group)?;
        let n = group.size();
        if dim >= t.rank() || !t.dims()[dim].is_multiple_of(n) {
            let msg = format!("cannot cut {:?} along dim {dim} into {n} chunks", t.shape());
            return Err(call.invalid(msg));
        }
        if copy_single && n == 1 {
            return fresh(t);
        }
        self.check_tensor(&call, t)?;
        let arranged = scatter_input(t, n, dim)?;
        let mut dims = t.dims().to_vec();
        dims[dim] /= n;
        let count = t.elem_count() / n;
        let key = CommKey::Group(group.clone());
        self.run(
            &call,
            key,
            Some(&arranged),
            dims.into(),
            t.dtype(),
            Order::Stream,
            |l| unsafe {
                // SAFETY: the send buffer holds `n * count` elements, the receive buffer `count`.
                let sum = sys::ncclRedOp_t::ncclSum;
                nc::reduce_scatter(l.send, l.recv, count, l.dtype, sum, l.comm, l.stream)
            },
        )
    }

    pub(super) fn broadcast_in(
        &self,
        group: &Group,
        t: &Tensor,
        root: usize,
        copy_single: bool,
    ) -> Result<Tensor> {
        let call = self.begin("broadcast", group)?;
        let Some(root_index) = group.index_of(root) else {
            let msg = format!("root {root} is not a member of the group");
            return Err(call.invalid(msg));
        };
        if copy_single && group.size() == 1 {
            return fresh(t);
        }
        self.check_tensor(&call, t)?;
        let input = (root == self.shared.rank).then_some(t);
        let (n, key) = (t.elem_count(), CommKey::Group(group.clone()));
        self.run(
            &call,
            key,
            input,
            t.shape().clone(),
            t.dtype(),
            Order::Stream,
            |l| unsafe {
                // SAFETY: `n` elements each; NCCL reads the send buffer on the root only.
                nc::broadcast(
                    l.send,
                    l.recv,
                    n,
                    l.dtype,
                    root_index as i32,
                    l.comm,
                    l.stream,
                )
            },
        )
    }

    /// A barrier over `group`, waited for on the host up to `timeout`.
    pub(super) fn barrier_in(
        &self,
        group: &Group,
        copy_single: bool,
        timeout: std::time::Duration,
    ) -> Result<()> {
        let call = self.begin("barrier", group)?;
        if copy_single && group.size() == 1 {
            return Ok(());
        }
        let one = Tensor::zeros(1, DType::F32, &Device::Cuda(self.shared.device.clone()))?;
        let key = CommKey::Group(group.clone());
        self.run(
            &call,
            key,
            Some(&one),
            (1,).into(),
            DType::F32,
            Order::Wait(timeout),
            |l| unsafe {
                // SAFETY: one f32 in each buffer.
                let sum = sys::ncclRedOp_t::ncclSum;
                nc::all_reduce(l.send, l.recv, 1, l.dtype, sum, l.comm, l.stream)
            },
        )
        .map(|_| ())
    }

    /// [`Comm::all_to_all`](crate::comm::Comm::all_to_all): one NCCL group of a send and a
    /// receive per member with rows to exchange, on the group's all-to-all communicator (also
    /// when this rank sends or receives no rows: its buffers are then one placeholder row).
    pub(super) fn all_to_all_in(
        &self,
        group: &Group,
        t: &Tensor,
        send: &[usize],
        recv: &[usize],
    ) -> Result<Tensor> {
        let call = self.begin("all_to_all", group)?;
        let rows = t.dim(0)?;
        check_all_to_all(self.shared.rank, group, rows, send, recv)?;
        let received: usize = recv.iter().sum();
        if group.size() == 1 {
            return all_to_all_p2p(self, group, t, send, recv);
        }
        self.check_tensor(&call, t)?;
        let mut dims = t.dims().to_vec();
        let input = if rows == 0 {
            dims[0] = 1;
            Tensor::zeros(dims.as_slice(), t.dtype(), t.device())?
        } else {
            t.clone()
        };
        let row_elems: usize = t.dims()[1..].iter().product();
        let bytes = row_elems * t.dtype().size_in_bytes();
        let starts = |counts: &[usize]| -> Vec<usize> {
            counts
                .iter()
                .scan(0, |at, &c| {
                    let s = *at;
                    *at += c;
                    Some(s)
                })
                .collect()
        };
        let (send_at, recv_at) = (starts(send), starts(recv));
        dims[0] = received.max(1);
        let key = CommKey::AllToAll(group.clone());
        let out = self.run(
            &call,
            key,
            Some(&input),
            dims.into(),
            t.dtype(),
            Order::Stream,
            |l| {
                nc::group_start()?;
                let mut r = Ok(nc::NcclStatus::Success);
                for (j, (&s, &rc)) in send.iter().zip(recv).enumerate() {
                    let peer = j as i32;
                    if s > 0 && r.is_ok() {
                        // SAFETY: rows `send_at[j] ..+ s` lie inside the send buffer.
                        let at = unsafe { l.send.byte_add(send_at[j] * bytes) };
                        r = unsafe { nc::send(at, s * row_elems, l.dtype, peer, l.comm, l.stream) };
                    }
                    if rc > 0 && r.is_ok() {
                        // SAFETY: rows `recv_at[j] ..+ rc` lie inside the receive buffer.
                        let at = unsafe { l.recv.byte_add(recv_at[j] * bytes) };
                        r = unsafe {
                            nc::recv(at, rc * row_elems, l.dtype, peer, l.comm, l.stream)
                        };
                    }
                }
                // The group is always closed, also after a failed enqueue.
                let end = nc::group_end();
                r.and(end)
            },
        )?;
        Ok(out.narrow(0, 0, received)?)
    }

    /// [`Comm::send`](crate::comm::Comm::send).
    pub(super) fn send_to(&self, t: &Tensor, dst: usize) -> Result<()> {
        let sh = &self.shared;
        let call = self.call("send", vec![sh.rank, dst], vec![dst]);
        if dst >= sh.world_size || dst == sh.rank {
            let msg = format!("cannot send to rank {dst} (job of {} ranks)", sh.world_size);
            return Err(call.invalid(msg));
        }
        self.start(&call)?;
        let nccl_type = self.check_tensor(&call, t)?;
        let key = CommKey::P2p { src: sh.rank, dst };
        let comm = sh.comm(&call, &key)?;
        // A copy (on the device's stream), so that later in-place updates of `t` are not seen by
        // `dst`; the send runs on the direction communicator's stream, after the copy.
        let data = fresh(t)?;
        let addr = device_addr(&data, &sh.stream)? as *const _;
        self.follow_device(&comm)?;
        let comm_stream = comm.stream();
        let (count, cu_stream) = (
            data.elem_count(),
            comm_stream.cu_stream() as sys::cudaStream_t,
        );
        self.enqueue(&call, &comm, &[&data], |c| unsafe {
            // SAFETY: `data` holds `count` elements and is kept until the send completes.
            nc::send(addr, count, nccl_type, 1, c, cu_stream)
        })?;
        let done = comm_stream
            .record_event(None)
            .map_err(|e| cuda_err("event", e))?;
        let pending = PendingOp {
            done,
            _data: vec![data],
            key,
            op: "send",
            group: vec![sh.rank, dst],
            peers: vec![dst],
            since: Instant::now(),
        };
        sh.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(pending);
        Ok(())
    }

    /// [`Comm::recv`](crate::comm::Comm::recv).
    pub(super) fn recv_from(&self, src: usize, shape: &Shape, dtype: DType) -> Result<Tensor> {
        let sh = &self.shared;
        let call = self.call("recv", vec![src, sh.rank], vec![src]);
        if src >= sh.world_size || src == sh.rank {
            let msg = format!(
                "cannot receive from rank {src} (job of {} ranks)",
                sh.world_size
            );
            return Err(call.invalid(msg));
        }
        self.start(&call)?;
        let key = CommKey::P2p { src, dst: sh.rank };
        let count = shape.elem_count();
        self.run(
            &call,
            key,
            None,
            shape.clone(),
            dtype,
            Order::Stream,
            |l| unsafe {
                // SAFETY: the receive buffer holds `count` elements of `l.dtype`.
                nc::recv(l.recv, count, l.dtype, 0, l.comm, l.stream)
            },
        )
    }
}

/// The grouped transfer of a ring and the connection of a point-to-point direction.
impl NcclComm {
    /// [`Comm::send_recv`](crate::comm::Comm::send_recv): one NCCL group of a send to `dst` and
    /// a receive from `src` on the group's ring communicator (so both connect together), ordered after
    /// the device stream's work so far. The device stream is not made to wait here: the returned
    /// transfer does that when waited for, so the kernels queued in between overlap it. The
    /// pending list holds both buffers until the operation is done, also when the transfer is
    /// dropped unwaited.
    pub(super) fn send_recv_in(
        &self,
        group: &Group,
        t: &Tensor,
        dst: usize,
        src: usize,
    ) -> Result<Transfer> {
        let sh = &self.shared;
        let call = self.begin("send_recv", group)?;
        check_send_recv(sh.rank, group, dst, src)?;
        let nccl_type = self.check_tensor(&call, t)?;
        let member = |r: usize| group.index_of(r).map_or(0, |i| i as i32);
        let (to, from) = (member(dst), member(src));
        let key = CommKey::Ring(group.clone());
        let comm = sh.comm(&call, &key)?;
        let data = t.contiguous()?;
        let out = alloc(&sh.device, t.shape().clone(), t.dtype())?;
        let send = device_addr(&data, &sh.stream)? as *const std::ffi::c_void;
        let recv = device_addr(&out, &sh.stream)? as *mut std::ffi::c_void;
        self.follow_device(&comm)?;
        let comm_stream = comm.stream();
        let cu_stream = comm_stream.cu_stream() as sys::cudaStream_t;
        let n = data.elem_count();
        self.enqueue(&call, &comm, &[&data, &out], |c| {
            nc::group_start()?;
            // SAFETY: both buffers hold `n` elements of `nccl_type` on this device and are kept
            // (by the pending list) until the operation is done.
            let r = unsafe { nc::send(send, n, nccl_type, to, c, cu_stream) }
                .and_then(|_| unsafe { nc::recv(recv, n, nccl_type, from, c, cu_stream) });
            // The group is always closed, also after a failed enqueue.
            let end = nc::group_end();
            r.and(end)
        })?;
        let event = || {
            comm_stream
                .record_event(None)
                .map_err(|e| cuda_err("event", e))
        };
        let (done, arrived) = (event()?, event()?);
        let mut peers = vec![dst, src];
        peers.dedup();
        let pending = PendingOp {
            done,
            _data: vec![data, out.clone()],
            key,
            op: "send_recv",
            group: call.group.clone(),
            peers,
            since: Instant::now(),
        };
        sh.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(pending);
        let shared = sh.clone();
        Ok(Transfer::new(move || {
            if let Some((failed, reason)) = shared.failure() {
                return Err(call.peer_failed(failed, reason));
            }
            let ctx = shared.stream.context();
            ctx.bind_to_thread().map_err(|e| cuda_err("bind", e))?;
            shared
                .stream
                .wait(&arrived)
                .map_err(|e| cuda_err("stream wait", e))?;
            Ok(out)
        }))
    }
}
