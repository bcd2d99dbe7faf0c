//! Mailboxes: per rank, the posted operations that no peer has matched yet.

use std::sync::Mutex;

use super::completion::CompletionRef;

/// A posted, unmatched operation. `ptr` points into the owner's buffer, which the owner's request borrows.
///
/// 40 bytes, so that a mailbox's lock, its first slot and the header of the others share one cache line (see
/// [`Mailbox`]): `word` packs the key (its low [`KEY_BITS`] bits), whether the slot is a send, and the peer (for a
/// send: the sending rank; for a receive: the rank it receives from).
#[derive(Clone, Copy)]
pub(super) struct Slot {
    pub(super) word: u64,
    pub(super) meta: u64,
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
    pub(super) done: CompletionRef,
}

/// Bits of a key: the user tag (32) and the internal flag above it (`communicator::INTERNAL`).
pub(super) const KEY_BITS: u32 = 33;
/// Most ranks a threads world may have (what a slot's word has room for).
pub(crate) const MAX_THREAD_RANKS: usize = 1 << (63 - KEY_BITS);

impl Slot {
    pub(super) fn word(is_send: bool, peer: usize, key: u64) -> u64 {
        debug_assert!(key >> KEY_BITS == 0 && peer < MAX_THREAD_RANKS);
        key | (is_send as u64) << KEY_BITS | (peer as u64) << (KEY_BITS + 1)
    }

    pub(super) fn key(&self) -> u64 {
        self.word & ((1 << KEY_BITS) - 1)
    }

    pub(super) fn is_send(&self) -> bool {
        self.word >> KEY_BITS & 1 == 1
    }

    pub(super) fn peer(&self) -> usize {
        (self.word >> (KEY_BITS + 1)) as usize
    }
}

// SAFETY: `ptr` is only dereferenced after the slot left its queue (matched), by the rank that removed it or, for
// a large message, by whichever side claims the pair; meanwhile the owner's request keeps the buffer borrowed (it
// cannot complete, and so cannot release the borrow, before `done` is completed).
unsafe impl Send for Slot {}

/// A mailbox's unmatched operations (sends addressed to its rank and receives its rank posted), oldest first.
///
/// Sends and receives share one queue. Its oldest slot is stored inline and the others in a ring buffer whose
/// header is 16 bytes, so the lock word, that slot and the ring's header fill exactly one cache line (checked
/// below). A message between two ranks with nothing else in flight so moves one mailbox line between the cores
/// (two `Vec`s would keep their slots on a second line), and windowed streams touch the ring's slots but no
/// header line of their own (as a boxed `VecDeque` would). Both kinds may wait here at once (for different peers
/// or tags); an operation only matches the other kind with the same peer and tag, oldest first,
/// so each (peer, tag) stays first-in first-out. The ring keeps its capacity, so a steady state allocates
/// nothing.
#[derive(Default)]
pub(super) struct Mailbox {
    /// Set only while `rest` is empty, so it is always the oldest slot. It is not refilled from `rest` when
    /// taken: with many in flight, moving each next slot into the lock's line costs more than the line saves.
    pub(super) first: Option<Slot>,
    pub(super) rest: SlotRing,
}

const _: () = assert!(std::mem::size_of::<Mutex<Mailbox>>() <= 64);

impl Mailbox {
    /// A mailbox whose ring already has room for a few slots: a second slot waits only now and then (two
    /// messages in flight at once), and that must not allocate in the middle of a steady state.
    pub(super) fn new() -> Mailbox {
        let mut m = Mailbox::default();
        m.rest.grow();
        m
    }

    pub(super) fn push(&mut self, slot: Slot) {
        if self.first.is_none() && self.rest.len == 0 {
            self.first = Some(slot);
        } else {
            self.rest.push_back(slot);
        }
    }

