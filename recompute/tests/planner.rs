//! The planner: the seed's models have their published parameter counts; its memory breakdown adds up by
//! hand for Llama 3 8B; longer sequences never need less memory; impossible layouts are typed errors naming
//! the smallest change; the per-layer activation count agrees with Korthikanti et al.'s formula once the
//! attention scores a flash kernel does not keep are taken out.

use longctx_recompute::planner::{check, korthikanti_layer_bytes, layer_for, parse_tokens, suggest};
use longctx_recompute::{device, model, plan, Layout, PlanInput, Policy, RecomputeError};

fn input(model_name: &str, seq: u64, gpus: u64, tp: u64, cp: u64, pp: u64) -> PlanInput {
    PlanInput {
        model: model(model_name).unwrap(),
        device: device("h100-80g").unwrap(),
        layout: Layout {
            gpus,
            tp,
            cp,
            pp,
            sequence_parallel: tp > 1,
            distributed_optimizer: true,
            global_batch: gpus / (tp * cp * pp),
        },
        seq_len: seq,
        policy: None,
        efficiency: 0.5,
        fp8: false,
        loss_chunk: 1024,
        offload: false,
    }
}

#[test]
fn the_seed_models_have_their_published_parameter_counts() {
    for (name, billions) in
        [("llama3-8b", 8.03), ("llama3-70b", 70.55), ("mixtral-8x7b", 46.70), ("nemotron4-15b", 15.7)]
    {
        let p = model(name).unwrap().params() as f64 / 1e9;
        assert!((p - billions).abs() / billions < 0.02, "{name}: {p:.2}B, published {billions}B");
    }
}

#[test]
fn the_memory_breakdown_adds_up_by_hand_for_llama3_8b() {
    let mut i = input("llama3-8b", 8192, 8, 1, 1, 1);
    i.policy = Some(Policy::None);
    let r = plan(&i).unwrap();
    let p = model("llama3-8b").unwrap().params();
    assert_eq!(r.memory.weights, 2 * p);
    assert_eq!(r.memory.gradients, 4 * p);
    assert_eq!(r.memory.optimizer, 12 * p / 8);
    assert_eq!(r.memory.activations_per_layer, 139_400 * 8192);
    let spec = layer_for(&i.model, &i.layout, 8192);
    assert_eq!(r.memory.activations, 32 * 139_400 * 8192 + spec.backward_working_bytes);
    assert_eq!(
        r.memory.total,
        r.memory.weights
            + r.memory.gradients
            + r.memory.optimizer
            + r.memory.activations
            + r.memory.loss
            + r.memory.comm
    );
    assert!(!r.fits, "96 GB: Llama 3 8B at 8K needs TP or recompute on one 80 GB device (NeMo uses TP 4)");
    // Llama 3 8B at 8K on 8 H100s at half of the bf16 peak: close to 0.5 × 989 TFLOP/s.
    assert!(r.time.tflops_per_device > 450.0 && r.time.tflops_per_device <= 495.0, "{:?}", r.time);
}

#[test]
fn longer_sequences_never_need_less_activation_memory() {
    let mut last = 0;
    for k in 13..=18 {
        let mut i = input("llama3-8b", 1 << k, 8, 1, 8, 1);
        i.policy = Some(Policy::None);
        let a = plan(&i).unwrap().memory.activations;
        assert!(a > last, "{}: {a}", 1 << k);
        last = a;
    }
}

