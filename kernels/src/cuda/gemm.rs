//! Matrix products ([`Gemm`]) through cuBLASLt's `cublasLtMatmul`.
//!
//! One [`Blas`] per device (its `cublasLtHandle_t`, which holds no stream and is thread-safe, and the algorithm
//! cache), shared by the device's forks; one workspace per stream, owned by the `DriverDevice` of that stream:
//! two streams sharing a workspace would race on it. The workspace is [`WORKSPACE_BYTES`] = 32 MiB, the size
//! cuBLAS recommends for Hopper (cuBLAS docs, `cublasSetWorkspace`: 32 MiB on Hopper, 4 MiB before it; cudarc's
//! `Workspace` uses the same figures): the fastest Hopper kernels need it and less excludes them from the
//! heuristic. It is allocated once per stream, at its first product.
//!
//! Each product: a matmul descriptor with compute type `CUBLAS_COMPUTE_32F` (or `CUBLAS_COMPUTE_32F_FAST_TF32`,
//! only when [`Gemm::tf32`] is set and the inputs are `f32`), scale type `f32` (alpha and beta are host `f32`),
//! `TRANSA`/`TRANSB`, and with a bias the `CUBLASLT_EPILOGUE_BIAS` epilogue and `BIAS_POINTER`; column-major
//! layouts with their leading dimensions, and for `batch > 1` the batch count and strided batch offsets on each.
//! C and D are one buffer with one layout (cuBLASLt allows in place when `Cdesc == Ddesc`). The bias's type
//! (`CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE`) is left unset: its default, -1, means the output's type (cublasLt.h),
//! which is what [`Gemm::bias`] says, so setting it would change nothing, and unset is the path most callers take.
//!
//! Element types (cuBLASLt's table of `cublasLtMatmul` type combinations, regular non-FP8 rows, compute 32F,
//! scale 32F): A/B `f32` → C/D `f32` (also with `FAST_TF32`); A/B `bf16` → C/D `bf16`; A/B `bf16` → C/D `f32`.
//! `f32` inputs with a `bf16` output is not a cuBLASLt combination and is [`KernelError::Unsupported`]. (`f16`
//! would be the same as `bf16`, but `DType` has no `f16`.)
//!
//! The descriptors are built on the host in a [`Plan`], which needs cuBLASLt loaded but no GPU: the test
//! `plans_are_accepted_by_the_real_cublaslt` has the real library check every attribute's value and size.
//!
//! The algorithm is asked of `cublasLtMatmulAlgoGetHeuristic` once per [`GemmKey`]: every field of the product
//! that a descriptor carries (shape, leading dimensions, transposes, batch and strides, types, bias or not) and
//! the alignment of each pointer (A, B, C/D and the bias), since a view into the middle of a buffer can be as
//! little as 2-byte aligned: the preference's `MIN_ALIGNMENT_{A,B,C,D}_BYTES` are set from the actual pointers
//! (the default, 256, would let the heuristic pick a kernel that faults or fails on them), the bias pointer is set
//! on the descriptor before the query (the header: the heuristic depends "on its value to determine expected
//! pointer alignment"), and the workspace limit is the workspace's size.
//!
//! ## Determinism
//!
//! Training must be bit-reproducible run to run on one machine. cuBLAS documents (Results Reproducibility) that
//! its routines give bitwise-identical results run to run for one toolkit version on GPUs of the same
//! architecture and SM count, the exception being several streams sharing the library's internal workspace,
//! which `cublasLtMatmul` with a user-owned workspace per stream (what this file does) avoids. Split-K does not
//! break this: `cublasLtReductionScheme_t` documents each scheme as ordered (`INPLACE` "using the output buffer
//! … and counters (in workspace) to guarantee the sequentiality"; `COMPUTE_TYPE` and `OUTPUT_TYPE` reduce
//! partial results "in a separate step"), and the atomics-based producer/consumer mode (`ATOMIC_SYNC`) is only
//! used when asked for, which this file never does. The heuristic is a deterministic function of its inputs (no
//! timing), and the chosen algorithm is memoised per key, so one product always runs one algorithm. Decision:
//! the reduction schemes are **not** restricted (`CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK` left at "all"),
//! keeping split-K for the long-K weight gradients of long-context training; [`REDUCTION_SCHEME_MASK`] is the
//! one line to change if the GPU test `gemm_is_bitwise_reproducible` (a split-K shape, run twice) ever
//! disagrees. Results may differ across GPUs with another SM count or another cuBLAS version, as every
//! library's do.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::cublaslt::result as lt_result;
use cudarc::cublaslt::result::CublasError;
use cudarc::cublaslt::sys as lt;
use cudarc::driver::sys::CUstream;

