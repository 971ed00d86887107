//! The in-place collectives of [`NcclComm`] (see `comm::in_place`): NCCL's own in-place forms
//! (the send buffer is the receive buffer, or lies inside it at this member's chunk), ordered
//! after a hand-off mark, a CUDA event recorded on the device stream by the thread that handed
//! the tensor over, rather than after all the device work queued when they are issued. They
//! copy nothing and allocate nothing on the device stream, which is what lets them start from
//! the mark: the tensor's memory was allocated, and its contents written, before it.

use candle_core::cuda::cudarc::driver::CudaEvent;
use candle_core::cuda::cudarc::nccl::{result as nc, sys};
use candle_core::Tensor;

use crate::comm::Result;

use super::layout::CommKey;
use super::raw::{cuda_err, device_addr, Buffers, Launch};
use super::state::Call;
use super::{NcclComm, Order};
use crate::comm::in_place::{chunk_of, HandOff};
use crate::comm::{Group, ReduceOp};

impl NcclComm {
    /// A mark of the work queued so far on the device's stream.
    pub(super) fn mark(&self) -> Result<HandOff> {
        Ok(HandOff::new(self.device_mark()?))
    }

    /// [`Comm::all_reduce_in_place`](crate::comm::Comm::all_reduce_in_place) of a CUDA tensor;
    /// `copy_single`: a single-member group is left as it is, without NCCL.
    pub(super) fn all_reduce_in_place_in(
        &self,
        group: &Group,
        t: &Tensor,
        op: ReduceOp,
        after: &HandOff,
        copy_single: bool,
    ) -> Result<()> {
        let call = self.begin("all_reduce", group)?;
        if copy_single && group.size() == 1 {
            return Ok(());
        }
        contiguous(&call, t)?;
        let red = match op {
            ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
            ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        };
        let n = t.elem_count();
        self.run_in_place(&call, group, t, after, (0, 0), |l| unsafe {
            // SAFETY: one buffer of `n` elements of `l.dtype`, read and written in place.
            nc::all_reduce(l.send, l.recv, n, l.dtype, red, l.comm, l.stream)
        })
    }

    /// [`Comm::reduce_scatter_in_place`](crate::comm::Comm::reduce_scatter_in_place) of a CUDA
    /// tensor (`copy_single` as for [`NcclComm::all_reduce_in_place_in`]).
    pub(super) fn reduce_scatter_in_place_in(
        &self,
        group: &Group,
        t: &Tensor,
        after: &HandOff,
        copy_single: bool,
    ) -> Result<Tensor> {
        let call = self.begin("reduce_scatter", group)?;
        let (me, chunk) = chunk_of(self, "reduce_scatter", group, t)?;
        if copy_single && group.size() == 1 {
            return Ok(t.narrow(0, 0, chunk)?);
        }
        let count = t.elem_count() / group.size();
        let at = me * count * t.dtype().size_in_bytes();
        // NCCL's in-place form: the receive buffer is this member's chunk of the send buffer.
        self.run_in_place(&call, group, t, after, (0, at), |l| unsafe {
            // SAFETY: the send buffer holds `n * count` elements, the receive buffer (inside
            // it) `count`.
            let sum = sys::ncclRedOp_t::ncclSum;
            nc::reduce_scatter(l.send, l.recv, count, l.dtype, sum, l.comm, l.stream)
        })?;
        Ok(t.narrow(0, me * chunk, chunk)?)
    }

    /// [`Comm::all_gather_in_place`](crate::comm::Comm::all_gather_in_place) of a CUDA tensor
    /// (`copy_single` as for [`NcclComm::all_reduce_in_place_in`]).
    pub(super) fn all_gather_in_place_in(
        &self,
        group: &Group,
        t: &Tensor,
        after: &HandOff,
        copy_single: bool,
    ) -> Result<()> {
        let call = self.begin("all_gather", group)?;
        let (me, _) = chunk_of(self, "all_gather", group, t)?;
        if copy_single && group.size() == 1 {
            return Ok(());
        }
        let count = t.elem_count() / group.size();
        let at = me * count * t.dtype().size_in_bytes();
        // NCCL's in-place form: the send buffer is this member's chunk of the receive buffer.
        self.run_in_place(&call, group, t, after, (at, 0), |l| unsafe {
            // SAFETY: the send buffer (inside the receive buffer) holds `count` elements, the
            // receive buffer `n * count`.
            nc::all_gather(l.send, l.recv, count, l.dtype, l.comm, l.stream)
        })
    }

    /// Runs one in-place operation on `t` (send and receive buffers at the byte offsets
    /// `(send, recv)` into it) on `group`'s communicator stream, after `after` (or, without a
    /// mark, after all work queued on the device stream). Its completion is ordered as
    /// `Order::Stream` says: the calling thread waits for it on a communication thread (where
    /// the data-parallel reductions run), the device stream does on a compute thread.
    fn run_in_place(
        &self,
        call: &Call,
        group: &Group,
        t: &Tensor,
        after: &HandOff,
        (send, recv): (usize, usize),
        launch: impl FnOnce(&Launch) -> std::result::Result<nc::NcclStatus, nc::NcclError>,
    ) -> Result<()> {
        let sh = &self.shared;
        let dtype = self.check_tensor(call, t)?;
        let key = CommKey::Group(group.clone());
        let comm = sh.comm(call, &key)?;
        let base = device_addr(t, &sh.stream)? as usize;
        let buffers = Buffers {
            send: (base + send) as *const _,
            recv: (base + recv) as *mut _,
            dtype,
        };
        match after.get::<CudaEvent>() {
            Some(mark) => comm
                .stream()
                .wait(mark)
                .map_err(|e| cuda_err("stream wait", e))?,
            None => self.follow_device(&comm)?,
        }
        self.issue(call, key, &comm, Order::Stream, &[t], buffers, launch)
    }
}

/// In place needs the tensor's own, contiguous memory.
fn contiguous(call: &Call, t: &Tensor) -> Result<()> {
    if t.is_contiguous() {
        return Ok(());
    }
    let msg = format!("in place needs a contiguous tensor, not {:?}", t.layout());
    Err(call.invalid(msg))
}
