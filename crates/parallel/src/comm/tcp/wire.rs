//! The wire format of the `tcp` backend: frames between two ranks and the tensor encoding.
//!
//! A frame (little-endian) is a 26-byte header `kind u8, op u8, group u64, seq u64, len u64`
//! followed by `len` payload bytes. `kind` is one of [`Frame`]'s variants; `group` identifies the group of a
//! collective (0 for point-to-point), `seq` counts the calls on it. A tensor payload is
//! `dtype u8, rank u8, dims u64 × rank` then the raw little-endian elements.

use std::io::{Read, Write};

use candle_core::{DType, Device, Result, Shape, Tensor};

/// Largest payload a peer may announce (a bound against corrupted or hostile headers; tensors
/// of one collective are far smaller).
pub const MAX_PAYLOAD: u64 = 1 << 36;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// First frame of a connection: `payload` = the job token, `seq` = the sender's rank.
    Hello = 1,
    /// A collective's contribution or a point-to-point tensor.
    Data = 2,
    /// The sender declares the job failed: `seq` = the failed rank, payload = the reason.
    Abort = 3,
    /// The sender closes the connection in an orderly way.
    Bye = 4,
}

/// One received frame.
#[derive(Debug)]
pub struct Frame {
    /// Kind of frame.
    pub kind: FrameKind,
    /// Operation code of a `Data` frame (see `Kind` codes in the backend).
    pub op: u8,
    /// Group identifier (0: point-to-point).
    pub group: u64,
    /// Call sequence number (or rank for `Hello` and `Abort`).
    pub seq: u64,
    /// Payload bytes.
    pub payload: Vec<u8>,
}

/// Writes one frame.
pub fn write_frame(
    w: &mut impl Write,
    kind: FrameKind,
    op: u8,
    group: u64,
    seq: u64,
    payload: &[u8],
) -> std::io::Result<()> {
    let mut header = [0u8; 26];
    header[0] = kind as u8;
    header[1] = op;
    header[2..10].copy_from_slice(&group.to_le_bytes());
    header[10..18].copy_from_slice(&seq.to_le_bytes());
    header[18..26].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    w.write_all(&header)?;
    w.write_all(payload)?;
    w.flush()
}

/// Reads one frame; errors on an unknown kind or an oversized payload.
pub fn read_frame(r: &mut impl Read) -> std::io::Result<Frame> {
    read_frame_bounded(r, MAX_PAYLOAD)
}

/// Reads one frame whose payload may be at most `max` bytes (checked before allocating).
pub fn read_frame_bounded(r: &mut impl Read, max: u64) -> std::io::Result<Frame> {
    let mut header = [0u8; 26];
    r.read_exact(&mut header)?;
    let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
    let kind = match header[0] {
        1 => FrameKind::Hello,
        2 => FrameKind::Data,
        3 => FrameKind::Abort,
        4 => FrameKind::Bye,
        k => return Err(bad(format!("unknown frame kind {k}"))),
    };
    let word = |i: usize| u64::from_le_bytes(header[i..i + 8].try_into().unwrap_or([0; 8]));
    let len = word(18);
    if len > max {
        return Err(bad(format!("frame payload of {len} bytes exceeds {max}")));
    }
    let mut payload = vec![0u8; len as usize];
    r.read_exact(&mut payload)?;
    Ok(Frame {
        kind,
        op: header[1],
        group: word(2),
        seq: word(10),
        payload,
    })
}

fn dtype_code(dtype: DType) -> Result<u8> {
    Ok(match dtype {
        DType::U8 => 1,
        DType::U32 => 2,
        DType::I64 => 3,
        DType::BF16 => 4,
        DType::F16 => 5,
        DType::F32 => 6,
        DType::F64 => 7,
        d => candle_core::bail!("tcp backend: cannot send tensors of dtype {d:?}"),
    })
}