use super::device::{DevicePtr, Gemm};
use super::libraries::{self, CudaLib};
use crate::dtype::DType;
use crate::error::{KernelError, Result};

/// Bytes of cuBLASLt workspace per stream (see the module docs).
pub(crate) const WORKSPACE_BYTES: usize = 32 << 20;

/// The reduction schemes the heuristic may pick; `None` leaves the preference at its default (all). See the
/// module docs' "Determinism".
const REDUCTION_SCHEME_MASK: Option<u32> = None;

/// The most a pointer's alignment is asked for: cuBLASLt's default minimum, which no kernel exceeds.
const MAX_ALIGNMENT: u32 = 256;

/// cuBLASLt's view of a product's element types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Types {
    pub compute: lt::cublasComputeType_t,
    pub ab: lt::cudaDataType,
    pub c: lt::cudaDataType,
}

fn cuda_type(t: DType) -> lt::cudaDataType {
    match t {
        DType::F32 => lt::cudaDataType::CUDA_R_32F,
        DType::Bf16 => lt::cudaDataType::CUDA_R_16BF,
        DType::F16 => lt::cudaDataType::CUDA_R_16F,
    }
}

/// The cuBLASLt types of `g`, or `Unsupported` for a combination cuBLASLt does not have.
pub(crate) fn types(g: &Gemm) -> Result<Types> {
    let compute = match (g.ab_type, g.c_type) {
        (DType::F32, DType::F32) if g.tf32 => lt::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        (DType::F32, DType::F32)
        | (DType::Bf16, DType::Bf16)
        | (DType::Bf16, DType::F32)
        | (DType::F16, DType::F16)
        | (DType::F16, DType::F32) => lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        (DType::F32, DType::Bf16 | DType::F16) => {
            return Err(KernelError::Unsupported("cuBLASLt has no product of f32 inputs with a 16-bit output"))
        }
        (DType::Bf16, DType::F16) | (DType::F16, DType::Bf16) => {
            return Err(KernelError::Unsupported("cuBLASLt has no product mixing bf16 and f16"))
        }
    };
    Ok(Types { compute, ab: cuda_type(g.ab_type), c: cuda_type(g.c_type) })
}

/// Everything the algorithm choice depends on (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct GemmKey {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub lda: u64,
    pub ldb: u64,
    pub ldc: u64,
    pub trans_a: bool,
    pub trans_b: bool,
    pub batch: i32,
    /// Strides in elements; 0 when `batch == 1` (they are not used then).
    pub stride_a: i64,
    pub stride_b: i64,
    pub stride_c: i64,
    pub types: Types,
    pub bias: bool,
    /// Alignment in bytes of A, B, C/D and the bias (0 without one), at most [`MAX_ALIGNMENT`].
    pub align: [u32; 4],
}

/// The largest power of two (at most [`MAX_ALIGNMENT`]) dividing `ptr` and, for a batch, every matrix's start.
fn alignment(ptr: DevicePtr, batch_stride_bytes: u64) -> u32 {
    let bits = ptr | batch_stride_bytes;
    if bits == 0 {
        MAX_ALIGNMENT
    } else {
        (1u64 << bits.trailing_zeros().min(MAX_ALIGNMENT.trailing_zeros())) as u32
    }
}

fn invalid(why: String) -> KernelError {
    KernelError::InvalidArgument { name: "gemm", why }
}

