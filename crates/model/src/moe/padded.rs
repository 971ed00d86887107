//! Routing with every expert's rows padded to its capacity (`moe_capacity_policy: padded`),
//! on the device: the top-k choice, each pair's place among its expert's pairs, the kept pairs'
//! slots and the statistics are tensor operations, and the shapes are fixed (`E · C` rows), so
//! a layer reads nothing back to the host and its grouped GEMMs and all-to-alls have sizes known
//! in advance.
//!
//! ```text
//! probs (+ bias) [n, E] ──arg sort, first k──> chosen [n, k] ──one-hot──> [P, E]   (P = n·k pairs)
//!   place of a pair among its expert's pairs = exclusive prefix sum of the one-hots, in pair order
//!   kept = place < C;  slot = expert · C + place (kept), E · C (dropped: reads a zero row)
//!   pair and token of each slot: products of one-hots (padding: P and n, zero rows)
//! ```
//!
//! Each expert keeps its first `C` pairs in pair (token) order, as `position` does on the host:
//! on the same probabilities the two give the same kept pairs, each expert's in the same order
//! (`tests/moe.rs`). The prefix sums are products with triangular matrices of ones over blocks
//! of [`BLOCK`] pairs (then over the blocks' totals): sums of integers, exact in f32.
//! Ties between equal probabilities go to the lower expert on the CPU; the GPU's sort does not
//! promise an order for them.

use candle_core::{DType, Device, Result, Tensor, D};

use super::routing::{Loads, Plan};

/// Pairs per block of the prefix sums.
const BLOCK: usize = 128;

/// The most experts a padded layer may have: the GPU sorts a token's experts in one thread
/// block's shared memory (4 bytes each, a power of two of them, in 48 KiB).
pub const MAX_PADDED_EXPERTS: usize = 8192;

/// `x` `[p, c]` (f32) summed over the rows before each row: `out[i] = Σ_{j < i} x[j]` (exact
/// for integer counts below 2^24, as long as f32 products are not rounded to TF32, which
/// nothing here enables).
fn exclusive_prefix_sum(x: &Tensor) -> Result<Tensor> {
    let (p, c) = x.dims2()?;
    let dev = x.device();
    if p <= BLOCK {
        return strictly_lower(p, dev)?.matmul(x); // [p, c]
    }
    let blocks = p.div_ceil(BLOCK);
    let padded = if blocks * BLOCK > p {
        let zeros = Tensor::zeros((blocks * BLOCK - p, c), x.dtype(), dev)?;
        Tensor::cat(&[x, &zeros], 0)?
    } else {
        x.clone()
    };
    // [blocks, BLOCK, c]; every block at once: one product with their rows side by side.
    let b = padded.reshape((blocks, BLOCK, c))?;
    let side = b
        .transpose(0, 1)?
        .contiguous()?
        .reshape((BLOCK, blocks * c))?;
    let within = strictly_lower(BLOCK, dev)?
        .matmul(&side)? // [BLOCK, blocks·c]
        .reshape((BLOCK, blocks, c))?
        .transpose(0, 1)?; // [blocks, BLOCK, c]
    let before = exclusive_prefix_sum(&b.sum(1)?)?; // [blocks, c]
    within
        .broadcast_add(&before.unsqueeze(1)?)?
        .reshape((blocks * BLOCK, c))?
        .narrow(0, 0, p)
}

/// The `[n, n]` f32 matrix with ones below the diagonal.
fn strictly_lower(n: usize, dev: &Device) -> Result<Tensor> {
    let rows = Tensor::arange(0u32, n as u32, dev)?.unsqueeze(1)?; // [n, 1]
    let cols = Tensor::arange(0u32, n as u32, dev)?.unsqueeze(0)?; // [1, n]
    rows.broadcast_gt(&cols)?.to_dtype(DType::F32)
}

/// Most elements of one chunk of place one-hots in [`slot_pairs`] (64 MiB of f32).
const CHUNK_ELEMS: usize = 1 << 24;

