//! Launchers of Muon's element-wise kernels (`kernels/flat.cu`, `muon_*`), called from the root
//! crate's `optim::muon::fused` ops: the momentum, the direction placed among a rank's owned
//! elements, and the update, one launch per run of owned hidden-matrix elements, over 64-bit
//! indices (no bound on the buffers). A run is given by where its gradients start in the
//! gradient buffer (`g`), where it starts in Muon's `k` elements (`here`), where among the
//! rank's owned elements (`at`) and its length.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::PushKernelArg;
use candle_core::cuda::{CudaStorage, WrapErr};
use candle_core::{bail, Layout, Result};

use super::flat::{kernel, range};
use super::{elementwise, view};

/// Errors unless `start + len <= size` for every `(start, len)`.
fn check(
    op: &str,
    what: &str,
    spans: impl Iterator<Item = (usize, usize)>,
    size: usize,
) -> Result<()> {
    for (start, len) in spans {
        if start.checked_add(len).is_none_or(|end| end > size) {
            bail!("{op}: a run of {len} at {start} exceeds the {size} elements of {what}")
        }
    }
    Ok(())
}

/// The momentum `buf ← lerp(buf, g')` of every run `[g, here, len]` in Muon's state `st`
/// (`[master | buf]`, `2 k` f32) from the gradient buffer `grad`; `scale`: clipping's factor
/// (`None`: 1); `(low, c)`: the lerp's branch and constant.
pub fn momentum(
    (st, sl): (&mut CudaStorage, &Layout),
    (grad, gl): (&CudaStorage, &Layout),
    runs: &[[usize; 3]],
    scale: Option<f32>,
    (low, c): (bool, f32),
) -> Result<()> {
    const OP: &str = "muon-momentum";
    let dev = st.device().clone();
    let g = view::<f32>(OP, "gradients", grad, gl)?;
    let (a, b) = range(OP, "state", sl)?;
    let k = (b - a) / 2;
    check(
        OP,
        "the gradients",
        runs.iter().map(|r| (r[0], r[2])),
        g.len(),
    )?;
    check(OP, "the state", runs.iter().map(|r| (r[1], r[2])), k)?;
    let f = kernel(&dev, "muon_momentum")?;
    let dtype = st.dtype();
    let Ok(data) = st.as_cuda_slice_mut::<f32>() else {
        bail!("{OP}: expected an f32 state, got {dtype:?}")
    };
    let mut state = data.slice_mut(a..b); // [2 k]
    let stream = dev.cuda_stream();
    let (scaled, gs, low) = (
        i32::from(scale.is_some()),
        scale.unwrap_or(1.0),
        i32::from(low),
    );
    let k_u = k as u64;
    for &[at_g, here, len] in runs.iter().filter(|r| r[2] > 0) {
        let (here, at_g, len_u) = (here as u64, at_g as u64, len as u64);
        let mut builder = stream.launch_builder(&f);
        builder
            .arg(&mut state)
            .arg(&g)
            .arg(&k_u)
            .arg(&here)
            .arg(&at_g);
        builder.arg(&len_u).arg(&scaled).arg(&gs).arg(&low).arg(&c);
        // SAFETY: matches `muon_momentum(float*, const float*, u64, u64, u64, u64, int, float,
        // int, float)`; the run lies inside the state's momentum and the gradients (checked).
        unsafe { builder.launch(elementwise(len)) }.w()?;
    }
    Ok(())
}

