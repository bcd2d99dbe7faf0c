//! The CPU backend: SIMD kernels on a rayon thread pool, behind [`Backend`].
//!
//! The kernels themselves (`crate::attention`'s tiled forward, backward and merge, and the ops under
//! `crate::ops`) take typed slices and explicit sizes and are private to this backend: each method below checks
//! its views (memory, dims, dtypes), takes their slices without copying and calls one kernel on the backend's
//! pool.
//!
//! Its thread pool and its SIMD level are fields, not process-wide settings, so two backends in one process
//! (one per rank of a threads world, or one per SIMD path in a test) do not disturb each other.

use std::sync::Arc;

use half::{bf16, f16};
use rayon::prelude::*;

mod attention;
mod ops;
mod peak;

pub use attention::SimdPath;
pub use peak::fma_peak_flops;

use crate::attention::{AttnGrads, AttnOptions, AttnOut, AttnPartial, AttnSaved, Qkv};
use crate::backend::{AdamwState, Backend, GradMode, LinearGrads, NormGrads, NormParams, ProjectionGrads};
use crate::buffer::Buffer;
use crate::checks::{self, CrossEntropyDims, LinearDims, On, Rows};
use crate::dtype::{DType, Element};
use crate::error::{KernelError, Result};
use crate::host::{cache as host_cache, HostElement, HostSlice, HostSliceMut};
use crate::ops::{AdamW, CrossEntropyOptions, CrossEntropyOutput, RopeTable, RouterOutput, Routing};
use crate::saved::{
    LayerNormSaved, LinearSaved, MoeCombineSaved, MoeRouterSaved, RmsNormSaved, SquaredReluSaved, SwigluSaved,
};
use crate::view::{Dims, Memory, View, ViewMut};

/// Binds the type `$T` to the Rust type of `$dt` in `$body`.
macro_rules! by_dtype {
    ($dt:expr, $T:ident => $body:expr) => {
        match $dt {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::Bf16 => {
                type $T = bf16;
                $body
            }
            DType::F16 => {
                type $T = f16;
                $body
            }
        }
    };
}

/// Buffers from this size up come from the host cache when it holds one of their type and length, and are
/// cleared (for `zeros`) by the pool's threads rather than by `calloc` on the calling thread. An allocator that
/// reuses freed memory (glibc's heap, or the trainer's own) clears a reused block on the thread that asks for
/// it, while the pool waits: 2% of a training step's samples at 4K tokens, all of it serial.
const PARALLEL_ZEROS_BYTES: usize = host_cache::MIN_BYTES;

/// Whether [`Backend::empty`] fills its buffers with NaN: in debug builds (so the test suite), an op that leaves
/// part of an output unwritten shows as NaN rather than passing on stale values that happen to fit.
const POISON_EMPTY: bool = cfg!(debug_assertions);

/// Where the CPU backend's views live, for the shared checks.
const ON: On = On { memory: Memory::Host };

/// The CPU backend (see the module docs).
#[derive(Debug, Clone)]
pub struct CpuBackend {
    pool: Option<Arc<rayon::ThreadPool>>,
    simd: SimdPath,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self { pool: None, simd: SimdPath::detect() }
    }
}

