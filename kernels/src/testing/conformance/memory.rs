//! Data in and out of the backend's memory: `upload` and `download` move bytes (any bit pattern, NaN payloads
//! included, through whole buffers and row ranges of them), `zeros` is zeros and `empty` has its dims, and a fork's
//! queue sees the work recorded before an event. Every other family relies on these, so they run first.

use std::fmt;

use half::bf16;
use proptest::prelude::*;

use super::data::DataRng;
use super::failure::{Against, FailureKind};
use super::harness::{At, Ctx, Fault};
use super::{strategies, Failure, Limits};
use crate::buffer::Buffer;
use crate::dtype::DType;
use crate::view::{Dims, View, ViewMut};

/// A buffer of random bits (every pattern: NaNs with payloads, infinities, subnormals, negative zeros) and a row
/// range of it.
#[derive(Clone)]
pub struct TransferCase {
    /// The element type.
    pub dtype: DType,
    /// 1 to 4 dims, any of them possibly 0.
    pub dims: Vec<usize>,
    /// A range of rows of the first dim, moved on its own.
    pub rows: (usize, usize),
    /// The seed of the bits.
    pub seed: u64,
}

impl fmt::Debug for TransferCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {:?}, rows {}..{}, seed {:#x}", self.dtype.name(), self.dims, self.rows.0, self.rows.1, self.seed)
    }
}

/// Transfer cases within `limits.elems` elements.
pub fn cases(limits: &Limits) -> impl Strategy<Value = TransferCase> {
    let cap = limits.elems.max(1);
    (strategies::dtype(), prop::collection::vec(0usize..=64, 1..=4), any::<u64>(), 0.0f64..1.0, 0.0f64..1.0).prop_map(
        move |(dtype, mut dims, seed, a, b)| {
            // Shrink the outer dims until the buffer fits.
            while dims.iter().product::<usize>() > cap {
                let i = dims.iter().position(|&d| d > 1).unwrap_or(0);
                dims[i] /= 2;
            }
            let first = dims[0];
            let start = (a * first as f64) as usize;
            let n = ((b * (first - start) as f64) as usize).min(first - start);
            TransferCase { dtype, dims, rows: (start, n), seed }
        },
    )
}

/// Host elements of random bits.
enum Bits {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<half::f16>),
}

impl Bits {
    fn random(dtype: DType, n: usize, seed: u64) -> Bits {
        let mut r = DataRng::new(seed);
        match dtype {
            DType::F32 => Bits::F32((0..n).map(|_| f32::from_bits(r.next_u64() as u32)).collect()),
            DType::Bf16 => Bits::Bf16((0..n).map(|_| bf16::from_bits(r.next_u64() as u16)).collect()),
            DType::F16 => Bits::F16((0..n).map(|_| half::f16::from_bits(r.next_u64() as u16)).collect()),
        }
    }
    fn zeros(dtype: DType, n: usize) -> Bits {
        match dtype {
            DType::F32 => Bits::F32(vec![0.0; n]),
            DType::Bf16 => Bits::Bf16(vec![bf16::ZERO; n]),
            DType::F16 => Bits::F16(vec![half::f16::ZERO; n]),
        }
    }
    fn view(&self, dims: Dims) -> crate::Result<View<'_>> {
        match self {
            Bits::F32(v) => View::new(v, dims),
            Bits::Bf16(v) => View::new(v, dims),
            Bits::F16(v) => View::new(v, dims),
        }
    }
    fn view_mut(&mut self, dims: Dims) -> crate::Result<ViewMut<'_>> {
        match self {
            Bits::F32(v) => ViewMut::new(v, dims),
            Bits::Bf16(v) => ViewMut::new(v, dims),
            Bits::F16(v) => ViewMut::new(v, dims),
        }
    }
    fn bits(&self) -> Vec<u32> {
        match self {
            Bits::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
            Bits::Bf16(v) => v.iter().map(|x| x.to_bits() as u32).collect(),
            Bits::F16(v) => v.iter().map(|x| x.to_bits() as u32).collect(),
        }
    }
}

/// The checks of this family.
pub(crate) fn check(ctx: &Ctx<'_>) -> Result<(), Failure> {
    ctx.property("upload then download moves every bit", cases(&ctx.cfg.limits), |c| round_trip(ctx, c))?;
    ctx.fixed("zeros are zeros, empty has its dims", || zeros_and_empty(ctx))?;
    ctx.fixed("a fork's queue sees what an event recorded", || fork_and_events(ctx))
}