/// Checks `g` and returns its key.
pub(crate) fn key(g: &Gemm) -> Result<GemmKey> {
    let types = types(g)?;
    for (name, v) in [("m", g.m), ("n", g.n), ("k", g.k), ("batch", g.batch)] {
        if v == 0 || v > i32::MAX as usize {
            return Err(invalid(format!("{name} = {v} is outside 1..=2^31-1")));
        }
    }
    let (rows_a, rows_b) = (if g.trans_a { g.k } else { g.m }, if g.trans_b { g.n } else { g.k });
    for (name, ld, rows) in [("lda", g.lda, rows_a), ("ldb", g.ldb, rows_b), ("ldc", g.ldc, g.m)] {
        if ld < rows || ld > i64::MAX as usize {
            return Err(invalid(format!("{name} = {ld} is less than the {rows} rows it must hold")));
        }
    }
    let (ab, c) = (g.ab_type.size() as u64, g.c_type.size() as u64);
    let mut pointers = vec![("a", g.a, ab), ("b", g.b, ab), ("c", g.c, c)];
    if let Some(bias) = g.bias {
        pointers.push(("bias", bias, c));
    }
    for (name, p, size) in pointers {
        if p == 0 || !p.is_multiple_of(size) {
            return Err(invalid(format!("{name} = {p:#x} is not an address of {size}-byte elements")));
        }
    }
    let batched = g.batch > 1;
    if batched && g.stride_c < g.ldc * g.n {
        return Err(invalid(format!(
            "stride_c = {} makes the {} outputs of ldc × n = {} elements overlap",
            g.stride_c,
            g.batch,
            g.ldc * g.n
        )));
    }
    let stride = |s: usize| if batched { s as i64 } else { 0 };
    let stride_bytes = |s: usize, size: u64| if batched { s as u64 * size } else { 0 };
    Ok(GemmKey {
        m: g.m as u64,
        n: g.n as u64,
        k: g.k as u64,
        lda: g.lda as u64,
        ldb: g.ldb as u64,
        ldc: g.ldc as u64,
        trans_a: g.trans_a,
        trans_b: g.trans_b,
        batch: g.batch as i32,
        stride_a: stride(g.stride_a),
        stride_b: stride(g.stride_b),
        stride_c: stride(g.stride_c),
        types,
        bias: g.bias.is_some(),
        align: [
            alignment(g.a, stride_bytes(g.stride_a, ab)),
            alignment(g.b, stride_bytes(g.stride_b, ab)),
            alignment(g.c, stride_bytes(g.stride_c, c)),
            g.bias.map_or(0, |p| alignment(p, 0)),
        ],
    })
}

fn lt_err(op: &str, key: &GemmKey, e: CublasError) -> KernelError {
    KernelError::Device { backend: "cuda", op: op.to_string(), why: format!("{:?} for {key:?}", e.0) }
}

/// One device's cuBLASLt: its handle and the algorithm chosen for each [`GemmKey`].
pub(crate) struct Blas {
    handle: lt::cublasLtHandle_t,
    algos: Mutex<HashMap<GemmKey, lt::cublasLtMatmulAlgo_t>>,
}

// SAFETY: a cuBLASLt handle may be used from any thread (cuBLAS docs, Thread Safety: the library is thread safe
// even with one handle; a cuBLASLt handle holds no stream or other per-call state); the map is behind a mutex.
unsafe impl Send for Blas {}
// SAFETY: as above.
unsafe impl Sync for Blas {}

impl std::fmt::Debug for Blas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blas").field("algorithms", &self.algos.lock().map(|a| a.len()).unwrap_or(0)).finish()
    }
}

impl Blas {
    /// Loads cuBLASLt and makes a handle. The device's context must be current on this thread (cuBLASLt binds
    /// the handle to the current device).
    pub fn new() -> Result<Self> {
        libraries::ensure(CudaLib::CublasLt).map_err(|e| KernelError::Device {
            backend: "cuda",
            op: "loading cuBLASLt".to_string(),
            why: e.to_string(),
        })?;
        let handle = lt_result::create_handle().map_err(|e| KernelError::Device {
            backend: "cuda",
            op: "cublasLtCreate".to_string(),
            why: format!("{:?}", e.0),
        })?;
        Ok(Self { handle, algos: Mutex::new(HashMap::new()) })
    }

