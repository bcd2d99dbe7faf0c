//! Agreement between ranks: planning exchanges a small fingerprint of the problem (shape, dtype, mask kind and
//! window, document use, partition, schedule, scale), so ranks that planned different problems fail together
//! with an error naming the field and who holds which value, instead of computing wrong results silently or
//! waiting for a communicator timeout.

use longctx_kernels::DType;
use longctx_p2p::Communicator;

use crate::context::{CpConfig, CpMask, CpShape, Schedule};
use crate::error::{Result, RingError};
use crate::partition::Partition;

/// The fields, in the order of the fingerprint.
const FIELDS: [&str; 13] = [
    "batch",
    "q_heads",
    "kv_heads",
    "seq_len",
    "head_dim",
    "dtype",
    "causal",
    "window",
    "documents",
    "partition",
    "schedule",
    "schedule parameter",
    "softmax scale",
];

fn fingerprint(cfg: &CpConfig, s: &CpShape, m: &CpMask, scale: f32) -> [u64; 13] {
    let dtype = match s.dtype {
        DType::F32 => 0,
        DType::Bf16 => 1,
        DType::F16 => 2,
    };
    let partition = match cfg.partition {
        Partition::Zigzag => 0,
        Partition::Contiguous => 1,
        Partition::Striped => 2,
    };
    let (schedule, param) = match cfg.schedule {
        Schedule::Ring => (0, 0),
        Schedule::AllGather { kv_heads_per_step } => (1, kv_heads_per_step as u64),
        Schedule::Ulysses => (2, 0),
        Schedule::Hybrid { group } => (3, group as u64),
    };
    [
        s.batch as u64,
        s.q_heads as u64,
        s.kv_heads as u64,
        s.seq_len as u64,
        s.head_dim as u64,
        dtype,
        m.causal as u64,
        m.window.unwrap_or(u64::MAX),
        m.documents as u64,
        partition,
        schedule,
        param,
        scale.to_bits() as u64,
    ]
}

fn describe(field: usize, v: u64) -> String {
    match FIELDS[field] {
        "dtype" => ["f32", "bf16"].get(v as usize).unwrap_or(&"?").to_string(),
        "causal" | "documents" => (v != 0).to_string(),
        "window" if v == u64::MAX => "none".into(),
        "partition" => ["zigzag", "contiguous", "striped"].get(v as usize).unwrap_or(&"?").to_string(),
        "schedule" => ["ring", "all-gather", "ulysses", "hybrid"].get(v as usize).unwrap_or(&"?").to_string(),
        "softmax scale" => f32::from_bits(v as u32).to_string(),
        _ => v.to_string(),
    }
}

/// Fails on every rank, naming the first field the ranks disagree on, unless all planned the same problem.
pub(crate) fn agree(comm: &Communicator, cfg: &CpConfig, s: &CpShape, m: &CpMask, scale: f32) -> Result<()> {
    let mine = fingerprint(cfg, s, m, scale);
    let n = comm.world_size();
    let mut all = vec![0u64; mine.len() * n];
    comm.all_gather(&mine, &mut all)?;
    let of = |r: usize| &all[r * mine.len()..(r + 1) * mine.len()];
    for (f, field) in FIELDS.iter().enumerate() {
        if (1..n).all(|r| of(r)[f] == of(0)[f]) {
            continue;
        }
        // Each distinct value with the ranks holding it, in rank order of first appearance.
        let mut groups: Vec<(u64, Vec<usize>)> = Vec::new();
        for r in 0..n {
            let v = of(r)[f];
            match groups.iter_mut().find(|g| g.0 == v) {
                Some(g) => g.1.push(r),
                None => groups.push((v, vec![r])),
            }
        }
        let detail = groups
            .iter()
            .map(|(v, ranks)| {
                let rs = ranks.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ");
                let word = if ranks.len() == 1 { "rank" } else { "ranks" };
                format!("{word} {rs}: {}", describe(f, *v))
            })
            .collect::<Vec<_>>()
            .join("; ");
        return Err(RingError::RanksDisagree { field, detail });
    }
    Ok(())
}