/// Upload, download: the same bits; then the row range uploaded into a buffer of other bits and downloaded on its
/// own and whole: the range's bits where it went, the others' elsewhere.
fn round_trip(ctx: &Ctx<'_>, c: &TransferCase) -> Result<(), Failure> {
    let b = ctx.backend;
    let fault = |f: Fault| ctx.fault("upload/download", c, f, false);
    let dims = Dims::new(&c.dims).at("Dims::new").map_err(fault)?;
    let n = dims.numel();
    let data = Bits::random(c.dtype, n, c.seed);
    let other = Bits::random(c.dtype, n, !c.seed);
    let compare = |got: &Bits, want: &[u32], output: &'static str| -> Result<(), Failure> {
        match got.bits().iter().zip(want).position(|(g, w)| g != w) {
            None => Ok(()),
            Some(index) => Err(ctx.failure(
                "upload/download",
                c,
                FailureKind::Bits {
                    output,
                    against: Against::Reference,
                    index,
                    got: got.bits()[index] as f64,
                    want: want[index] as f64,
                },
            )),
        }
    };
    let run = || -> Result<(Bits, Bits, Bits), Fault> {
        let mut buf = b.empty(c.dtype, dims).at("empty")?;
        b.upload(buf.view_mut(), data.view(dims).at("View::new")?).at("upload")?;
        let mut back = Bits::zeros(c.dtype, n);
        b.download(back.view_mut(dims).at("ViewMut::new")?, buf.view()).at("download")?;
        // The rows `start..start + len` of `data` into a buffer holding `other`.
        let (start, len) = c.rows;
        let row = n / c.dims[0].max(1);
        let mut dst = b.empty(c.dtype, dims).at("empty")?;
        b.upload(dst.view_mut(), other.view(dims).at("View::new")?).at("upload")?;
        let src = data.view(dims).at("View::new")?.rows(start, len).at("View::rows")?;
        b.upload(dst.view_mut().rows(start, len).at("ViewMut::rows")?, src).at("upload")?;
        let mut part = Bits::zeros(c.dtype, len * row);
        let part_dims = src.shape();
        b.download(part.view_mut(part_dims).at("ViewMut::new")?, dst.view().rows(start, len).at("View::rows")?)
            .at("download")?;
        let mut whole = Bits::zeros(c.dtype, n);
        b.download(whole.view_mut(dims).at("ViewMut::new")?, dst.view()).at("download")?;
        Ok((back, part, whole))
    };
    let (back, part, whole) = run().map_err(fault)?;
    compare(&back, &data.bits(), "whole buffer")?;
    let (start, len) = c.rows;
    let row = n / c.dims[0].max(1);
    let range = start * row..(start + len) * row;
    compare(&part, &data.bits()[range.clone()], "row range")?;
    let mut want = other.bits();
    want[range.clone()].copy_from_slice(&data.bits()[range]);
    compare(&whole, &want, "buffer around the row range")
}

fn zeros_and_empty(ctx: &Ctx<'_>) -> Result<(), Failure> {
    let b = ctx.backend;
    for dt in [DType::F32, DType::Bf16, DType::F16] {
        for dims in [vec![1], vec![3, 0], vec![5, 7], vec![2, 3, 4, 5], vec![ctx.cfg.limits.elems.max(1)]] {
            let case = (dt, &dims);
            let run = || -> Result<(Buffer, Vec<f64>, Buffer), Fault> {
                let d = Dims::new(&dims).at("Dims::new")?;
                // Dirty memory first, so that zeros cannot pass by reusing a zeroed block.
                drop(ctx.mem().filled(dt, &dims, 3.0)?);
                let z = b.zeros(dt, d).at("zeros")?;
                let vals = ctx.mem().read(z.view())?;
                Ok((z, vals, b.empty(dt, d).at("empty")?))
            };
            let (z, vals, e) = run().map_err(|f| ctx.fault("zeros/empty", &case, f, false))?;
            for (buf, call) in [(&z, "zeros"), (&e, "empty")] {
                let ok = buf.dims() == &dims[..] && buf.dtype() == dt && buf.memory() == b.memory();
                ctx.ensure(ok, call, &case, || {
                    format!(
                        "made {:?} {} in {}, not {dims:?} {} in {}",
                        buf.dims(),
                        buf.dtype().name(),
                        buf.memory(),
                        dt.name(),
                        b.memory()
                    )
                })?;
            }
            ctx.ensure(vals.iter().all(|&v| v == 0.0), "zeros", &case, || "holds a nonzero element".into())?;
        }
    }
    Ok(())
}

fn fork_and_events(ctx: &Ctx<'_>) -> Result<(), Failure> {
    let b = ctx.backend;
    let n = ctx.cfg.limits.elems.clamp(1, 4096);
    let run = || -> Result<Vec<f64>, Fault> {
        let f = b.fork().at("fork")?;
        let mut buf = ctx.mem().filled(DType::F32, &[n], 1.0)?;
        b.scale(buf.view_mut(), 3.0).at("scale")?;
        let e = b.record_event().at("record_event")?;
        f.wait_event(&e).at("wait_event")?;
        // The fork computes on the same memory, with data of its own upload.
        let half = vec![0.5f32; n];
        let mut addend = f.empty(DType::F32, Dims::new(&[n]).at("Dims::new")?).at("empty")?;
        f.upload(addend.view_mut(), View::new(&half, [n]).at("View::new")?).at("upload")?;
        f.add(buf.view_mut(), addend.view()).at("add")?;
        let e = f.record_event().at("record_event")?;
        b.wait_event(&e).at("wait_event")?;
        b.synchronize().at("synchronize")?;
        f.synchronize().at("synchronize")?;
        ctx.mem().read(buf.view())
    };
    let got = run().map_err(|f| ctx.fault("fork/record_event/wait_event", &n, f, false))?;
    ctx.ensure(got.iter().all(|&v| v == 3.5), "fork/record_event/wait_event", &n, || {
        format!("1·3 + 0.5 across two queues gave {:?}", got.iter().find(|&&v| v != 3.5))
    })?;
    Ok(())
}
