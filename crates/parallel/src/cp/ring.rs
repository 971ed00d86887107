//! Ring attention over a context-parallel group (Liu et al. 2023; the load-balanced causal variant
//! of Megatron-LM/Transformer Engine): a graph-free forward ([`attention`]) and its backward
//! ([`attention_bwd`]).
//!
//! Rank `r` of `P` holds queries, keys and values of chunks `r` and `2P − 1 − r` (local rows
//! `[0, c)` and `[c, 2c)`). Its K/V block travels around the ring: at step `i` a rank holds the
//! block of rank `src = r − i (mod P)` and
//!
//! | step | queries | keys | mask |
//! |---|---|---|---|
//! | `i = 0` (own block) | all `2c` | all `2c` | causal (chunk `r` precedes chunk `2P−1−r`) |
//! | `src < r` | all `2c` | first half (chunk `src`) | none: both query chunks come later; the second key chunk `2P−1−src` comes after both |
//! | `src > r` | second half (chunk `2P−1−r`) | all `2c` | none: chunk `r` precedes both key chunks, chunk `2P−1−r` follows both |
//!
//! so every step after the first costs the same (`2c × c` scores) on every rank. Each hop is one
//! grouped send to the next rank and receive from the previous one ([`Comm::send_recv`], one NCCL
//! group on the ring's communicator, so the ring connects without the cycle a send-then-receive
//! ring has), posted before the step's block computes and waited for only when the next step
//! needs it: the transfer overlaps the computation. The partial outputs are merged by their
//! log-sum-exp in the accumulation dtype (f32, f64 for f64).
//!
//! With documents kept apart ([`super::DocumentStarts`]) every block gets the floor of its keys
//! (the first key each query may see), and a block that no query may see is skipped: its K/V
//! still travel, its scores are never computed.
//!
//! Backward: K/V rotate again, each step computing the block's gradients with the *merged*
//! output and log-sum-exp (so its probabilities are its share of the final softmax); `dQ`
//! accumulates locally, the `dK`/`dV` accumulator of a block travels with it and, after `P`
//! moves, arrives back at its owner. The accumulator arriving at a step is waited for only after
//! that step's block gradients are computed, so its transfer overlaps them too. It travels in the
//! accumulation dtype (f32 for bf16 K and V): sent in bf16 instead, each hop would round the
//! running sum once more, and at cp 4 dK's error against f64 grew from 1.1× one rank's to 2.6×
//! (`tests/cp_ring.rs`), for a third fewer bytes in a transfer that is hidden behind the block's
//! gradients anyway. With GQA only the `hkv` K/V heads travel.

use std::sync::Arc;
use std::time::Instant;

use candle_core::{Result, Tensor};

use super::{local_chunks, DocumentStarts, Floor};
use crate::comm::{Comm, Group, Transfer};
use crate::stats::StepStats;

