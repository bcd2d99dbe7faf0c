//! The one interface every caller computes through: [`Backend`].
//!
//! # Why a trait object over views
//! Every method takes [`View`]s, which carry their dims, dtype and memory, so the methods are not generic and
//! the trait is object safe: ring attention and the trainer hold an `Arc<dyn Backend>` and never name the
//! backend's type, and the CUDA backend is one more implementation with one more [`Memory`] kind. Generic
//! parameters (`B: Backend` with associated buffer types) would be checked at compile time instead, but every
//! struct that holds a backend (a model, a context-parallel plan) would carry the parameter, and a dtype
//! chosen at run time (a recipe's `bf16`) would need a second dispatch anyway. A backend checks, before any
//! work, that each view lives in its memory ([`KernelError::Memory`]) and that the dims agree.
//!
//! It is the only way to compute: the CPU kernels (typed slices with explicit sizes) are private to
//! [`CpuBackend`](crate::CpuBackend), which turns views into them, so code written against the trait runs
//! unchanged on every backend, and tests written once over a `&dyn Backend` run on each.
//!
//! # Conventions (llm.c's)
//! Outputs first, then the upstream gradient, then what the forward saved ([`crate::saved`]), then parameters
//! and options. Gradients are named `dq, dk, dv, dout, dx, dw`. Activation gradients are overwritten; the
//! gradients a [`GradMode`] governs are named in each method's docs. Every shape is checked before any element
//! is written: an `Err` leaves outputs untouched.
//!
//! # Memory
//! Every [`View`] and [`ViewMut`] a method takes lives in the backend's memory ([`Backend::memory`]): a view
//! of other memory is a [`KernelError::Memory`] naming the argument. The exceptions say so: `upload` reads host
//! memory, `download` writes it. Host data reaches a device backend only through `upload`, and leaves only
//! through `download`.
//!
//! Arguments that are plain slices or host structures are host memory, read before the call returns: token
//! positions (`&[i64]`), token ids and targets, an [`AttnMask`](crate::AttnMask)'s explicit positions and document
//! ids, a [`RopeTable`], a [`Routing`]. A device backend uploads what the op needs of them on every call (a few
//! bytes per token, ordered on its stream like any op); the caller may change them once the call returned.
//!
//! # Ordering
//! On a device backend every op is asynchronous: the call checks its arguments, enqueues the work on the
//! backend's queue (a CUDA stream) and returns; ops run in the order they were called on that backend. So:
//! - results reach the host through [`Backend::download`], which waits for the ops enqueued before it; a method
//!   that returns a value computed on the device (`sum_squares`, the cross-entropy loss, the MoE router's
//!   routing) waits for its own op before it returns, and says so;
//! - [`Backend::synchronize`] waits for everything enqueued, and reports a fault of any of it (a failed launch
//!   the device refuses is reported by the call that made it);
//! - a buffer may be dropped while ops that use it are enqueued on the backend that made it: its memory is
//!   reused only by ops enqueued after the drop;
//! - work on another queue ([`Backend::fork`]: the same device and memory, its own queue) is ordered with an
//!   [`Event`]: `let e = a.record_event()?; b.wait_event(&e)?;` makes the ops enqueued on `b` from then on wait
//!   for those enqueued on `a` before `e`. A buffer used on `b` and made (or dropped) on `a` needs that order.
//!
//! On the CPU every op has run when its call returns: events are complete at once, and the two-queue rules
//! hold trivially.

use std::fmt;

use crate::attention::{AttnGrads, AttnOptions, AttnOut, AttnPartial, AttnSaved, Qkv};
use crate::buffer::Buffer;
use crate::dtype::DType;
use crate::error::{KernelError, Result};
use crate::event::Event;
use crate::ops::{AdamW, CrossEntropyOptions, CrossEntropyOutput, RopeTable, RouterOutput, Routing};
use crate::saved::{
    LayerNormSaved, LinearSaved, MoeCombineSaved, MoeRouterSaved, RmsNormSaved, SquaredReluSaved, SwigluSaved,
};
use crate::view::{Dims, Memory, View, ViewMut};