    /// How many algorithms are cached (tests check that a second product of the same key asks no heuristic).
    pub fn cached(&self) -> usize {
        self.algos.lock().map(|a| a.len()).unwrap_or(0)
    }

    /// Enqueues `g` on `stream` with `workspace_bytes` of workspace at `workspace`.
    ///
    /// # Safety
    /// The device's context is current; `stream` is a live stream of it; `workspace` is an allocation of at least
    /// `workspace_bytes` used by nothing else on another stream; every pointer of `g` covers the elements the
    /// product touches (see [`Gemm`]).
    pub unsafe fn matmul(
        &self,
        g: &Gemm,
        stream: CUstream,
        workspace: DevicePtr,
        workspace_bytes: usize,
    ) -> Result<()> {
        let plan = Plan::new(g, workspace_bytes)?;
        let key = plan.key;
        let cached = self.algos.lock().unwrap_or_else(|e| e.into_inner()).get(&key).copied();
        let algo = match cached {
            Some(a) => a,
            None => {
                // SAFETY: the plan's descriptors and the handle are live.
                let found = unsafe {
                    lt_result::get_matmul_algo_heuristic(
                        self.handle,
                        plan.desc.0,
                        plan.a.0,
                        plan.b.0,
                        plan.c.0,
                        plan.c.0,
                        plan.pref.0,
                    )
                };
                // cudarc's wrapper asks for one result and turns "none found" and a failed state into errors.
                let a = found
                    .map_err(|e| KernelError::Device {
                        backend: "cuda",
                        op: "cublasLtMatmulAlgoGetHeuristic".to_string(),
                        why: format!(
                            "{:?}: no algorithm for {key:?} within {workspace_bytes} bytes of workspace (alignments \
                             of A, B, C/D, bias: {:?})",
                            e.0, key.align
                        ),
                    })?
                    .algo;
                self.algos.lock().unwrap_or_else(|e| e.into_inner()).insert(key, a);
                a
            }
        };
        let (alpha, beta) = (g.alpha, g.beta);
        // SAFETY: the caller guarantees the context, stream, workspace and matrix pointers; alpha and beta are
        // host f32 (pointer mode host, scale type 32F) read during the call; C and D are the same buffer with the
        // same layout, which cuBLASLt allows; `algo` was returned by the heuristic for this key (alignments
        // included) within this workspace.
        unsafe {
            lt_result::matmul(
                self.handle,
                plan.desc.0,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                g.a as usize as *const c_void,
                plan.a.0,
                g.b as usize as *const c_void,
                plan.b.0,
                g.c as usize as *const c_void,
                plan.c.0,
                g.c as usize as *mut c_void,
                plan.c.0,
                &algo,
                workspace as usize as *mut c_void,
                workspace_bytes,
                stream.cast(),
            )
        }
        .map_err(|e| lt_err("cublasLtMatmul", &key, e))
    }
}

/// The host-side description of one product: its key, matmul descriptor, layouts (C's serves D) and heuristic
/// preference. Building it needs cuBLASLt loaded but no GPU, so a test checks every attribute against the real
/// library (which refuses a value of the wrong size).
pub(crate) struct Plan {
    pub key: GemmKey,
    desc: Desc,
    a: Layout,
    b: Layout,
    c: Layout,
    pref: Pref,
}

