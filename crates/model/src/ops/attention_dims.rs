//! The sizes and the mask of one attention call ([`Dims`], a document [`Floor`]): which keys each
//! block of query rows and each row sees, shared by the CPU kernels (`attention.rs`,
//! `attention_bwd.rs`), the CUDA launchers and the cuDNN descriptions.

use candle_core::{bail, Layout, Result, Tensor};
pub(crate) use parallel::cp::Floor;

use super::attention::OP;

/// Sizes of one attention call: `q` is `[b, s, hq, d]`, `k` and `v` are `[b, sk, hkv, d]`.
/// Causal calls have `sk == s` and query row `i` sees keys `0..=i`; full (unmasked) calls let every
/// query see all `sk` keys (a block of context-parallel ring attention whose keys all precede the
/// queries).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    pub b: usize,
    /// Query rows.
    pub s: usize,
    /// Key (and value) rows.
    pub sk: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    /// Causal mask (`sk == s`) or none.
    pub causal: bool,
}

impl Dims {
    pub(crate) fn from_layouts(q: &Layout, k: &Layout, causal: bool) -> Result<Self> {
        let (&[b, s, hq, d], &[_, sk, hkv, _]) = (q.dims(), k.dims()) else {
            bail!(
                "{OP}: expected rank-4 q and k, got {:?} and {:?}",
                q.dims(),
                k.dims()
            )
        };
        if causal && sk != s {
            bail!("{OP}: a causal call needs as many keys ({sk}) as queries ({s})")
        }
        Ok(Self {
            b,
            s,
            sk,
            hq,
            hkv,
            d,
            causal,
        })
    }

    /// Query heads per kv head.
    pub fn group(&self) -> usize {
        self.hq / self.hkv
    }

    /// Keys seen by the query rows `r0..r1`: up to `r1` when causal, else all of them.
    pub fn keys_seen(&self, r1: usize) -> usize {
        if self.causal {
            r1
        } else {
            self.sk
        }
    }

    /// Keys seen by query row `i` (within [`Dims::keys_seen`] of its block).
    pub fn row_keys(&self, i: usize) -> usize {
        if self.causal {
            i + 1
        } else {
            self.sk
        }
    }

    /// The keys `lo..hi` query rows `r0..r1` of sample `bi` see between them: up to
    /// [`Dims::keys_seen`], from the lowest of their floors (see [`Floor`]).
    pub fn block_keys(&self, floor: Floor<'_>, bi: usize, r0: usize, r1: usize) -> (usize, usize) {
        let hi = self.keys_seen(r1);
        let row = bi * self.s;
        let lo = floor.map_or(0, |f| {
            f[row + r0..row + r1]
                .iter()
                .min()
                .map_or(0, |&x| x as usize)
        });
        (lo.min(hi), hi)
    }

    /// The keys `lo..hi` query row `i` of sample `bi` sees.
    pub fn row_range(&self, floor: Floor<'_>, bi: usize, i: usize) -> (usize, usize) {
        let hi = self.row_keys(i);
        let lo = floor.map_or(0, |f| f[bi * self.s + i] as usize);
        (lo.min(hi), hi)
    }
}

/// Checks a floor against the queries of `q` `[b, s, hq, d]`: one entry per query row, never
/// decreasing along a sample (what the kernels' block bounds assume; floors of queries and keys
/// in sequence order always are).
pub(crate) fn check_floor(floor: Floor<'_>, q: &Tensor) -> Result<()> {
    if let Some(f) = floor {
        let (b, s) = (q.dim(0)?, q.dim(1)?);
        if f.len() != b * s {
            bail!(
                "{OP}: the document floor has {} rows for {} query rows",
                f.len(),
                b * s
            )
        }
        if let Some(i) = (1..f.len()).find(|&i| i % s != 0 && f[i] < f[i - 1]) {
            bail!("{OP}: the document floor decreases at query row {i}")
        }
    }
    Ok(())
}