/// Whether a backward overwrites the gradients it is given or adds to them (accumulation over micro-batches,
/// or over the key blocks of ring attention).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GradMode {
    /// The buffer receives the gradient.
    #[default]
    Overwrite,
    /// The gradient is added to what the buffer holds.
    Accumulate,
}

impl GradMode {
    pub(crate) fn accumulate(self) -> bool {
        self == GradMode::Accumulate
    }
}

/// The parameters of a norm: `weight[C]` (and `bias[C]` for LayerNorm; none for RMSNorm) and `eps`.
#[derive(Debug, Clone, Copy)]
pub struct NormParams<'a> {
    /// `[C]`, the buffers' dtype.
    pub weight: View<'a>,
    /// `[C]`; LayerNorm only.
    pub bias: Option<View<'a>>,
    /// Added to the variance; finite and ≥ 0.
    pub eps: f32,
}

/// The gradients of a norm's backward: `dx` (overwritten), `dweight` and `dbias` (per [`GradMode`]).
#[derive(Debug)]
pub struct NormGrads<'a> {
    /// `[N, C]`.
    pub dx: ViewMut<'a>,
    /// `[C]`; any dtype.
    pub dweight: ViewMut<'a>,
    /// `[C]`; LayerNorm only, same dtype as `dweight`.
    pub dbias: Option<ViewMut<'a>>,
}

/// The gradients of a linear layer's backward: `dx` (overwritten; `None` skips it, e.g. for the first layer),
/// `dw` and `dbias` (per [`GradMode`]).
#[derive(Debug)]
pub struct LinearGrads<'a> {
    /// `[N, IN]`.
    pub dx: Option<ViewMut<'a>>,
    /// `[OUT, IN]`.
    pub dw: ViewMut<'a>,
    /// `[OUT]`, same dtype as `dw`.
    pub dbias: Option<ViewMut<'a>>,
}

/// The gradients of the fused output projection and loss.
#[derive(Debug)]
pub struct ProjectionGrads<'a> {
    /// `[T, C]`, overwritten.
    pub dhidden: ViewMut<'a>,
    /// `[V, C]`, per [`GradMode`].
    pub dweight: ViewMut<'a>,
}

/// The moment estimates of AdamW, `f32`, one per parameter.
#[derive(Debug)]
pub struct AdamwState<'a> {
    /// First moment.
    pub m: ViewMut<'a>,
    /// Second moment.
    pub v: ViewMut<'a>,
}

/// Bytes a device backend's memory pool holds ([`Backend::device_memory`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// In use by live buffers.
    pub used: usize,
    /// The most `used` has been since the pool was made (or its marks were last reset).
    pub used_high: usize,
    /// Held by the pool: in use plus kept for reuse.
    pub reserved: usize,
    /// The most `reserved` has been.
    pub reserved_high: usize,
}

/// The compute of longctx: attention and every other transformer op with its backward, on one kind of memory.
/// See the module docs for why this is a trait object over views, and for the argument conventions.
pub trait Backend: Send + Sync + fmt::Debug {
    /// A short name for messages (`cpu`, `cuda`).
    fn name(&self) -> &'static str;
    /// The memory this backend computes on.
    fn memory(&self) -> Memory;

