//! Where a pipeline's model chunks sit. The model is cut into `pp × v` consecutive global chunks;
//! stage `s` holds `v` of them, its local chunks `0..v`:
//!
//! - [`ChunkPlacement::Looped`] (Megatron's virtual pipeline): local chunk `c` of stage `s` is
//!   global chunk `c·pp + s`; activations always go on to the next stage, the last stage's to the
//!   first stage's next chunk.
//! - [`ChunkPlacement::Vee`] (the zero-bubble V schedules): chunks zig-zag, down the stages and
//!   back up: with `v = 2`, stage `s` holds global chunks `s` and `2·pp − 1 − s`, so the first
//!   stage holds both the embedding and the head, and the last stage hands its first chunk's
//!   output to its own second chunk without a message.

/// How global chunks map to (stage, local chunk); see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ChunkPlacement {
    /// Local chunk `c` of stage `s` is global chunk `c·pp + s`.
    #[default]
    Looped,
    /// Even local chunks run down the stages, odd ones back up.
    Vee,
}

impl ChunkPlacement {
    /// The global chunk of local chunk `chunk` on `stage` (of `pp` stages).
    pub fn global(self, pp: usize, stage: usize, chunk: usize) -> usize {
        match self {
            ChunkPlacement::Vee if chunk % 2 == 1 => chunk * pp + (pp - 1 - stage),
            _ => chunk * pp + stage,
        }
    }

    /// `(stage, local chunk)` of global chunk `global`.
    pub fn locate(self, pp: usize, global: usize) -> (usize, usize) {
        let (chunk, within) = (global / pp, global % pp);
        match self {
            ChunkPlacement::Vee if chunk % 2 == 1 => (pp - 1 - within, chunk),
            _ => (within, chunk),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locate_inverts_global() {
        for placement in [ChunkPlacement::Looped, ChunkPlacement::Vee] {
            for pp in 1..6 {
                for v in 1..5 {
                    for g in 0..pp * v {
                        let (s, c) = placement.locate(pp, g);
                        assert!(s < pp && c < v);
                        assert_eq!(placement.global(pp, s, c), g, "{placement:?} {pp} {v}");
                    }
                }
            }
        }
        // pp 4, v 2: stage 0 holds chunks 0 and 7, stage 3 chunks 3 and 4.
        let vee = ChunkPlacement::Vee;
        assert_eq!((vee.global(4, 0, 1), vee.global(4, 3, 1)), (7, 4));
        assert_eq!(vee.locate(4, 5), (2, 1));
        assert_eq!(ChunkPlacement::Looped.locate(4, 5), (1, 1));
    }
}