impl CpuBackend {
    /// Runs on rayon's global pool with the best SIMD path this CPU has.
    pub fn new() -> Self {
        Self::default()
    }
    /// Runs on a new pool of `threads` threads.
    pub fn with_threads(threads: usize) -> Result<Self> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .map_err(|e| KernelError::InvalidArgument { name: "threads", why: e.to_string() })?;
        Ok(Self { pool: Some(Arc::new(pool)), ..Self::default() })
    }
    /// Runs on a pool the caller owns (a host framework's threads).
    pub fn with_pool(pool: Arc<rayon::ThreadPool>) -> Self {
        Self { pool: Some(pool), ..Self::default() }
    }
    /// The same backend limited to `simd` (clamped to what this CPU supports), e.g. to test every path.
    pub fn with_simd(mut self, simd: SimdPath) -> Self {
        self.simd = simd.clamp_supported();
        self
    }
    /// The SIMD path the attention kernels take.
    pub fn simd(&self) -> SimdPath {
        self.simd
    }
    /// Threads the kernels use.
    pub fn threads(&self) -> usize {
        self.pool.as_ref().map_or_else(rayon::current_num_threads, |p| p.current_num_threads())
    }
    /// Bytes of large host buffers kept for reuse, process-wide (see [`Backend::empty`]): what
    /// [`CpuBackend::release_scratch`] would give back.
    pub fn cached_bytes(&self) -> usize {
        host_cache::kept_bytes()
    }
    /// Frees the `f32` conversion buffers that the calling thread and this backend's threads keep for `bf16`
    /// operands (each thread reuses a few between calls), and the large host buffers kept for reuse.
    pub fn release_scratch(&self) {
        host_cache::release();
        ops::clear_pool();
        match &self.pool {
            Some(p) => p.broadcast(|_| ops::clear_pool()),
            None => rayon::broadcast(|_| ops::clear_pool()),
        };
    }

    /// A large host buffer with `dims`: a cached one (as its last owner left it) or, failing that, fresh zeros;
    /// either way filled with `fill` by the pool's threads when given.
    fn large<T: HostElement>(&self, dims: Dims, fill: Option<T>) -> Buffer {
        let n = dims.numel();
        let cached = host_cache::take(T::DTYPE, n).and_then(T::from_host_vec);
        let v = match cached {
            Some(mut v) => {
                if let Some(x) = fill {
                    self.run(|| v.par_chunks_mut(ops::ELEMS_PER_TASK).for_each(|c| c.fill(x)));
                }
                v
            }
            None => {
                host_cache::made(n * T::DTYPE.size());
                self.filled_vec(n, fill.unwrap_or_default())
            }
        };
        Buffer::owning(T::into_host_vec(v), dims)
    }

    /// `n` copies of `x`, written by the pool's threads.
    fn filled_vec<T: Element>(&self, n: usize, x: T) -> Vec<T> {
        let mut v = Vec::with_capacity(n);
        self.run(|| {
            v.spare_capacity_mut()[..n]
                .par_chunks_mut(ops::ELEMS_PER_TASK)
                .for_each(|c| c.fill(std::mem::MaybeUninit::new(x)))
        });
        // SAFETY: the first `n` elements were written just above.
        unsafe { v.set_len(n) };
        v
    }

    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(p) => p.install(f),
            None => f(),
        }
    }
}