impl Plan {
    /// Checks `g` and describes it for a workspace of `workspace_bytes`. cuBLASLt must be loaded.
    pub fn new(g: &Gemm, workspace_bytes: usize) -> Result<Self> {
        let key = key(g)?;
        let err = |op: &'static str| move |e: CublasError| lt_err(op, &key, e);
        let (rows_a, cols_a) = if g.trans_a { (g.k, g.m) } else { (g.m, g.k) };
        let (rows_b, cols_b) = if g.trans_b { (g.n, g.k) } else { (g.k, g.n) };
        let a = Layout::new(key.types.ab, rows_a, cols_a, g.lda, key.batch, key.stride_a)
            .map_err(err("cublasLtMatrixLayout (A)"))?;
        let b = Layout::new(key.types.ab, rows_b, cols_b, g.ldb, key.batch, key.stride_b)
            .map_err(err("cublasLtMatrixLayout (B)"))?;
        let c = Layout::new(key.types.c, g.m, g.n, g.ldc, key.batch, key.stride_c)
            .map_err(err("cublasLtMatrixLayout (C)"))?;

        let desc = Desc::new(key.types.compute).map_err(err("cublasLtMatmulDescCreate"))?;
        use lt::cublasLtMatmulDescAttributes_t as D;
        // SAFETY (every `set` below): `desc` is live and each value has the type cublasLt.h gives the attribute:
        // TRANSA/TRANSB int32_t (cublasOperation_t: N = 0, T = 1), EPILOGUE uint32_t, BIAS_POINTER a pointer.
        unsafe {
            desc.set(D::CUBLASLT_MATMUL_DESC_TRANSA, &(g.trans_a as i32)).map_err(err("matmul desc TRANSA"))?;
            desc.set(D::CUBLASLT_MATMUL_DESC_TRANSB, &(g.trans_b as i32)).map_err(err("matmul desc TRANSB"))?;
            if let Some(bias) = g.bias {
                let epilogue = lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS as u32;
                desc.set(D::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue).map_err(err("matmul desc EPILOGUE"))?;
                // The heuristic reads this pointer's alignment, so it is set before the query.
                let bias_ptr = bias as usize as *const c_void;
                desc.set(D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr).map_err(err("matmul desc BIAS_POINTER"))?;
            }
        }

        let pref = Pref::new().map_err(err("cublasLtMatmulPreferenceCreate"))?;
        use lt::cublasLtMatmulPreferenceAttributes_t as P;
        // SAFETY (every `set` below): `pref` is live; MAX_WORKSPACE_BYTES is uint64_t, MIN_ALIGNMENT_* and
        // REDUCTION_SCHEME_MASK are uint32_t (cublasLt.h).
        unsafe {
            pref.set(P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &(workspace_bytes as u64))
                .map_err(err("preference MAX_WORKSPACE_BYTES"))?;
            for (attr, align) in [
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align[0]),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align[1]),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align[2]),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align[2]),
            ] {
                pref.set(attr, &align).map_err(err("preference MIN_ALIGNMENT"))?;
            }
            if let Some(mask) = REDUCTION_SCHEME_MASK {
                pref.set(P::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask)
                    .map_err(err("preference REDUCTION_SCHEME_MASK"))?;
            }
        }
        Ok(Self { key, desc, a, b, c, pref })
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle was made by cublasLtCreate and is destroyed once; the owner binds the context first.
        let _ = unsafe { lt_result::destroy_handle(self.handle) };
    }
}

/// A matmul descriptor, destroyed on drop.
struct Desc(lt::cublasLtMatmulDesc_t);

impl Desc {
    fn new(compute: lt::cublasComputeType_t) -> std::result::Result<Self, CublasError> {
        lt_result::create_matmul_desc(compute, lt::cudaDataType::CUDA_R_32F).map(Self)
    }
    /// # Safety
    /// `T` is the attribute's documented type.
    unsafe fn set<T>(&self, attr: lt::cublasLtMatmulDescAttributes_t, v: &T) -> std::result::Result<(), CublasError> {
        // SAFETY: `v` is valid for `size_of::<T>()` bytes; the caller vouches for the type.
        unsafe { lt_result::set_matmul_desc_attribute(self.0, attr, (v as *const T).cast(), std::mem::size_of::<T>()) }
    }
}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by cublasLtMatmulDescCreate, destroyed once.
        let _ = unsafe { lt_result::destroy_matmul_desc(self.0) };
    }
}

/// A matrix layout, destroyed on drop.
struct Layout(lt::cublasLtMatrixLayout_t);