    /// Copies `src` (host memory) into `dst` (this backend's memory): same dims and dtype. Returns once `src` may
    /// be changed or freed; the copy is ordered with this backend's other work like any op.
    fn upload(&self, dst: ViewMut<'_>, src: View<'_>) -> Result<()>;
    /// Copies `src` (this backend's memory) into `dst` (host memory): same dims and dtype. Waits for the ops
    /// enqueued before it; returns once `dst` holds the values.
    fn download(&self, dst: ViewMut<'_>, src: View<'_>) -> Result<()>;
    /// Blocks until every op enqueued so far on this backend has run; reports a fault of any of them. A no-op
    /// on a backend whose ops run before they return (the default).
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    /// An event complete once every op enqueued so far on this backend has run (see "Ordering"). The default,
    /// for a backend whose ops run before they return, is complete at once.
    fn record_event(&self) -> Result<Event> {
        Ok(Event::complete())
    }
    /// As [`record_event`](Backend::record_event), with the device's clock: [`Event::elapsed_since`] between two
    /// such events is the device time between them (for measuring a queue's idle gaps without stopping it).
    /// Costs a little more than an ordering event on a GPU. The default records an ordinary event, which carries
    /// no time.
    fn record_timed_event(&self) -> Result<Event> {
        self.record_event()
    }
    /// Ops enqueued on this backend from now on wait for `event` (recorded on this backend or another one of
    /// the same device). The default, for a backend whose ops run before they return, waits on the host.
    fn wait_event(&self, event: &Event) -> Result<()> {
        event.synchronize()
    }
    /// The same device, memory and settings with a queue of its own, so that its work (a ring's transfers, an
    /// offload's copies) can overlap this backend's. Buffers of either may be used by both, ordered by events.
    fn fork(&self) -> Result<std::sync::Arc<dyn Backend>>;
    /// Makes `buf`, allocated by another queue of this device (a [`fork`](Backend::fork), e.g. one that copies),
    /// this backend's: work enqueued here from now on follows the work enqueued so far on the queue that allocated
    /// it (so what that queue wrote is in place), and its memory goes back to the pool on this backend's queue
    /// when dropped, after this backend's work that uses it. What a buffer filled on a copy queue and then used
    /// and dropped by the compute queue needs: freed on the copy queue, its memory could be handed out again while
    /// compute still reads it. A buffer of this queue, a host buffer, and any buffer of a backend whose ops run
    /// before they return (the default) are left as they are.
    fn adopt(&self, buf: &mut Buffer) -> Result<()> {
        let _ = buf;
        Ok(())
    }
    /// Registers `len` bytes of host memory at `ptr` with this backend's device, so that [`upload`](Backend::upload)
    /// from it and [`download`](Backend::download) into it move by DMA with no staging of their own (the CUDA
    /// backend: page-locked with `cuMemHostRegister`): what a host tier's buffers, reused for a whole run, are
    /// registered with. The default, for a backend whose memory is the host's, does nothing.
    ///
    /// # Safety
    /// The range is host memory of this process, not registered already, that stays mapped until
    /// [`unregister_host`](Backend::unregister_host).
    unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<()> {
        let _ = (ptr, len);
        Ok(())
    }
    /// Undoes [`register_host`](Backend::register_host) of the same range.
    ///
    /// # Safety
    /// The range was registered by `register_host` of this backend (or a fork) and not unregistered since; no
    /// copy uses it any more.
    unsafe fn unregister_host(&self, ptr: *mut u8, len: usize) {
        let _ = (ptr, len);
    }
    /// What the memory pool of this backend's device holds now and at most (shared with its forks), for a backend
    /// that computes on device memory; `None` for host memory (the process's peak RSS tells), the default.
    fn device_memory(&self) -> Option<MemoryStats> {
        None
    }