/// The pair and the token of each slot `e·C + c` (u32 `[E·C]` each): expert `e`'s kept pair at
/// place `c`, or for an unused slot `P` and `n` (past the last pair and token). Found as a sum
/// over the pairs of `[expert is e]·[place is c]·(pair + 1)`, a product of one-hots over chunks
/// of pairs with one non-zero term per slot (exact in f32), rather than by writing each pair to
/// its slot: candle's scatters run one GPU thread per column through every index.
fn slot_pairs(
    one_hot: &Tensor,
    place: &Tensor,
    (n, k): (usize, usize),
    capacity: usize,
    chunk_elems: usize,
) -> Result<(Tensor, Tensor)> {
    let (p, e) = one_hot.dims2()?;
    let dev = one_hot.device();
    let ids = |count: usize| -> Result<Tensor> {
        Tensor::arange(0u32, count as u32, dev)?.to_dtype(DType::F32)? + 1.0 // [count]
    };
    let tokens = ids(n)?.unsqueeze(1)?.broadcast_as((n, k))?.flatten_all()?; // [P]

    // Each pair's id and token (plus one: zero is "none") in its expert's column: [P, 2E].
    let marked = Tensor::cat(
        &[
            one_hot.broadcast_mul(&ids(p)?.unsqueeze(1)?)?,
            one_hot.broadcast_mul(&tokens.unsqueeze(1)?)?,
        ],
        1,
    )?;
    let places = Tensor::arange(0u32, capacity as u32, dev)?
        .to_dtype(DType::F32)?
        .unsqueeze(0)?; // [1, C]
    let chunk = (chunk_elems / capacity.max(1)).max(1);
    let mut found = Tensor::zeros((2 * e, capacity), DType::F32, dev)?; // [2E, C]
    for start in (0..p).step_by(chunk) {
        let len = chunk.min(p - start);
        // [len, C]: a dropped pair's place matches none.
        let at = place
            .narrow(0, start, len)?
            .unsqueeze(1)?
            .broadcast_eq(&places)?
            .to_dtype(DType::F32)?;
        found = (found + marked.narrow(0, start, len)?.t()?.matmul(&at)?)?;
    }
    // Found: the value less one; none: the value past the last.
    let resolve = |v: Tensor, none: usize| -> Result<Tensor> {
        let missing = v.eq(0.0)?.to_dtype(DType::F32)?;
        ((v - 1.0)? + (missing * (none + 1) as f64)?)?
            .flatten_all()?
            .to_dtype(DType::U32) // [E·C]
    };
    Ok((
        resolve(found.narrow(0, 0, e)?, p)?,
        resolve(found.narrow(0, e, e)?, n)?,
    ))
}

/// The plan of routing the rows of `probs` `[n, E]` (f32 or f64, on the device) to their top
/// `k` experts ranked by `probs + bias`, each expert taking its first `capacity` pairs and its
/// rows padded to `capacity`.
pub(super) fn route(
    probs: &Tensor,
    bias: Option<&[f32]>,
    k: usize,
    capacity: usize,
) -> Result<Plan> {
    let (n, e) = probs.dims2()?;
    let dev = probs.device();
    let p = n * k;
    let rows = e * capacity;
    if rows >= 1 << 24 || p >= 1 << 24 {
        candle_core::bail!(
            "padded MoE routing: {p} pairs and {rows} rows exceed the 2^24 that f32 counts exactly"
        );
    }
    let scores = probs.to_dtype(DType::F32)?;
    let scores = match bias {
        Some(b) => scores.broadcast_add(&Tensor::from_slice(b, (1, e), dev)?)?,
        None => scores,
    };
    // A NaN (a diverged router) ranks last, as on the host, and leaves the sort a total order.
    let nan = scores.ne(&scores)?;
    let scores = nan.where_cond(
        &scores.ones_like()?.affine(0.0, f64::NEG_INFINITY)?,
        &scores,
    )?;
    let chosen = scores
        .arg_sort_last_dim(false)?
        .narrow(1, 0, k)?
        .contiguous()?; // [n, k] u32
    let experts = chosen.flatten_all()?; // [P]
    let ids = Tensor::arange(0u32, e as u32, dev)?.unsqueeze(0)?; // [1, E]
    let one_hot = experts
        .unsqueeze(1)?
        .broadcast_eq(&ids)?
        .to_dtype(DType::F32)?; // [P, E]
    let place = (exclusive_prefix_sum(&one_hot)? * &one_hot)?.sum(1)?; // [P]
    let kept = place.lt(capacity as f64)?.to_dtype(DType::F32)?; // [P], 1 or 0
    let slot = ((experts.to_dtype(DType::F32)? * capacity as f64)? + &place)?;
    // Kept: the slot; dropped: the slot past the last (`rows`, a zero row when gathered).
    let inverse = ((slot - rows as f64)?.mul(&kept)? + rows as f64)?; // [P]
    let slots = inverse.to_dtype(DType::U32)?;
    let (order, tokens) = slot_pairs(&one_hot, &place, (n, k), capacity, CHUNK_ELEMS)?;
    let loads = one_hot.sum(0)?; // [E]
    let dropped = (kept.sum_all()?.neg()? + p as f64)?.reshape(1)?;
    Ok(Plan {
        chosen,
        tokens,
        order,
        inverse: slots,
        counts: vec![capacity; e],
        loads: Loads::Device(Tensor::cat(&[&loads, &dropped], D::Minus1)?),
        n,
        k,
        padded: true,
    })
}