/// The direction `u ← lerp(g', buf)` (with `nesterov`'s branch and constant) or `buf` of every
/// run `[g, here, at, len]`, written into `u` (`[n]` f32) at `at`.
pub fn direction(
    (u, ul): (&mut CudaStorage, &Layout),
    (grad, gl): (&CudaStorage, &Layout),
    (st, sl): (&CudaStorage, &Layout),
    runs: &[[usize; 4]],
    scale: Option<f32>,
    nesterov: Option<(bool, f32)>,
) -> Result<()> {
    const OP: &str = "muon-direction";
    let dev = u.device().clone();
    let g = view::<f32>(OP, "gradients", grad, gl)?;
    let state = view::<f32>(OP, "state", st, sl)?; // [2 k]
    let k = state.len() / 2;
    let (a, b) = range(OP, "direction", ul)?;
    check(
        OP,
        "the gradients",
        runs.iter().map(|r| (r[0], r[3])),
        g.len(),
    )?;
    check(OP, "the state", runs.iter().map(|r| (r[1], r[3])), k)?;
    check(
        OP,
        "the direction",
        runs.iter().map(|r| (r[2], r[3])),
        b - a,
    )?;
    let f = kernel(&dev, "muon_direction")?;
    let dtype = u.dtype();
    let Ok(data) = u.as_cuda_slice_mut::<f32>() else {
        bail!("{OP}: expected an f32 direction, got {dtype:?}")
    };
    let mut out = data.slice_mut(a..b); // [n]
    let stream = dev.cuda_stream();
    let (scaled, gs) = (i32::from(scale.is_some()), scale.unwrap_or(1.0));
    let (on, low, c) = match nesterov {
        Some((low, c)) => (1i32, i32::from(low), c),
        None => (0, 0, 0.0f32),
    };
    let k_u = k as u64;
    for &[at_g, here, at, len] in runs.iter().filter(|r| r[3] > 0) {
        let [at_g, here, at, len_u] = [at_g, here, at, len].map(|x| x as u64);
        let mut builder = stream.launch_builder(&f);
        builder
            .arg(&mut out)
            .arg(&g)
            .arg(&state)
            .arg(&k_u)
            .arg(&here);
        builder
            .arg(&at_g)
            .arg(&at)
            .arg(&len_u)
            .arg(&scaled)
            .arg(&gs);
        builder.arg(&on).arg(&low).arg(&c);
        // SAFETY: matches `muon_direction(float*, const float*, const float*, u64, u64, u64, u64,
        // u64, int, float, int, int, float)`; the run lies inside all three buffers (checked).
        unsafe { builder.launch(elementwise(len)) }.w()?;
    }
    Ok(())
}

/// The update `master ← (master·keep + 0) + o` of every run `[here, at, len]` in Muon's state
/// `st` from the orthogonalised update `o` (`[n]` f32, read at `at`).
pub fn apply(
    (st, sl): (&mut CudaStorage, &Layout),
    (o, ol): (&CudaStorage, &Layout),
    runs: &[[usize; 3]],
    keep: f32,
) -> Result<()> {
    const OP: &str = "muon-apply";
    let dev = st.device().clone();
    let update = view::<f32>(OP, "update", o, ol)?; // [n]
    let (a, b) = range(OP, "state", sl)?;
    check(
        OP,
        "the state",
        runs.iter().map(|r| (r[0], r[2])),
        (b - a) / 2,
    )?;
    check(
        OP,
        "the update",
        runs.iter().map(|r| (r[1], r[2])),
        update.len(),
    )?;
    let f = kernel(&dev, "muon_apply")?;
    let dtype = st.dtype();
    let Ok(data) = st.as_cuda_slice_mut::<f32>() else {
        bail!("{OP}: expected an f32 state, got {dtype:?}")
    };
    let mut state = data.slice_mut(a..b); // [2 k]
    let stream = dev.cuda_stream();
    for &[here, at, len] in runs.iter().filter(|r| r[2] > 0) {
        let [here, at, len_u] = [here, at, len].map(|x| x as u64);
        let mut builder = stream.launch_builder(&f);
        builder
            .arg(&mut state)
            .arg(&update)
            .arg(&here)
            .arg(&at)
            .arg(&len_u)
            .arg(&keep);
        // SAFETY: matches `muon_apply(float*, const float*, u64, u64, u64, float)`; the run
        // lies inside the state's master weights and the update (checked).
        unsafe { builder.launch(elementwise(len)) }.w()?;
    }
    Ok(())
}
