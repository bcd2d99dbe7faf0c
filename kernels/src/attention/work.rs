//! What an attention call will compute, counted in the kernels' own tiles.
//!
//! The forward and the backward cut `Q` into tiles of [`BR`] rows and `K`/`V` into tiles of [`BC`] rows, and
//! classify every (query tile, key tile) pair from the mask's position and document ranges: hidden pairs are
//! skipped, fully visible ones run without a per-element mask, the rest (e.g. on a causal diagonal) run with
//! it. [`attention_work`] runs that same classification without touching any data, so a caller can know the
//! cost of a call before making it: a context-parallel schedule checks that its ranks get equal work, a
//! planner estimates time from a measured rate per score, a benchmark divides time by work.

use super::mask::{tile_summaries, TileClass};
use super::{AttnParams, BC, BR};
use crate::error::Result;

/// The tile pairs of one attention call, summed over batch elements and query heads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AttnWork {
    /// Pairs computed with no per-element mask (every query of the tile sees every key).
    pub visible_tiles: u64,
    /// Pairs computed with a per-element mask (some but perhaps not all pairs visible).
    pub partial_tiles: u64,
    /// Pairs skipped (the mask hides every key of the tile from every query).
    pub hidden_tiles: u64,
    /// Query-key scores the kernels compute: rows × columns of every visible and partial tile. The
    /// forward's two products (`Q·Kᵀ`, `P·V`) each cost `2·D` flops per score, the backward's four the same.
    pub scores: u64,
}

impl AttnWork {
    /// Forward flops of the matrix products (`4·D` per computed score).
    pub fn forward_flops(&self, head_dim: usize) -> f64 {
        4.0 * head_dim as f64 * self.scores as f64
    }

    /// Backward flops of the matrix products (`Q·Kᵀ` again, `dO·Vᵀ`, `dS·K`, `dSᵀ·Q`, `Pᵀ·dO`: `10·D`
    /// per computed score).
    pub fn backward_flops(&self, head_dim: usize) -> f64 {
        10.0 * head_dim as f64 * self.scores as f64
    }
}

impl std::ops::Add for AttnWork {
    type Output = AttnWork;
    fn add(self, o: AttnWork) -> AttnWork {
        AttnWork {
            visible_tiles: self.visible_tiles + o.visible_tiles,
            partial_tiles: self.partial_tiles + o.partial_tiles,
            hidden_tiles: self.hidden_tiles + o.hidden_tiles,
            scores: self.scores + o.scores,
        }
    }
}

impl std::iter::Sum for AttnWork {
    fn sum<I: Iterator<Item = AttnWork>>(it: I) -> AttnWork {
        it.fold(AttnWork::default(), |a, b| a + b)
    }
}

/// Counts the tile pairs that the CPU backend's [`attention_forward`](crate::Backend::attention_forward) and
/// [`attention_backward`](crate::Backend::attention_backward) compute and skip for `p` (both use the same tiles
/// and classification). Costs `O(Sq + Sk)` for the range summaries plus one test per tile pair; reads no data.
///
/// ```
/// use longctx_kernels::{attention_work, AttnMask, AttnParams, AttnShape};
/// // 512 causal rows are 4 × 4 tiles of 128: 4 diagonal tiles masked per element, 6 below it full, 6 skipped.
/// let shape = AttnShape { batch: 1, q_heads: 2, kv_heads: 1, q_len: 512, kv_len: 512, head_dim: 64 };
/// let w = attention_work(&AttnParams::new(shape).with_mask(AttnMask::causal()))?;
/// assert_eq!((w.partial_tiles, w.visible_tiles, w.hidden_tiles), (2 * 4, 2 * 6, 2 * 6));
/// assert_eq!(w.scores, 2 * 10 * 128 * 128);
/// # Ok::<(), longctx_kernels::KernelError>(())
/// ```
pub fn attention_work(p: &AttnParams<'_>) -> Result<AttnWork> {
    p.validate()?;
    let s = p.shape;
    let q_sum = tile_summaries(&p.mask, true, s.q_len, BR);
    let k_sum = tile_summaries(&p.mask, false, s.kv_len, BC);
    let mut w = AttnWork::default();
    for (qt, q) in q_sum.iter().enumerate() {
        let rows = (BR.min(s.q_len - qt * BR)) as u64;
        for (kt, k) in k_sum.iter().enumerate() {
            let cols = (BC.min(s.kv_len - kt * BC)) as u64;
            match p.mask.classify(q, k) {
                TileClass::Hidden => w.hidden_tiles += 1,
                TileClass::Visible => {
                    w.visible_tiles += 1;
                    w.scores += rows * cols;
                }
                TileClass::Partial => {
                    w.partial_tiles += 1;
                    w.scores += rows * cols;
                }
            }
        }
    }
    // The mask is shared by every batch element and query head.
    let heads = (s.batch * s.q_heads) as u64;
    Ok(AttnWork {
        visible_tiles: w.visible_tiles * heads,
        partial_tiles: w.partial_tiles * heads,
        hidden_tiles: w.hidden_tiles * heads,
        scores: w.scores * heads,
    })
}
