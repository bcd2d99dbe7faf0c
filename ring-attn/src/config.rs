//! What every rank must agree on: the whole problem's sizes ([`CpShape`]) and mask ([`CpMask`]), and how the
//! ranks split and exchange it ([`CpConfig`], [`Schedule`]).

use longctx_kernels::DType;

use crate::partition::Partition;

/// Sizes of the whole problem (all ranks together) and the element type of `Q`, `K`, `V`. Each rank's views are
/// `[B, H, L, D]` with `L = S / CP` ([`CpPlan::local_len`](crate::CpPlan::local_len)), holding its tokens in the order
/// [`SeqLayout::positions`](crate::SeqLayout::positions) gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpShape {
    /// `B`.
    pub batch: usize,
    /// `Hq`: a multiple of `Hkv` (grouped-query attention: query head `h` reads KV head `h / (Hq / Hkv)`).
    pub q_heads: usize,
    /// `Hkv`.
    pub kv_heads: usize,
    /// Total tokens `S` of the sequence: a multiple of `2·CP` for zigzag, of `CP` for the other partitions.
    pub seq_len: usize,
    /// `D`: 32 to 256 in steps of 8.
    pub head_dim: usize,
    /// The element type of `Q`, `K`, `V`, `O` and the gradients (`LSE` is always `f32`).
    pub dtype: DType,
}

/// The mask, by global token positions: causal and/or a sliding window, and whether the sequence packs several
/// documents (their ids are given per batch with [`CpPlan::set_documents`](crate::CpPlan::set_documents)).
///
/// Conventions (those of `longctx-kernels`' `AttnMask`): a query at position `i` sees the key at `j` when
/// - causal: `j ≤ i`;
/// - with a window `w`: `i − j < w` when causal (the query itself and the `w − 1` keys before it), and
///   `|i − j| < w` when not (the query itself and the `w − 1` keys on each side of it: `2w − 1` positions);
/// - with documents: both tokens have the same document id.
///
/// A row that sees no key gets `O = 0` and `LSE = −inf`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpMask {
    /// Keys after the query are hidden.
    pub causal: bool,
    /// Sliding window in positions (at least 1): keys less than this far from the query, before it when causal,
    /// on either side when not.
    pub window: Option<u64>,
    /// The sequence packs documents that must not see each other.
    pub documents: bool,
}

impl CpMask {
    /// Causal, one document.
    pub fn causal() -> Self {
        Self { causal: true, ..Self::default() }
    }
    /// With a sliding window of `window` positions (one-sided when causal, on both sides when not; see
    /// [`CpMask`]).
    pub fn with_window(mut self, window: u64) -> Self {
        self.window = Some(window);
        self
    }
    /// With packed documents.
    pub fn with_documents(mut self) -> Self {
        self.documents = true;
        self
    }
}

/// How the ranks exchange what attention needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Schedule {
    /// KV blocks passed around a ring, overlapped with compute (`CP − 1` steps).
    #[default]
    Ring,
    /// Gather all K/V (this many KV heads at a time, bounding memory), compute the local queries.
    AllGather {
        /// KV heads gathered per step (at least 1).
        kv_heads_per_step: usize,
    },
    /// All-to-all from sequence shards to head shards, local full attention, and back. Needs both head
    /// counts divisible by CP.
    Ulysses,
    /// All-to-all inside groups of `group` consecutive ranks (a fast link) and ring across the groups.
    /// Needs `group` to divide CP and both head counts divisible by `group`.
    Hybrid {
        /// Ranks per all-to-all group.
        group: usize,
    },
}

/// Partition, schedule and softmax scale.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CpConfig {
    /// How the sequence is cut.
    pub partition: Partition,
    /// How the ranks exchange.
    pub schedule: Schedule,
    /// Softmax scale; `1/sqrt(D)` when `None`.
    pub scale: Option<f32>,
}
