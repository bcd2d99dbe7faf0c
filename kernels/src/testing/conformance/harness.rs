//! The machinery every family uses: moving a case's data through the backend (`upload`, NaN-poisoned outputs,
//! `download`), comparing outputs with the reference and the CPU backend, running a property's cases through
//! proptest, and turning whatever went wrong into a [`Failure`].

use std::cell::{Cell, RefCell};
use std::fmt::Debug;

use half::bf16;
use proptest::strategy::Strategy;
use proptest::test_runner::{Config as ProptestConfig, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};

use super::failure::{Against, CheckReport, Failure, FailureKind, Report, Worst};
use super::tolerance::CPU_FACTOR;
use super::{Config, Family};
use crate::backend::Backend;
use crate::buffer::Buffer;
use crate::dtype::DType;
use crate::error::KernelError;
use crate::view::{Dims, View, ViewMut};

/// A backend call that failed, before the suite knows which property and case it belongs to.
#[derive(Debug)]
pub(crate) struct Fault {
    pub call: &'static str,
    pub error: KernelError,
}

/// Names the call a `KernelError` came from.
pub(crate) trait At<T> {
    fn at(self, call: &'static str) -> Result<T, Fault>;
}

impl<T> At<T> for Result<T, KernelError> {
    fn at(self, call: &'static str) -> Result<T, Fault> {
        self.map_err(|error| Fault { call, error })
    }
}

/// One output of a run, downloaded and widened: a tensor of `dtype`, or a host value (`dtype` `None`).
#[derive(Debug, Clone)]
pub(crate) struct Output {
    pub name: &'static str,
    pub dtype: Option<DType>,
    pub vals: Vec<f64>,
}

impl Output {
    /// A value the call returned on the host (a loss, a norm, a count).
    pub fn host(name: &'static str, vals: Vec<f64>) -> Self {
        Output { name, dtype: None, vals }
    }
}

/// What an output should be: the reference's values and the tolerance of the comparison (0: exact).
#[derive(Debug, Clone)]
pub(crate) struct Expect {
    pub name: &'static str,
    pub vals: Vec<f64>,
    pub tol: f64,
    /// The least scale the error is measured on (see [`Expect::floor`]).
    pub floor: f64,
}

impl Expect {
    pub fn new(name: &'static str, vals: Vec<f64>, tol: f64) -> Self {
        Expect { name, vals, tol, floor: 0.0 }
    }
    /// Measures the error on at least `floor`: a scalar such as a loss that may be near zero is compared to within
    /// `tol` absolutely there, relatively above `floor`.
    pub fn floor(mut self, floor: f64) -> Self {
        self.floor = floor;
        self
    }
    fn scale(&self) -> f64 {
        scale(&self.vals).max(self.floor)
    }
    /// The guard rows of a [`Placed`] output of `row` elements per row: NaN, as poisoned.
    pub fn guard(name: &'static str, pad: usize, row: usize) -> Self {
        Expect::new(name, vec![f64::NAN; (pad + 1) * row], 0.0)
    }
}

/// A view of `rows` rows that starts `pad` rows into its buffer and ends one row before the buffer does: an argument
/// that is not at the start of an allocation (a dispatched expert's rows, a chunk of tokens), so that a backend that
/// assumes aligned or whole buffers shows, and a write outside the view lands in the guard rows.
pub(crate) struct Placed {
    buf: Buffer,
    pad: usize,
    rows: usize,
}

impl Placed {
    pub fn view(&self) -> View<'_> {
        self.buf.view().rows(self.pad, self.rows).expect("the rows were allocated")
    }
    pub fn view_mut(&mut self) -> ViewMut<'_> {
        self.buf.view_mut().rows(self.pad, self.rows).expect("the rows were allocated")
    }
}

/// Moves a case's data through one backend.
#[derive(Clone, Copy)]
pub(crate) struct Mem<'a>(pub &'a dyn Backend);

