//! Objects of a threads world by address, and the per-rank pools they are recycled through.

use std::sync::Mutex;

use crossbeam::utils::CachePadded;

/// An object of a [`World`] by address: a completion, an exchange channel or an outcome cell. They are
/// allocated by the world (its [`Recycler`]s and channel map) and freed only when it is dropped, so every `Ref`
/// held by something the world outlives (an operation, which holds the world; a slot in its mailboxes; a pair or
/// attachment in its completions; an endpoint's channel cache) points to a live object.
///
/// Not an `Arc`: the slot, pair and attachment of a message were clones of a completion, each made or dropped by
/// the peer rank, and every such count change would move the completion's first cache line between the cores.
pub(crate) struct Ref<T>(pub(super) std::ptr::NonNull<T>);

impl<T> PartialEq for Ref<T> {
    /// The same object.
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}

impl<T> std::fmt::Debug for Ref<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Ref({:p})", self.0)
    }
}

impl<T> Clone for Ref<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Ref<T> {}

impl<T> Ref<T> {
    pub(crate) fn leak(b: Box<T>) -> Self {
        Ref(std::ptr::NonNull::from(Box::leak(b)))
    }

    pub(crate) fn as_ptr(self) -> *mut T {
        self.0.as_ptr()
    }

    /// # Safety
    /// Once, when nothing refers to the object any more (its world is dropped).
    pub(super) unsafe fn free(self) {
        // SAFETY: allocated by `leak`, freed once per the contract.
        drop(unsafe { Box::from_raw(self.0.as_ptr()) });
    }
}

// SAFETY: the objects are `Sync` (locks and atomics); a `Ref` is valid on any thread while its world lives.
unsafe impl<T: Sync> Send for Ref<T> {}
// SAFETY: as above.
unsafe impl<T: Sync> Sync for Ref<T> {}

impl<T> std::ops::Deref for Ref<T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: see the type's docs: the object lives as long as its world, which outlives every holder.
        unsafe { self.0.as_ref() }
    }
}

/// One rank's objects of one kind: the finished ones kept for reuse, each with what its last user left (`E`: an
/// outcome cell's last ticket), and every one ever allocated, freed with the world.
pub(super) struct Recycler<T, E> {
    pub(super) free: Vec<(Ref<T>, E)>,
    pub(super) all: Vec<Ref<T>>,
}

impl<T, E> Default for Recycler<T, E> {
    fn default() -> Self {
        Recycler { free: Vec::new(), all: Vec::new() }
    }
}

impl<T, E: Default> Recycler<T, E> {
    /// A free object and what its last user left, or a new one from `make` (and `E::default()`).
    pub(super) fn take(&mut self, make: impl FnOnce() -> T) -> (Ref<T>, E) {
        self.free.pop().unwrap_or_else(|| {
            let r = Ref::leak(Box::new(make()));
            self.all.push(r);
            (r, E::default())
        })
    }

    pub(super) fn put(&mut self, r: Ref<T>, left: E) {
        self.free.push((r, left));
    }
}

/// One `T` per rank (or per rank and kind), each locked on cache lines of its own.
pub(super) type PerRank<T> = Box<[CachePadded<Mutex<T>>]>;

impl<T, E> Drop for Recycler<T, E> {
    fn drop(&mut self) {
        for r in self.all.drain(..) {
            // SAFETY: allocated by `take`, freed once here. The recycler lives in its world, which is dropped only
            // when nothing refers to its objects any more: their holders are operations (each holds the world) and
            // slots, pairs and attachments inside the world.
            unsafe { r.free() };
        }
    }
}
