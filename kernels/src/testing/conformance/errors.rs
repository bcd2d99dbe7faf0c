//! Bad input is a typed error, checked before any work: every op given wrong dims, dtypes, lengths or scalars
//! returns the [`KernelError`] the CPU backend returns for the same call (the argument checks are shared, so a
//! backend that uses them agrees by construction, and one that does not is held to them), and leaves its outputs
//! as they were. On a backend whose memory is not the host's, a host view where a device view belongs is
//! [`KernelError::Memory`] naming the argument.

use half::bf16;

use super::failure::FailureKind;
use super::harness::{Ctx, Mem};
use super::Failure;
use crate::attention::{AttnGrads, AttnMask, AttnOptions, AttnOut, AttnPartial, AttnSaved, Positions, Qkv};
use crate::backend::{AdamwState, Backend, GradMode, LinearGrads, NormGrads, NormParams, ProjectionGrads};
use crate::buffer::Buffer;
use crate::dtype::DType;
use crate::error::{KernelError, Result};
use crate::ops::{AdamW, CrossEntropyOptions, RopeConfig, RopeScaling, RopeTable, Routing};
use crate::saved::{LayerNormSaved, LinearSaved, MoeCombineSaved, RmsNormSaved, SquaredReluSaved, SwigluSaved};
use crate::view::{Memory, View, ViewMut};

use DType::{Bf16, F32};

