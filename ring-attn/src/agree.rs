//! Agreement between ranks: planning exchanges a small fingerprint of the problem (shape, dtype, mask kind and
//! window, document use, partition, schedule, scale), so ranks that planned different problems fail together
//! with an error naming the field and who holds which value, instead of computing wrong results silently or
//! waiting for a communicator timeout. The schedule is also agreed on alone, before anything else is exchanged,
//! when the ranks build their `ContextParallel` (see [`agree_on_schedule`]).

use longctx_kernels::DType;
use longctx_p2p::Communicator;

use crate::config::{CpConfig, CpMask, CpShape, Schedule};
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

/// The schedule and its parameter, as the fingerprint holds them (`describe` names them back).
fn schedule_words(s: Schedule) -> [u64; 2] {
    match s {
        Schedule::Ring => [0, 0],
        Schedule::AllGather { kv_heads_per_step } => [1, kv_heads_per_step as u64],
        Schedule::Ulysses => [2, 0],
        Schedule::Hybrid { group } => [3, group as u64],
    }
}

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
    let [schedule, param] = schedule_words(cfg.schedule);
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

fn describe(field: &str, v: u64) -> String {
    match field {
        "dtype" => ["f32", "bf16", "f16"].get(v as usize).unwrap_or(&"?").to_string(),
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
    agree_on(comm, &FIELDS, &fingerprint(cfg, s, m, scale))
}

/// Fails on every rank, naming `schedule` (or its parameter), unless all chose the same schedule. Called by
/// [`ContextParallel::new`](crate::ContextParallel::new) before it splits the communicator: the Ulysses and
/// hybrid schedules split it (a collective) and the others do not, so ranks that chose differently would each
/// meet another collective than their peers' and fail with a bare size mismatch instead of naming the field.
pub(crate) fn agree_on_schedule(comm: &Communicator, schedule: Schedule) -> Result<()> {
    agree_on(comm, &["schedule", "schedule parameter"], &schedule_words(schedule))
}

/// Exchanges `mine` (one word per field of `fields`) and fails on every rank, naming the first field that
/// differs and each value with the ranks that hold it; every rank sees the same words, so all fail alike.
fn agree_on(comm: &Communicator, fields: &[&'static str], mine: &[u64]) -> Result<()> {
    debug_assert_eq!(fields.len(), mine.len());
    let n = comm.world_size();
    let mut all = vec![0u64; mine.len() * n];
    comm.all_gather(mine, &mut all)?;
    let of = |r: usize| &all[r * mine.len()..(r + 1) * mine.len()];
    for (f, field) in fields.iter().enumerate() {
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
                format!("{word} {rs}: {}", describe(field, *v))
            })
            .collect::<Vec<_>>()
            .join("; ");
        return Err(RingError::RanksDisagree { field, detail });
    }
    Ok(())
}
