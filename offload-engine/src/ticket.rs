//! Tickets: the caller's claim on an offloaded tensor.
//!
//! A ticket carries what the caller needs without asking the engine (tag, dtype, dims); the data lives in a
//! slot of the engine. [`OffloadEngine::fetch`](crate::OffloadEngine::fetch) takes the ticket by value, so a
//! tensor cannot be fetched twice, and dropping a ticket frees its slot wherever the data is (a copy in flight
//! is finished and then thrown away).

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use crate::location::Location;
use crate::memory::{Host, Memory};
use crate::shared::Shared;
use crate::slot::SlotId;
use crate::tag::{Activation, Kind, TensorTag, Weights};
use crate::tensor::DType;

/// A claim on one offloaded tensor (see the module docs). `K` is [`Activation`] or [`Weights`]; `M` the memory
/// it was handed over from and comes back to, [`Host`] or [`Device`](crate::Device).
///
/// A ticket is consumed by `fetch`, so fetching twice does not compile:
///
/// ```compile_fail,E0382
/// # use longctx_offload::{HostTensor, OffloadEngine};
/// # let engine = OffloadEngine::builder().host_tier(1 << 20).build()?;
/// let ticket = engine.offload(0, "x", HostTensor::f32(vec![1.0; 4], [4])?)?;
/// let x = engine.fetch(ticket)?;
/// let again = engine.fetch(ticket)?; // error[E0382]: use of moved value: `ticket`
/// # Ok::<(), longctx_offload::OffloadError>(())
/// ```
#[must_use = "dropping a ticket frees the tensor it stands for"]
pub struct Ticket<K: Kind, M: Memory = Host> {
    pub(crate) slot: SlotId,
    pub(crate) tag: TensorTag,
    pub(crate) dtype: DType,
    pub(crate) dims: Vec<usize>,
    pub(crate) bytes: usize,
    pub(crate) engine: Arc<Shared>,
    // `fn() -> (K, M)`: the markers neither own a value nor limit `Send`/`Sync`.
    pub(crate) kind: PhantomData<fn() -> (K, M)>,
}

/// A ticket for a saved activation in host memory.
pub type ActivationTicket = Ticket<Activation>;

/// A ticket for a layer's parameters in host memory.
pub type WeightsTicket = Ticket<Weights>;

impl<K: Kind, M: Memory> Ticket<K, M> {
    /// The tag given at offload.
    pub fn tag(&self) -> &TensorTag {
        &self.tag
    }

    /// The layer given at offload.
    pub fn layer(&self) -> usize {
        self.tag.layer
    }

    /// The name given at offload.
    pub fn name(&self) -> &str {
        &self.tag.name
    }

    /// The element type of the tensor.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The dims of the tensor.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// Bytes of the tensor's elements.
    pub fn size_bytes(&self) -> usize {
        self.bytes
    }

    /// Where the data is now (a snapshot: workers move it concurrently).
    pub fn location(&self) -> Location {
        self.engine.location(self.slot)
    }
}

impl<K: Kind, M: Memory> fmt::Debug for Ticket<K, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ticket")
            .field("tag", &self.tag)
            .field("dtype", &self.dtype)
            .field("dims", &self.dims)
            .finish_non_exhaustive()
    }
}

impl<K: Kind, M: Memory> Drop for Ticket<K, M> {
    fn drop(&mut self) {
        // A fetched ticket's slot is already gone; this is then a no-op.
        self.engine.release(self.slot);
    }
}
