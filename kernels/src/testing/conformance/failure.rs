//! What the suite returns: a [`Failure`] that says enough to act on it on a machine one cannot debug
//! interactively (a GPU box), or a [`Report`] of what passed and how closely.

use std::fmt;

use super::Family;
use crate::dtype::DType;
use crate::error::KernelError;

/// What an output was compared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Against {
    /// The suite's f64 reference (plain loops on the same rounded inputs).
    Reference,
    /// [`CpuBackend`](crate::CpuBackend) given the same inputs.
    Cpu,
    /// The same backend's first run of the same case (determinism), or its clean run (NaN confinement).
    Rerun,
}

impl fmt::Display for Against {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Against::Reference => "the f64 reference",
            Against::Cpu => "the CPU backend",
            Against::Rerun => "its own other run",
        })
    }
}

/// A failed check (see the module docs of [`conformance`](super)).
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    /// The backend's [`name`](crate::Backend::name).
    pub backend: &'static str,
    /// The family of the check.
    pub family: Family,
    /// The property that failed, e.g. `forward and backward against the reference`.
    pub check: &'static str,
    /// The op (or the backend call) that failed, e.g. `attention_backward`.
    pub op: &'static str,
    /// The case, as its `Debug` (shapes, mask, dtypes, mode and the seed of its data).
    pub case: String,
    /// What went wrong (boxed: a `Result` carrying a `Failure` stays small).
    pub kind: Box<FailureKind>,
}

/// What went wrong in a [`Failure`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum FailureKind {
    /// An output is farther from what it was compared with than the tolerance.
    Tolerance {
        /// The output, e.g. `dq`.
        output: &'static str,
        /// What it was compared with.
        against: Against,
        /// `max |got − want| / max |want|` (see [`tolerance`](super::tolerance)).
        err: f64,
        /// The tolerance.
        tol: f64,
        /// The element of the largest difference (or the first non-finite one).
        index: usize,
        /// The value there.
        got: f64,
        /// What it should be there.
        want: f64,
    },
    /// Bits that must be identical are not.
    Bits {
        /// The output.
        output: &'static str,
        /// What it was compared with.
        against: Against,
        /// The first element that differs.
        index: usize,
        /// Its value.
        got: f64,
        /// The value it should have had.
        want: f64,
    },
    /// The backend returned an error where it should have computed.
    Error {
        /// The backend call.
        call: &'static str,
        /// Whether it was the CPU backend the suite compares with that failed.
        on_cpu: bool,
        /// The error.
        error: KernelError,
    },
    /// A call given bad input did not return the error the CPU backend returns for it.
    WrongError {
        /// The backend call.
        call: &'static str,
        /// What it returned (`None`: `Ok`).
        got: Option<KernelError>,
        /// What the CPU backend returned (the shared checks' error).
        want: KernelError,
    },
    /// A call that returned an error changed an output.
    Touched {
        /// The backend call.
        call: &'static str,
        /// The output.
        output: &'static str,
        /// The first element changed.
        index: usize,
    },
    /// Another property of the op does not hold.
    Property(String),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} backend, {:?}: {}: `{}` ", self.backend, self.family, self.check, self.op)?;
        match self.kind.as_ref() {
            FailureKind::Tolerance { output, against, err, tol, index, got, want } => write!(
                f,
                "output `{output}` differs from {against} by {err:.3e} (tolerance {tol:.1e}); largest at element \
                 {index}: {got:e}, want {want:e}"
            )?,
            FailureKind::Bits { output, against, index, got, want } => write!(
                f,
                "output `{output}` is not bit-identical to {against}: element {index} is {got:e} ({:#x}), was \
                 {want:e} ({:#x})",
                got.to_bits(),
                want.to_bits()
            )?,
            FailureKind::Error { call, on_cpu, error } => {
                let who = if *on_cpu { " (on the CPU backend compared with)" } else { "" };
                write!(f, "`{call}` failed{who}: {error}")?
            }
            FailureKind::WrongError { call, got: Some(got), want } => {
                write!(f, "`{call}` returned `{got:?}`, the CPU backend `{want:?}`")?
            }
            FailureKind::WrongError { call, got: None, want } => {
                write!(f, "`{call}` returned Ok, the CPU backend `{want:?}`")?
            }
            FailureKind::Touched { call, output, index } => {
                write!(f, "`{call}` returned an error but changed `{output}` (element {index})")?
            }
            FailureKind::Property(what) => f.write_str(what)?,
        }
        write!(f, "\n  case: {}", self.case)
    }
}

impl std::error::Error for Failure {}

/// The largest error one output showed in a property, against what, beside its tolerance.
#[derive(Debug, Clone, PartialEq)]
pub struct Worst {
    /// The op.
    pub op: &'static str,
    /// The output.
    pub output: &'static str,
    /// Its element type (`None` for a host value such as a loss).
    pub dtype: Option<DType>,
    /// What it was compared with.
    pub against: Against,
    /// The largest error over the property's cases.
    pub err: f64,
    /// The tolerance (0: exact).
    pub tol: f64,
}

/// One property's result.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckReport {
    /// Its family.
    pub family: Family,
    /// The property.
    pub name: &'static str,
    /// Cases run (1 for a fixed case).
    pub cases: u32,
    /// The largest error of each output, against the reference and the CPU backend.
    pub worst: Vec<Worst>,
}

/// What passed: every property run, with its case count and worst errors.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// The backend's name.
    pub backend: &'static str,
    /// The properties, in the order they ran.
    pub checks: Vec<CheckReport>,
}

impl Report {
    /// The largest `err / tol` of any output against `against` (0 when every comparison was exact).
    pub fn worst_ratio(&self, against: Against) -> f64 {
        self.checks
            .iter()
            .flat_map(|c| &c.worst)
            .filter(|w| w.against == against && w.tol > 0.0)
            .map(|w| w.err / w.tol)
            .fold(0.0, f64::max)
    }
}

/// One line per property with its closest call (the largest error against its tolerance); `{:#}` lists every
/// output.
impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cases: u32 = self.checks.iter().map(|c| c.cases).sum();
        writeln!(f, "{} backend: {} properties, {cases} cases, all passed", self.backend, self.checks.len())?;
        for c in &self.checks {
            write!(f, "  {:?}: {} ({} cases)", c.family, c.name, c.cases)?;
            let closest =
                c.worst.iter().filter(|w| w.tol > 0.0).max_by(|a, b| (a.err / a.tol).total_cmp(&(b.err / b.tol)));
            match closest {
                Some(w) if !f.alternate() => writeln!(
                    f,
                    ": at most {:.0}% of the tolerance ({} `{}`, {} vs {})",
                    100.0 * w.err / w.tol,
                    w.op,
                    w.output,
                    w.dtype.map_or("host", DType::name),
                    w.against
                )?,
                _ => writeln!(f)?,
            }
            if !f.alternate() {
                continue;
            }
            for w in &c.worst {
                let dt = w.dtype.map_or("host", DType::name);
                writeln!(
                    f,
                    "    {:<22} {:<10} {:<5} vs {:<17} worst {:.2e} / tolerance {:.1e}",
                    w.op, w.output, dt, w.against, w.err, w.tol
                )?;
            }
        }
        Ok(())
    }
}