impl Mem<'_> {
    /// A buffer of `dtype` with `dims` in the backend's memory holding `vals` (already representable in `dtype`),
    /// brought there by `upload`.
    pub fn input(&self, dtype: DType, dims: &[usize], vals: &[f64]) -> Result<Buffer, Fault> {
        let d = Dims::new(dims).at("Dims::new")?;
        let mut buf = self.0.empty(dtype, d).at("empty")?;
        match dtype {
            DType::F32 => {
                let host: Vec<f32> = vals.iter().map(|&x| x as f32).collect();
                self.0.upload(buf.view_mut(), View::new(&host, d).at("View::new")?).at("upload")?;
            }
            DType::Bf16 => {
                let host: Vec<bf16> = vals.iter().map(|&x| bf16::from_f64(x)).collect();
                self.0.upload(buf.view_mut(), View::new(&host, d).at("View::new")?).at("upload")?;
            }
            DType::F16 => {
                let host: Vec<half::f16> = vals.iter().map(|&x| half::f16::from_f64(x)).collect();
                self.0.upload(buf.view_mut(), View::new(&host, d).at("View::new")?).at("upload")?;
            }
        }
        Ok(buf)
    }
    /// An output buffer, every element NaN (`empty`, then `fill` through the backend), so that an element the op
    /// does not write fails any comparison.
    pub fn poisoned(&self, dtype: DType, dims: &[usize]) -> Result<Buffer, Fault> {
        self.filled(dtype, dims, f32::NAN)
    }
    /// A buffer of `value` everywhere.
    pub fn filled(&self, dtype: DType, dims: &[usize], value: f32) -> Result<Buffer, Fault> {
        let mut buf = self.0.empty(dtype, Dims::new(dims).at("Dims::new")?).at("empty")?;
        self.0.fill(buf.view_mut(), value).at("fill")?;
        Ok(buf)
    }
    /// The elements of `v`, brought to the host by `download` and widened.
    pub fn read(&self, v: View<'_>) -> Result<Vec<f64>, Fault> {
        let d = v.shape();
        match v.dtype() {
            DType::F32 => {
                let mut host = vec![0f32; v.len()];
                self.0.download(ViewMut::new(&mut host, d).at("ViewMut::new")?, v).at("download")?;
                Ok(host.into_iter().map(f64::from).collect())
            }
            DType::Bf16 => {
                let mut host = vec![bf16::ZERO; v.len()];
                self.0.download(ViewMut::new(&mut host, d).at("ViewMut::new")?, v).at("download")?;
                Ok(host.into_iter().map(bf16::to_f64).collect())
            }
            DType::F16 => {
                let mut host = vec![half::f16::ZERO; v.len()];
                self.0.download(ViewMut::new(&mut host, d).at("ViewMut::new")?, v).at("download")?;
                Ok(host.into_iter().map(half::f16::to_f64).collect())
            }
        }
    }
    /// `vals` (dims `dims`) in rows `pad..` of a buffer whose `pad` rows before and one row after hold NaN.
    pub fn input_at(&self, dtype: DType, dims: &[usize], vals: &[f64], pad: usize) -> Result<Placed, Fault> {
        let mut p = self.poisoned_at(dtype, dims, pad)?;
        let d = Dims::new(dims).at("Dims::new")?;
        match dtype {
            DType::F32 => {
                let host: Vec<f32> = vals.iter().map(|&x| x as f32).collect();
                self.0.upload(p.view_mut(), View::new(&host, d).at("View::new")?).at("upload")?;
            }
            DType::Bf16 => {
                let host: Vec<bf16> = vals.iter().map(|&x| bf16::from_f64(x)).collect();
                self.0.upload(p.view_mut(), View::new(&host, d).at("View::new")?).at("upload")?;
            }
            DType::F16 => {
                let host: Vec<half::f16> = vals.iter().map(|&x| half::f16::from_f64(x)).collect();
                self.0.upload(p.view_mut(), View::new(&host, d).at("View::new")?).at("upload")?;
            }
        }
        Ok(p)
    }
    /// A NaN view of `dims` in rows `pad..` of a NaN buffer one row longer.
    pub fn poisoned_at(&self, dtype: DType, dims: &[usize], pad: usize) -> Result<Placed, Fault> {
        let mut whole = dims.to_vec();
        whole[0] += pad + 1;
        Ok(Placed { buf: self.poisoned(dtype, &whole)?, pad, rows: dims[0] })
    }
    /// The view's elements as `name`, and the guard rows around it as `guard` (all NaN unless something wrote there).
    pub fn output_at(&self, name: &'static str, guard: &'static str, p: &Placed) -> Result<[Output; 2], Fault> {
        let all = self.read(p.buf.view())?;
        let row = all.len() / p.buf.dims()[0].max(1);
        let (start, end) = (p.pad * row, (p.pad + p.rows) * row);
        let guards = all[..start].iter().chain(&all[end..]).copied().collect();
        let dtype = Some(p.buf.dtype());
        Ok([Output { name, dtype, vals: all[start..end].to_vec() }, Output { name: guard, dtype, vals: guards }])
    }
    /// [`read`](Self::read) as a named [`Output`].
    pub fn output(&self, name: &'static str, buf: &Buffer) -> Result<Output, Fault> {
        Ok(Output { name, dtype: Some(buf.dtype()), vals: self.read(buf.view())? })
    }
}