impl Layout {
    /// A column-major `rows × cols` layout with leading dimension `ld`, batched when `batch > 1`.
    fn new(
        t: lt::cudaDataType,
        rows: usize,
        cols: usize,
        ld: usize,
        batch: i32,
        stride: i64,
    ) -> std::result::Result<Self, CublasError> {
        let layout = Self(lt_result::create_matrix_layout(t, rows as u64, cols as u64, ld as i64)?);
        if batch > 1 {
            use lt::cublasLtMatrixLayoutAttribute_t as L;
            // SAFETY: `layout` is live; BATCH_COUNT is int32_t and STRIDED_BATCH_OFFSET int64_t (cublasLt.h).
            unsafe {
                lt_result::set_matrix_layout_attribute(
                    layout.0,
                    L::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                    (&batch as *const i32).cast(),
                    std::mem::size_of::<i32>(),
                )?;
                lt_result::set_matrix_layout_attribute(
                    layout.0,
                    L::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                    (&stride as *const i64).cast(),
                    std::mem::size_of::<i64>(),
                )?;
            }
        }
        Ok(layout)
    }
}

impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created by cublasLtMatrixLayoutCreate, destroyed once.
        let _ = unsafe { lt_result::destroy_matrix_layout(self.0) };
    }
}

/// A heuristic preference, destroyed on drop.
struct Pref(lt::cublasLtMatmulPreference_t);

