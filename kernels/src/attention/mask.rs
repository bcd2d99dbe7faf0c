//! Attention masks given by **global token positions**.
//!
//! A query block holds the tokens at positions `q_pos`, a key block those at `k_pos`. Whether query `i` may see
//! key `j` depends only on the two positions (and optional document ids), never on where the rows sit in the
//! buffers. That is what lets ring attention combine a query block from one part of the sequence with a key
//! block from another and still get exactly the rows of full attention.

use crate::error::{check_len, KernelError, Result};

/// The global positions of the rows of one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Positions<'a> {
    /// Consecutive positions `start, start + 1, …`.
    Offset(i64),
    /// One position per row (e.g. a zigzag shard holds two separate ranges).
    Explicit(&'a [i64]),
}

impl Positions<'_> {
    /// The position of row `i`.
    #[inline(always)]
    pub fn get(&self, i: usize) -> i64 {
        match self {
            Positions::Offset(s) => s + i as i64,
            Positions::Explicit(p) => p[i],
        }
    }
}

impl Default for Positions<'_> {
    fn default() -> Self {
        Positions::Offset(0)
    }
}

/// Which keys each query may attend to. The mask is shared by every batch element and head.
///
/// Query at position `p` sees key at position `t` iff all of these hold:
/// - `causal` is off, or `t <= p`;
/// - `window` is `None`, or the distance is below it: `p - t < w` when causal, `|p - t| < w` otherwise;
/// - document ids are absent, or `q_doc[i] == k_doc[j]` (packed sequences).
#[derive(Debug, Clone, Copy, Default)]
pub struct AttnMask<'a> {
    /// Positions of the query rows.
    pub q_pos: Positions<'a>,
    /// Positions of the key rows.
    pub k_pos: Positions<'a>,
    /// Keys after the query are hidden.
    pub causal: bool,
    /// Sliding window: only keys closer than this many positions are seen (`Some(0)` is rejected).
    pub window: Option<u64>,
    /// Document id of each query row (length `Sq`); needs `k_doc`.
    pub q_doc: Option<&'a [u32]>,
    /// Document id of each key row (length `Sk`); needs `q_doc`.
    pub k_doc: Option<&'a [u32]>,
}

impl<'a> AttnMask<'a> {
    /// No masking: every query sees every key.
    pub fn full() -> Self {
        Self::default()
    }
    /// Causal mask with both blocks starting at position 0.
    pub fn causal() -> Self {
        Self { causal: true, ..Self::default() }
    }
    /// Sets the positions of the two blocks.
    pub fn with_positions(mut self, q_pos: Positions<'a>, k_pos: Positions<'a>) -> Self {
        self.q_pos = q_pos;
        self.k_pos = k_pos;
        self
    }
    /// Sets a sliding window.
    pub fn with_window(mut self, window: u64) -> Self {
        self.window = Some(window);
        self
    }
    /// Sets the document ids of the two blocks (packed sequences).
    pub fn with_docs(mut self, q_doc: &'a [u32], k_doc: &'a [u32]) -> Self {
        self.q_doc = Some(q_doc);
        self.k_doc = Some(k_doc);
        self
    }

    /// Checks slice lengths against the block sizes.
    pub fn validate(&self, q_len: usize, kv_len: usize) -> Result<()> {
        if let Positions::Explicit(p) = self.q_pos {
            check_len("q_pos", p.len(), q_len)?;
        }
        if let Positions::Explicit(p) = self.k_pos {
            check_len("k_pos", p.len(), kv_len)?;
        }
        if self.window == Some(0) {
            return Err(KernelError::InvalidArgument { name: "window", why: "a window of 0 hides every key".into() });
        }
        match (self.q_doc, self.k_doc) {
            (None, None) => {}
            (Some(q), Some(k)) => {
                check_len("q_doc", q.len(), q_len)?;
                check_len("k_doc", k.len(), kv_len)?;
            }
            _ => {
                return Err(KernelError::InvalidArgument {
                    name: "q_doc/k_doc",
                    why: "document ids must be given for both queries and keys".into(),
                })
            }
        }
        Ok(())
    }

    /// Whether query row `i` sees key row `j`.
    #[inline(always)]
    pub fn visible(&self, i: usize, j: usize) -> bool {
        let p = self.q_pos.get(i);
        let t = self.k_pos.get(j);
        self.visible_pos(p, t) && self.same_doc(i, j)
    }