fn code_dtype(code: u8) -> Option<DType> {
    Some(match code {
        1 => DType::U8,
        2 => DType::U32,
        3 => DType::I64,
        4 => DType::BF16,
        5 => DType::F16,
        6 => DType::F32,
        7 => DType::F64,
        _ => return None,
    })
}

/// `t`'s dtype, shape and elements as a payload.
pub fn encode(t: &Tensor) -> Result<Vec<u8>> {
    let dims = t.dims();
    let mut out =
        Vec::with_capacity(2 + 8 * dims.len() + t.elem_count() * t.dtype().size_in_bytes());
    out.push(dtype_code(t.dtype())?);
    out.push(dims.len() as u8);
    for &d in dims {
        out.extend_from_slice(&(d as u64).to_le_bytes());
    }
    t.contiguous()?.write_bytes(&mut out)?;
    Ok(out)
}

/// The dtype and shape a payload announces, and where its elements start.
pub fn signature(payload: &[u8]) -> Option<(DType, Shape, usize)> {
    let dtype = code_dtype(*payload.first()?)?;
    let rank = *payload.get(1)? as usize;
    let mut dims = Vec::with_capacity(rank);
    for i in 0..rank {
        let at = 2 + 8 * i;
        dims.push(u64::from_le_bytes(payload.get(at..at + 8)?.try_into().ok()?) as usize);
    }
    Some((dtype, Shape::from(dims), 2 + 8 * rank))
}

/// The tensor of a payload, on `device`; errors if the payload is malformed.
pub fn decode(payload: &[u8], device: &Device) -> Result<Tensor> {
    let Some((dtype, shape, start)) = signature(payload) else {
        candle_core::bail!(
            "tcp backend: malformed tensor payload ({} bytes)",
            payload.len()
        )
    };
    let data = &payload[start..];
    if data.len() != shape.elem_count() * dtype.size_in_bytes() {
        candle_core::bail!(
            "tcp backend: tensor payload of {shape:?} {dtype:?} has {} bytes of data",
            data.len()
        )
    }
    Tensor::from_raw_buffer(data, dtype, shape.dims(), &Device::Cpu)?.to_device(device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_and_frame_round_trip() {
        let t = Tensor::arange(0f32, 12.0, &Device::Cpu)
            .unwrap()
            .reshape((3, 4))
            .unwrap()
            .t()
            .unwrap();
        let mut buf = Vec::new();
        write_frame(&mut buf, FrameKind::Data, 7, 99, 3, &encode(&t).unwrap()).unwrap();
        let f = read_frame(&mut buf.as_slice()).unwrap();
        assert_eq!((f.kind, f.op, f.group, f.seq), (FrameKind::Data, 7, 99, 3));
        let back = decode(&f.payload, &Device::Cpu).unwrap();
        assert_eq!(back.to_vec2::<f32>().unwrap(), t.to_vec2::<f32>().unwrap());
        let bf = t.to_dtype(DType::BF16).unwrap();
        let back = decode(&encode(&bf).unwrap(), &Device::Cpu).unwrap();
        assert_eq!(back.dtype(), DType::BF16);
        assert_eq!(back.dims(), &[4, 3]);
    }

    #[test]
    fn corrupt_input_is_an_error() {
        let mut header = vec![9u8; 26];
        assert!(read_frame(&mut header.as_slice()).is_err());
        header[0] = 2;
        header[18..26].copy_from_slice(&u64::MAX.to_le_bytes());
        let e = read_frame(&mut header.as_slice()).unwrap_err();
        assert!(e.to_string().contains("exceeds"), "{e}");
        header[18..26].copy_from_slice(&5000u64.to_le_bytes());
        let e = read_frame_bounded(&mut header.as_slice(), 4096).unwrap_err();
        assert!(e.to_string().contains("5000 bytes exceeds 4096"), "{e}");
        assert!(decode(&[6, 1, 5, 0, 0, 0, 0, 0, 0, 0, 1, 2], &Device::Cpu).is_err());
        assert!(decode(&[42], &Device::Cpu).is_err());
    }
}