    /// Removes and returns the oldest slot that `matches`.
    pub(super) fn take(&mut self, matches: impl Fn(&Slot) -> bool) -> Option<Slot> {
        if self.first.as_ref().is_some_and(&matches) {
            return self.first.take();
        }
        let i = self.rest.iter().position(|s| matches(&s))?;
        Some(self.rest.remove(i))
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = Slot> + '_ {
        self.first.into_iter().chain(self.rest.iter())
    }

    /// Removes every slot that `gone` selects and returns them.
    pub(super) fn drain_where(&mut self, gone: impl Fn(&Slot) -> bool) -> Vec<Slot> {
        let all: Vec<Slot> = self.iter().collect();
        self.first = None;
        self.rest.len = 0;
        let (removed, kept): (Vec<Slot>, Vec<Slot>) = all.into_iter().partition(|s| gone(s));
        kept.into_iter().for_each(|s| self.push(s));
        removed
    }
}

/// A first-in first-out ring of slots whose header is a pointer and two counters: the capacity (a power of two)
/// is stored at the start of the allocation, on a line of its own that only growing writes.
#[derive(Default)]
pub(super) struct SlotRing {
    /// The allocation: the capacity (`usize`) in its first cache line, then the slots.
    pub(super) block: Option<std::ptr::NonNull<u8>>,
    pub(super) head: u32,
    pub(super) len: u32,
}

// SAFETY: the ring owns its allocation; slots are plain data (see `Slot`'s `Send`).
unsafe impl Send for SlotRing {}

impl SlotRing {
    const SLOTS_AT: usize = 64;

    pub(super) fn layout(cap: usize) -> std::alloc::Layout {
        let bytes = Self::SLOTS_AT + cap * std::mem::size_of::<Slot>();
        // Capacities stay far below this bound: a threads world holds at most the operations its ranks posted.
        std::alloc::Layout::from_size_align(bytes, 64).unwrap_or_else(|_| panic!("slot ring of {cap} slots"))
    }

    pub(super) fn cap(&self) -> usize {
        // SAFETY: a block starts with its capacity, written when it was allocated.
        self.block.map_or(0, |b| unsafe { *(b.as_ptr() as *const usize) })
    }

    pub(super) fn slot(&self, i: usize) -> *mut Slot {
        let b = self.block.expect("a ring with slots has a block");
        let at = (self.head as usize + i) & (self.cap() - 1);
        // SAFETY: `at` < capacity, so the slot lies inside the allocation.
        unsafe { (b.as_ptr().add(Self::SLOTS_AT) as *mut Slot).add(at) }
    }

    pub(super) fn push_back(&mut self, s: Slot) {
        if self.len as usize == self.cap() {
            self.grow();
        }
        let p = self.slot(self.len as usize);
        // SAFETY: inside the allocation; `Slot` is `Copy`, so overwriting a stale slot drops nothing.
        unsafe { p.write(s) };
        self.len += 1;
    }

    pub(super) fn grow(&mut self) {
        let cap = (self.cap() * 2).max(8);
        assert!(cap <= u32::MAX as usize, "more than 2^31 operations waiting in one mailbox");
        let layout = Self::layout(cap);
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc(layout) };
        let Some(block) = std::ptr::NonNull::new(raw) else { std::alloc::handle_alloc_error(layout) };
        // SAFETY: the new block holds the capacity and `cap` slots; the old slots are copied in order.
        unsafe {
            *(raw as *mut usize) = cap;
            let slots = raw.add(Self::SLOTS_AT) as *mut Slot;
            for i in 0..self.len as usize {
                slots.add(i).write(self.slot(i).read());
            }
        }
        self.free();
        self.block = Some(block);
        self.head = 0;
    }

    pub(super) fn free(&mut self) {
        let cap = self.cap();
        if let Some(b) = self.block.take() {
            // SAFETY: allocated by `grow` with this capacity's layout.
            unsafe { std::alloc::dealloc(b.as_ptr(), Self::layout(cap)) };
        }
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = Slot> + '_ {
        // SAFETY: slots `0..len` are initialized.
        (0..self.len as usize).map(|i| unsafe { self.slot(i).read() })
    }

    /// Removes slot `i` (counted from the oldest), moving the newer ones up.
    pub(super) fn remove(&mut self, i: usize) -> Slot {
        debug_assert!(i < self.len as usize);
        // SAFETY: slots `0..len` are initialized; each move stays inside the ring.
        unsafe {
            let s = self.slot(i).read();
            if i == 0 {
                self.head = ((self.head as usize + 1) & (self.cap() - 1)) as u32;
            } else {
                for j in i..self.len as usize - 1 {
                    self.slot(j).write(self.slot(j + 1).read());
                }
            }
            self.len -= 1;
            s
        }
    }
}