    /// A zeroed buffer of `dtype` with `dims` in this backend's memory.
    fn zeros(&self, dtype: DType, dims: Dims) -> Result<Buffer>;
    /// A buffer of `dtype` with `dims` whose contents are unspecified, for an output that an op writes whole
    /// before anything reads it (every op's output, and every gradient under [`GradMode::Overwrite`]): what
    /// saves clearing memory that is about to be overwritten. Reading an element before writing it gives an
    /// unspecified value (never undefined behaviour). The default is [`Backend::zeros`].
    fn empty(&self, dtype: DType, dims: Dims) -> Result<Buffer> {
        self.zeros(dtype, dims)
    }
    /// `dst = src`, converting the element type when they differ. Same dims.
    fn copy(&self, dst: ViewMut<'_>, src: View<'_>) -> Result<()>;
    /// Every element of `dst` = `value`, rounded to `dst`'s type (e.g. `0` or `-inf`).
    fn fill(&self, dst: ViewMut<'_>, value: f32) -> Result<()>;
    /// `dst += src` (in `f32`, rounded to `dst`'s type). Same dims.
    fn add(&self, dst: ViewMut<'_>, src: View<'_>) -> Result<()>;
    /// `x *= a`.
    fn scale(&self, x: ViewMut<'_>, a: f32) -> Result<()>;
    /// `Σ x²` over all the views, in `f64` (the squared global norm, to all-reduce before clipping). Waits for
    /// its op: the value is on the host.
    fn sum_squares(&self, xs: &[View<'_>]) -> Result<f64>;
    /// Clips gradients by their global L2 norm (PyTorch's `clip_grad_norm_`): `‖g‖ = √(Σ g²)` over all of
    /// `grads`, in `f64`; when it exceeds `max_norm`, every gradient is scaled by `max_norm / (‖g‖ + 1e-6)`.
    /// Returns the norm before clipping (finite for any finite `f32` gradients).
    ///
    /// This is [`sum_squares`](Backend::sum_squares) then [`scale`](Backend::scale), provided here so that a
    /// backend may fuse the two. When the gradients are sharded or data-parallel, the squares must be
    /// all-reduced between the two steps, so such a caller makes the two calls itself (as the reference trainer
    /// does).
    ///
    /// Errors: `max_norm` negative or not finite; a non-finite norm (a NaN or infinite gradient) is reported as
    /// [`KernelError::InvalidArgument`] for `grads`, with the gradients left untouched.
    fn clip_grad_norm(&self, grads: &mut [ViewMut<'_>], max_norm: f32) -> Result<f64> {
        if !max_norm.is_finite() {
            return Err(KernelError::InvalidArgument { name: "max_norm", why: format!("{max_norm} is not finite") });
        }
        if max_norm < 0.0 {
            return Err(KernelError::InvalidArgument { name: "max_norm", why: format!("{max_norm} < 0") });
        }
        let norm = {
            let views: Vec<View<'_>> = grads.iter().map(|g| g.as_view()).collect();
            self.sum_squares(&views)?.sqrt()
        };
        if !norm.is_finite() {
            return Err(KernelError::InvalidArgument { name: "grads", why: format!("gradient norm is {norm}") });
        }
        if norm > max_norm as f64 {
            let k = (max_norm as f64 / (norm + 1e-6)) as f32;
            for g in grads.iter_mut() {
                self.scale(g.reborrow(), k)?;
            }
        }
        Ok(norm)
    }
    /// `dst[a, c, b, d] = src[a, b, c, d]`: swaps the middle dims of a 4-D view, converting the element type
    /// when they differ. A model uses it between its token-major projections `[B, S, H, D]` and attention's
    /// head-major `[B, H, S, D]` (and back, and for the gradients). Saves nothing.
    fn transpose12(&self, dst: ViewMut<'_>, src: View<'_>) -> Result<()>;

    /// Attention forward: `out.o` and `out.lse` receive full attention of the queries over the keys the mask
    /// shows them (a row that sees none gets `O = 0`, `LSE = -inf`). The forward saves `qkv`, `out.o` and
    /// `out.lse` ([`AttnSaved`]).
    fn attention_forward(&self, opts: &AttnOptions<'_>, out: AttnOut<'_>, qkv: Qkv<'_>) -> Result<()>;
    /// Attention backward: `grads` (overwritten, or added to with [`GradMode::Accumulate`]: all of `dq`, `dk`,
    /// `dv`, in `f32` or the buffers' type) from `dout` and what the forward saved.
    fn attention_backward(
        &self,
        opts: &AttnOptions<'_>,
        grads: AttnGrads<'_>,
        dout: View<'_>,
        saved: AttnSaved<'_>,
        mode: GradMode,
    ) -> Result<()>;
    /// Merges a partial result over a disjoint set of keys into `acc` (both `f32`): the exact attention over
    /// the union of the keys.
    fn attention_merge(&self, acc: AttnOut<'_>, part: AttnPartial<'_>) -> Result<()>;

    /// `y[N,OUT] = x[N,IN]·wᵀ + bias` (`w` is `[OUT, IN]`, as PyTorch's `Linear`). Saves `x` ([`LinearSaved`]).
    fn linear_forward(&self, y: ViewMut<'_>, x: View<'_>, w: View<'_>, bias: Option<View<'_>>) -> Result<()>;
    /// The linear layer's backward: `grads.dx` (overwritten), `grads.dw` and `grads.dbias` (per `mode`).
    fn linear_backward(
        &self,
        grads: LinearGrads<'_>,
        dy: View<'_>,
        saved: LinearSaved<'_>,
        w: View<'_>,
        mode: GradMode,
    ) -> Result<()>;

    /// RMSNorm over the last dim: `y = x · rstd · weight`, writing the saved `rstd[N]` (`f32`).
    fn rmsnorm_forward(&self, y: ViewMut<'_>, rstd: ViewMut<'_>, x: View<'_>, p: &NormParams<'_>) -> Result<()>;
    /// RMSNorm backward: `grads.dx` (overwritten), `grads.dweight` (per `mode`).
    fn rmsnorm_backward(
        &self,
        grads: NormGrads<'_>,
        dy: View<'_>,
        saved: RmsNormSaved<'_>,
        weight: View<'_>,
        mode: GradMode,
    ) -> Result<()>;
    /// LayerNorm over the last dim, writing the saved `mean[N]` and `rstd[N]` (`f32`).
    fn layernorm_forward(
        &self,
        y: ViewMut<'_>,
        mean: ViewMut<'_>,
        rstd: ViewMut<'_>,
        x: View<'_>,
        p: &NormParams<'_>,
    ) -> Result<()>;
    /// LayerNorm backward: `grads.dx` (overwritten), `grads.dweight` and `grads.dbias` (per `mode`).
    fn layernorm_backward(
        &self,
        grads: NormGrads<'_>,
        dy: View<'_>,
        saved: LayerNormSaved<'_>,
        weight: View<'_>,
        mode: GradMode,
    ) -> Result<()>;

    /// Rotary embedding of `x[B,H,S,D]` in place, by the angles of `positions[S]` (global token positions; host
    /// memory, as the table). Saves nothing.
    fn rope_forward(&self, rope: &RopeTable, x: ViewMut<'_>, positions: &[i64]) -> Result<()>;
    /// The rotary embedding's backward in place: `d` holds `dy` and receives `dx` (the transpose of the forward
    /// map, so with no attention factor its inverse).
    fn rope_backward(&self, rope: &RopeTable, d: ViewMut<'_>, positions: &[i64]) -> Result<()>;

    /// SwiGLU: `out = silu(gate) ∘ up`. Saves both inputs ([`SwigluSaved`]).
    fn swiglu_forward(&self, out: ViewMut<'_>, gate: View<'_>, up: View<'_>) -> Result<()>;
    /// SwiGLU backward: `dgate`, `dup` (overwritten).
    fn swiglu_backward(
        &self,
        dgate: ViewMut<'_>,
        dup: ViewMut<'_>,
        dout: View<'_>,
        saved: SwigluSaved<'_>,
    ) -> Result<()>;
    /// Squared ReLU: `out = max(x, 0)²`. Saves `x` ([`SquaredReluSaved`]).
    fn squared_relu_forward(&self, out: ViewMut<'_>, x: View<'_>) -> Result<()>;
    /// Squared ReLU backward: `dx` (overwritten).
    fn squared_relu_backward(&self, dx: ViewMut<'_>, dout: View<'_>, saved: SquaredReluSaved<'_>) -> Result<()>;

    /// Mixture-of-experts router (Hugging Face Mixtral): `probs[L,E]` (`f32`) = softmax of `logits[L,E]`, each
    /// token's `top_k` most probable experts (ties to the lower index) and their probabilities renormalised to
    /// sum to 1 into `weights[L,K]` (`f32`). Returns the routing and the per-expert probability sums; saves
    /// [`MoeRouterSaved`]. The routing is host metadata (it sizes each expert's product), so on a device backend
    /// this call waits for its op and brings each token's choices to the host: one synchronisation per MoE layer.
    fn moe_router_forward(
        &self,
        probs: ViewMut<'_>,
        weights: ViewMut<'_>,
        logits: View<'_>,
        top_k: usize,
    ) -> Result<RouterOutput>;
    /// The router's backward: `dlogits[L,E]` (overwritten) from `dweights[L,K]` (`f32`) and `aux[E]` (`f32`), a
    /// gradient added to every token's expert probabilities (the load-balancing loss').
    fn moe_router_backward(
        &self,
        dlogits: ViewMut<'_>,
        dweights: View<'_>,
        aux: Option<View<'_>>,
        saved: MoeRouterSaved<'_>,
    ) -> Result<()>;
    /// Dispatch: `xe[N,C]` row `n` = `x[L,C]` row `routing.row_tokens()[n]` (tokens grouped by expert, expert
    /// `e`'s rows `routing.offsets()[e]..[e+1]`). Saves nothing.
    fn moe_gather_forward(&self, xe: ViewMut<'_>, x: View<'_>, routing: &Routing) -> Result<()>;
    /// The dispatch's backward: `dx[L,C]` (overwritten) sums each token's rows of `dxe[N,C]`.
    fn moe_gather_backward(&self, dx: ViewMut<'_>, dxe: View<'_>, routing: &Routing) -> Result<()>;
    /// Combine (a weighted index-add): `out[L,C]` (overwritten) row `t` = `Σ_j weights[t,j]·ye[row of (t, j)]`,
    /// summed in ascending expert order. Saves [`MoeCombineSaved`].
    fn moe_combine_forward(&self, out: ViewMut<'_>, ye: View<'_>, weights: View<'_>, routing: &Routing) -> Result<()>;
    /// The combine's backward: `dye[N,C]` and `dweights[L,K]` (`f32`), both overwritten.
    fn moe_combine_backward(
        &self,
        dye: ViewMut<'_>,
        dweights: ViewMut<'_>,
        dout: View<'_>,
        saved: MoeCombineSaved<'_>,
    ) -> Result<()>;

    /// Token embedding: `out[N,C] = table[ids[n]]` (`table` is `[V, C]`). Saves the ids.
    fn embedding_forward(&self, out: ViewMut<'_>, ids: &[u32], table: View<'_>) -> Result<()>;
    /// Embedding backward: `dtable` (per `mode`) gathers `dout`'s rows.
    fn embedding_backward(&self, dtable: ViewMut<'_>, dout: View<'_>, ids: &[u32], mode: GradMode) -> Result<()>;

    /// Cross-entropy of the output projection `hidden[T,C]·weightᵀ` (`weight` `[V, C]`) computed in chunks of
    /// tokens, so the `[T, V]` logits never exist at once: the loss, `grads.dhidden` (overwritten) and
    /// `grads.dweight` (per `mode`). `targets` are host memory; the loss is returned on the host, so a device
    /// backend waits for the op.
    fn cross_entropy_fused(
        &self,
        grads: ProjectionGrads<'_>,
        hidden: View<'_>,
        weight: View<'_>,
        targets: &[i64],
        opts: &CrossEntropyOptions,
        mode: GradMode,
    ) -> Result<CrossEntropyOutput>;

    /// One AdamW step on the `f32` master weights `master` from `grads`; with `copy_to`, the updated weights
    /// are also rounded into it (a `bf16` model's working copy).
    fn adamw_step(
        &self,
        master: ViewMut<'_>,
        copy_to: Option<ViewMut<'_>>,
        grads: View<'_>,
        state: AdamwState<'_>,
        hp: &AdamW,
        step: u64,
    ) -> Result<()>;
}