/// The index tables and counts of [`route`] for `probs` `[n, E]` (no bias): the chosen experts
/// `[n, k]`, the token and the pair of each row `[E·C]`, the row of each pair `[n·k]` (u32),
/// and the loads with the drops `[E + 1]` (f32); for the self-test, which compares a device's
/// with the CPU's.
pub fn padded_tables(probs: &Tensor, k: usize, capacity: usize) -> Result<Vec<Tensor>> {
    let plan = route(probs, None, k, capacity)?;
    let Loads::Device(loads) = plan.loads else {
        candle_core::bail!("padded routing counted its loads on the host");
    };
    Ok(vec![
        plan.chosen,
        plan.tokens,
        plan.order,
        plan.inverse,
        loads,
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kept pair is found in its slot, with its token, whatever the chunks; the other
    /// slots point past the last pair and token; a NaN probability ranks last.
    #[test]
    fn each_slot_holds_its_kept_pair_in_any_chunking() {
        let dev = Device::Cpu;
        let (n, e, k, capacity) = (40, 4, 2, 15); // 80 pairs, 60 slots
        let mut v: Vec<f32> = (0..n * e).map(|i| ((i * 37 + 11) % 97) as f32).collect();
        v[3] = f32::NAN; // token 0, expert 3
        let probs = Tensor::from_vec(v, (n, e), &dev).unwrap();
        let plan = route(&probs, None, k, capacity).unwrap();
        let chosen = plan.chosen.to_vec2::<u32>().unwrap();
        assert!(!chosen[0].contains(&3), "{:?}", chosen[0]);
        let inverse = plan.inverse.to_vec1::<u32>().unwrap();
        let rows = e * capacity;
        let kept = inverse.iter().filter(|&&s| (s as usize) < rows).count();
        assert!(kept < n * k, "the case drops nothing");
        let experts = chosen.concat();
        let one_hot = Tensor::from_iter(
            (0..n * k * e).map(|i| f32::from(experts[i / e] as usize == i % e)),
            &dev,
        )
        .unwrap()
        .reshape((n * k, e))
        .unwrap();
        let place = exclusive_prefix_sum(&one_hot)
            .unwrap()
            .mul(&one_hot)
            .unwrap()
            .sum(1)
            .unwrap();
        for chunk in [CHUNK_ELEMS, capacity, 7 * capacity] {
            let (order, tokens) = slot_pairs(&one_hot, &place, (n, k), capacity, chunk).unwrap();
            let (order, tokens) = (
                order.to_vec1::<u32>().unwrap(),
                tokens.to_vec1::<u32>().unwrap(),
            );
            let mut want = (vec![(n * k) as u32; rows], vec![n as u32; rows]);
            for (pair, &slot) in inverse.iter().enumerate() {
                if (slot as usize) < rows {
                    want.0[slot as usize] = pair as u32;
                    want.1[slot as usize] = (pair / k) as u32;
                }
            }
            assert_eq!((order, tokens), want, "chunks of {chunk} elements");
        }
    }

    #[test]
    fn prefix_sums_are_exact_across_blocks() {
        let dev = Device::Cpu;
        for p in [1, 5, BLOCK, BLOCK + 1, 3 * BLOCK + 7, BLOCK * BLOCK + 3] {
            let x: Vec<f32> = (0..2 * p).map(|i| ((i * 7 + 3) % 5) as f32).collect();
            let t = Tensor::from_vec(x.clone(), (p, 2), &dev).unwrap();
            let got = exclusive_prefix_sum(&t).unwrap().to_vec2::<f32>().unwrap();
            let mut run = [0f32; 2];
            for (i, row) in got.iter().enumerate() {
                assert_eq!(row.as_slice(), run.as_slice(), "p {p} row {i}");
                run[0] += x[2 * i];
                run[1] += x[2 * i + 1];
            }
        }
    }
}