type Call = Box<dyn Fn(&dyn Backend, &[View<'_>], Vec<ViewMut<'_>>) -> Result<()>>;

/// The error a bad call must give (the CPU backend's is checked against it, and the backend's against the CPU's).
enum Want {
    /// Exactly this error.
    Is(KernelError),
    /// A [`KernelError::Shape`] whose message names the argument (an empty name: any `Shape`).
    Shape(&'static str),
    /// A [`KernelError::DType`] for the argument.
    DType(&'static str),
    /// A [`KernelError::BufferLength`] for the argument.
    Length(&'static str),
    /// A [`KernelError::InvalidArgument`] for the argument.
    Invalid(&'static str),
}

fn shape(name: &'static str) -> Want {
    Want::Shape(name)
}
fn dtype(name: &'static str) -> Want {
    Want::DType(name)
}
fn length(name: &'static str) -> Want {
    Want::Length(name)
}
fn invalid(name: &'static str) -> Want {
    Want::Invalid(name)
}

impl Want {
    fn matches(&self, e: &KernelError) -> bool {
        match (self, e) {
            (Want::Is(w), e) => w == e,
            (Want::Shape(n), KernelError::Shape(m)) => n.is_empty() || m.contains(&format!("`{n}`")),
            (Want::DType(n), KernelError::DType { name, .. })
            | (Want::Length(n), KernelError::BufferLength { name, .. })
            | (Want::Invalid(n), KernelError::InvalidArgument { name, .. }) => n == name,
            _ => false,
        }
    }
}

impl std::fmt::Debug for Want {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Want::Is(e) => write!(f, "{e:?}"),
            Want::Shape(n) => write!(f, "Shape naming `{n}`"),
            Want::DType(n) => write!(f, "DType {{ name: {n:?}, .. }}"),
            Want::Length(n) => write!(f, "BufferLength {{ name: {n:?}, .. }}"),
            Want::Invalid(n) => write!(f, "InvalidArgument {{ name: {n:?}, .. }}"),
        }
    }
}

/// One bad call: the error it must give, its inputs (filled with 0.5), its outputs (filled with `init`), and the
/// call.
struct Scenario {
    name: &'static str,
    want: Want,
    ins: Vec<(DType, Vec<usize>)>,
    outs: Vec<(DType, Vec<usize>)>,
    init: f32,
    call: Call,
}

fn bad(name: &'static str, want: Want, ins: &[(DType, &[usize])], outs: &[(DType, &[usize])], call: Call) -> Scenario {
    let own = |v: &[(DType, &[usize])]| v.iter().map(|(d, s)| (*d, s.to_vec())).collect();
    Scenario { name, want, ins: own(ins), outs: own(outs), init: 7.0, call }
}

/// The checks of this family.
pub(crate) fn check(ctx: &Ctx<'_>) -> Result<(), Failure> {
    ctx.fixed("bad dims, dtypes and scalars: the CPU backend's error, outputs untouched", || {
        scenarios().iter().try_for_each(|s| refuses(ctx, s))
    })?;
    if ctx.backend.memory() != Memory::Host {
        ctx.fixed("a host view given to a device backend is a Memory error naming it", || memory(ctx))?;
    }
    Ok(())
}

/// Makes the scenario's buffers on `b`, calls, and returns the result with the outputs as they are after it.
fn attempt(b: &dyn Backend, s: &Scenario) -> std::result::Result<(Result<()>, Vec<Vec<f64>>), super::harness::Fault> {
    let m = Mem(b);
    let ins: Vec<Buffer> = s.ins.iter().map(|(dt, d)| m.filled(*dt, d, 0.5)).collect::<std::result::Result<_, _>>()?;
    let mut outs: Vec<Buffer> =
        s.outs.iter().map(|(dt, d)| m.filled(*dt, d, s.init)).collect::<std::result::Result<_, _>>()?;
    let views: Vec<View<'_>> = ins.iter().map(|b| b.view()).collect();
    let r = (s.call)(b, &views, outs.iter_mut().map(|b| b.view_mut()).collect());
    let after = outs.iter().map(|o| m.read(o.view())).collect::<std::result::Result<_, _>>()?;
    Ok((r, after))
}

fn refuses(ctx: &Ctx<'_>, s: &Scenario) -> Result<(), Failure> {
    let (got, after) = attempt(ctx.backend, s).map_err(|f| ctx.fault(s.name, &s.name, f, false))?;
    let (want, _) = attempt(&ctx.cfg.cpu, s).map_err(|f| ctx.fault(s.name, &s.name, f, true))?;
    let want = match want {
        Err(e) if s.want.matches(&e) => e,
        Err(e) => {
            let why = format!("the CPU backend returns `{e:?}`, not {:?}", s.want);
            return Err(ctx.failure(s.name, &s.name, FailureKind::Property(why)));
        }
        Ok(()) => {
            return Err(ctx.failure(s.name, &s.name, FailureKind::Property("the CPU backend accepts this call".into())))
        }
    };
    if got.as_ref().err() != Some(&want) {
        return Err(ctx.failure(s.name, &s.name, FailureKind::WrongError { call: s.name, got: got.err(), want }));
    }
    untouched(ctx, s.name, &s.outs, s.init, &after)
}

fn untouched(
    ctx: &Ctx<'_>,
    name: &'static str,
    outs: &[(DType, Vec<usize>)],
    init: f32,
    after: &[Vec<f64>],
) -> Result<(), Failure> {
    for (i, vals) in after.iter().enumerate() {
        let want = super::data::store(outs[i].0, init);
        if let Some(index) = vals.iter().position(|&v| v.to_bits() != want.to_bits() && !(v.is_nan() && want.is_nan()))
        {
            let output =
                ["output 0", "output 1", "output 2", "output 3", "output 4"].get(i).copied().unwrap_or("output");
            return Err(ctx.failure(name, &name, FailureKind::Touched { call: name, output, index }));
        }
    }
    Ok(())
}

/// Every bad call, by op.
fn scenarios() -> Vec<Scenario> {
    let q = [1usize, 2, 8, 32];
    let lse = [1usize, 2, 8];
    let attn_fwd = |opts: AttnOptions<'static>| -> Call {
        Box::new(move |b, i, mut o| {
            let (q, k, v) = (i[0], i[1], i[2]);
            let (lse, o0) = (o.pop().expect("lse"), o.pop().expect("o"));
            b.attention_forward(&opts, AttnOut { o: o0, lse }, Qkv::new(q, k, v))
        })
    };
    let explicit: &'static [i64] = &[0, 1, 2];
    let docs: &'static [u32] = &[0; 8];
    let mut only_q_docs = AttnMask::full();
    only_q_docs.q_doc = Some(docs);
    let v = vec![
        // The utilities.
        bad(
            "copy",
            shape("dst"),
            &[(F32, &[2, 3])],
            &[(F32, &[3, 2])],
            Box::new(|b, i, mut o| b.copy(o.remove(0), i[0])),
        ),
        bad("add", shape("dst"), &[(F32, &[4])], &[(F32, &[5])], Box::new(|b, i, mut o| b.add(o.remove(0), i[0]))),
        bad(
            "transpose12",
            shape("dst"),
            &[(F32, &[2, 3, 5, 4])],
            &[(F32, &[2, 3, 5, 4])],
            Box::new(|b, i, mut o| b.transpose12(o.remove(0), i[0])),
        ),
        bad(
            "transpose12 of 3 dims",
            shape("src"),
            &[(F32, &[2, 3, 5])],
            &[(F32, &[2, 5, 3])],
            Box::new(|b, i, mut o| b.transpose12(o.remove(0), i[0])),
        ),
        bad(
            "upload of other dims",
            shape("dst"),
            &[],
            &[(F32, &[2, 3])],
            Box::new(|b, _, mut o| b.upload(o.remove(0), View::new(&[1.0f32; 6], [3, 2])?)),
        ),
        bad(
            "upload of another dtype",
            dtype("dst"),
            &[],
            &[(F32, &[4])],
            Box::new(|b, _, mut o| b.upload(o.remove(0), View::new(&[bf16::ONE; 4], [4])?)),
        ),
        bad(
            "download into other dims",
            shape("dst"),
            &[(F32, &[2, 3])],
            &[],
            Box::new(|b, i, _| b.download(ViewMut::new(&mut [0f32; 6], [6])?, i[0])),
        ),
        bad(
            "download into another dtype",
            dtype("dst"),
            &[(Bf16, &[4])],
            &[],
            Box::new(|b, i, _| b.download(ViewMut::new(&mut [0f32; 4], [4])?, i[0])),
        ),
        bad(
            "clip_grad_norm with a negative max_norm",
            invalid("max_norm"),
            &[],
            &[(F32, &[4])],
            Box::new(|b, _, mut o| b.clip_grad_norm(&mut o, -1.0).map(drop)),
        ),
        bad(
            "clip_grad_norm with a NaN max_norm",
            invalid("max_norm"),
            &[],
            &[(F32, &[4])],
            Box::new(|b, _, mut o| b.clip_grad_norm(&mut o, f32::NAN).map(drop)),
        ),
        Scenario {
            init: f32::NAN,
            ..bad(
                "clip_grad_norm of NaN gradients",
                invalid("grads"),
                &[],
                &[(F32, &[2]), (Bf16, &[3])],
                Box::new(|b, _, mut o| b.clip_grad_norm(&mut o, 1.0).map(drop)),
            )
        },
        Scenario {
            init: f32::INFINITY,
            ..bad(
                "clip_grad_norm of infinite gradients",
                invalid("grads"),
                &[],
                &[(F32, &[2])],
                Box::new(|b, _, mut o| b.clip_grad_norm(&mut o, 1.0).map(drop)),
            )
        },
        // Attention.
        bad(
            "attention_forward with query heads not a multiple",
            Want::Is(KernelError::HeadsNotDivisible { q_heads: 3, kv_heads: 2 }),
            &[(F32, &[1, 3, 8, 32]), (F32, &q), (F32, &q)],
            &[(F32, &[1, 3, 8, 32]), (F32, &[1, 3, 8])],
            attn_fwd(AttnOptions::default()),
        ),
        bad(
            "attention_forward with head dim 36",
            Want::Is(KernelError::HeadDim(36)),
            &[(F32, &[1, 2, 8, 36]), (F32, &[1, 2, 8, 36]), (F32, &[1, 2, 8, 36])],
            &[(F32, &[1, 2, 8, 36]), (F32, &lse)],
            attn_fwd(AttnOptions::default()),
        ),
        bad(
            "attention_forward with head dim 264",
            Want::Is(KernelError::HeadDim(264)),
            &[(F32, &[1, 2, 8, 264]), (F32, &[1, 2, 8, 264]), (F32, &[1, 2, 8, 264])],
            &[(F32, &[1, 2, 8, 264]), (F32, &lse)],
            attn_fwd(AttnOptions::default()),
        ),
        bad(
            "attention_forward with V in another dtype",
            dtype("v"),
            &[(F32, &q), (F32, &q), (Bf16, &q)],
            &[(F32, &q), (F32, &lse)],
            attn_fwd(AttnOptions::default()),
        ),
        bad(
            "attention_forward with K of another head dim",
            shape("k"),
            &[(F32, &q), (F32, &[1, 2, 4, 64]), (F32, &[1, 2, 4, 64])],
            &[(F32, &q), (F32, &lse)],
            attn_fwd(AttnOptions::default()),
        ),
        bad(
            "attention_forward with LSE of other dims",
            shape("lse"),
            &[(F32, &q), (F32, &q), (F32, &q)],
            &[(F32, &q), (F32, &[2, 8])],
            attn_fwd(AttnOptions::default()),
        ),
        bad(
            "attention_forward with LSE in bf16",
            dtype("lse"),
            &[(F32, &q), (F32, &q), (F32, &q)],
            &[(F32, &q), (Bf16, &lse)],
            attn_fwd(AttnOptions::default()),
        ),
        bad(
            "attention_forward with no keys",
            Want::Is(KernelError::ZeroDim("kv_len")),
            &[(F32, &q), (F32, &[1, 2, 0, 32]), (F32, &[1, 2, 0, 32])],
            &[(F32, &q), (F32, &lse)],
            attn_fwd(AttnOptions::default()),
        ),
        bad(
            "attention_forward with a window of 0",
            invalid("window"),
            &[(F32, &q), (F32, &q), (F32, &q)],
            &[(F32, &q), (F32, &lse)],
            attn_fwd(AttnOptions::new(AttnMask::full().with_window(0))),
        ),
        bad(
            "attention_forward with a NaN scale",
            invalid("scale"),
            &[(F32, &q), (F32, &q), (F32, &q)],
            &[(F32, &q), (F32, &lse)],
            attn_fwd(AttnOptions { mask: AttnMask::full(), scale: Some(f32::NAN) }),
        ),
        bad(
            "attention_forward with a negative scale",
            invalid("scale"),
            &[(F32, &q), (F32, &q), (F32, &q)],
            &[(F32, &q), (F32, &lse)],
            attn_fwd(AttnOptions { mask: AttnMask::full(), scale: Some(-1.0) }),
        ),
        bad(
            "attention_forward with 3 positions for 8 rows",
            length("q_pos"),
            &[(F32, &q), (F32, &q), (F32, &q)],
            &[(F32, &q), (F32, &lse)],
            attn_fwd(AttnOptions::new(
                AttnMask::causal().with_positions(Positions::Explicit(explicit), Positions::Offset(0)),
            )),
        ),
        bad(
            "attention_forward with query documents only",
            invalid("q_doc/k_doc"),
            &[(F32, &q), (F32, &q), (F32, &q)],
            &[(F32, &q), (F32, &lse)],
            attn_fwd(AttnOptions::new(only_q_docs)),
        ),
        bad(
            "attention_backward with dO of other dims",
            shape("dout"),
            &[(F32, &q), (F32, &q), (F32, &q), (F32, &q), (F32, &lse), (F32, &[1, 2, 8, 16])],
            &[(F32, &q), (F32, &q), (F32, &q)],
            Box::new(|b, i, mut o| {
                let (dv, dk, dq) = (o.pop().expect("dv"), o.pop().expect("dk"), o.pop().expect("dq"));
                let saved = AttnSaved { qkv: Qkv::new(i[0], i[1], i[2]), o: i[3], lse: i[4] };
                b.attention_backward(
                    &AttnOptions::default(),
                    AttnGrads { dq, dk, dv },
                    i[5],
                    saved,
                    GradMode::Overwrite,
                )
            }),
        ),
        bad(
            "attention_backward with dK of other dims",
            shape("dk"),
            &[(F32, &q), (F32, &q), (F32, &q), (F32, &q), (F32, &lse), (F32, &q)],
            &[(F32, &q), (F32, &[1, 2, 4, 32]), (F32, &q)],
            Box::new(|b, i, mut o| {
                let (dv, dk, dq) = (o.pop().expect("dv"), o.pop().expect("dk"), o.pop().expect("dq"));
                let saved = AttnSaved { qkv: Qkv::new(i[0], i[1], i[2]), o: i[3], lse: i[4] };
                b.attention_backward(
                    &AttnOptions::default(),
                    AttnGrads { dq, dk, dv },
                    i[5],
                    saved,
                    GradMode::Accumulate,
                )
            }),
        ),
        bad(
            "attention_merge with a partial of other dims",
            shape("part.o"),
            &[(F32, &[1, 1, 2, 3]), (F32, &[1, 1, 2])],
            &[(F32, &[1, 1, 2, 4]), (F32, &[1, 1, 2])],
            Box::new(|b, i, mut o| {
                let (lse, o0) = (o.pop().expect("lse"), o.pop().expect("o"));
                b.attention_merge(AttnOut { o: o0, lse }, AttnPartial { o: i[0], lse: i[1] })
            }),
        ),
        bad(
            "attention_merge in bf16",
            dtype("part.o"),
            &[(Bf16, &[1, 1, 2, 4]), (F32, &[1, 1, 2])],
            &[(F32, &[1, 1, 2, 4]), (F32, &[1, 1, 2])],
            Box::new(|b, i, mut o| {
                let (lse, o0) = (o.pop().expect("lse"), o.pop().expect("o"));
                b.attention_merge(AttnOut { o: o0, lse }, AttnPartial { o: i[0], lse: i[1] })
            }),
        ),
        // Linear layers.
        bad(
            "linear_forward with a weight of other width",
            shape("w"),
            &[(F32, &[2, 3]), (F32, &[2, 4])],
            &[(F32, &[2, 2])],
            Box::new(|b, i, mut o| b.linear_forward(o.remove(0), i[0], i[1], None)),
        ),
        bad(
            "linear_forward into other dims",
            shape("y"),
            &[(F32, &[2, 3]), (F32, &[2, 3])],
            &[(F32, &[1, 3])],
            Box::new(|b, i, mut o| b.linear_forward(o.remove(0), i[0], i[1], None)),
        ),
        bad(
            "linear_forward with a bias of 1",
            length("bias"),
            &[(F32, &[2, 3]), (F32, &[2, 3]), (F32, &[1])],
            &[(F32, &[2, 2])],
            Box::new(|b, i, mut o| b.linear_forward(o.remove(0), i[0], i[1], Some(i[2]))),
        ),
        bad(
            "linear_forward with a bf16 weight",
            dtype("w"),
            &[(F32, &[2, 3]), (Bf16, &[2, 3])],
            &[(F32, &[2, 2])],
            Box::new(|b, i, mut o| b.linear_forward(o.remove(0), i[0], i[1], None)),
        ),
        bad(
            "linear_backward with dw of 5",
            shape("dw"),
            &[(F32, &[2, 2]), (F32, &[2, 3]), (F32, &[2, 3])],
            &[(F32, &[5])],
            Box::new(|b, i, mut o| {
                let grads = LinearGrads { dx: None, dw: o.remove(0), dbias: None };
                b.linear_backward(grads, i[0], LinearSaved { x: i[1] }, i[2], GradMode::Overwrite)
            }),
        ),
        bad(
            "linear_backward with dbias of another dtype",
            dtype("dbias"),
            &[(F32, &[2, 2]), (F32, &[2, 3]), (F32, &[2, 3])],
            &[(F32, &[2, 3]), (Bf16, &[2])],
            Box::new(|b, i, mut o| {
                let (db, dw) = (o.pop().expect("dbias"), o.pop().expect("dw"));
                let grads = LinearGrads { dx: None, dw, dbias: Some(db) };
                b.linear_backward(grads, i[0], LinearSaved { x: i[1] }, i[2], GradMode::Accumulate)
            }),
        ),
        // Norms.
        bad(
            "rmsnorm_forward with a weight of 2",
            length("weight"),
            &[(F32, &[2, 3]), (F32, &[2])],
            &[(F32, &[2, 3]), (F32, &[2])],
            norm_fwd(1e-5, false),
        ),
        bad(
            "rmsnorm_forward with a NaN eps",
            invalid("eps"),
            &[(F32, &[2, 3]), (F32, &[3])],
            &[(F32, &[2, 3]), (F32, &[2])],
            norm_fwd(f32::NAN, false),
        ),
        bad(
            "rmsnorm_forward with a negative eps",
            invalid("eps"),
            &[(F32, &[2, 3]), (F32, &[3])],
            &[(F32, &[2, 3]), (F32, &[2])],
            norm_fwd(-1.0, false),
        ),
        bad(
            "rmsnorm_forward of no rows",
            Want::Is(KernelError::ZeroDim("n")),
            &[(F32, &[0, 3]), (F32, &[3])],
            &[(F32, &[0, 3]), (F32, &[0])],
            norm_fwd(1e-5, false),
        ),
        bad(
            "rmsnorm_forward with a bias",
            invalid("bias"),
            &[(F32, &[2, 3]), (F32, &[3])],
            &[(F32, &[2, 3]), (F32, &[2])],
            norm_fwd(1e-5, true),
        ),
        bad(
            "rmsnorm_forward with rstd in bf16",
            dtype("rstd"),
            &[(F32, &[2, 3]), (F32, &[3])],
            &[(F32, &[2, 3]), (Bf16, &[2])],
            norm_fwd(1e-5, false),
        ),
        bad(
            "layernorm_forward without a bias",
            invalid("bias"),
            &[(F32, &[2, 3]), (F32, &[3])],
            &[(F32, &[2, 3]), (F32, &[2]), (F32, &[2])],
            Box::new(|b, i, mut o| {
                let (r, m, y) = (o.pop().expect("rstd"), o.pop().expect("mean"), o.pop().expect("y"));
                b.layernorm_forward(y, m, r, i[0], &NormParams { weight: i[1], bias: None, eps: 1e-5 })
            }),
        ),
        bad(
            "layernorm_forward with rstd of 1",
            length("rstd"),
            &[(F32, &[2, 3]), (F32, &[3])],
            &[(F32, &[2, 3]), (F32, &[2]), (F32, &[1])],
            Box::new(|b, i, mut o| {
                let (r, m, y) = (o.pop().expect("rstd"), o.pop().expect("mean"), o.pop().expect("y"));
                b.layernorm_forward(y, m, r, i[0], &NormParams { weight: i[1], bias: Some(i[1]), eps: 1e-5 })
            }),
        ),
        bad(
            "layernorm_backward with dbias of 4",
            length("dbias"),
            &[(F32, &[2, 3]), (F32, &[2, 3]), (F32, &[2]), (F32, &[3])],
            &[(F32, &[2, 3]), (F32, &[3]), (F32, &[4])],
            Box::new(|b, i, mut o| {
                let (db, dw, dx) = (o.pop().expect("dbias"), o.pop().expect("dweight"), o.pop().expect("dx"));
                let saved = LayerNormSaved { x: i[1], mean: i[2], rstd: i[2] };
                b.layernorm_backward(
                    NormGrads { dx, dweight: dw, dbias: Some(db) },
                    i[0],
                    saved,
                    i[3],
                    GradMode::Accumulate,
                )
            }),
        ),
        bad(
            "rmsnorm_backward with dy of 5",
            shape("dy"),
            &[(F32, &[5]), (F32, &[2, 3]), (F32, &[2]), (F32, &[3])],
            &[(F32, &[2, 3]), (F32, &[3])],
            Box::new(|b, i, mut o| {
                let (dw, dx) = (o.pop().expect("dweight"), o.pop().expect("dx"));
                let saved = RmsNormSaved { x: i[1], rstd: i[2] };
                b.rmsnorm_backward(NormGrads { dx, dweight: dw, dbias: None }, i[0], saved, i[3], GradMode::Accumulate)
            }),
        ),
        // Rotary embeddings.
        bad("rope_forward with 2 positions for 3", shape(""), &[], &[(F32, &[2, 3, 1, 8])], rope(&[0, 1], true)),
        bad("rope_backward with 3 positions for 1", shape(""), &[], &[(F32, &[1, 1, 1, 8])], rope(&[0, 1, 2], false)),
        bad(
            "rope_forward of no positions",
            Want::Is(KernelError::ZeroDim("s")),
            &[],
            &[(F32, &[2, 3, 0, 8])],
            rope(&[], true),
        ),
        bad("rope_forward of another head dim", shape(""), &[], &[(F32, &[1, 1, 2, 16])], rope(&[0, 1], true)),
        // Activations.
        bad(
            "swiglu_forward with up of 3",
            shape("up"),
            &[(F32, &[4]), (F32, &[3])],
            &[(F32, &[4])],
            Box::new(|b, i, mut o| b.swiglu_forward(o.remove(0), i[0], i[1])),
        ),
        bad(
            "swiglu_forward with up in bf16",
            dtype("up"),
            &[(F32, &[4]), (Bf16, &[4])],
            &[(F32, &[4])],
            Box::new(|b, i, mut o| b.swiglu_forward(o.remove(0), i[0], i[1])),
        ),
        bad(
            "swiglu_forward into 2",
            shape("out"),
            &[(F32, &[4]), (F32, &[4])],
            &[(F32, &[2])],
            Box::new(|b, i, mut o| b.swiglu_forward(o.remove(0), i[0], i[1])),
        ),
        bad(
            "swiglu_backward with dup of 1",
            shape("dup"),
            &[(F32, &[4]), (F32, &[4]), (F32, &[4])],
            &[(F32, &[4]), (F32, &[1])],
            Box::new(|b, i, mut o| {
                let (du, dg) = (o.pop().expect("dup"), o.pop().expect("dgate"));
                b.swiglu_backward(dg, du, i[0], SwigluSaved { gate: i[1], up: i[2] })
            }),
        ),
        bad(
            "squared_relu_forward into 3",
            shape("out"),
            &[(F32, &[4])],
            &[(F32, &[3])],
            Box::new(|b, i, mut o| b.squared_relu_forward(o.remove(0), i[0])),
        ),
        bad(
            "squared_relu_backward with dout of 1",
            shape("dout"),
            &[(F32, &[1]), (F32, &[4])],
            &[(F32, &[4])],
            Box::new(|b, i, mut o| b.squared_relu_backward(o.remove(0), i[0], SquaredReluSaved { x: i[1] })),
        ),
        // Mixture of experts.
        bad(
            "moe_router_forward with top 5 of 3",
            invalid("top_k"),
            &[(F32, &[4, 3])],
            &[(F32, &[4, 3]), (F32, &[4, 5])],
            Box::new(|b, i, mut o| {
                let (w, p) = (o.pop().expect("weights"), o.pop().expect("probs"));
                b.moe_router_forward(p, w, i[0], 5).map(drop)
            }),
        ),
        bad(
            "moe_router_forward with probs of other dims",
            shape("probs"),
            &[(F32, &[3, 4])],
            &[(F32, &[4, 3]), (F32, &[4, 2])],
            Box::new(|b, i, mut o| {
                let (w, p) = (o.pop().expect("weights"), o.pop().expect("probs"));
                b.moe_router_forward(p, w, i[0], 2).map(drop)
            }),
        ),
        bad(
            "moe_gather_forward of tokens of other dims",
            shape("x"),
            &[(F32, &[3, 4])],
            &[(F32, &[4, 3])],
            Box::new(|b, i, mut o| {
                let routing = Routing::new(vec![0, 1, 1, 2], 2, 3, 2)?;
                b.moe_gather_forward(o.remove(0), i[0], &routing)
            }),
        ),
        bad(
            "moe_combine_forward with bf16 weights",
            dtype("weights"),
            &[(F32, &[4, 3]), (Bf16, &[2, 2])],
            &[(F32, &[2, 3])],
            Box::new(|b, i, mut o| {
                let routing = Routing::new(vec![0, 1, 1, 2], 2, 3, 2)?;
                b.moe_combine_forward(o.remove(0), i[0], i[1], &routing)
            }),
        ),
        bad(
            "moe_combine_backward with dweights of other dims",
            shape("dweights"),
            &[(F32, &[4, 3]), (F32, &[2, 2]), (F32, &[2, 3])],
            &[(F32, &[4, 3]), (F32, &[2, 3])],
            Box::new(|b, i, mut o| {
                let routing = Routing::new(vec![0, 1, 1, 2], 2, 3, 2)?;
                let (dw, dye) = (o.pop().expect("dweights"), o.pop().expect("dye"));
                b.moe_combine_backward(dye, dw, i[2], MoeCombineSaved { ye: i[0], weights: i[1], routing: &routing })
            }),
        ),
        // Embeddings.
        bad(
            "embedding_forward of an id past the vocabulary",
            invalid("ids"),
            &[(F32, &[4, 3])],
            &[(F32, &[2, 3])],
            Box::new(|b, i, mut o| b.embedding_forward(o.remove(0), &[1, 4], i[0])),
        ),
        bad(
            "embedding_forward of 1 id into 2 rows",
            shape("out"),
            &[(F32, &[4, 3])],
            &[(F32, &[2, 3])],
            Box::new(|b, i, mut o| b.embedding_forward(o.remove(0), &[0], i[0])),
        ),
        bad(
            "embedding_forward of an empty vocabulary",
            Want::Is(KernelError::ZeroDim("v")),
            &[(F32, &[0, 3])],
            &[(F32, &[2, 3])],
            Box::new(|b, i, mut o| b.embedding_forward(o.remove(0), &[0, 1], i[0])),
        ),
        bad(
            "embedding_forward of a flat table",
            shape(""),
            &[(F32, &[12])],
            &[(F32, &[2, 3])],
            Box::new(|b, i, mut o| b.embedding_forward(o.remove(0), &[0, 1], i[0])),
        ),
        bad(
            "embedding_backward of an id past the vocabulary",
            invalid("ids"),
            &[(F32, &[2, 3])],
            &[(F32, &[4, 3])],
            Box::new(|b, i, mut o| b.embedding_backward(o.remove(0), i[0], &[0, u32::MAX], GradMode::Accumulate)),
        ),
        // The fused cross-entropy.
        ce(
            "cross_entropy_fused with a target past the vocabulary",
            invalid("targets"),
            &[0, 3],
            CrossEntropyOptions::default(),
            &[2, 4],
        ),
        ce(
            "cross_entropy_fused with a negative target",
            invalid("targets"),
            &[0, -1],
            CrossEntropyOptions::default(),
            &[2, 4],
        ),
        ce(
            "cross_entropy_fused with 1 target for 2 tokens",
            length("targets"),
            &[0],
            CrossEntropyOptions::default(),
            &[2, 4],
        ),
        ce(
            "cross_entropy_fused with a zero denominator",
            invalid("denominator"),
            &[0, 1],
            CrossEntropyOptions { denominator: Some(0.0), ..Default::default() },
            &[2, 4],
        ),
        ce(
            "cross_entropy_fused with chunks of 0",
            Want::Is(KernelError::ZeroDim("chunk_tokens")),
            &[0, 1],
            CrossEntropyOptions { chunk_tokens: 0, ..Default::default() },
            &[2, 4],
        ),
        ce("cross_entropy_fused with a flat dhidden", shape("dhidden"), &[0, 1], CrossEntropyOptions::default(), &[8]),
        // AdamW.
        adamw("adamw_step with grads of 3", shape("grads"), &[3], &[4], AdamW::default(), 1),
        adamw("adamw_step with moments of 1", shape("m"), &[4], &[1], AdamW::default(), 1),
        adamw("adamw_step at step 0", invalid("step"), &[4], &[4], AdamW::default(), 0),
        adamw("adamw_step with beta1 1", invalid("beta1"), &[4], &[4], AdamW { beta1: 1.0, ..AdamW::default() }, 1),
        adamw("adamw_step with eps 0", invalid("eps"), &[4], &[4], AdamW { eps: 0.0, ..AdamW::default() }, 1),
        adamw(
            "adamw_step with a NaN learning rate",
            invalid("lr"),
            &[4],
            &[4],
            AdamW { lr: f32::NAN, ..AdamW::default() },
            1,
        ),
        bad(
            "adamw_step with a copy of 3",
            shape("copy_to"),
            &[(F32, &[4])],
            &[(F32, &[4]), (F32, &[4]), (F32, &[4]), (Bf16, &[3])],
            Box::new(|b, i, mut o| {
                let (c, v, m, p) =
                    (o.pop().expect("copy"), o.pop().expect("v"), o.pop().expect("m"), o.pop().expect("master"));
                b.adamw_step(p, Some(c), i[0], AdamwState { m, v }, &AdamW::default(), 1)
            }),
        ),
        bad(
            "adamw_step with bf16 master weights",
            dtype("master"),
            &[(F32, &[4])],
            &[(Bf16, &[4]), (F32, &[4]), (F32, &[4])],
            Box::new(|b, i, mut o| {
                let (v, m, p) = (o.pop().expect("v"), o.pop().expect("m"), o.pop().expect("master"));
                b.adamw_step(p, None, i[0], AdamwState { m, v }, &AdamW::default(), 1)
            }),
        ),
    ];
    v
}

fn norm_fwd(eps: f32, bias: bool) -> Call {
    Box::new(move |b, i, mut o| {
        let (r, y) = (o.pop().expect("rstd"), o.pop().expect("y"));
        b.rmsnorm_forward(y, r, i[0], &NormParams { weight: i[1], bias: bias.then_some(i[1]), eps })
    })
}

fn rope(positions: &'static [i64], forward: bool) -> Call {
    Box::new(move |b, _, mut o| {
        let t = RopeTable::new(&RopeConfig { head_dim: 8, base: 10_000.0, scaling: RopeScaling::None })?;
        if forward {
            b.rope_forward(&t, o.remove(0), positions)
        } else {
            b.rope_backward(&t, o.remove(0), positions)
        }
    })
}

fn ce(
    name: &'static str,
    want: Want,
    targets: &'static [i64],
    opts: CrossEntropyOptions,
    dhidden: &'static [usize],
) -> Scenario {
    bad(
        name,
        want,
        &[(F32, &[2, 4]), (F32, &[3, 4])],
        &[(F32, dhidden), (F32, &[3, 4])],
        Box::new(move |b, i, mut o| {
            let (dw, dh) = (o.pop().expect("dweight"), o.pop().expect("dhidden"));
            b.cross_entropy_fused(
                ProjectionGrads { dhidden: dh, dweight: dw },
                i[0],
                i[1],
                targets,
                &opts,
                GradMode::Overwrite,
            )
            .map(drop)
        }),
    )
}

fn adamw(
    name: &'static str,
    want: Want,
    grads: &'static [usize],
    moments: &'static [usize],
    hp: AdamW,
    step: u64,
) -> Scenario {
    bad(
        name,
        want,
        &[(F32, grads)],
        &[(F32, &[4]), (F32, moments), (F32, &[4])],
        Box::new(move |b, i, mut o| {
            let (v, m, p) = (o.pop().expect("v"), o.pop().expect("m"), o.pop().expect("master"));
            b.adamw_step(p, None, i[0], AdamwState { m, v }, &hp, step)
        }),
    )
}

/// Host views where device views belong, one per argument kind and op: `KernelError::Memory` naming the argument,
/// the backend's memory expected and the host's found; and device views where `upload` and `download` take host
/// memory (the argument's name ends in `!` in the table): the host's expected, the backend's found. The outputs
/// untouched.
fn memory(ctx: &Ctx<'_>) -> Result<(), Failure> {
    let host = [0.5f32; 64];
    let hv = |dims: &[usize]| View::new(&host[..dims.iter().product::<usize>()], dims).expect("fits");
    type MemCall<'h> = Box<dyn Fn(&dyn Backend, &[View<'_>], Vec<ViewMut<'_>>) -> Result<()> + 'h>;
    type Shapes = Vec<(DType, Vec<usize>)>;
    let cases: Vec<(&'static str, &'static str, Shapes, Shapes, MemCall<'_>)> = vec![
        (
            "upload from device memory",
            "src!",
            vec![(F32, vec![4])],
            vec![(F32, vec![4])],
            Box::new(|b, i, mut o| b.upload(o.remove(0), i[0])),
        ),
        (
            "upload into host memory",
            "dst",
            vec![],
            vec![],
            Box::new(|b, _, _| b.upload(ViewMut::new(&mut [0f32; 4], [4])?, hv(&[4]))),
        ),
        (
            "download from host memory",
            "src",
            vec![],
            vec![],
            Box::new(|b, _, _| b.download(ViewMut::new(&mut [0f32; 4], [4])?, hv(&[4]))),
        ),
        (
            "download into device memory",
            "dst!",
            vec![(F32, vec![4])],
            vec![(F32, vec![4])],
            Box::new(|b, i, mut o| b.download(o.remove(0), i[0])),
        ),
        (
            "copy from host memory",
            "src",
            vec![],
            vec![(F32, vec![4])],
            Box::new(|b, _, mut o| b.copy(o.remove(0), hv(&[4]))),
        ),
        (
            "fill of host memory",
            "dst",
            vec![],
            vec![],
            Box::new(|b, _, _| b.fill(ViewMut::new(&mut [0f32; 4], [4])?, 1.0)),
        ),
        (
            "add of host memory",
            "src",
            vec![],
            vec![(F32, vec![4])],
            Box::new(|b, _, mut o| b.add(o.remove(0), hv(&[4]))),
        ),
        (
            "scale of host memory",
            "x",
            vec![],
            vec![],
            Box::new(|b, _, _| b.scale(ViewMut::new(&mut [0f32; 4], [4])?, 2.0)),
        ),
        (
            "sum_squares of host memory",
            "xs",
            vec![(F32, vec![4])],
            vec![],
            Box::new(|b, i, _| b.sum_squares(&[i[0], hv(&[4])]).map(drop)),
        ),
        (
            "transpose12 from host memory",
            "src",
            vec![],
            vec![(F32, vec![1, 2, 2, 2])],
            Box::new(|b, _, mut o| b.transpose12(o.remove(0), hv(&[1, 2, 2, 2]))),
        ),
        (
            "attention_forward of host K",
            "k",
            vec![(F32, vec![1, 1, 4, 32]), (F32, vec![1, 1, 4, 32])],
            vec![(F32, vec![1, 1, 4, 32]), (F32, vec![1, 1, 4])],
            Box::new(|b, i, mut o| {
                let (lse, o0) = (o.pop().expect("lse"), o.pop().expect("o"));
                let k = View::new(&[0.5f32; 128], [1, 1, 4, 32])?;
                b.attention_forward(&AttnOptions::default(), AttnOut { o: o0, lse }, Qkv::new(i[0], k, i[1]))
            }),
        ),
        (
            "attention_merge of a host partial",
            "part.lse",
            vec![(F32, vec![1, 1, 2, 4])],
            vec![(F32, vec![1, 1, 2, 4]), (F32, vec![1, 1, 2])],
            Box::new(|b, i, mut o| {
                let (lse, o0) = (o.pop().expect("lse"), o.pop().expect("o"));
                b.attention_merge(AttnOut { o: o0, lse }, AttnPartial { o: i[0], lse: hv(&[1, 1, 2]) })
            }),
        ),
        (
            "linear_forward with a host weight",
            "w",
            vec![(F32, vec![2, 3])],
            vec![(F32, vec![2, 2])],
            Box::new(|b, i, mut o| b.linear_forward(o.remove(0), i[0], hv(&[2, 3]), None)),
        ),
        (
            "rmsnorm_forward with a host weight",
            "weight",
            vec![(F32, vec![2, 3])],
            vec![(F32, vec![2, 3]), (F32, vec![2])],
            Box::new(|b, i, mut o| {
                let (r, y) = (o.pop().expect("rstd"), o.pop().expect("y"));
                b.rmsnorm_forward(y, r, i[0], &NormParams { weight: hv(&[3]), bias: None, eps: 1e-5 })
            }),
        ),
        (
            "rope_forward of host memory",
            "x",
            vec![],
            vec![],
            Box::new(|b, _, _| {
                let t = RopeTable::new(&RopeConfig { head_dim: 8, base: 10_000.0, scaling: RopeScaling::None })?;
                b.rope_forward(&t, ViewMut::new(&mut [0f32; 16], [1, 1, 2, 8])?, &[0, 1])
            }),
        ),
        (
            "swiglu_forward with a host up",
            "up",
            vec![(F32, vec![4])],
            vec![(F32, vec![4])],
            Box::new(|b, i, mut o| b.swiglu_forward(o.remove(0), i[0], hv(&[4]))),
        ),
        (
            "moe_router_forward of host logits",
            "logits",
            vec![],
            vec![(F32, vec![2, 3]), (F32, vec![2, 1])],
            Box::new(|b, _, mut o| {
                let (w, p) = (o.pop().expect("weights"), o.pop().expect("probs"));
                b.moe_router_forward(p, w, hv(&[2, 3]), 1).map(drop)
            }),
        ),
        (
            "embedding_forward of a host table",
            "table",
            vec![],
            vec![(F32, vec![2, 3])],
            Box::new(|b, _, mut o| b.embedding_forward(o.remove(0), &[0, 1], hv(&[4, 3]))),
        ),
        (
            "cross_entropy_fused with a host weight",
            "weight",
            vec![(F32, vec![2, 4])],
            vec![(F32, vec![2, 4]), (F32, vec![3, 4])],
            Box::new(|b, i, mut o| {
                let (dw, dh) = (o.pop().expect("dweight"), o.pop().expect("dhidden"));
                b.cross_entropy_fused(
                    ProjectionGrads { dhidden: dh, dweight: dw },
                    i[0],
                    hv(&[3, 4]),
                    &[0, 1],
                    &CrossEntropyOptions::default(),
                    GradMode::Overwrite,
                )
                .map(drop)
            }),
        ),
        (
            "adamw_step with host gradients",
            "grads",
            vec![],
            vec![(F32, vec![4]), (F32, vec![4]), (F32, vec![4])],
            Box::new(|b, _, mut o| {
                let (v, m, p) = (o.pop().expect("v"), o.pop().expect("m"), o.pop().expect("master"));
                b.adamw_step(p, None, hv(&[4]), AdamwState { m, v }, &AdamW::default(), 1)
            }),
        ),
    ];
    let b = ctx.backend;
    for (name, arg, ins, outs, call) in &cases {
        let m = Mem(b);
        let run = || -> std::result::Result<(Result<()>, Vec<Vec<f64>>), super::harness::Fault> {
            let ins: Vec<Buffer> =
                ins.iter().map(|(dt, d)| m.filled(*dt, d, 0.5)).collect::<std::result::Result<_, _>>()?;
            let mut outs: Vec<Buffer> =
                outs.iter().map(|(dt, d)| m.filled(*dt, d, 7.0)).collect::<std::result::Result<_, _>>()?;
            let views: Vec<View<'_>> = ins.iter().map(|b| b.view()).collect();
            let r = call(b, &views, outs.iter_mut().map(|b| b.view_mut()).collect());
            let after = outs.iter().map(|o| m.read(o.view())).collect::<std::result::Result<_, _>>()?;
            Ok((r, after))
        };
        let (got, after) = run().map_err(|f| ctx.fault(name, name, f, false))?;
        let (arg, want_mem, got_mem) = match arg.strip_suffix('!') {
            Some(host_side) => (host_side, Memory::Host, b.memory()),
            None => (*arg, b.memory(), Memory::Host),
        };
        let ok = matches!(&got, Err(KernelError::Memory { name: n, expected, got, .. }) if *n == arg && *expected == want_mem && *got == got_mem);
        if !ok {
            let want = KernelError::Memory { name: arg, backend: b.name(), expected: want_mem, got: got_mem };
            return Err(ctx.failure(name, name, FailureKind::WrongError { call: name, got: got.err(), want }));
        }
        untouched(ctx, name, outs, 7.0, &after)?;
    }
    Ok(())
}
