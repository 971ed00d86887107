//! Muon's element-wise work as three in-place passes over the flat buffers, each reading its
//! inputs once and writing one output, with no full-size temporary: the momentum (`buf ←
//! lerp(buf, g, 1 − momentum)`, in the state), the direction handed to the orthogonalisation
//! (`u ← lerp(g, buf, momentum)` with Nesterov, else `buf`, placed among the rank's owned
//! elements) and the update (`W ← W·(1 − lr·wd) + O`, `O` already scaled by `−lr·ratio`). They
//! perform the f32 operations of `torch.optim.Muon` in the order the chain of candle ops they
//! replace performed them (`tests.rs` holds them equal bit for bit): `torch.lerp`'s two-sided
//! formula, each product rounded, and the `+ 0` of candle's `affine`. CPU here; with the `cuda`
//! feature `model::ops::cuda::muon`'s kernels (`kernels/flat.cu`), emulated on the CPU by the
//! model crate's kernel tests.

#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{bail, CpuStorage, InplaceOp2, InplaceOp3, Layout, Result};
#[cfg(feature = "cuda")]
use model::ops::cuda::muon as kernels;
use rayon::prelude::*;

/// Elements per parallel chunk.
const CHUNK: usize = 1 << 14;

/// A run of owned hidden-matrix elements: where its gradients start in the gradient buffer,
/// where it starts in Muon's `[k]` elements, where among the rank's `n` owned elements, and its
/// length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// Its first gradient in the gradient buffer.
    pub grad: usize,
    /// Its first element among Muon's.
    pub here: usize,
    /// Its first element among the rank's owned elements.
    pub at: usize,
    /// Elements.
    pub len: usize,
}

/// `torch.lerp(start, end, w)` at a fixed weight, as candle ops computed it: with `|w| < 0.5`,
/// `start + ((end − start)·w + 0)`; otherwise `end − ((end − start)·(1 − w) + 0)`, `1 − w`
/// taken in f32.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Lerp {
    /// Whether `|w| < 0.5`.
    pub low: bool,
    /// `w`, or `1 − w`.
    pub c: f32,
}

impl Lerp {
    /// The lerp at weight `weight` (rounded to f32 first).
    pub fn new(weight: f64) -> Self {
        let w = weight as f32;
        if w.abs() < 0.5 {
            Self { low: true, c: w }
        } else {
            Self {
                low: false,
                c: 1.0 - w,
            }
        }
    }

    fn at(self, start: f32, end: f32) -> f32 {
        let d = (end - start) * self.c + 0.0;
        if self.low {
            start + d
        } else {
            end - d
        }
    }
}

/// The gradient as Muon reads it: `g·scale + 0` (clipping's scale, rounded to f32), or `g`
/// itself when not scaled.
fn read(g: f32, scale: Option<f32>) -> f32 {
    match scale {
        Some(s) => g * s + 0.0,
        None => g,
    }
}

/// The f32 elements of a contiguous storage.
fn slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => bail!("muon: {what} must be a contiguous f32 buffer"),
    }
}

fn slice_mut<'a>(s: &'a mut CpuStorage, l: &Layout, what: &str) -> Result<&'a mut [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&mut v[a..b]),
        _ => bail!("muon: {what} must be a contiguous f32 buffer"),
    }
}

/// `dst[i] ← f(dst[i], src[i])` for every element of `dst` (`src` at least as long), in
/// parallel chunks.
fn update_with(dst: &mut [f32], src: &[f32], f: impl Fn(f32, f32) -> f32 + Sync) {
    let src = &src[..dst.len()];
    dst.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| {
            for (d, &s) in d.iter_mut().zip(s) {
                *d = f(*d, s);
            }
        });
}

/// Errors unless every run lies inside buffers of `grads`, `k` and `n` elements.
fn check(runs: &[Run], grads: usize, k: usize, n: usize) -> Result<()> {
    for r in runs {
        let ends = [r.grad, r.here, r.at].map(|s| s.checked_add(r.len));
        if ends[0].is_none_or(|e| e > grads)
            || ends[1].is_none_or(|e| e > k)
            || ends[2].is_none_or(|e| e > n)
        {
            bail!("muon: run {r:?} exceeds {grads} gradients, {k} elements or {n} owned")
        }
    }
    Ok(())
}

/// `buf ← lerp(buf, g)` in place: the op's destination is Muon's state `[master | buf]`
/// (`[2k]`), its source the gradient buffer.
pub struct Momentum<'a> {
    /// The runs updated.
    pub runs: &'a [Run],
    /// Clipping's scale of the gradients (`None`: 1).
    pub scale: Option<f32>,
    /// `lerp(buf, g, 1 − momentum)`.
    pub lerp: Lerp,
}