impl CpuBackend {
    fn host<'a>(&self, name: &'static str, v: View<'a>) -> Result<HostSlice<'a>> {
        self.check_memory(name, v.memory())?;
        v.as_host(name)
    }
    fn host_mut<'a>(&self, name: &'static str, v: ViewMut<'a>) -> Result<HostSliceMut<'a>> {
        self.check_memory(name, v.memory())?;
        v.into_host(name)
    }
    fn check_memory(&self, name: &'static str, got: Memory) -> Result<()> {
        if got == Memory::Host {
            Ok(())
        } else {
            Err(KernelError::Memory { name, backend: "cpu", expected: Memory::Host, got })
        }
    }
    fn typed<'a, T: Element>(&self, name: &'static str, v: View<'a>) -> Result<&'a [T]> {
        self.check_memory(name, v.memory())?;
        v.as_typed(name)
    }
    fn typed_mut<'a, T: Element>(&self, name: &'static str, v: ViewMut<'a>) -> Result<&'a mut [T]> {
        self.check_memory(name, v.memory())?;
        v.into_typed(name)
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn memory(&self) -> Memory {
        Memory::Host
    }

    fn upload(&self, dst: ViewMut<'_>, src: View<'_>) -> Result<()> {
        checks::upload(ON, &dst, &src)?;
        self.copy(dst, src)
    }

    fn download(&self, dst: ViewMut<'_>, src: View<'_>) -> Result<()> {
        checks::download(ON, &dst, &src)?;
        self.copy(dst, src)
    }

    fn fork(&self) -> Result<Arc<dyn Backend>> {
        Ok(Arc::new(self.clone()))
    }

    fn zeros(&self, dtype: DType, dims: Dims) -> Result<Buffer> {
        if dims.numel() * dtype.size() < PARALLEL_ZEROS_BYTES {
            return Buffer::host_zeros(dtype, dims);
        }
        Ok(by_dtype!(dtype, T => self.large::<T>(dims, Some(T::default()))))
    }

    fn empty(&self, dtype: DType, dims: Dims) -> Result<Buffer> {
        let small = dims.numel() * dtype.size() < PARALLEL_ZEROS_BYTES;
        match (small, POISON_EMPTY) {
            (true, false) => Buffer::host_zeros(dtype, dims),
            (true, true) => {
                let mut b = Buffer::host_zeros(dtype, dims)?;
                by_dtype!(dtype, T => self.typed_mut::<T>("empty", b.view_mut())?.fill(T::from_f32(f32::NAN)));
                Ok(b)
            }
            (false, poison) => Ok(by_dtype!(dtype, T => self.large::<T>(dims, poison.then(|| T::from_f32(f32::NAN))))),
        }
    }

    fn copy(&self, dst: ViewMut<'_>, src: View<'_>) -> Result<()> {
        checks::copy(ON, &dst, &src)?;
        by_dtype!(dst.dtype(), D => by_dtype!(src.dtype(), S => {
            let (d, s) = (self.typed_mut::<D>("dst", dst)?, self.typed::<S>("src", src)?);
            self.run(|| {
                d.par_chunks_mut(ops::ELEMS_PER_TASK).zip(s.par_chunks(ops::ELEMS_PER_TASK)).for_each(|(d, s)| {
                    if D::DTYPE == S::DTYPE {
                        d.copy_from_slice(bytemuck::cast_slice(s))
                    } else {
                        d.iter_mut().zip(s).for_each(|(d, s)| *d = D::from_f32(s.to_f32()))
                    }
                })
            });
            Ok(())
        }))
    }

    fn fill(&self, dst: ViewMut<'_>, value: f32) -> Result<()> {
        checks::fill(ON, &dst)?;
        by_dtype!(dst.dtype(), D => {
            let (d, x) = (self.typed_mut::<D>("dst", dst)?, D::from_f32(value));
            self.run(|| d.par_chunks_mut(ops::ELEMS_PER_TASK).for_each(|c| c.fill(x)));
            Ok(())
        })
    }

    fn add(&self, dst: ViewMut<'_>, src: View<'_>) -> Result<()> {
        checks::copy(ON, &dst, &src)?;
        by_dtype!(dst.dtype(), D => by_dtype!(src.dtype(), S => {
            let (d, s) = (self.typed_mut::<D>("dst", dst)?, self.typed::<S>("src", src)?);
            self.run(|| {
                d.par_chunks_mut(ops::ELEMS_PER_TASK).zip(s.par_chunks(ops::ELEMS_PER_TASK)).for_each(|(d, s)| {
                    d.iter_mut().zip(s).for_each(|(d, s)| *d = D::from_f32(d.to_f32() + s.to_f32()))
                })
            });
            Ok(())
        }))
    }

    fn scale(&self, x: ViewMut<'_>, a: f32) -> Result<()> {
        checks::scale(ON, &x, a)?;
        by_dtype!(x.dtype(), T => {
            let x = self.typed_mut::<T>("x", x)?;
            self.run(|| {
                x.par_chunks_mut(ops::ELEMS_PER_TASK)
                    .for_each(|c| c.iter_mut().for_each(|v| *v = T::from_f32(v.to_f32() * a)))
            });
            Ok(())
        })
    }

    fn sum_squares(&self, xs: &[View<'_>]) -> Result<f64> {
        checks::sum_squares(ON, xs)?;
        let hosts = xs.iter().map(|x| self.host("xs", *x)).collect::<Result<Vec<_>>>()?;
        Ok(self.run(|| {
            hosts
                .iter()
                .map(|h| match *h {
                    HostSlice::F32(s) => ops::sum_squares(s),
                    HostSlice::Bf16(s) => ops::sum_squares(s),
                    HostSlice::F16(s) => ops::sum_squares(s),
                })
                .sum()
        }))
    }

    fn transpose12(&self, dst: ViewMut<'_>, src: View<'_>) -> Result<()> {
        let [_, b, c, d] = checks::transpose12(ON, &dst, &src)?;
        by_dtype!(dst.dtype(), D => by_dtype!(src.dtype(), S => {
            let (dst, src) = (self.typed_mut::<D>("dst", dst)?, self.typed::<S>("src", src)?);
            // One task per destination row block [c, ·]: each reads b strided rows of d elements.
            self.run(|| {
                dst.par_chunks_mut(b * d).enumerate().for_each(|(ac, out)| {
                    let (ai, ci) = (ac / c, ac % c);
                    for bi in 0..b {
                        let from = &src[((ai * b + bi) * c + ci) * d..][..d];
                        out[bi * d..(bi + 1) * d].iter_mut().zip(from).for_each(|(o, x)| *o = D::from_f32(x.to_f32()));
                    }
                })
            });
            Ok(())
        }))
    }

    fn attention_forward(&self, opts: &AttnOptions<'_>, out: AttnOut<'_>, qkv: Qkv<'_>) -> Result<()> {
        let p = checks::attention_forward(ON, opts, &out, &qkv)?;
        let (q, k, v) = (self.host("q", qkv.q)?, self.host("k", qkv.k)?, self.host("v", qkv.v)?);
        let o = self.host_mut("o", out.o)?;
        let lse = self.typed_mut::<f32>("lse", out.lse)?;
        let simd = self.simd;
        {
            self.run(|| attention::attention_forward_on(simd, &p, q, k, v, o, lse));
            Ok(())
        }
    }

    fn attention_backward(
        &self,
        opts: &AttnOptions<'_>,
        grads: AttnGrads<'_>,
        dout: View<'_>,
        saved: AttnSaved<'_>,
        mode: GradMode,
    ) -> Result<()> {
        let p = checks::attention_backward(ON, opts, &grads, &dout, &saved)?;
        let (q, k, v) = (self.host("q", saved.qkv.q)?, self.host("k", saved.qkv.k)?, self.host("v", saved.qkv.v)?);
        let (o, d_o) = (self.host("o", saved.o)?, self.host("dout", dout)?);
        let lse = self.typed::<f32>("lse", saved.lse)?;
        let (dq, dk, dv) =
            (self.host_mut("dq", grads.dq)?, self.host_mut("dk", grads.dk)?, self.host_mut("dv", grads.dv)?);
        let simd = self.simd;
        {
            self.run(|| {
                attention::attention_backward_on(simd, &p, q, k, v, o, d_o, lse, dq, dk, dv, mode.accumulate())
            });
            Ok(())
        }
    }

    fn attention_merge(&self, acc: AttnOut<'_>, part: AttnPartial<'_>) -> Result<()> {
        checks::attention_merge(ON, &acc, &part)?;
        let o1 = self.typed_mut::<f32>("acc.o", acc.o)?;
        let lse1 = self.typed_mut::<f32>("acc.lse", acc.lse)?;
        let (o2, lse2) = (self.typed::<f32>("part.o", part.o)?, self.typed::<f32>("part.lse", part.lse)?);
        {
            self.run(|| attention::merge_partial_attention(o1, lse1, o2, lse2));
            Ok(())
        }
    }

    fn linear_forward(&self, y: ViewMut<'_>, x: View<'_>, w: View<'_>, bias: Option<View<'_>>) -> Result<()> {
        let LinearDims { t, d_in, d_out } = checks::linear_forward(ON, &y, &x, &w, bias.as_ref())?;
        by_dtype!(x.dtype(), T => {
            let (x, w) = (self.typed::<T>("x", x)?, self.typed::<T>("w", w)?);
            let bias = bias.map(|b| self.typed::<T>("bias", b)).transpose()?;
            let y = self.typed_mut::<T>("y", y)?;
            { self.run(|| ops::linear_forward(y, x, w, bias, t, d_in, d_out)); Ok(()) }
        })
    }

    fn linear_backward(
        &self,
        grads: LinearGrads<'_>,
        dy: View<'_>,
        saved: LinearSaved<'_>,
        w: View<'_>,
        mode: GradMode,
    ) -> Result<()> {
        let LinearDims { t, d_in, d_out } = checks::linear_backward(ON, &grads, &dy, &saved, &w)?;
        by_dtype!(saved.x.dtype(), T => by_dtype!(grads.dw.dtype(), G => {
            let (x, w, dy) = (self.typed::<T>("x", saved.x)?, self.typed::<T>("w", w)?, self.typed::<T>("dy", dy)?);
            let dx = grads.dx.map(|d| self.typed_mut::<T>("dx", d)).transpose()?;
            let dw = self.typed_mut::<G>("dw", grads.dw)?;
            let dbias = grads.dbias.map(|d| self.typed_mut::<G>("dbias", d)).transpose()?;
            { self.run(|| ops::linear_backward(dx, dw, dbias, dy, x, w, t, d_in, d_out, mode.accumulate())); Ok(()) }
        }))
    }

    fn rmsnorm_forward(&self, y: ViewMut<'_>, rstd: ViewMut<'_>, x: View<'_>, p: &NormParams<'_>) -> Result<()> {
        let Rows { c, .. } = checks::rmsnorm_forward(ON, &y, &rstd, &x, p)?;
        by_dtype!(x.dtype(), T => {
            let (x, w) = (self.typed::<T>("x", x)?, self.typed::<T>("weight", p.weight)?);
            let (y, rstd) = (self.typed_mut::<T>("y", y)?, self.typed_mut::<f32>("rstd", rstd)?);
            { self.run(|| ops::rmsnorm_forward(y, rstd, x, w, c, p.eps)); Ok(()) }
        })
    }

    fn rmsnorm_backward(
        &self,
        grads: NormGrads<'_>,
        dy: View<'_>,
        saved: RmsNormSaved<'_>,
        weight: View<'_>,
        mode: GradMode,
    ) -> Result<()> {
        let Rows { c, .. } = checks::rmsnorm_backward(ON, &grads, &dy, &saved, &weight)?;
        by_dtype!(saved.x.dtype(), T => by_dtype!(grads.dweight.dtype(), G => {
            let (x, w, dy) = (self.typed::<T>("x", saved.x)?, self.typed::<T>("weight", weight)?, self.typed::<T>("dy", dy)?);
            let rstd = self.typed::<f32>("rstd", saved.rstd)?;
            let (dx, dw) = (self.typed_mut::<T>("dx", grads.dx)?, self.typed_mut::<G>("dweight", grads.dweight)?);
            { self.run(|| ops::rmsnorm_backward(dx, dw, dy, x, w, rstd, c, mode.accumulate())); Ok(()) }
        }))
    }

    fn layernorm_forward(
        &self,
        y: ViewMut<'_>,
        mean: ViewMut<'_>,
        rstd: ViewMut<'_>,
        x: View<'_>,
        p: &NormParams<'_>,
    ) -> Result<()> {
        let Rows { c, .. } = checks::layernorm_forward(ON, &y, &mean, &rstd, &x, p)?;
        let bias = p.bias.ok_or(KernelError::InvalidArgument { name: "bias", why: "LayerNorm needs a bias".into() })?;
        by_dtype!(x.dtype(), T => {
            let (x, w, b) = (self.typed::<T>("x", x)?, self.typed::<T>("weight", p.weight)?, self.typed::<T>("bias", bias)?);
            let y = self.typed_mut::<T>("y", y)?;
            let (mean, rstd) = (self.typed_mut::<f32>("mean", mean)?, self.typed_mut::<f32>("rstd", rstd)?);
            { self.run(|| ops::layernorm_forward(y, mean, rstd, x, w, b, c, p.eps)); Ok(()) }
        })
    }

    fn layernorm_backward(
        &self,
        grads: NormGrads<'_>,
        dy: View<'_>,
        saved: LayerNormSaved<'_>,
        weight: View<'_>,
        mode: GradMode,
    ) -> Result<()> {
        let Rows { c, .. } = checks::layernorm_backward(ON, &grads, &dy, &saved, &weight)?;
        let dbias = grads
            .dbias
            .ok_or(KernelError::InvalidArgument { name: "dbias", why: "LayerNorm's backward needs dbias".into() })?;
        by_dtype!(saved.x.dtype(), T => by_dtype!(grads.dweight.dtype(), G => {
            let (x, w, dy) = (self.typed::<T>("x", saved.x)?, self.typed::<T>("weight", weight)?, self.typed::<T>("dy", dy)?);
            let (mean, rstd) = (self.typed::<f32>("mean", saved.mean)?, self.typed::<f32>("rstd", saved.rstd)?);
            let dx = self.typed_mut::<T>("dx", grads.dx)?;
            let (dw, db) = (self.typed_mut::<G>("dweight", grads.dweight)?, self.typed_mut::<G>("dbias", dbias)?);
            { self.run(|| ops::layernorm_backward(dx, dw, db, dy, x, w, mean, rstd, c, mode.accumulate())); Ok(()) }
        }))
    }

    fn rope_forward(&self, rope: &RopeTable, x: ViewMut<'_>, positions: &[i64]) -> Result<()> {
        checks::rope(ON, rope, &x, positions)?;
        by_dtype!(x.dtype(), T => {
            let x = self.typed_mut::<T>("x", x)?;
            { self.run(|| rope.forward_inplace(x, positions)); Ok(()) }
        })
    }

    fn rope_backward(&self, rope: &RopeTable, d: ViewMut<'_>, positions: &[i64]) -> Result<()> {
        checks::rope(ON, rope, &d, positions)?;
        by_dtype!(d.dtype(), T => {
            let d = self.typed_mut::<T>("d", d)?;
            { self.run(|| rope.backward_inplace(d, positions)); Ok(()) }
        })
    }

    fn swiglu_forward(&self, out: ViewMut<'_>, gate: View<'_>, up: View<'_>) -> Result<()> {
        checks::swiglu_forward(ON, &out, &gate, &up)?;
        by_dtype!(gate.dtype(), T => {
            let (g, u, o) = (self.typed::<T>("gate", gate)?, self.typed::<T>("up", up)?, self.typed_mut::<T>("out", out)?);
            let simd = self.simd;
            { self.run(|| ops::swiglu_forward(simd, o, g, u)); Ok(()) }
        })
    }

    fn swiglu_backward(
        &self,
        dgate: ViewMut<'_>,
        dup: ViewMut<'_>,
        dout: View<'_>,
        saved: SwigluSaved<'_>,
    ) -> Result<()> {
        checks::swiglu_backward(ON, &dgate, &dup, &dout, &saved)?;
        by_dtype!(saved.gate.dtype(), T => {
            let (g, u, dy) = (self.typed::<T>("gate", saved.gate)?, self.typed::<T>("up", saved.up)?, self.typed::<T>("dout", dout)?);
            let (dg, du) = (self.typed_mut::<T>("dgate", dgate)?, self.typed_mut::<T>("dup", dup)?);
            let simd = self.simd;
            { self.run(|| ops::swiglu_backward(simd, dg, du, dy, g, u)); Ok(()) }
        })
    }

    fn squared_relu_forward(&self, out: ViewMut<'_>, x: View<'_>) -> Result<()> {
        checks::squared_relu_forward(ON, &out, &x)?;
        by_dtype!(x.dtype(), T => {
            let (x, o) = (self.typed::<T>("x", x)?, self.typed_mut::<T>("out", out)?);
            { self.run(|| ops::squared_relu_forward(o, x)); Ok(()) }
        })
    }

    fn squared_relu_backward(&self, dx: ViewMut<'_>, dout: View<'_>, saved: SquaredReluSaved<'_>) -> Result<()> {
        checks::squared_relu_backward(ON, &dx, &dout, &saved)?;
        by_dtype!(saved.x.dtype(), T => {
            let (x, dy, dx) = (self.typed::<T>("x", saved.x)?, self.typed::<T>("dout", dout)?, self.typed_mut::<T>("dx", dx)?);
            { self.run(|| ops::squared_relu_backward(dx, dy, x)); Ok(()) }
        })
    }

    fn moe_router_forward(
        &self,
        probs: ViewMut<'_>,
        weights: ViewMut<'_>,
        logits: View<'_>,
        top_k: usize,
    ) -> Result<RouterOutput> {
        let (l, e) = checks::moe_router_forward(ON, &probs, &weights, &logits, top_k)?;
        by_dtype!(logits.dtype(), T => {
            let x = self.typed::<T>("logits", logits)?;
            let (p, w) = (self.typed_mut::<f32>("probs", probs)?, self.typed_mut::<f32>("weights", weights)?);
            self.run(|| ops::router_forward(p, w, x, l, e, top_k))
        })
    }

    fn moe_router_backward(
        &self,
        dlogits: ViewMut<'_>,
        dweights: View<'_>,
        aux: Option<View<'_>>,
        saved: MoeRouterSaved<'_>,
    ) -> Result<()> {
        checks::moe_router_backward(ON, &dlogits, &dweights, aux.as_ref(), &saved)?;
        let r = saved.routing;
        let aux = aux.map(|a| self.typed::<f32>("aux", a)).transpose()?;
        let (p, w) = (self.typed::<f32>("probs", saved.probs)?, self.typed::<f32>("weights", saved.weights)?);
        let dw = self.typed::<f32>("dweights", dweights)?;
        by_dtype!(dlogits.dtype(), T => {
            let dl = self.typed_mut::<T>("dlogits", dlogits)?;
            { self.run(|| ops::router_backward(dl, dw, aux, p, w, r)); Ok(()) }
        })
    }

    fn moe_gather_forward(&self, xe: ViewMut<'_>, x: View<'_>, routing: &Routing) -> Result<()> {
        let c = checks::moe_gather_forward(ON, &xe, &x, routing)?;
        by_dtype!(x.dtype(), T => {
            let (x, o) = (self.typed::<T>("x", x)?, self.typed_mut::<T>("xe", xe)?);
            { self.run(|| ops::gather(o, x, routing, c)); Ok(()) }
        })
    }

    fn moe_gather_backward(&self, dx: ViewMut<'_>, dxe: View<'_>, routing: &Routing) -> Result<()> {
        let c = checks::moe_gather_backward(ON, &dx, &dxe, routing)?;
        by_dtype!(dxe.dtype(), T => {
            let (g, dx) = (self.typed::<T>("dxe", dxe)?, self.typed_mut::<T>("dx", dx)?);
            { self.run(|| ops::gather_backward(dx, g, routing, c)); Ok(()) }
        })
    }

    fn moe_combine_forward(&self, out: ViewMut<'_>, ye: View<'_>, weights: View<'_>, routing: &Routing) -> Result<()> {
        let c = checks::moe_combine_forward(ON, &out, &ye, &weights, routing)?;
        let w = self.typed::<f32>("weights", weights)?;
        by_dtype!(ye.dtype(), T => {
            let (y, o) = (self.typed::<T>("ye", ye)?, self.typed_mut::<T>("out", out)?);
            { self.run(|| ops::combine(o, y, w, routing, c)); Ok(()) }
        })
    }

    fn moe_combine_backward(
        &self,
        dye: ViewMut<'_>,
        dweights: ViewMut<'_>,
        dout: View<'_>,
        saved: MoeCombineSaved<'_>,
    ) -> Result<()> {
        let c = checks::moe_combine_backward(ON, &dye, &dweights, &dout, &saved)?;
        let r = saved.routing;
        let w = self.typed::<f32>("weights", saved.weights)?;
        let dw = self.typed_mut::<f32>("dweights", dweights)?;
        by_dtype!(saved.ye.dtype(), T => {
            let (y, g, dy) = (self.typed::<T>("ye", saved.ye)?, self.typed::<T>("dout", dout)?, self.typed_mut::<T>("dye", dye)?);
            { self.run(|| ops::combine_backward(dy, dw, g, y, w, r, c)); Ok(()) }
        })
    }

    fn embedding_forward(&self, out: ViewMut<'_>, ids: &[u32], table: View<'_>) -> Result<()> {
        let (_, c) = checks::embedding_forward(ON, &out, ids, &table)?;
        by_dtype!(table.dtype(), T => {
            let (t, o) = (self.typed::<T>("table", table)?, self.typed_mut::<T>("out", out)?);
            { self.run(|| ops::embedding_forward(o, ids, t, c)); Ok(()) }
        })
    }

    fn embedding_backward(&self, dtable: ViewMut<'_>, dout: View<'_>, ids: &[u32], mode: GradMode) -> Result<()> {
        let (v, c) = checks::embedding_backward(ON, &dtable, &dout, ids)?;
        by_dtype!(dout.dtype(), T => by_dtype!(dtable.dtype(), G => {
            let (dy, dt) = (self.typed::<T>("dout", dout)?, self.typed_mut::<G>("dtable", dtable)?);
            { self.run(|| ops::embedding_backward(dt, dy, ids, v, c, mode.accumulate())); Ok(()) }
        }))
    }

    fn cross_entropy_fused(
        &self,
        grads: ProjectionGrads<'_>,
        hidden: View<'_>,
        weight: View<'_>,
        targets: &[i64],
        opts: &CrossEntropyOptions,
        mode: GradMode,
    ) -> Result<CrossEntropyOutput> {
        let CrossEntropyDims { t, c, v, n_valid, denom } =
            checks::cross_entropy_fused(ON, &grads, &hidden, &weight, targets, opts)?;
        by_dtype!(hidden.dtype(), T => by_dtype!(grads.dweight.dtype(), G => {
            let (h, w) = (self.typed::<T>("hidden", hidden)?, self.typed::<T>("weight", weight)?);
            let (dh, dw) = (self.typed_mut::<T>("dhidden", grads.dhidden)?, self.typed_mut::<G>("dweight", grads.dweight)?);
            Ok(self.run(|| ops::cross_entropy_fused(dh, dw, h, w, targets, t, c, v, opts, (n_valid, denom), mode.accumulate())))
        }))
    }

    fn adamw_step(
        &self,
        master: ViewMut<'_>,
        copy_to: Option<ViewMut<'_>>,
        grads: View<'_>,
        state: AdamwState<'_>,
        hp: &AdamW,
        step: u64,
    ) -> Result<()> {
        checks::adamw_step(ON, &master, copy_to.as_ref(), &grads, &state, hp, step)?;
        let master = self.typed_mut::<f32>("master", master)?;
        let (m, v) = (self.typed_mut::<f32>("m", state.m)?, self.typed_mut::<f32>("v", state.v)?);
        by_dtype!(grads.dtype(), G => {
            let g = self.typed::<G>("grads", grads)?;
            match copy_to {
                None => { self.run(|| ops::adamw_step(master, g, m, v, hp, step)); Ok(()) },
                Some(c) => by_dtype!(c.dtype(), P => {
                    let p = self.typed_mut::<P>("copy_to", c)?;
                    { self.run(|| ops::adamw_step_with_copy(p, master, g, m, v, hp, step)); Ok(()) }
                }),
            }
        })
    }
}
