//! How an operand's FP8 codes and inverse scales lie in one byte buffer, in the layouts
//! cuBLASLt reads on Hopper: each GEMM operand K-major, with one scale (tensorwise), one per
//! 1 × 128 run along K (`VEC128_32F`) or one per 128 × 128 tile (`BLK128x128_32F`).
//!
//! A part is the operand's codes as laid out (`[rows, cols]`, K = cols) or transposed
//! (`[cols, rows]`, K = rows), then its scales. The scales of an `mn × K` operand form a grid
//! of blocks; cuBLASLt reads a 1 × 128 grid with `mn` fastest (column-major) and a 128 × 128
//! grid with K fastest (row-major), each line of scales padded to a multiple of 4 (cuBLAS's
//! scale strides; PyTorch pads a weight's tile grid so). The quantizing kernels compute the grid
//! of the tensor as laid out (row-major over its blocks), so a part whose operand grid is that
//! grid's transpose, or whose order is column-major, is written in column-major order of the
//! laid-out grid ([`Part::colmajor`]). Each piece starts 256-byte aligned.

use candle_core::{bail, Result};

use super::Fp8Blocks;

/// How an FP8 GEMM scales one operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LtScale {
    /// One f32 for the whole operand.
    Scalar,
    /// One f32 per 1 × 128 run along K.
    Vec128,
    /// One f32 per 128 × 128 tile.
    Blk128,
}

/// One layout of the codes in a packed buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Part {
    /// Byte offset of the codes (`rows · cols` of them).
    pub codes: usize,
    /// Byte offset of the inverse scales (f32).
    pub scales: usize,
    /// The blocks that share a scale, on the tensor as laid out.
    pub blocks: Fp8Blocks,
    /// Whether the codes are transposed.
    pub transposed: bool,
    /// Scales a line of them holds ([`Part::colmajor`]: a column of the block grid, else a
    /// row), the line's length rounded up to a multiple of 4 as cuBLASLt reads them.
    pub ld: usize,
    /// Lines of scales.
    pub lines: usize,
}

impl Part {
    /// How a GEMM scales this part, or why it cannot read it K-major: blocks of a row (1 × 128)
    /// run along K as laid out, blocks of a column (128 × 1) once transposed.
    pub fn scale(&self) -> Result<LtScale> {
        Ok(match (self.blocks, self.transposed) {
            (Fp8Blocks::Tensor, _) => LtScale::Scalar,
            (Fp8Blocks::Rows, false) | (Fp8Blocks::Cols, true) => LtScale::Vec128,
            (Fp8Blocks::Tiles, _) => LtScale::Blk128,
            (b, t) => bail!(
                "fp8 packing: {b:?} blocks do not run along K of the codes {}",
                if t { "transposed" } else { "as laid out" }
            ),
        })
    }

    /// Whether the scales are written in column-major order of the laid-out tensor's block
    /// grid: 1 × 128 runs as laid out (cuBLASLt reads them `mn` fastest) and tiles transposed
    /// (the operand's grid is the transpose).
    pub fn colmajor(&self) -> bool {
        matches!(
            (self.blocks, self.transposed),
            (Fp8Blocks::Rows, false) | (Fp8Blocks::Tiles, true)
        )
    }
}

/// Where the parts of a packed operand `[rows, cols]` lie in its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Packing {
    pub rows: usize,
    pub cols: usize,
    pub plain: Option<Part>,
    pub transposed: Option<Part>,
    /// Bytes in all.
    pub len: usize,
}

impl Packing {
    /// The packing of `[rows, cols]` with the codes as laid out (`plain`) and/or transposed,
    /// each scaled by the blocks given.
    pub fn new(
        (rows, cols): (usize, usize),
        plain: Option<Fp8Blocks>,
        transposed: Option<Fp8Blocks>,
    ) -> Self {
        let aligned = |x: usize| x.div_ceil(256) * 256;
        let mut at = 0;
        let mut part = |blocks: Option<Fp8Blocks>, transposed: bool| {
            blocks.map(|blocks| {
                let codes = at;
                let scales = aligned(codes + rows * cols);
                let (br, bc) = blocks.dims(rows, cols);
                let (nbr, nbc) = (rows.div_ceil(br.max(1)), cols.div_ceil(bc.max(1)));
                let mut p = Part {
                    codes,
                    scales,
                    blocks,
                    transposed,
                    ld: 1,
                    lines: 1,
                };
                if blocks != Fp8Blocks::Tensor {
                    let (inner, lines) = if p.colmajor() { (nbr, nbc) } else { (nbc, nbr) };
                    (p.ld, p.lines) = (inner.div_ceil(4) * 4, lines);
                }
                at = aligned(scales + 4 * (p.ld * p.lines).max(1));
                p
            })
        };
        let (plain, transposed) = (part(plain, false), part(transposed, true));
        Packing {
            rows,
            cols,
            plain,
            transposed,
            len: at.max(16),
        }
    }