impl InplaceOp2 for Momentum<'_> {
    fn name(&self) -> &'static str {
        "muon-momentum"
    }

    fn cpu_fwd(&self, st: &mut CpuStorage, sl: &Layout, g: &CpuStorage, gl: &Layout) -> Result<()> {
        let state = slice_mut(st, sl, "the state")?;
        let grads = slice(g, gl, "the gradients")?;
        let k = state.len() / 2;
        check(self.runs, grads.len(), k, usize::MAX)?;
        let buf = &mut state[k..];
        for r in self.runs {
            let (b, g) = (&mut buf[r.here..r.here + r.len], &grads[r.grad..]);
            update_with(b, g, |b, g| self.lerp.at(b, read(g, self.scale)));
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        st: &mut CudaStorage,
        sl: &Layout,
        g: &CudaStorage,
        gl: &Layout,
    ) -> Result<()> {
        let runs: Vec<[usize; 3]> = self.runs.iter().map(|r| [r.grad, r.here, r.len]).collect();
        kernels::momentum(
            (st, sl),
            (g, gl),
            &runs,
            self.scale,
            (self.lerp.low, self.lerp.c),
        )
    }
}

/// `u ← lerp(g, buf)` (Nesterov) or `buf`, each run placed among the rank's owned elements: the
/// op's destination is `u` `[n]` (zero outside the runs), its sources the gradient buffer and
/// Muon's state `[master | buf]`.
pub struct Direction<'a> {
    /// The runs written.
    pub runs: &'a [Run],
    /// Clipping's scale of the gradients (`None`: 1).
    pub scale: Option<f32>,
    /// With Nesterov, `lerp(g, buf, momentum)`.
    pub nesterov: Option<Lerp>,
}

impl InplaceOp3 for Direction<'_> {
    fn name(&self) -> &'static str {
        "muon-direction"
    }

    fn cpu_fwd(
        &self,
        u: &mut CpuStorage,
        ul: &Layout,
        g: &CpuStorage,
        gl: &Layout,
        st: &CpuStorage,
        sl: &Layout,
    ) -> Result<()> {
        let u = slice_mut(u, ul, "the direction")?;
        let grads = slice(g, gl, "the gradients")?;
        let state = slice(st, sl, "the state")?;
        let k = state.len() / 2;
        check(self.runs, grads.len(), k, u.len())?;
        let buf = &state[k..];
        for r in self.runs {
            let out = &mut u[r.at..r.at + r.len];
            let (g, b) = (&grads[r.grad..r.grad + r.len], &buf[r.here..r.here + r.len]);
            out.par_chunks_mut(CHUNK)
                .zip(g.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
                .for_each(|(o, (g, b))| {
                    for ((o, &g), &b) in o.iter_mut().zip(g).zip(b) {
                        *o = match self.nesterov {
                            Some(l) => l.at(read(g, self.scale), b),
                            None => b,
                        };
                    }
                });
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    #[allow(clippy::too_many_arguments)]
    fn cuda_fwd(
        &self,
        u: &mut CudaStorage,
        ul: &Layout,
        g: &CudaStorage,
        gl: &Layout,
        st: &CudaStorage,
        sl: &Layout,
    ) -> Result<()> {
        let runs: Vec<[usize; 4]> = (self.runs.iter())
            .map(|r| [r.grad, r.here, r.at, r.len])
            .collect();
        let nesterov = self.nesterov.map(|l| (l.low, l.c));
        kernels::direction((u, ul), (g, gl), (st, sl), &runs, self.scale, nesterov)
    }
}

/// `W ← (W·keep + 0) + O` over the runs: the op's destination is Muon's state `[master | buf]`,
/// its source the orthogonalised update `O` `[n]` among the rank's owned elements.
pub struct Apply<'a> {
    /// The runs updated.
    pub runs: &'a [Run],
    /// `1 − lr·wd`, rounded to f32.
    pub keep: f32,
}

impl InplaceOp2 for Apply<'_> {
    fn name(&self) -> &'static str {
        "muon-apply"
    }

    fn cpu_fwd(&self, st: &mut CpuStorage, sl: &Layout, o: &CpuStorage, ol: &Layout) -> Result<()> {
        let state = slice_mut(st, sl, "the state")?;
        let o = slice(o, ol, "the update")?;
        let k = state.len() / 2;
        check(self.runs, usize::MAX, k, o.len())?;
        for r in self.runs {
            let w = &mut state[r.here..r.here + r.len];
            update_with(w, &o[r.at..], |w, o| (w * self.keep + 0.0) + o);
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        st: &mut CudaStorage,
        sl: &Layout,
        o: &CudaStorage,
        ol: &Layout,
    ) -> Result<()> {
        let runs: Vec<[usize; 3]> = self.runs.iter().map(|r| [r.here, r.at, r.len]).collect();
        kernels::apply((st, sl), (o, ol), &runs, self.keep)
    }
}