    #[inline(always)]
    fn visible_pos(&self, p: i64, t: i64) -> bool {
        if self.causal && t > p {
            return false;
        }
        match self.window {
            None => true,
            Some(w) => (p - t).unsigned_abs() < w,
        }
    }

    #[inline(always)]
    fn same_doc(&self, i: usize, j: usize) -> bool {
        match (self.q_doc, self.k_doc) {
            (Some(q), Some(k)) => q[i] == k[j],
            _ => true,
        }
    }

    /// False when no query row of the block can see any key row (so the whole block may be skipped); true
    /// when some may. Conservative: decided from the blocks' position and document ranges.
    pub fn may_see_any(&self, q_len: usize, kv_len: usize) -> bool {
        let q = self.summarize(true, 0, q_len);
        let k = self.summarize(false, 0, kv_len);
        self.classify(&q, &k) != TileClass::Hidden
    }

    /// Summary of rows `range` of the query block (when `query`) or of the key block.
    pub(crate) fn summarize(&self, query: bool, start: usize, end: usize) -> RangeSummary {
        let (pos, doc) = if query { (self.q_pos, self.q_doc) } else { (self.k_pos, self.k_doc) };
        let mut s = RangeSummary { pos_min: i64::MAX, pos_max: i64::MIN, doc_min: u32::MAX, doc_max: 0 };
        for i in start..end {
            let p = pos.get(i);
            s.pos_min = s.pos_min.min(p);
            s.pos_max = s.pos_max.max(p);
        }
        if let Some(d) = doc {
            for &x in &d[start..end] {
                s.doc_min = s.doc_min.min(x);
                s.doc_max = s.doc_max.max(x);
            }
        } else {
            s.doc_min = 0;
        }
        s
    }

    /// Classifies a (query tile, key tile) pair from the two tiles' summaries, conservatively: `Hidden` and
    /// `Visible` are only returned when they hold for every pair of rows.
    pub(crate) fn classify(&self, q: &RangeSummary, k: &RangeSummary) -> TileClass {
        // Every pair hidden?
        if self.causal && k.pos_min > q.pos_max {
            return TileClass::Hidden;
        }
        if let Some(w) = self.window {
            let w = w as i128;
            // Smallest distance p - t over the tiles is q.pos_min - k.pos_max (when the key tile lies before).
            if (q.pos_min as i128 - k.pos_max as i128) >= w {
                return TileClass::Hidden;
            }
            if !self.causal && (k.pos_min as i128 - q.pos_max as i128) >= w {
                return TileClass::Hidden;
            }
        }
        let docs = self.q_doc.is_some();
        if docs && (q.doc_max < k.doc_min || k.doc_max < q.doc_min) {
            return TileClass::Hidden;
        }
        // Every pair visible?
        let causal_ok = !self.causal || k.pos_max <= q.pos_min;
        let window_ok = match self.window {
            None => true,
            Some(w) => {
                let w = w as i128;
                let far1 = q.pos_max as i128 - k.pos_min as i128;
                let far2 = k.pos_max as i128 - q.pos_min as i128;
                far1 < w && far2 < w
            }
        };
        let docs_ok = !docs || (q.doc_min == q.doc_max && k.doc_min == k.doc_max && q.doc_min == k.doc_min);
        if causal_ok && window_ok && docs_ok {
            TileClass::Visible
        } else {
            TileClass::Partial
        }
    }
}

/// Position and document extremes of a run of rows.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RangeSummary {
    pub pos_min: i64,
    pub pos_max: i64,
    pub doc_min: u32,
    pub doc_max: u32,
}

/// How a tile pair is masked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TileClass {
    /// No query sees any key: skipped.
    Hidden,
    /// Every query sees every key: no per-element mask.
    Visible,
    /// Mixed: per-element mask.
    Partial,
}

/// Summaries of consecutive tiles of `tile` rows.
pub(crate) fn tile_summaries(mask: &AttnMask<'_>, query: bool, len: usize, tile: usize) -> Vec<RangeSummary> {
    (0..len.div_ceil(tile)).map(|t| mask.summarize(query, t * tile, ((t + 1) * tile).min(len))).collect()
}