/// The largest finite magnitude of `x`: the scale errors are measured on.
pub(crate) fn scale(x: &[f64]) -> f64 {
    x.iter().filter(|v| v.is_finite()).fold(0.0, |m, v| m.max(v.abs()))
}

/// The error of `got` against `want` (see [`tolerance`](super::tolerance)) relative to `scale` (absolute when it is
/// 0): `(error, index of the largest difference or of the first mismatched non-finite value)`. A NaN meets a NaN; an
/// infinity must meet itself. The comparison with the CPU backend is measured on the reference's scale, since the CPU's result is itself only close to the truth (where the truth is zero, its
/// values are rounding noise, and a relative error on their scale would mean nothing).
pub(crate) fn measure_on(got: &[f64], want: &[f64], scale: f64) -> (f64, usize) {
    if got.len() != want.len() {
        return (f64::INFINITY, got.len().min(want.len()));
    }
    let (mut num, mut at) = (0f64, 0usize);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_nan() || g.is_nan() {
            if w.is_nan() && g.is_nan() {
                continue;
            }
            return (f64::INFINITY, i);
        }
        if w.is_infinite() || g.is_infinite() {
            if g != w {
                return (f64::INFINITY, i);
            }
            continue;
        }
        let d = (g - w).abs();
        if d > num {
            num = d;
            at = i;
        }
    }
    (if scale == 0.0 { num } else { num / scale }, at)
}

/// The first element whose bits differ (any NaN meets any NaN: a payload is not a result).
pub(crate) fn first_bit_difference(got: &[f64], want: &[f64]) -> Option<usize> {
    if got.len() != want.len() {
        return Some(got.len().min(want.len()));
    }
    got.iter().zip(want).position(|(g, w)| g.to_bits() != w.to_bits() && !(g.is_nan() && w.is_nan()))
}

/// The state of one run of the suite: the backend, the CPU backend compared with, the report so far, and where in
/// it the suite is (for failures).
pub(crate) struct Ctx<'a> {
    pub backend: &'a dyn Backend,
    pub cfg: &'a Config,
    family: Cell<Family>,
    check: Cell<&'static str>,
    case_no: Cell<u32>,
    report: RefCell<Report>,
}

impl<'a> Ctx<'a> {
    pub fn new(backend: &'a dyn Backend, cfg: &'a Config) -> Self {
        Ctx {
            backend,
            cfg,
            family: Cell::new(Family::Memory),
            check: Cell::new(""),
            case_no: Cell::new(0),
            report: RefCell::new(Report { backend: backend.name(), checks: Vec::new() }),
        }
    }

    pub fn set_family(&self, f: Family) {
        self.family.set(f);
    }

    pub fn into_report(self) -> Report {
        self.report.into_inner()
    }

