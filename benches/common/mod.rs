//! What the CPU step benches share: the synthetic token stream `bench/torch_llama.py` also
//! generates, so both sides train on the same batch.

use data::Batch;

/// `micro` micro-batches of `b` rows of `s` tokens (and their next tokens) from the stream
/// x_{i+1} = (x_i · 6364136223846793005 + 1442695040888963407) mod 2⁶⁴ from 42, token =
/// (x >> 33) mod `vocab` (`synthetic_batches` of bench/torch_llama.py).
pub fn synthetic_batches(vocab: u64, micro: usize, b: usize, s: usize) -> Vec<Batch> {
    let mut x: u64 = 42;
    let mut next = || {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((x >> 33) % vocab) as u32
    };
    (0..micro)
        .map(|_| {
            let seqs: Vec<Vec<u32>> = (0..b).map(|_| (0..=s).map(|_| next()).collect()).collect();
            Batch {
                tokens: seqs.iter().flat_map(|q| q[..s].to_vec()).collect(),
                labels: seqs.iter().flat_map(|q| q[1..].to_vec()).collect(),
                loss_mask: vec![1.0; b * s],
                micro_batch: b,
                seq_len: s,
                doc_starts: None,
            }
        })
        .collect()
}