impl Drop for SlotRing {
    fn drop(&mut self) {
        self.free();
    }
}

#[cfg(test)]
mod tests {
    use super::super::completion::Completion;
    use super::super::refs::Ref;
    use super::*;
    use crate::op::INTERNAL;

    /// drain, across the ring's growth and wrap-around.
    #[test]
    fn mailbox_matches_oldest_first_like_a_vec() {
        let completions: Vec<Box<Completion>> = (0..4).map(|_| Box::new(Completion::new())).collect();
        let slot = |n: u64, is_send: bool, peer: usize| Slot {
            word: Slot::word(is_send, peer, n % 3),
            meta: n,
            ptr: std::ptr::null_mut(),
            len: n as usize,
            done: Ref(std::ptr::NonNull::from(&*completions[(n % 4) as usize])),
        };
        let mut mb = Mailbox::default();
        let mut model: Vec<Slot> = Vec::new();
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut n = 0;
        let (mut max_cap, mut wrapped) = (0, false);
        for step in 0..20_000 {
            let r = next();
            // Bursts of pushes, so the ring grows, then drains and wraps.
            let push_bias = if (step / 500) % 2 == 0 { 60 } else { 35 };
            if r % 100 < push_bias {
                let s = slot(n, next() % 2 == 0, (next() % 3) as usize);
                n += 1;
                mb.push(s);
                model.push(s);
            } else if r % 100 < 95 {
                let (is_send, peer, key) = (next() % 2 == 0, (next() % 3) as usize, next() % 3);
                let want = Slot::word(is_send, peer, key);
                let got = mb.take(|s| s.word == want).map(|s| s.meta);
                let i = model.iter().position(|s| s.word == want);
                assert_eq!(got, i.map(|i| model.remove(i).meta), "step {step}");
            } else {
                let meta = next() % (n + 1);
                let got = mb.take(|s| s.meta == meta).map(|s| s.meta);
                let i = model.iter().position(|s| s.meta == meta);
                assert_eq!(got, i.map(|i| model.remove(i).meta), "step {step}");
            }
            let metas: Vec<u64> = mb.iter().map(|s| s.meta).collect();
            assert_eq!(metas, model.iter().map(|s| s.meta).collect::<Vec<_>>(), "step {step}");
            max_cap = max_cap.max(mb.rest.cap());
            wrapped |= mb.rest.head as usize + mb.rest.len as usize > mb.rest.cap();
        }
        assert!(max_cap >= 32 && wrapped, "the test should grow the ring and wrap it (capacity {max_cap})");
        let gone: Vec<u64> = mb.drain_where(|s| s.is_send() && s.peer() == 1).iter().map(|s| s.meta).collect();
        let (model_gone, model_kept): (Vec<Slot>, Vec<Slot>) =
            model.into_iter().partition(|s| s.is_send() && s.peer() == 1);
        assert_eq!(gone, model_gone.iter().map(|s| s.meta).collect::<Vec<_>>());
        assert_eq!(
            mb.iter().map(|s| s.meta).collect::<Vec<_>>(),
            model_kept.iter().map(|s| s.meta).collect::<Vec<_>>()
        );
        let w = Slot::word(true, MAX_THREAD_RANKS - 1, INTERNAL | 0xFF);
        let s = Slot { word: w, ..slot(0, false, 0) };
        assert!(s.is_send() && s.peer() == MAX_THREAD_RANKS - 1 && s.key() == INTERNAL | 0xFF);
    }
}