/// Causal attention over the whole sequence: `(q, k, v, scale, floor) → (out, lse)`, the output
/// in the kernel's dtype and the log-sum-exp in the accumulation dtype.
pub type CausalFn = fn(&Tensor, &Tensor, &Tensor, f64, Floor<'_>) -> Result<(Tensor, Tensor)>;
/// Its gradients: `(q, k, v, (out, lse), dout, scale, floor) → (dq, dk, dv)` in the dtypes of
/// `q`, `k`, `v`.
pub type CausalBwdFn = fn(
    &Tensor,
    &Tensor,
    &Tensor,
    (&Tensor, &Tensor),
    &Tensor,
    f64,
    Floor<'_>,
) -> Result<(Tensor, Tensor, Tensor)>;
/// One block without autograd: `(q, k, v, scale, causal, floor) → (out, lse)`, the output in the
/// accumulation dtype (that of `lse`).
pub type BlockFn = fn(&Tensor, &Tensor, &Tensor, f64, bool, Floor<'_>) -> Result<(Tensor, Tensor)>;
/// A block's gradients: `(q, k, v, out, dout, lse, scale, causal, floor) → (dq, dk, dv)` in the
/// accumulation dtype, from the merged attention's `out` and `lse`.
pub type BlockBwdFn = fn(
    &Tensor,
    &Tensor,
    &Tensor,
    &Tensor,
    &Tensor,
    &Tensor,
    f64,
    bool,
    Floor<'_>,
) -> Result<(Tensor, Tensor, Tensor)>;

/// The attention kernels the ring runs (the model's op library provides them).
#[derive(Clone, Copy, Debug)]
pub struct Kernels {
    /// Plain causal attention (one rank).
    pub causal: CausalFn,
    /// Its backward.
    pub causal_bwd: CausalBwdFn,
    /// One block's forward.
    pub block: BlockFn,
    /// One block's backward.
    pub block_bwd: BlockBwdFn,
}

/// One rank's view of the ring.
#[derive(Clone)]
pub(super) struct Ring {
    pub comm: Arc<dyn Comm>,
    pub group: Group,
    pub index: usize,
    pub kernels: Kernels,
    pub scale: f64,
    pub stats: Arc<StepStats>,
    /// Documents kept apart, or none.
    pub docs: Option<DocumentStarts>,
}

impl Ring {
    fn size(&self) -> usize {
        self.group.size()
    }

    /// Global rank of the next member (blocks go there) and of the previous one (they come from
    /// there).
    fn neighbours(&self) -> (usize, usize) {
        let (p, r) = (self.size(), self.index);
        let ranks = self.group.ranks();
        (ranks[(r + 1) % p], ranks[(r + p - 1) % p])
    }

    /// Posts one hop: `t` to the next rank, the previous rank's tensor of the same shape back.
    fn pass(&self, t: &Tensor) -> Result<Transfer> {
        let bytes = t.elem_count() * t.dtype().size_in_bytes();
        self.stats
            .ring
            .sent_bytes
            .fetch_add(bytes as u64, std::sync::atomic::Ordering::Relaxed);
        let t0 = Instant::now();
        let (next, prev) = self.neighbours();
        let posted = self.comm.send_recv(&self.group, t, next, prev);
        add_ns(&self.stats.ring.send_ns, t0);
        Ok(posted?)
    }

    /// The tensor a hop brought (waiting for it on the host, or ordering the device after it).
    fn arrive(&self, hop: Transfer) -> Result<Tensor> {
        let t0 = Instant::now();
        let t = hop.wait();
        add_ns(&self.stats.ring.wait_ns, t0);
        Ok(t?)
    }

    /// Source cp index of the block held at step `i`.
    fn src(&self, i: usize) -> usize {
        let p = self.size();
        (self.index + p - i % p) % p
    }

    /// The floor of the block of `src` (its rows as in the table of the module docs;
    /// `src == index` is the own block), or `None` without document masking.
    fn floor(&self, src: usize, c: usize) -> Result<Option<Vec<u32>>> {
        let Some(docs) = &self.docs else {
            return Ok(None);
        };
        let (p, r) = (self.size(), self.index);
        let rows = |rank: usize| -> Result<Vec<usize>> {
            Ok(local_chunks(2 * c * p, p, rank)?
                .into_iter()
                .flatten()
                .collect())
        };
        let own = rows(r)?;
        Ok(Some(if src == r {
            docs.floor(&own, &own)
        } else if src < r {
            docs.floor(&own, &rows(src)?[..c])
        } else {
            docs.floor(&own[c..], &rows(src)?)
        }))
    }

    /// Whether a block's `floor` leaves every query no key among its `keys`: the block is
    /// skipped (and counted).
    fn skips(&self, floor: &Option<Vec<u32>>, keys: usize) -> bool {
        let skip = floor
            .as_ref()
            .is_some_and(|f| f.iter().all(|&x| x as usize >= keys));
        if skip {
            let skipped = &self.stats.ring.skipped_blocks;
            skipped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        skip
    }
}

fn add_ns(counter: &std::sync::atomic::AtomicU64, since: Instant) {
    let ns = since.elapsed().as_nanos().min(u64::MAX as u128) as u64;
    counter.fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
}

/// Merges two partial attentions over disjoint keys: outputs `[b, s, h, d]` and log-sum-exps
/// `[b, h, s]` (all in the accumulation dtype) → the attention over both key sets.
fn merge(a: (&Tensor, &Tensor), b: (&Tensor, &Tensor)) -> Result<(Tensor, Tensor)> {
    let (oa, la) = a;
    let (ob, lb) = b;
    let m = la.maximum(lb)?; // [b, h, s]
    let (ea, eb) = (la.broadcast_sub(&m)?.exp()?, lb.broadcast_sub(&m)?.exp()?);
    let sum = (&ea + &eb)?;
    let lse = (m + sum.log()?)?;
    // Weights per row, as [b, s, h, 1] to scale the outputs.
    let w = |e: &Tensor| -> Result<Tensor> { (e / &sum)?.transpose(1, 2)?.unsqueeze(3) };
    let out = (oa.broadcast_mul(&w(&ea)?)? + ob.broadcast_mul(&w(&eb)?)?)?;
    Ok((out, lse))
}

/// `rows` of `t` along `dim` replaced by `f(those rows)`.
fn update_rows(
    t: &Tensor,
    dim: usize,
    rows: std::ops::Range<usize>,
    f: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let n = t.dim(dim)?;
    let mut parts = Vec::with_capacity(3);
    if rows.start > 0 {
        parts.push(t.narrow(dim, 0, rows.start)?);
    }
    parts.push(f(&t.narrow(dim, rows.start, rows.len())?)?);
    if rows.end < n {
        parts.push(t.narrow(dim, rows.end, n - rows.end)?);
    }
    Tensor::cat(&parts, dim)
}

/// The ring forward: the merged output `[b, 2c, hq, d]` and log-sum-exp `[b, hq, 2c]` in the
/// accumulation dtype.
fn forward(ring: &Ring, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
    let (p, r, scale) = (ring.size(), ring.index, ring.scale);
    let block = ring.kernels.block;
    let c = q.dim(1)? / 2;
    // [2, b, 2c, hkv, d]
    let own = Tensor::stack(&[k, v], 0)?;
    // Step 1's block travels while the own block computes.
    let mut hop = if p > 1 { Some(ring.pass(&own)?) } else { None };
    // The own block: causal over the local rows.
    let floor = ring.floor(r, c)?;
    // [b, 2c, hq, d], [b, hq, 2c]
    let (mut out, mut lse) = block(q, k, v, scale, true, floor.as_deref())?;
    for i in 1..p {
        let Some(arriving) = hop.take() else {
            candle_core::bail!("ring attention: no block in flight at step {i}")
        };
        let cur = ring.arrive(arriving)?;
        if i + 1 < p {
            hop = Some(ring.pass(&cur)?);
        }
        let (kb, vb) = (cur.get(0)?, cur.get(1)?); // [b, 2c, hkv, d]
        let src = ring.src(i);
        let floor = ring.floor(src, c)?;
        if src < r {
            // All local queries see the block's first chunk.
            if ring.skips(&floor, c) {
                continue;
            }
            let (kb, vb) = (kb.narrow(1, 0, c)?, vb.narrow(1, 0, c)?);
            let (ob, lb) = block(q, &kb, &vb, scale, false, floor.as_deref())?;
            (out, lse) = merge((&out, &lse), (&ob, &lb))?;
        } else {
            // The second local chunk sees the whole block.
            if ring.skips(&floor, 2 * c) {
                continue;
            }
            let qh = q.narrow(1, c, c)?;
            let (ob, lb) = block(&qh, &kb, &vb, scale, false, floor.as_deref())?;
            let (oa, la) = (out.narrow(1, c, c)?, lse.narrow(2, c, c)?);
            let (om, lm) = merge((&oa, &la), (&ob, &lb))?;
            out = update_rows(&out, 1, c..2 * c, |_| Ok(om))?;
            lse = update_rows(&lse, 2, c..2 * c, |_| Ok(lm))?;
        }
    }
    Ok((out, lse))
}

/// Which rows of a block's `dK`/`dV` accumulator a step's gradients add to.
enum Rows {
    /// None: the block was skipped.
    None,
    /// All `2c` (the own block, and blocks the second query chunk sees whole).
    All(Tensor),
    /// The first chunk's `c` (blocks whose first chunk every local query sees).
    First(Tensor),
}

/// The ring backward: `(dq, dk, dv)` in the dtypes of `q`, `k`, `v`.
fn backward(
    ring: &Ring,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (p, r, scale) = (ring.size(), ring.index, ring.scale);
    let bwd = ring.kernels.block_bwd;
    let (acc, c) = (lse.dtype(), q.dim(1)? / 2);
    let mut cur = Tensor::stack(&[k, v], 0)?; // [2, b, 2c, hkv, d]
    let mut dq = q.zeros_like()?.to_dtype(acc)?; // [b, 2c, hq, d]
    let second = |t: &Tensor, dim: usize| t.narrow(dim, c, c);
    // The accumulator of the block held, on its way from the previous rank (none at step 0).
    let mut accumulator: Option<Transfer> = None;
    for i in 0..p {
        // The next step's block travels while this one's gradients compute.
        let hop = if i + 1 < p {
            Some(ring.pass(&cur)?)
        } else {
            None
        };
        let (kb, vb) = (cur.get(0)?, cur.get(1)?);
        let src = ring.src(i);
        let floor = ring.floor(src, c)?;
        let fl = floor.as_deref();
        let rows = if i == 0 {
            let (dqb, dkb, dvb) = bwd(q, &kb, &vb, out, dout, lse, scale, true, fl)?;
            dq = (dq + dqb)?;
            Rows::All(Tensor::stack(&[dkb, dvb], 0)?)
        } else if src < r {
            if ring.skips(&floor, c) {
                Rows::None
            } else {
                let (kb, vb) = (kb.narrow(1, 0, c)?, vb.narrow(1, 0, c)?);
                let (dqb, dkb, dvb) = bwd(q, &kb, &vb, out, dout, lse, scale, false, fl)?;
                dq = (dq + dqb)?;
                Rows::First(Tensor::stack(&[dkb, dvb], 0)?) // [2, b, c, hkv, d]
            }
        } else if ring.skips(&floor, 2 * c) {
            Rows::None
        } else {
            let (qh, oh, dh, lh) = (
                second(q, 1)?,
                second(out, 1)?,
                second(dout, 1)?,
                second(lse, 2)?,
            );
            let (dqb, dkb, dvb) = bwd(&qh, &kb, &vb, &oh, &dh, &lh, scale, false, fl)?;
            dq = update_rows(&dq, 1, c..2 * c, |d| d + dqb)?;
            Rows::All(Tensor::stack(&[dkb, dvb], 0)?)
        };
        // [2, b, 2c, hkv, d] in the accumulation dtype
        let mut dkv = match accumulator.take() {
            Some(arriving) => ring.arrive(arriving)?.to_dtype(acc)?,
            None => cur.zeros_like()?.to_dtype(acc)?,
        };
        dkv = match rows {
            Rows::None => dkv,
            Rows::All(add) => (dkv + add)?,
            Rows::First(add) => update_rows(&dkv, 2, 0..c, |d| d + add)?,
        };
        // The accumulator moves on with its block; after `p` moves it is back with its owner.
        accumulator = Some(ring.pass(&dkv)?);
        if let Some(arriving) = hop {
            cur = ring.arrive(arriving)?;
        }
    }
    let Some(own) = accumulator else {
        candle_core::bail!("ring attention: no dK/dV accumulator came back")
    };
    let dkv = ring.arrive(own)?;
    Ok((
        dq.to_dtype(q.dtype())?,
        dkv.get(0)?.to_dtype(k.dtype())?,
        dkv.get(1)?.to_dtype(v.dtype())?,
    ))
}

/// Checks that local `q` and `k` hold two equal chunks of the same rows.
fn check_chunks(q: &Tensor, k: &Tensor) -> Result<()> {
    let s = q.dim(1)?;
    if s % 2 != 0 || k.dim(1)? != s {
        candle_core::bail!(
            "ring attention: local q {:?} and k {:?} must hold two equal chunks",
            q.dims(),
            k.dims()
        )
    }
    Ok(())
}

/// The ring's forward without a graph: the output `[b, 2c, hq, d]` in the dtype of `q` and the
/// log-sum-exp `[b, hq, 2c]` in the accumulation dtype, what [`grads`] reads.
pub(super) fn attention(
    ring: &Ring,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<(Tensor, Tensor)> {
    check_chunks(q, k)?;
    let t0 = Instant::now();
    let (out, lse) = forward(ring, q, k, v)?;
    let out = out.to_dtype(q.dtype())?;
    add_ns(&ring.stats.ring.total_ns, t0);
    Ok((out, lse))
}

/// The ring's backward from [`attention`]'s output and log-sum-exp and the output's gradient `dout`:
/// `(dq, dk, dv)` in the dtypes of `q`, `k`, `v`.
pub(super) fn attention_bwd(
    ring: &Ring,
    qkv: (&Tensor, &Tensor, &Tensor),
    (out, lse): (&Tensor, &Tensor),
    dout: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let t0 = Instant::now();
    let grads = backward(ring, qkv, out, lse, dout);
    add_ns(&ring.stats.ring.total_ns, t0);
    grads
}
