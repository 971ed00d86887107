//! Where a model's pieces and state lie once it is cut for pipelines and ZeRO: the pieces of a
//! pipeline chunk ([`chunk_pieces`]), the parameters each reads in order ([`piece_params`]) and
//! the flat state layout they make on a rank ([`state_layout`]). The trainer builds ranks from
//! these and the planner counts them; neither owns them.

use parallel::dp::StateLayout;
use parallel::ParallelConfig;

use crate::{Inventory, Piece};

/// The pieces of global chunk `g`, where global chunk `k` holds `layers[k]` consecutive layers
/// (`layers` has `pp · v` entries), with the embedding if it is the first global chunk and the
/// head if it is the last. Which stage holds it is the schedule's
/// [`ChunkPlacement`](parallel::pipeline::ChunkPlacement).
pub fn chunk_pieces(g: usize, layers: &[usize]) -> Vec<Piece> {
    let first: usize = layers[..g].iter().sum();
    let mut pieces = Vec::new();
    if g == 0 {
        pieces.push(Piece::Embedding);
    }
    pieces.extend((first..first + layers[g]).map(Piece::Block));
    if g + 1 == layers.len() {
        pieces.push(Piece::Head);
    }
    pieces
}

/// The parameters each piece in `chunks` reads, in execution order (what ZeRO-2/3 buckets
/// follow).
pub fn piece_params(inventory: &Inventory, chunks: &[Vec<Piece>]) -> Vec<Vec<usize>> {
    chunks
        .iter()
        .flatten()
        .map(|&p| inventory.piece_params(p))
        .collect()
}

/// The state layout of a rank at shard index `shard_index` (`expert_index` in its expert
/// gradient group) holding the part `inventory` describes (local sizes `numels`) in pipeline
/// chunks `chunks`.
pub fn state_layout(
    par: &ParallelConfig,
    inventory: &Inventory,
    numels: &[usize],
    chunks: &[Vec<Piece>],
    (shard_index, expert_index): (usize, usize),
) -> StateLayout {
    let pieces = piece_params(inventory, chunks);
    let (expert, joined) = (inventory.expert_flags(), inventory.joined_flags());
    let flags = (expert.as_slice(), joined.as_slice());
    StateLayout::new(par, numels, &pieces, flags, shard_index, expert_index)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_hold_consecutive_layers_with_embedding_first_and_head_last() {
        use Piece::{Block, Embedding, Head};
        // One stage, one chunk: the whole model.
        assert_eq!(
            chunk_pieces(0, &[3]),
            vec![Embedding, Block(0), Block(1), Block(2), Head]
        );
        // 8 layers in 4 chunks (pp 2 × v 2: stage 0 holds global chunks 0 and 2 when looped, 0
        // and 3 as a V).
        let even = [2, 2, 2, 2];
        assert_eq!(chunk_pieces(0, &even), vec![Embedding, Block(0), Block(1)]);
        assert_eq!(chunk_pieces(2, &even), vec![Block(4), Block(5)]);
        assert_eq!(chunk_pieces(1, &even), vec![Block(2), Block(3)]);
        assert_eq!(chunk_pieces(3, &even), vec![Block(6), Block(7), Head]);
        // Uneven: pp 3 over 7 layers as [1, 4, 2]; an end chunk may hold no layer.
        assert_eq!(chunk_pieces(0, &[1, 4, 2]), vec![Embedding, Block(0)]);
        assert_eq!(
            chunk_pieces(1, &[1, 4, 2]),
            (1..5).map(Block).collect::<Vec<_>>()
        );
        assert_eq!(chunk_pieces(2, &[1, 4, 2]), vec![Block(5), Block(6), Head]);
        assert_eq!(chunk_pieces(1, &[3, 0]), vec![Head]);
    }
}