    /// The backend under test, for moving data.
    pub fn mem(&self) -> Mem<'a> {
        Mem(self.backend)
    }

    /// A [`Failure`] of the current property.
    pub fn failure(&self, op: &'static str, case: &dyn Debug, kind: FailureKind) -> Failure {
        Failure {
            backend: self.backend.name(),
            family: self.family.get(),
            check: self.check.get(),
            op,
            case: format!("{case:?}"),
            kind: Box::new(kind),
        }
    }

    /// A failed backend call as a [`Failure`].
    pub fn fault(&self, op: &'static str, case: &dyn Debug, f: Fault, on_cpu: bool) -> Failure {
        self.failure(op, case, FailureKind::Error { call: f.call, on_cpu, error: f.error })
    }

    /// A property that must hold, as a [`Failure`] when it does not.
    pub fn ensure(
        &self,
        ok: bool,
        op: &'static str,
        case: &dyn Debug,
        what: impl FnOnce() -> String,
    ) -> Result<(), Failure> {
        if ok {
            Ok(())
        } else {
            Err(self.failure(op, case, FailureKind::Property(what())))
        }
    }

    fn begin(&self, name: &'static str) {
        self.check.set(name);
        self.case_no.set(0);
        let family = self.family.get();
        self.report.borrow_mut().checks.push(CheckReport { family, name, cases: 0, worst: Vec::new() });
    }

    fn count_case(&self) -> u32 {
        let n = self.case_no.get();
        self.case_no.set(n + 1);
        if let Some(c) = self.report.borrow_mut().checks.last_mut() {
            c.cases += 1;
        }
        n
    }

    /// Records an error against its tolerance in the current property's worst list.
    fn record(
        &self,
        op: &'static str,
        output: &'static str,
        dtype: Option<DType>,
        against: Against,
        err: f64,
        tol: f64,
    ) {
        let mut r = self.report.borrow_mut();
        let Some(c) = r.checks.last_mut() else { return };
        match c
            .worst
            .iter_mut()
            .find(|w| w.op == op && w.output == output && w.dtype == dtype && w.against == against && w.tol == tol)
        {
            Some(w) => w.err = w.err.max(err),
            None => c.worst.push(Worst { op, output, dtype, against, err, tol }),
        }
    }

    /// Runs `check` on `cfg.cases` cases drawn from `strategy`; on a failure, proptest shrinks the case and the
    /// check of the smallest failing one is returned.
    pub fn property<S>(
        &self,
        name: &'static str,
        strategy: S,
        check: impl Fn(&S::Value) -> Result<(), Failure>,
    ) -> Result<(), Failure>
    where
        S: Strategy,
        S::Value: Debug,
    {
        self.begin(name);
        let config = ProptestConfig {
            cases: self.cfg.cases.max(1),
            max_shrink_iters: self.cfg.max_shrink_iters,
            failure_persistence: None,
            ..ProptestConfig::default()
        };
        let mut runner = TestRunner::new_with_rng(
            config,
            TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes(self.cfg.seed, name)),
        );
        let result = runner.run(&strategy, |case| {
            self.count_case();
            check(&case).map_err(|f| TestCaseError::fail(f.to_string()))
        });
        match result {
            Ok(()) => Ok(()),
            // The smallest failing case, checked once more for its `Failure` (the message is its `Display`).
            Err(TestError::Fail(why, case)) => match check(&case) {
                Err(f) => Err(f),
                Ok(()) => {
                    Err(self.failure("", &case, FailureKind::Property(format!("failed once, then passed: {why}"))))
                }
            },
            Err(TestError::Abort(why)) => {
                Err(self.failure("", &name, FailureKind::Property(format!("aborted: {why}"))))
            }
        }
    }

    /// Runs one fixed case.
    pub fn fixed(&self, name: &'static str, check: impl FnOnce() -> Result<(), Failure>) -> Result<(), Failure> {
        self.begin(name);
        self.count_case();
        check()
    }

    /// Whether the current case is one of those run twice for determinism.
    fn rerun_this_case(&self) -> bool {
        self.cfg.determinism && self.case_no.get().saturating_sub(1).is_multiple_of(4)
    }

    /// The heart of the suite: runs `run` (upload, poison, call, download) on the backend and compares every output
    /// with `want` (same order and names) within its tolerance; then, as configured, with the CPU backend's run of
    /// the same case, and with a second run on the backend (bit for bit). Returns the backend's outputs.
    pub fn compare(
        &self,
        op: &'static str,
        case: &dyn Debug,
        run: impl Fn(&dyn Backend) -> Result<Vec<Output>, Fault>,
        want: &[Expect],
    ) -> Result<Vec<Output>, Failure> {
        let got = run(self.backend).map_err(|f| self.fault(op, case, f, false))?;
        for w in want {
            let g = got.iter().find(|g| g.name == w.name).expect("the run has every expected output");
            self.within_on(op, case, g, &w.vals, w.scale(), w.tol, Against::Reference)?;
        }
        if self.cfg.compare_cpu {
            let cpu = run(&self.cfg.cpu).map_err(|f| self.fault(op, case, f, true))?;
            for (g, c) in got.iter().zip(&cpu) {
                let w = want.iter().find(|w| w.name == g.name).expect("every output has a reference");
                self.within_on(op, case, g, &c.vals, w.scale(), w.tol * CPU_FACTOR, Against::Cpu)?;
            }
        }
        if self.rerun_this_case() {
            let again = run(self.backend).map_err(|f| self.fault(op, case, f, false))?;
            self.same_bits(op, case, &again, &got, Against::Rerun)?;
        }
        Ok(got)
    }

    /// `got` within `tol` of `want` (bit for bit when `tol` is 0), recorded in the report.
    pub fn within(
        &self,
        op: &'static str,
        case: &dyn Debug,
        got: &Output,
        want: &[f64],
        tol: f64,
        against: Against,
    ) -> Result<(), Failure> {
        self.within_on(op, case, got, want, scale(want), tol, against)
    }

    /// [`within`](Self::within), measured on `scale`.
    #[allow(clippy::too_many_arguments)]
    pub fn within_on(
        &self,
        op: &'static str,
        case: &dyn Debug,
        got: &Output,
        want: &[f64],
        scale: f64,
        tol: f64,
        against: Against,
    ) -> Result<(), Failure> {
        // With `tol` 0 this is exact: equal values, NaN where NaN, the same infinities (-0 and +0 are one value).
        let (err, index) = measure_on(&got.vals, want, scale);
        self.record(op, got.name, got.dtype, against, err, tol);
        if err <= tol {
            return Ok(());
        }
        Err(self.failure(
            op,
            case,
            FailureKind::Tolerance {
                output: got.name,
                against,
                err,
                tol,
                index,
                got: got.vals.get(index).copied().unwrap_or(f64::NAN),
                want: want.get(index).copied().unwrap_or(f64::NAN),
            },
        ))
    }

    /// Every output of `got` has the bits of the same output of `want`.
    pub fn same_bits(
        &self,
        op: &'static str,
        case: &dyn Debug,
        got: &[Output],
        want: &[Output],
        against: Against,
    ) -> Result<(), Failure> {
        for (g, w) in got.iter().zip(want) {
            if let Some(index) = first_bit_difference(&g.vals, &w.vals) {
                return Err(self.failure(
                    op,
                    case,
                    FailureKind::Bits {
                        output: g.name,
                        against,
                        index,
                        got: g.vals.get(index).copied().unwrap_or(f64::NAN),
                        want: w.vals.get(index).copied().unwrap_or(f64::NAN),
                    },
                ));
            }
        }
        Ok(())
    }
}

/// The ChaCha seed of a property: the configured seed with the property's name mixed in, so two properties draw
/// different cases and adding one does not move the others.
fn seed_bytes(seed: u64, name: &str) -> [u8; 32] {
    let mut h = seed ^ 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    let mut rng = super::data::DataRng::new(h);
    let mut out = [0u8; 32];
    for chunk in out.chunks_mut(8) {
        chunk.copy_from_slice(&rng.next_u64().to_le_bytes());
    }
    out
}
