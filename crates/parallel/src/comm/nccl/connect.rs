//! Connecting a communicator's point-to-point directions at `prepare`, before any step: NCCL
//! connects a direction at its first send and receive, each waiting for the other, and
//! allocates the connection's buffers then.

use candle_core::cuda::cudarc::nccl::{result as nc, sys};
use candle_core::{DType, Device, Tensor};

use super::layout::CommKey;
use super::raw::{cuda_err, device_addr, RawComm};
use super::state::Call;
use super::{keep_forever, NcclComm};
use crate::comm::{Group, Result};

impl NcclComm {
    /// Connects the point-to-point directions of a ring's or an all-to-all's communicator now,
    /// as `prepare` does after creating it: one byte goes around the ring (as its hops go: to
    /// the next member, from the previous one), or one byte to and from every member. Every
    /// member walks the same channel list, so all get here together, and an operation's launch
    /// settles its connections before it returns (bounded by the communicator's timeout);
    /// NCCL's connection buffers are then allocated before the first step, not inside it. The
    /// bytes themselves are left to arrive in stream order, as any operation's do.
    pub(super) fn warm_up(&self, key: &CommKey, group: &Group) -> Result<()> {
        let sh = &self.shared;
        let n = group.size();
        let dev = Device::Cuda(sh.device.clone());
        match key {
            CommKey::Ring(_) => {
                let i = group.index_of(sh.rank).unwrap_or(0);
                let ranks = group.ranks();
                let (next, prev) = (ranks[(i + 1) % n], ranks[(i + n - 1) % n]);
                let byte = Tensor::zeros(1, DType::U8, &dev)?;
                self.send_recv_in(group, &byte, next, prev)?.wait()?;
            }
            CommKey::AllToAll(_) => {
                let bytes = Tensor::zeros((n, 1), DType::U8, &dev)?; // [n, 1]
                let ones = vec![1; n];
                self.all_to_all_in(group, &bytes, &ones, &ones)?;
            }
            CommKey::Group(_) | CommKey::P2p { .. } => {}
        }
        Ok(())
    }

    /// Connects a point-to-point direction now, as `prepare` does after creating its
    /// communicator: NCCL connects a direction at its first send and receive, each waiting for
    /// the other, so one byte goes from the sender (`sender`: this rank) to the receiver and the
    /// host waits for it. Every rank walks the same channel list, so both ends get here; no step
    /// then connects (or allocates the connection's buffers).
    pub(super) fn connect(&self, call: &Call, comm: &RawComm, sender: bool) -> Result<()> {
        let sh = &self.shared;
        let byte = Tensor::zeros(1, DType::U8, &Device::Cuda(sh.device.clone()))?;
        let addr = device_addr(&byte, &sh.stream)?;
        self.follow_device(comm)?;
        let comm_stream = comm.stream();
        let cu_stream = comm_stream.cu_stream() as sys::cudaStream_t;
        let u8_type = sys::ncclDataType_t::ncclUint8;
        self.enqueue(call, comm, &[&byte], |c| unsafe {
            // SAFETY: `byte` holds one u8 on this device and is kept until the wait below.
            if sender {
                nc::send(addr as *const _, 1, u8_type, 1, c, cu_stream)
            } else {
                nc::recv(addr as *mut _, 1, u8_type, 0, c, cu_stream)
            }
        })?;
        let done = comm_stream
            .record_event(None)
            .map_err(|e| cuda_err("event", e))?;
        sh.wait_event(call, &done, comm, sh.timeout)
            .inspect_err(|_| keep_forever(&[&byte]))
    }
}
