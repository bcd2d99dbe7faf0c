//! The building blocks the families draw their cases from: element types, [`GradMode`], token positions
//! (consecutive, or a zigzag shard's two ranges), documents, and whole attention masks ([`MaskCase`]). Each family's
//! module has its case type and strategy (e.g. [`attention::cases`](super::attention::cases)); these are public so a
//! test of a framework's own can draw the same shapes.

use std::fmt;

use proptest::prelude::*;

use crate::attention::{AttnMask, Positions};
use crate::backend::GradMode;
use crate::dtype::DType;

/// `f32` or `bf16`.
pub fn dtype() -> impl Strategy<Value = DType> + Clone {
    prop_oneof![Just(DType::F32), Just(DType::Bf16), Just(DType::F16)]
}

/// Overwrite or accumulate.
pub fn grad_mode() -> impl Strategy<Value = GradMode> + Clone {
    prop_oneof![Just(GradMode::Overwrite), Just(GradMode::Accumulate)]
}

/// The positions of `len` rows: consecutive from a start in `0..max_start`, or (as a zigzag context-parallel
/// shard holds them) two consecutive runs with a gap between them.
pub fn positions(len: usize, max_start: i64) -> impl Strategy<Value = Vec<i64>> + Clone {
    let consecutive = (0..max_start.max(1)).prop_map(move |s| (s..s + len as i64).collect::<Vec<i64>>());
    let zigzag = (0..max_start.max(1), 1..=len.max(1), 1i64..200).prop_map(move |(s, first, gap)| {
        let first = first.min(len);
        let second = s + first as i64 + gap;
        (s..s + first as i64).chain(second..second + (len - first) as i64).collect::<Vec<i64>>()
    });
    prop_oneof![consecutive, zigzag]
}

/// Document boundaries: the positions where a new document starts (0 to 4 of them below `max_pos`), or no
/// document ids at all.
pub fn document_cuts(max_pos: i64) -> impl Strategy<Value = Option<Vec<i64>>> + Clone {
    prop::option::of(prop::collection::vec(1..max_pos.max(2), 0..5))
}

/// The document of a token at `pos` given the boundaries `cuts`.
pub fn document_of(cuts: &[i64], pos: i64) -> u32 {
    cuts.iter().filter(|&&c| c <= pos).count() as u32
}

/// An attention mask with the data it borrows: causal or not, a window or not, the positions of the query and key
/// rows, and document ids (derived from one set of boundaries, so queries and keys agree on them).
#[derive(Clone, PartialEq)]
pub struct MaskCase {
    /// Keys after the query are hidden.
    pub causal: bool,
    /// Sliding window.
    pub window: Option<u64>,
    /// Positions of the query rows.
    pub q_pos: Vec<i64>,
    /// Positions of the key rows.
    pub k_pos: Vec<i64>,
    /// Pass the positions as [`Positions::Explicit`]; otherwise as [`Positions::Offset`] of the first, which needs
    /// them consecutive.
    pub explicit: bool,
    /// The document boundaries (see [`document_cuts`]), when the mask has document ids.
    pub cuts: Option<Vec<i64>>,
    q_doc: Vec<u32>,
    k_doc: Vec<u32>,
}

impl MaskCase {
    /// A mask over rows at `q_pos` and `k_pos` (explicit when either is not consecutive).
    pub fn new(causal: bool, window: Option<u64>, q_pos: Vec<i64>, k_pos: Vec<i64>, cuts: Option<Vec<i64>>) -> Self {
        let consecutive = |p: &[i64]| p.windows(2).all(|w| w[1] == w[0] + 1);
        let explicit = !consecutive(&q_pos) || !consecutive(&k_pos);
        let (q_doc, k_doc) = match &cuts {
            Some(c) => {
                (q_pos.iter().map(|&p| document_of(c, p)).collect(), k_pos.iter().map(|&p| document_of(c, p)).collect())
            }
            None => (Vec::new(), Vec::new()),
        };
        MaskCase { causal, window, q_pos, k_pos, explicit, cuts, q_doc, k_doc }
    }
    /// The same with explicit positions even when they are consecutive.
    pub fn explicit(mut self) -> Self {
        self.explicit = true;
        self
    }
    /// The mask, borrowing this case's positions and documents.
    pub fn mask(&self) -> AttnMask<'_> {
        let at = |p: &[i64]| p.first().copied().unwrap_or(0);
        let mut m = if self.explicit {
            AttnMask::full().with_positions(Positions::Explicit(&self.q_pos), Positions::Explicit(&self.k_pos))
        } else {
            AttnMask::full().with_positions(Positions::Offset(at(&self.q_pos)), Positions::Offset(at(&self.k_pos)))
        };
        m.causal = self.causal;
        m.window = self.window;
        if self.cuts.is_some() {
            m = m.with_docs(&self.q_doc, &self.k_doc);
        }
        m
    }
    /// The same mask over the key rows `range` only (a block of keys, as ring attention sees them).
    pub fn keys(&self, range: std::ops::Range<usize>) -> MaskCase {
        let mut m =
            MaskCase::new(self.causal, self.window, self.q_pos.clone(), self.k_pos[range].to_vec(), self.cuts.clone());
        m.explicit = true;
        m
    }
}

/// Runs of consecutive values, as `a..b` ranges: a zigzag shard's positions print as two ranges.
pub(crate) fn runs(p: &[i64]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < p.len() {
        let mut j = i + 1;
        while j < p.len() && p[j] == p[j - 1] + 1 {
            j += 1;
        }
        out.push(if j - i == 1 { format!("{}", p[i]) } else { format!("{}..{}", p[i], p[j - 1] + 1) });
        i = j;
    }
    format!("[{}]", out.join(", "))
}

impl fmt::Debug for MaskCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", if self.causal { "causal" } else { "full" })?;
        if let Some(w) = self.window {
            write!(f, ", window {w}")?;
        }
        let how = if self.explicit { "explicit" } else { "offset" };
        write!(f, ", q at {} k at {} ({how})", runs(&self.q_pos), runs(&self.k_pos))?;
        if let Some(c) = &self.cuts {
            write!(f, ", documents cut at {c:?}")?;
        }
        Ok(())
    }
}

/// A mask over `q_len` query and `k_len` key rows: causal or not, a window (1 to 79 positions) or not, documents
/// or not, keys from a start in `0..100` (or a zigzag shard's two ranges), queries likewise or aligned with the end
/// of the keys (as decoding, or a later block of a causal sequence, sees them). Queries before every key, windows
/// and documents make rows that see no key.
pub fn mask(q_len: usize, k_len: usize) -> impl Strategy<Value = MaskCase> {
    (
        any::<bool>(),
        prop::option::of(1u64..80),
        positions(k_len, 100),
        prop_oneof![Just(None), positions(q_len, 200).prop_map(Some)],
        0i64..7,
        document_cuts(300),
        any::<bool>(),
    )
        .prop_map(move |(causal, window, k_pos, q_pos, shift, cuts, explicit)| {
            let q_pos = q_pos.unwrap_or_else(|| {
                let end = k_pos.last().copied().unwrap_or(0) + 1;
                let s = (end - q_len as i64).max(0) + shift;
                (s..s + q_len as i64).collect()
            });
            let m = MaskCase::new(causal, window, q_pos, k_pos, cuts);
            if explicit {
                m.explicit()
            } else {
                m
            }
        })
}