#[test]
fn impossible_layouts_are_typed_errors_naming_the_smallest_change() {
    for (i, want) in [
        (input("llama3-8b", 8192, 8, 16, 1, 1), "multiple of 16 devices"),
        (input("llama3-8b", 8190, 8, 1, 2, 1), "multiple of 4"),
        (input("llama3-8b", 8192, 32, 16, 2, 1), "use TP 8"),
        (input("llama3-8b", 8192, 24, 1, 1, 3), "PP 3 does not divide 32 layers"),
    ] {
        match check(&i) {
            Err(e @ RecomputeError::Plan { .. }) => assert!(e.to_string().contains(want), "{e}"),
            other => panic!("{want}: {other:?}"),
        }
    }
    assert!(matches!(model("gpt-5"), Err(RecomputeError::Plan { .. })));
    assert!(matches!(device("tpu-v9"), Err(RecomputeError::Plan { .. })));
    let big = plan(&input("llama3-70b", 65536, 16, 8, 2, 1)).unwrap();
    assert!(!big.fits);
    let s = suggest(&big).expect("a larger CP fits");
    assert!(s.contains("CP 8"), "{s}");
    let mut i = input("llama3-8b", 8192, 8, 1, 1, 1);
    i.policy = Some(Policy::Budget(1000));
    assert!(matches!(plan(&i), Err(RecomputeError::Budget { .. })));
}

#[test]
fn activation_bytes_agree_with_korthikanti_without_the_attention_scores() {
    // Korthikanti et al.'s 34·s·b·h counts fp16 activations of a GPT layer (4h MLP, dropout masks); the
    // 5·a·s² term is the attention scores and softmax, which a flash kernel never stores. Llama 3 8B's layer
    // (GQA, SwiGLU 3.5h, no dropout) happens to land within 1% of 34·s·h.
    let m = model("llama3-8b").unwrap();
    for (s, t) in [(8192u64, 1u64), (8192, 4), (131072, 8)] {
        let layout = Layout {
            gpus: t,
            tp: t,
            cp: 1,
            pp: 1,
            sequence_parallel: t > 1,
            distributed_optimizer: true,
            global_batch: 1,
        };
        let ours = layer_for(&m, &layout, s).saved_bytes() as f64;
        let flash = (s * m.d_model) as f64 * 34.0 / t as f64;
        assert!((ours / flash - 1.0).abs() < 0.02, "s {s} t {t}: {ours} vs {flash}");
        assert!(korthikanti_layer_bytes(s, 1, m.d_model, m.heads, t) > 5.0 * ours);
    }
    assert_eq!(parse_tokens("1M"), Some(1 << 20));
    assert_eq!(parse_tokens("128K"), Some(131072));
}

#[test]
fn offloading_to_host_memory_is_weighed_against_recomputation_within_the_hosts_room() {
    // Llama 3 8B at 256K tokens over CP 8: without offload the solver reruns much of the forward to fit.
    let mut i = input("llama3-8b", 262144, 8, 1, 8, 1);
    let without = plan(&i).unwrap();
    assert!(without.fits && without.time.recompute_seconds > 0.0);
    assert_eq!((without.memory.host_offload, without.time.offload_exposed_seconds), (0, 0.0));
    // With a host tier the transfers hide under each layer's attention: offloading replaces recomputation.
    i.offload = true;
    let with = plan(&i).unwrap();
    assert!(with.fits, "{with:?}");
    assert!(with.memory.host_offload > 0 && with.memory.host_offload <= i.device.host_memory_bytes);
    assert!(with.time.recompute_seconds < without.time.recompute_seconds);
    assert!(with.time.step_seconds < without.time.step_seconds);
    assert!(with.memory.total <= i.device.memory_bytes);
    // Half the host memory: the solver offloads no more than fits and reruns the rest, never faster.
    i.device.host_memory_bytes = with.memory.host_offload / 2;
    let half = plan(&i).unwrap();
    assert!(half.fits && half.memory.host_offload <= i.device.host_memory_bytes, "{half:?}");
    assert!(half.time.step_seconds >= with.time.step_seconds && half.time.step_seconds <= without.time.step_seconds);
    // A host link too slow to hide anything: what is still offloaded shows up as exposed time.
    i.device.host_memory_bytes = with.memory.host_offload;
    i.device.host_bytes_per_s = 1e6;
    let slow = plan(&i).unwrap();
    assert!(slow.time.step_seconds <= without.time.step_seconds + 1e-9);
    let custom = Some("custom:act=offload".parse::<Policy>().unwrap());
    let forced = plan(&PlanInput { policy: custom, ..i.clone() }).unwrap();
    assert!(forced.time.offload_exposed_seconds > 1.0, "{:?}", forced.time);
}
