//! How a sequence is cut across context-parallel ranks, and the helpers that shard and unshard token arrays.
//!
//! - [`Partition::Zigzag`]: the sequence is cut into `2·CP` chunks; rank `r` holds chunks `r` and `2·CP−1−r`,
//!   so under a causal mask every rank has the same amount of work (an early chunk sees few keys, its late
//!   partner many).
//! - [`Partition::Contiguous`]: rank `r` holds tokens `[r·S/CP, (r+1)·S/CP)` (causal work is unbalanced).
//! - [`Partition::Striped`]: token `i` is on rank `i mod CP` (balanced, but no tile can be skipped).
//!
//! The sequence length must be a multiple of `2·CP` (zigzag) or `CP` (the others); otherwise the call is a
//! [`RingError::SeqNotDivisible`]. The padding rule we recommend: append tokens with their own document id
//! (so no real token attends to them) and an ignored loss target.

use crate::error::{Result, RingError};

/// A way of cutting the sequence across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Partition {
    /// Chunks `r` and `2·CP−1−r` on rank `r` (causal load balance).
    #[default]
    Zigzag,
    /// One contiguous range per rank.
    Contiguous,
    /// Token `i` on rank `i mod CP`.
    Striped,
}

impl Partition {
    /// The partition's name.
    pub fn name(self) -> &'static str {
        match self {
            Partition::Zigzag => "zigzag",
            Partition::Contiguous => "contiguous",
            Partition::Striped => "striped",
        }
    }
}

/// A sequence of `seq_len` tokens cut across `world` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqLayout {
    /// The partition.
    pub partition: Partition,
    /// Context-parallel ranks.
    pub world: usize,
    /// Total tokens.
    pub seq_len: usize,
}

impl SeqLayout {
    /// Checks that the sequence cuts evenly.
    pub fn new(partition: Partition, world: usize, seq_len: usize) -> Result<Self> {
        if world == 0 {
            return Err(RingError::NoRanks);
        }
        if seq_len == 0 {
            return Err(RingError::EmptySequence);
        }
        let divisor = match partition {
            Partition::Zigzag => 2 * world,
            _ => world,
        };
        if !seq_len.is_multiple_of(divisor) {
            return Err(RingError::SeqNotDivisible { seq_len, divisor, partition: partition.name(), world });
        }
        Ok(Self { partition, world, seq_len })
    }

    /// Tokens per rank (the layout is checked to cut evenly: `2·CP` chunks for zigzag, `CP` otherwise).
    pub fn local_len(&self) -> usize {
        self.seq_len / self.world
    }

    /// Checks that `rank` is one of the layout's ranks.
    pub fn check_rank(&self, rank: usize) -> Result<()> {
        if rank < self.world {
            Ok(())
        } else {
            Err(RingError::RankOutOfRange { rank, world: self.world })
        }
    }

    /// Global positions of rank `rank`'s tokens, in the order the rank stores them.
    pub fn positions(&self, rank: usize) -> Result<Vec<i64>> {
        self.check_rank(rank)?;
        Ok(self.positions_of(rank))
    }

    /// Every rank's positions, indexed by rank.
    pub fn all_positions(&self) -> Vec<Vec<i64>> {
        (0..self.world).map(|r| self.positions_of(r)).collect()
    }

    fn positions_of(&self, rank: usize) -> Vec<i64> {
        let l = self.local_len();
        match self.partition {
            Partition::Contiguous => (rank * l..(rank + 1) * l).map(|i| i as i64).collect(),
            Partition::Striped => (0..l).map(|i| (i * self.world + rank) as i64).collect(),
            Partition::Zigzag => {
                let c = l / 2;
                let late = 2 * self.world - 1 - rank;
                (rank * c..(rank + 1) * c).chain(late * c..(late + 1) * c).map(|i| i as i64).collect()
            }
        }
    }

    /// Picks rank `rank`'s tokens out of a full array `[outer, seq_len, inner]` (e.g. `[B·H, S, D]`), giving
    /// `[outer, local_len, inner]`.
    pub fn shard<T: Copy>(&self, full: &[T], outer: usize, inner: usize, rank: usize) -> Result<Vec<T>> {
        crate::error::check_len("full", full.len(), outer * self.seq_len * inner)?;
        let pos = self.positions(rank)?;
        let mut out = Vec::with_capacity(outer * pos.len() * inner);
        for o in 0..outer {
            for &p in &pos {
                let src = (o * self.seq_len + p as usize) * inner;
                out.extend_from_slice(&full[src..src + inner]);
            }
        }
        Ok(out)
    }

    /// Puts the shards of every rank back into the full array `[outer, seq_len, inner]`.
    pub fn unshard<T: Copy + Default>(&self, shards: &[Vec<T>], outer: usize, inner: usize) -> Result<Vec<T>> {
        if shards.len() != self.world {
            return Err(RingError::ShardCount { got: shards.len(), world: self.world });
        }
        let l = self.local_len();
        let mut full = vec![T::default(); outer * self.seq_len * inner];
        for (rank, shard) in shards.iter().enumerate() {
            crate::error::check_len("shard", shard.len(), outer * l * inner)?;
            for (i, &p) in self.positions_of(rank).iter().enumerate() {
                for o in 0..outer {
                    let dst = (o * self.seq_len + p as usize) * inner;
                    let src = (o * l + i) * inner;
                    full[dst..dst + inner].copy_from_slice(&shard[src..src + inner]);
                }
            }
        }
        Ok(full)
    }
}