impl Pref {
    fn new() -> std::result::Result<Self, CublasError> {
        lt_result::create_matmul_pref().map(Self)
    }
    /// # Safety
    /// `T` is the attribute's documented type.
    unsafe fn set<T>(
        &self,
        attr: lt::cublasLtMatmulPreferenceAttributes_t,
        v: &T,
    ) -> std::result::Result<(), CublasError> {
        // SAFETY: `v` is valid for `size_of::<T>()` bytes; the caller vouches for the type.
        unsafe { lt_result::set_matmul_pref_attribute(self.0, attr, (v as *const T).cast(), std::mem::size_of::<T>()) }
    }
}

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created by cublasLtMatmulPreferenceCreate, destroyed once.
        let _ = unsafe { lt_result::destroy_matmul_pref(self.0) };
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A row-major `Y[4,8] = X[4,16] · W[16,8]` as cuBLAS sees it (`m = 8, n = 4, k = 16`), bf16 in, f32 out.
    pub(crate) fn product() -> Gemm {
        Gemm {
            m: 8,
            n: 4,
            k: 16,
            a: 0x7000_0000,
            lda: 8,
            trans_a: false,
            stride_a: 0,
            b: 0x7100_0000,
            ldb: 16,
            trans_b: false,
            stride_b: 0,
            c: 0x7200_0000,
            ldc: 8,
            stride_c: 0,
            ab_type: DType::Bf16,
            c_type: DType::F32,
            batch: 1,
            alpha: 1.0,
            beta: 0.0,
            bias: None,
            tf32: false,
        }
    }

    /// Every descriptor, layout and preference attribute is accepted by the real cuBLASLt, which checks each
    /// value's size against the attribute's type (a `u64` for `TRANSA` is refused): this needs cuBLASLt loadable
    /// (the `nvidia-cublas` wheel, e.g. `LONGCTX_CUDA_LIB_DIRS=…/nvidia/cu13/lib`) but no GPU.
    #[test]
    fn plans_are_accepted_by_the_real_cublaslt() {
        if let Err(e) = libraries::ensure(CudaLib::CublasLt) {
            eprintln!("plans_are_accepted_by_the_real_cublaslt: skipped: {e}");
            return;
        }
        let variants: Vec<fn(&mut Gemm)> = vec![
            |_| {},
            |g| g.bias = Some(0x7300_0000),
            |g| {
                g.trans_a = true;
                g.lda = 16;
                g.trans_b = true;
                g.ldb = 4;
            },
            |g| {
                g.batch = 3;
                g.stride_a = 8 * 16 + 1;
                g.stride_b = 64;
                g.stride_c = 32;
                g.bias = Some(0x7300_0004);
            },
            |g| {
                g.ab_type = DType::F32;
                g.tf32 = true;
            },
            |g| g.c_type = DType::Bf16,
            |g| g.a += 2,
        ];
        for (i, change) in variants.iter().enumerate() {
            let mut g = product();
            change(&mut g);
            let plan = Plan::new(&g, WORKSPACE_BYTES).unwrap_or_else(|e| panic!("variant {i}: {e}"));
            assert_eq!(plan.key, key(&g).unwrap());
        }
    }

    #[test]
    fn equal_products_share_a_key_and_the_scalars_do_not_matter() {
        let g = product();
        let mut h = g;
        h.a += 0x1_0000;
        h.alpha = 2.0;
        h.beta = 1.0;
        assert_eq!(key(&g).unwrap(), key(&h).unwrap());
        assert_eq!(key(&g).unwrap().align, [256, 256, 256, 0]);
    }

    #[test]
    fn every_field_that_matters_changes_the_key() {
        let base = key(&product()).unwrap();
        let changes: Vec<fn(&mut Gemm)> = vec![
            |g| g.m = 7,
            |g| g.n = 5,
            |g| g.k = 15,
            |g| g.lda = 16,
            |g| g.ldb = 32,
            |g| g.ldc = 16,
            |g| {
                g.trans_a = true;
                g.lda = 16
            },
            |g| {
                g.trans_b = true;
                g.ldb = 4
            },
            |g| g.c_type = DType::Bf16,
            |g| g.bias = Some(0x7300_0000),
            |g| g.a += 2,
            |g| g.b += 16,
            |g| g.c += 4,
            |g| {
                g.batch = 3;
                g.stride_c = 32;
            },
        ];
        for (i, change) in changes.iter().enumerate() {
            let mut g = product();
            change(&mut g);
            assert_ne!(key(&g).unwrap(), base, "change {i}");
        }
    }

    #[test]
    fn alignment_follows_the_pointers_and_batch_strides() {
        let mut g = product();
        g.a += 2; // a bf16 view one element into its buffer
        g.c += 8;
        g.bias = Some(0x7300_0004);
        assert_eq!(key(&g).unwrap().align, [2, 256, 8, 4]);
        let mut g = product();
        g.batch = 2;
        g.stride_a = 8 * 16 + 1; // odd element stride: every other matrix starts 2-byte aligned
        g.stride_b = 16 * 4;
        g.stride_c = 8 * 4;
        let k = key(&g).unwrap();
        assert_eq!(k.align, [2, 128, 128, 0]);
        assert_eq!((k.stride_a, k.stride_b, k.stride_c), (129, 64, 32));
    }

    #[test]
    fn strides_are_ignored_without_a_batch() {
        let mut g = product();
        g.stride_a = 12345;
        assert_eq!(key(&g).unwrap(), key(&product()).unwrap());
    }

    #[test]
    fn tf32_only_with_f32_inputs() {
        let mut g = product();
        g.tf32 = true;
        assert_eq!(types(&g).unwrap().compute, lt::cublasComputeType_t::CUBLAS_COMPUTE_32F);
        g.ab_type = DType::F32;
        assert_eq!(types(&g).unwrap().compute, lt::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32);
        g.tf32 = false;
        assert_eq!(types(&g).unwrap().compute, lt::cublasComputeType_t::CUBLAS_COMPUTE_32F);
        assert_eq!(types(&g).unwrap().c, lt::cudaDataType::CUDA_R_32F);
    }

    #[test]
    fn unsupported_and_invalid_products_are_refused() {
        let mut g = product();
        g.ab_type = DType::F32;
        g.c_type = DType::Bf16;
        assert!(matches!(key(&g), Err(KernelError::Unsupported(_))));
        let bad: Vec<fn(&mut Gemm)> = vec![
            |g| g.m = 0,
            |g| g.k = 0,
            |g| g.batch = 0,
            |g| g.lda = 7,
            |g| g.ldb = 15,
            |g| g.ldc = 7,
            |g| g.trans_a = true, // lda must then hold k = 16 rows
            |g| g.a = 0,
            |g| g.c += 2, // an f32 output at a 2-byte offset
            |g| {
                g.batch = 2;
                g.stride_c = 31;
            },
            |g| g.m = 1 << 31,
        ];
        for (i, change) in bad.iter().enumerate() {
            let mut g = product();
            change(&mut g);
            assert!(matches!(key(&g), Err(KernelError::InvalidArgument { .. })), "case {i}: {:?}", key(&g));
        }
    }
}
