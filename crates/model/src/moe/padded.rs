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
//!   pair of each slot: scattered from the slots (padding: P, a zero row); token = pair / k
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

/// `x` `[p, c]` (f32) summed over the rows before each row: `out[i] = Σ_{j < i} x[j]`.
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
    let b = padded.reshape((blocks, BLOCK, c))?; // [blocks, BLOCK, c]
    let within = strictly_lower(BLOCK, dev)?
        .unsqueeze(0)?
        .broadcast_as((blocks, BLOCK, BLOCK))?
        .contiguous()?
        .matmul(&b)?; // [blocks, BLOCK, c]
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
                                                                      // Each kept pair's index and token written to its slot (slots are distinct): an unused slot
                                                                      // keeps P (a pair past the last) and n (a token past the last); the slot past the end
                                                                      // gathers the dropped pairs and is cut off.
    let slots = inverse.to_dtype(DType::U32)?;
    let to_slots = |v: Tensor, none: usize| -> Result<Tensor> {
        (Tensor::zeros(rows + 1, DType::F32, dev)?
            .index_add(&slots, &(v - none as f64)?, 0)?
            .narrow(0, 0, rows)?
            + none as f64)?
            .to_dtype(DType::U32) // [rows]
    };
    let pairs = Tensor::arange(0u32, p as u32, dev)?.to_dtype(DType::F32)?; // [P]
    let token_of_pair = Tensor::arange(0u32, n as u32, dev)?
        .to_dtype(DType::F32)?
        .unsqueeze(1)?
        .broadcast_as((n, k))?
        .flatten_all()?; // [P]
    let order = to_slots(pairs, p)?;
    let tokens = to_slots(token_of_pair, n)?;
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
