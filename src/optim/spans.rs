//! Whole-buffer operations done span by span, so that flat buffers of any size live on the GPU.
//!
//! candle's CUDA kernels (fills, casts, copies, element-wise ops) walk their elements with a
//! 32-bit grid-stride index, so one launch covers at most [`SPAN`] elements (2^31: the index plus
//! the stride stays below 2^32). A 7B model's flat gradient buffer and optimizer state on one
//! GPU hold 6.7e9 elements. Views are another matter: a narrow view's offset reaches a kernel as
//! a 64-bit pointer, so a span anywhere in a buffer is fine. These helpers split an operation
//! over such views; below one span they are the plain operation, so nothing changes for buffers
//! that fit (and on the CPU, where candle indexes with `usize`, they cost a loop of one).

use std::ops::Range;

use candle_core::{DType, Result, Tensor};

/// Most elements one candle CUDA kernel launch may cover.
pub const SPAN: usize = 1 << 31;

/// The ranges of at most `most` elements that tile `0..n`, in order.
pub fn spans(n: usize, most: usize) -> impl Iterator<Item = Range<usize>> {
    let most = most.max(1);
    (0..n).step_by(most).map(move |a| a..(a + most).min(n))
}

/// Zeroes the 1-D tensor `t` in place, span by span.
pub fn zero(t: &Tensor) -> Result<()> {
    zero_within(t, SPAN)
}

/// Writes the 1-D `src` into the 1-D `dst` at element `at` (same dtype), span by span.
pub fn copy_into(dst: &Tensor, at: usize, src: &Tensor) -> Result<()> {
    copy_into_within(dst, at, src, SPAN)
}

/// The 1-D `t` in `dtype`, cast span by span (one new buffer; no copy when the dtype is `t`'s).
pub fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
    cast_within(t, dtype, SPAN)
}

/// `f` applied to each span of the 1-D tensors `xs` (all of one length), the results
/// concatenated: for element-wise work whose candle ops would each cover the whole buffer.
pub fn map<const N: usize>(
    xs: [&Tensor; N],
    f: impl FnMut([Tensor; N], Range<usize>) -> Result<Tensor>,
) -> Result<Tensor> {
    map_within(xs, f, SPAN)
}

pub(crate) fn zero_within(t: &Tensor, most: usize) -> Result<()> {
    for r in spans(t.elem_count(), most) {
        t.narrow(0, r.start, r.len())?.zero_set()?;
    }
    Ok(())
}

pub(crate) fn copy_into_within(dst: &Tensor, at: usize, src: &Tensor, most: usize) -> Result<()> {
    for r in spans(src.elem_count(), most) {
        dst.slice_set(&src.narrow(0, r.start, r.len())?, 0, at + r.start)?;
    }
    Ok(())
}

pub(crate) fn cast_within(t: &Tensor, dtype: DType, most: usize) -> Result<Tensor> {
    if t.dtype() == dtype || t.elem_count() <= most {
        return t.to_dtype(dtype);
    }
    map_within([t], |[x], _| x.to_dtype(dtype), most)
}

pub(crate) fn map_within<const N: usize>(
    xs: [&Tensor; N],
    mut f: impl FnMut([Tensor; N], Range<usize>) -> Result<Tensor>,
    most: usize,
) -> Result<Tensor> {
    let n = xs.first().map_or(0, |x| x.elem_count());
    if let Some(x) = xs.iter().find(|x| x.elem_count() != n) {
        candle_core::bail!("spans: buffers of {n} and {} elements", x.elem_count());
    }
    if n <= most {
        return f(xs.map(Tensor::clone), 0..n);
    }
    let mut parts = Vec::with_capacity(n.div_ceil(most));
    for r in spans(n, most) {
        let views = xs.map(|x| x.narrow(0, r.start, r.len()));
        let mut out = Vec::with_capacity(N);
        for v in views {
            out.push(v?);
        }
        let views = <[Tensor; N]>::try_from(out)
            .map_err(|_| candle_core::Error::Msg("spans: one view per buffer".into()))?;
        parts.push(f(views, r)?);
    }
    Tensor::cat(&parts, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn ramp(n: usize) -> Tensor {
        Tensor::arange(0f32, n as f32, &Device::Cpu)
            .unwrap()
            .affine(0.37, -1.0)
            .unwrap()
    }

    #[test]
    fn spans_tile_the_range_in_order() {
        let got: Vec<_> = spans(10, 4).collect();
        assert_eq!(got, vec![0..4, 4..8, 8..10]);
        assert_eq!(spans(8, 4).count(), 2);
        assert_eq!(spans(0, 4).count(), 0);
        assert_eq!(spans(3, 0).count(), 3);
        assert_eq!(
            spans(SPAN * 3 + 1, SPAN).last(),
            Some(SPAN * 3..SPAN * 3 + 1)
        );
    }

    /// Each helper in spans of 3 equals the whole operation in one span, bit for bit, for
    /// lengths below, at and past multiples of the span.
    #[test]
    fn operations_in_small_spans_equal_the_whole_operation() {
        for n in [0, 1, 3, 7, 9] {
            let x = ramp(n);
            let t = ramp(n).affine(2.0, 0.0).unwrap();
            zero_within(&t, 3).unwrap();
            assert_eq!(t.to_vec1::<f32>().unwrap(), vec![0.0; n], "zero {n}");

            let dst = Tensor::zeros(n + 5, DType::F32, &Device::Cpu).unwrap();
            copy_into_within(&dst, 2, &x, 3).unwrap();
            let got = dst.to_vec1::<f32>().unwrap();
            assert_eq!(got[2..2 + n], x.to_vec1::<f32>().unwrap()[..], "copy {n}");
            assert!(got[..2].iter().chain(&got[2 + n..]).all(|&v| v == 0.0));

            let whole = x.to_dtype(DType::BF16).unwrap().to_vec1::<half::bf16>();
            let split = cast_within(&x, DType::BF16, 3).unwrap();
            assert_eq!(split.to_vec1::<half::bf16>().unwrap(), whole.unwrap());

            let y = ramp(n).sqr().unwrap();
            let f = |[a, b]: [Tensor; 2], _| (a * 3.0)? + b;
            let one = map_within([&x, &y], f, n.max(1)).unwrap();
            let three = map_within([&x, &y], f, 3).unwrap();
            assert_eq!(
                three.to_vec1::<f32>().unwrap(),
                one.to_vec1::<f32>().unwrap()
            );
        }
        let e = map_within([&ramp(3), &ramp(4)], |[a, _], _| Ok(a), 2).unwrap_err();
        assert!(e.to_string().contains("3 and 4 elements"), "{e}");
    }
}