    /// The part of the codes as laid out, or transposed.
    pub fn part(&self, transposed: bool) -> Option<Part> {
        if transposed {
            self.transposed
        } else {
            self.plain
        }
    }

    /// The block grid of a part on `[rows, cols]`: `(rows, columns)` of blocks.
    pub fn grid(&self, part: &Part) -> (usize, usize) {
        let (br, bc) = part.blocks.dims(self.rows, self.cols);
        (self.rows.div_ceil(br.max(1)), self.cols.div_ceil(bc.max(1)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_aligned_and_sized_by_their_blocks() {
        let p = Packing::new((300, 260), Some(Fp8Blocks::Tensor), Some(Fp8Blocks::Tensor));
        let (a, b) = (p.plain.unwrap(), p.transposed.unwrap());
        // 78,000 codes, then one scale, each piece 256-byte aligned.
        assert_eq!(
            (a.codes, a.scales, b.codes, b.scales),
            (0, 78080, 78336, 156416)
        );
        assert_eq!(p.len, 156672);
        let g = Packing::new((300, 260), Some(Fp8Blocks::Rows), Some(Fp8Blocks::Cols));
        let (a, b) = (g.plain.unwrap(), g.transposed.unwrap());
        assert_eq!((g.grid(&a), g.grid(&b)), ((300, 3), (3, 260)));
        // 1 × 128 runs: a line per column of runs, the 300 rows fastest; 128 × 1: a line per
        // row of runs, the 260 columns fastest.
        assert_eq!((a.ld, a.lines, b.ld, b.lines), (300, 3, 260, 3));
        assert_eq!(b.codes, (a.scales + 4 * 900).div_ceil(256) * 256);
        // A weight [384, 640]: tiles 3 × 5; lines of K blocks padded to 8 as laid out (K = 640)
        // and to 4 transposed (K = 384).
        let w = Packing::new((384, 640), Some(Fp8Blocks::Tiles), Some(Fp8Blocks::Tiles));
        let (a, b) = (w.plain.unwrap(), w.transposed.unwrap());
        assert_eq!((a.ld, a.lines, b.ld, b.lines), (8, 3, 4, 5));
        assert_eq!(Packing::new((0, 0), Some(Fp8Blocks::Tensor), None).len, 256);
    }

    /// The scale modes and orders cuBLASLt reads: 1 × 128 runs along K, column-major over `mn`;
    /// tiles row-major over the operand's grid (the laid-out grid transposed for transposed
    /// codes).
    #[test]
    fn each_part_is_scaled_and_ordered_as_cublaslt_reads_it() {
        let part = |blocks, transposed| Part {
            codes: 0,
            scales: 0,
            blocks,
            transposed,
            ld: 1,
            lines: 1,
        };
        use Fp8Blocks::*;
        let cases = [
            (Tensor, false, Some(LtScale::Scalar), false),
            (Tensor, true, Some(LtScale::Scalar), false),
            (Rows, false, Some(LtScale::Vec128), true),
            (Cols, true, Some(LtScale::Vec128), false),
            (Tiles, false, Some(LtScale::Blk128), false),
            (Tiles, true, Some(LtScale::Blk128), true),
            (Rows, true, None, false),
            (Cols, false, None, false),
        ];
        for (blocks, t, scale, colmajor) in cases {
            let p = part(blocks, t);
            assert_eq!(p.scale().ok(), scale, "{blocks:?} transposed {t}");
            if scale.is_some() {
                assert_eq!(p.colmajor(), colmajor, "{blocks:?} transposed {t}");
            }
        }
    }
}
