//! Hugging Face interop against transformers: the fixtures of `fixtures/hf/` (tiny random Llamas, a Mixtral in
//! both expert layouts and a Nemotron saved by transformers 5.24, made by `fixtures/hf/make_fixtures.py`, with
//! the losses and logits transformers computes) give the same loss here at CP 1, 2 and 4 (≤ 1e-5 relative, f32),
//! with every `rope_scaling` type; export then import is bit-exact for every family (f32; a bf16 export reads
//! back as each value rounded to bf16), a Mixtral's in either expert layout (`--experts fused` writes transformers'
//! own fused files); a run `--init-from` a checkpoint with a tokenizer carries it through its checkpoints and
//! exports; bad checkpoints and export options are errors naming the file and the tensor, field or option before
//! any work. The live tests load exported directories of every family and layout in transformers itself when a
//! Python can import it (`$LONGCTX_PYTHON`, else `python3`), and say they skipped when not.

use std::path::{Path, PathBuf};
use std::process::Command;

use longctx_trainer::checkpoint::LoadedTensor;
use longctx_trainer::eval::{evaluate, evaluate_hf, read_tokens, read_tokens_with};
use longctx_trainer::hf::weights::WeightFiles;
use longctx_trainer::hf::{self, export, HfCheckpoint};
use longctx_trainer::recipe::{Family, ModelConfig, MoeConfig, Recipe};
use longctx_trainer::train::{train, train_from, RunOptions};
use longctx_trainer::TrainError;
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf")
}

fn expected() -> Value {
    serde_json::from_slice(&std::fs::read(fixtures().join("expected.json")).unwrap()).unwrap()
}

fn tokens() -> Vec<u32> {
    read_tokens(&fixtures().join("tokens.npy")).unwrap()
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs()
}

/// A scratch directory, removed when dropped (the machine's disk is small).
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn scratch(name: &str) -> Scratch {
    let d = std::env::temp_dir().join(format!("longctx-hf-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    Scratch(d)
}

/// A copy of fixture `name` to break.
fn copy_fixture(name: &str, to: &str) -> Scratch {
    let dst = scratch(to);
    for e in std::fs::read_dir(fixtures().join(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    dst
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let p = dir.join("config.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    f(v.as_object_mut().unwrap());
    std::fs::write(&p, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

/// The fixture's token ids for its vocabulary (the Mixtral's is 257: `tokens.npy` mod 257, as the script did).
fn tokens_for(vocab: usize) -> Vec<u32> {
    tokens().iter().map(|&t| t % vocab as u32).collect()
}

#[test]
fn fixtures_match_transformers_at_cp_1_2_and_4() {
    let want = expected();
    for (name, cps) in [
        ("llama", &[1, 2][..]),
        ("llama3-sharded", &[1, 2]),
        ("mixtral", &[1, 2, 4]),
        ("mixtral-fused", &[1, 2]),
        ("nemotron", &[1, 2, 4]),
    ] {
        let ck = hf::load(&fixtures().join(name)).unwrap();
        let ids = tokens_for(ck.model().vocab);
        let w = want["loss"][name].as_f64().unwrap();
        for &cp in cps {
            let got = evaluate_hf(&ck, &ids, 64, cp).unwrap();
            println!("{name} cp {cp}: loss {:.9}, transformers {w:.9}, rel {:.2e}", got.loss, rel(got.loss, w));
            assert_eq!(got.tokens, 128);
            assert!(rel(got.loss, w) <= 1e-5, "{name} cp {cp}: {} vs transformers {w}", got.loss);
        }
    }
}

#[test]
fn every_rope_scaling_type_matches_transformers() {
    let want = expected();
    let ids = tokens();
    for (name, v) in want["variants"].as_object().unwrap() {
        let dir = copy_fixture("llama", &format!("rope-{name}"));
        edit_config(&dir, |c| {
            let mut rope = v["rope_scaling"].clone();
            rope["rope_theta"] = 10000.0.into();
            c.insert("rope_parameters".into(), rope);
            c.insert("max_position_embeddings".into(), v["max_position_embeddings"].clone());
        });
        let ck = hf::load(&dir).unwrap();
        let w = v["loss"].as_f64().unwrap();
        // The length-dependent types (dynamic, longrope) must not see a rank's share as the sequence.
        let cps: &[usize] = if ["dynamic", "longrope"].contains(&name.as_str()) { &[1, 2] } else { &[1] };
        for &cp in cps {
            let got = evaluate_hf(&ck, &ids, 64, cp).unwrap().loss;
            println!("rope {name} cp {cp}: loss {got:.9}, transformers {w:.9}, rel {:.2e}", rel(got, w));
            assert!(rel(got, w) <= 1e-5, "{name} cp {cp}: {got} vs transformers {w}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn the_legacy_rope_scaling_key_reads_the_same() {
    let want = expected();
    let dir = copy_fixture("llama3-sharded", "legacy");
    edit_config(&dir, |c| {
        let mut rope = c.remove("rope_parameters").unwrap();
        let r = rope.as_object_mut().unwrap();
        let theta = r.remove("rope_theta").unwrap();
        let t = r.remove("rope_type").unwrap();
        r.insert("type".into(), t);
        c.insert("rope_theta".into(), theta);
        c.insert("rope_scaling".into(), rope);
    });
    let ck = hf::load(&dir).unwrap();
    let got = evaluate_hf(&ck, &tokens(), 64, 1).unwrap().loss;
    assert!(rel(got, want["loss"]["llama3-sharded"].as_f64().unwrap()) <= 1e-5);
}

#[test]
fn text_through_tokenizer_json_matches_transformers() {
    let want = expected();
    let dir = fixtures().join("llama");
    let ck = hf::load(&dir).unwrap();
    let ids = read_tokens_with(&fixtures().join("text.txt"), ck.tokenizer.as_ref()).unwrap();
    let want_ids: Vec<u32> =
        want["text"]["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    assert_eq!(ids, want_ids, "tokenizer.json through the tokenizers crate");
    let got = evaluate_hf(&ck, &ids, 32, 2).unwrap().loss;
    let w = want["text"]["loss"].as_f64().unwrap();
    println!("text at seq 32 cp 2: loss {got:.9}, transformers {w:.9}");
    assert!(rel(got, w) <= 1e-5, "{got} vs {w}");
}

#[test]
fn hf_q_k_rows_load_as_they_are_and_the_permutation_helper_matches_the_converter() {
    // The checkpoint is half-split already (loss matches above). Permuting q/k to interleaved pairs, as a
    // converter applied twice would, gives what transformers gives for the same permutation in Python.
    let want = expected();
    let mut ck = hf::load(&fixtures().join("llama")).unwrap();
    let m = ck.model().clone();
    let d = m.head_dim();
    for t in ck.tensors.iter_mut() {
        let n = if t.name.ends_with("q_proj.weight") {
            m.heads
        } else if t.name.ends_with("k_proj.weight") {
            m.kv_heads
        } else {
            continue;
        };
        t.data = hf::permute::permute_half_split_to_interleaved(&t.data, n, d, t.dims[1]);
    }
    let got = evaluate_hf(&ck, &tokens(), 64, 1).unwrap().loss;
    let w = want["interleaved_loss"].as_f64().unwrap();
    println!("q/k permuted: loss {got:.6} (transformers {w:.6}; unpermuted {:.6})", want["loss"]["llama"]);
    assert!(rel(got, w) <= 1e-5, "{got} vs {w}");
}

fn tiny_recipe(extra: &[&str]) -> Recipe {
    let mut sets: Vec<String> = [
        "model.layers=2",
        "model.d_model=64",
        "model.heads=2",
        "model.kv_heads=1",
        "model.ffn=96",
        "train.seq_len=64",
        "train.batch=1",
        "train.steps=2",
        "train.warmup=1",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        "parallel.threads=1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    sets.extend(extra.iter().map(|s| s.to_string()));
    Recipe::load("tiny-llama", &sets).unwrap()
}

fn bits(t: &[LoadedTensor]) -> Vec<(String, Vec<usize>, Vec<u32>)> {
    t.iter().map(|t| (t.name.clone(), t.dims.clone(), t.data.iter().map(|x| x.to_bits()).collect())).collect()
}

/// A short trained run with a Llama 3 scaling, its checkpoint exported single-file and sharded. The weights
/// start with a wide spread (std 0.25), so attention is sharp and a RoPE mistake would show in the loss.
fn trained_and_exported(name: &str) -> (Scratch, Scratch, Scratch) {
    let recipe = tiny_recipe(&[
        "model.init_std=0.25",
        "model.rope_scaling.rope_type=\"llama3\"",
        "model.rope_scaling.factor=4.0",
        "model.rope_scaling.low_freq_factor=1.0",
        "model.rope_scaling.high_freq_factor=4.0",
        "model.rope_scaling.original_max_position_embeddings=16",
    ]);
    let out = scratch(&format!("{name}-run"));
    train(&recipe, &RunOptions { out: out.to_path_buf(), quiet: true, ..Default::default() }).unwrap();
    let (single, sharded) = exported_single_and_sharded(&out, name);
    (out, single, sharded)
}

#[test]
fn export_then_import_round_trips_bit_exactly() {
    let (run, single, sharded) = trained_and_exported("roundtrip");
    let ck = longctx_trainer::checkpoint::load(&run).unwrap();
    let recipe = longctx_trainer::eval::checkpoint_recipe(&ck).unwrap();
    assert!(sharded.join("model.safetensors.index.json").is_file());
    let shards = std::fs::read_dir(&sharded)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("model-0"));
    assert!(shards.count() > 2, "40 kB shards of a ~300 kB model");
    // A byte-level run has no tokenizer to save, nor its export to write.
    assert!(ck.tokenizer.is_none() && !ck.dir.join("tokenizer.json").exists());
    for dir in [&single, &sharded] {
        let back = hf::load(dir).unwrap();
        assert!(back.tokenizer.is_none() && back.config.eos_token_id.is_none(), "{}", dir.display());
        assert_eq!(bits(&back.tensors), bits(&ck.model), "{}", dir.display());
        let mut model = back.model().clone();
        model.init_std = recipe.model.init_std;
        assert_eq!(model, recipe.model);
        // And the loss is the same, bit for bit, as the trainer checkpoint's.
        let ids: Vec<u32> = (0..129u32).map(|i| (i * 37) % 257).collect();
        let a = evaluate(&run, &ids, 64, 1).unwrap().loss;
        let b = evaluate_hf(&back, &ids, 64, 1).unwrap().loss;
        assert_eq!(a.to_bits(), b.to_bits());
    }
    // Import → export → import of transformers' own (bf16, sharded) files: the same f32 values.
    let l3 = hf::load(&fixtures().join("llama3-sharded")).unwrap();
    let re = scratch("reexport");
    export::write_dir(&re, l3.model(), 128, &l3.tensors, None, &export::ExportOptions::default()).unwrap();
    let back = hf::load(&re).unwrap();
    assert_eq!(bits(&back.tensors), bits(&l3.tensors));
    assert_eq!(back.model(), l3.model());
    let e = export::write_dir(&re, l3.model(), 128, &l3.tensors, None, &export::ExportOptions::default()).unwrap_err();
    assert!(e.to_string().contains("not empty"), "{e}");
    // Tensors that are not the model's are refused by name before anything is written.
    let mut renamed = l3.tensors.clone();
    renamed[1].name = "model.layers.0.self_attn.q_proj.weigth".into();
    let fresh = scratch("reexport-renamed");
    let target = fresh.join("out");
    let e = export::write_dir(&target, l3.model(), 128, &renamed, None, &export::ExportOptions::default()).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("q_proj.weigth` (dims") && msg.contains(&format!("`{}` is missing", l3.tensors[1].name)),
        "{msg}"
    );
    assert!(!target.exists());
}

/// The run `out` exported as one file and sharded at 40 kB.
fn exported_single_and_sharded(out: &Path, name: &str) -> (Scratch, Scratch) {
    let single = scratch(&format!("{name}-single"));
    export::export_checkpoint(out, &single, &export::ExportOptions::default()).unwrap();
    let sharded = scratch(&format!("{name}-sharded"));
    export::export_checkpoint(out, &sharded, &export::ExportOptions { max_shard_bytes: 40_000, ..Default::default() })
        .unwrap();
    (single, sharded)
}

/// A short run of the tiny Mixtral or Nemotron recipe (shrunk, weights of a wide spread so routing and
/// attention are sharp), exported single-file and sharded.
fn trained_family(recipe: &str, name: &str) -> (Scratch, Scratch, Scratch) {
    let out = train_family(recipe, name, &[]);
    let (single, sharded) = exported_single_and_sharded(&out, name);
    (out, single, sharded)
}

/// The run of [`trained_family`], with `extra` recipe settings on top.
fn train_family(recipe: &str, name: &str, extra: &[&str]) -> Scratch {
    let mut sets: Vec<String> = [
        "model.d_model=64",
        "model.heads=2",
        "model.kv_heads=1",
        "model.ffn=32",
        "model.init_std=0.25",
        "train.seq_len=64",
        "train.batch=1",
        "train.steps=2",
        "train.warmup=1",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        "parallel.threads=1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    sets.extend(extra.iter().map(|s| s.to_string()));
    let recipe = Recipe::load(recipe, &sets).unwrap();
    let out = scratch(&format!("{name}-run"));
    train(&recipe, &RunOptions { out: out.to_path_buf(), quiet: true, ..Default::default() }).unwrap();
    out
}

#[test]
fn mixtral_and_nemotron_export_then_import_round_trip_bit_exactly() {
    for (recipe, family) in [("tiny-mixtral", Family::Mixtral), ("tiny-nemotron", Family::Nemotron)] {
        let (run, single, sharded) = trained_family(recipe, &format!("rt-{}", family.name()));
        let ck = longctx_trainer::checkpoint::load(&run).unwrap();
        let recipe = longctx_trainer::eval::checkpoint_recipe(&ck).unwrap();
        assert!(sharded.join("model.safetensors.index.json").is_file());
        let ids: Vec<u32> = (0..129u32).map(|i| (i * 37) % 257).collect();
        let a = evaluate(&run, &ids, 64, 1).unwrap().loss;
        for dir in [&single, &sharded] {
            reads_back_as_the_checkpoint(dir, &ck.model, &recipe.model, &ids, a);
        }
        // Hub names, not the fused ones.
        let names = String::from_utf8(std::fs::read(sharded.join("model.safetensors.index.json")).unwrap()).unwrap();
        if family == Family::Mixtral {
            assert!(names.contains("block_sparse_moe.experts.3.w2.weight") && !names.contains("gate_up_proj"));
        } else {
            assert!(names.contains("input_layernorm.bias") && names.contains("model.norm.bias"));
        }
    }
    // Import → export → import of transformers' own files: the same f32 values and model.
    for name in ["mixtral", "mixtral-fused", "nemotron"] {
        let ck = hf::load(&fixtures().join(name)).unwrap();
        let re = scratch(&format!("reexport-{name}"));
        export::write_dir(&re, ck.model(), 128, &ck.tensors, None, &export::ExportOptions::default()).unwrap();
        let back = hf::load(&re).unwrap();
        assert_eq!(bits(&back.tensors), bits(&ck.tensors), "{name}");
        assert_eq!(back.model(), ck.model(), "{name}");
    }
}

/// A short tiny-Mixtral run for the fused export, its experts 24 wide so that `[E, 2F, C]` = [4, 48, 64] and
/// `[E, C, F]` = [4, 64, 24] differ from their transposes.
fn fused_run(name: &str) -> Scratch {
    train_family("tiny-mixtral", name, &["model.ffn=24"])
}

fn fused_opts(max_shard_bytes: u64, dtype: export::WeightDtype) -> export::ExportOptions {
    export::ExportOptions { max_shard_bytes, dtype, experts: export::ExpertLayout::Fused }
}

fn f32_bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Checks `dir` holds the Mixtral `cfg` in transformers 5's fused layout and nothing per expert: per layer
/// `mlp.gate.weight` `[E, C]`, `mlp.experts.gate_up_proj` `[E, 2F, C]` whose expert `e` block has `want`'s w1 in
/// rows 0..F and w3 in rows F..2F, and `mlp.experts.down_proj` `[E, C, F]` whose expert `e` block is its w2.
/// Written out here rather than through the importer's mapping, so a layout both sides got wrong would show.
fn assert_fused_files(dir: &Path, cfg: &ModelConfig, want: &[LoadedTensor]) -> WeightFiles {
    let files = WeightFiles::open(dir).unwrap();
    let (c, f, e) = (cfg.d_model, cfg.ffn, cfg.moe.unwrap().experts);
    let per_expert: Vec<&String> =
        files.entries.keys().filter(|n| n.contains("block_sparse_moe") || n.contains(".experts.0.")).collect();
    assert!(per_expert.is_empty(), "{}: per-expert names {per_expert:?}", dir.display());
    // The embedding, 9 tensors per layer, the final norm and lm_head.
    assert_eq!(files.entries.len(), 3 + 9 * cfg.layers, "{}", dir.display());
    let w = |name: String| f32_bits(&want.iter().find(|t| t.name == name).unwrap().data);
    for l in 0..cfg.layers {
        let p = format!("model.layers.{l}.mlp");
        let (router, gate_up, down) =
            (format!("{p}.gate.weight"), format!("{p}.experts.gate_up_proj"), format!("{p}.experts.down_proj"));
        for (name, dims) in [(&router, vec![e, c]), (&gate_up, vec![e, 2 * f, c]), (&down, vec![e, c, f])] {
            assert_eq!(files.entries.get(name).map(|x| &x.shape), Some(&dims), "{}: {name}", dir.display());
        }
        let m = format!("model.layers.{l}.block_sparse_moe");
        // Compared as bits, reported by name (the values themselves would fill the screen).
        let same = |got: &[u32], name: String| assert!(got == w(name.clone()), "{}: not {name}", dir.display());
        same(&f32_bits(&files.read_f32(&router).unwrap()), format!("{m}.gate.weight"));
        let (gu, dn) = (f32_bits(&files.read_f32(&gate_up).unwrap()), f32_bits(&files.read_f32(&down).unwrap()));
        for x in 0..e {
            let block = &gu[x * 2 * f * c..(x + 1) * 2 * f * c];
            same(&block[..f * c], format!("{m}.experts.{x}.w1.weight"));
            same(&block[f * c..], format!("{m}.experts.{x}.w3.weight"));
            same(&dn[x * c * f..(x + 1) * c * f], format!("{m}.experts.{x}.w2.weight"));
        }
    }
    files
}

/// `longctx export --experts fused`: transformers 5's fused names and shapes, which `--init-from` reads back bit
/// for bit (f32) with the same loss and model, single-file and sharded (a fused tensor whole in one shard), with
/// the per-expert export's `config.json`; a run starts from it.
#[test]
fn a_fused_mixtral_export_round_trips_bit_exactly() {
    let run = fused_run("fused-rt");
    let ck = longctx_trainer::checkpoint::load(&run).unwrap();
    let recipe = longctx_trainer::eval::checkpoint_recipe(&ck).unwrap();
    let ids: Vec<u32> = (0..129u32).map(|i| (i * 37) % 257).collect();
    let a = evaluate(&run, &ids, 64, 1).unwrap().loss;
    let single = scratch("fused-rt-single");
    // Through the command line, as a user runs it.
    let out = Command::new(env!("CARGO_BIN_EXE_longctx"))
        .args(["export", "--experts", "fused", "--hf"])
        .arg(&*single)
        .arg("--checkpoint")
        .arg(&*run)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let sharded = scratch("fused-rt-sharded");
    export::export_checkpoint(&run, &sharded, &fused_opts(40_000, export::WeightDtype::F32)).unwrap();
    for dir in [&single, &sharded] {
        let files = assert_fused_files(dir, &recipe.model, &ck.model);
        assert_eq!(export::ExpertLayout::of(&files), export::ExpertLayout::Fused);
        reads_back_as_the_checkpoint(dir, &ck.model, &recipe.model, &ids, a);
    }
    // gate_up_proj, 48 KiB in f32, is past the 40 kB limit: it is written whole, in a shard of its own.
    let files = WeightFiles::open(&sharded).unwrap();
    let index = read_json(&sharded.join("model.safetensors.index.json"));
    assert!(index["weight_map"].as_object().unwrap().len() == files.entries.len());
    for l in 0..recipe.model.layers {
        let gu = &files.entries[&format!("model.layers.{l}.mlp.experts.gate_up_proj")];
        assert_eq!(files.entries.values().filter(|e| e.file == gu.file).count(), 1, "layer {l}");
    }
    // config.json does not depend on the layout.
    let per_expert = scratch("fused-rt-per-expert");
    export::export_checkpoint(&run, &per_expert, &export::ExportOptions::default()).unwrap();
    assert_eq!(read_json(&single.join("config.json")), read_json(&per_expert.join("config.json")));
    one_step_starts_from(&hf::load(&single).unwrap(), "fused-initfrom");
}

/// `--experts fused --dtype bf16`: every tensor BF16 and each value of the checkpoint rounded to the nearest bf16,
/// in the fused tensors as elsewhere; single-file and sharded.
#[test]
fn a_fused_bf16_export_imports_as_each_value_rounded_to_nearest_bf16() {
    let run = fused_run("fused-bf16");
    let ck = longctx_trainer::checkpoint::load(&run).unwrap();
    let recipe = longctx_trainer::eval::checkpoint_recipe(&ck).unwrap();
    let rounded = rounded_to_bf16(&ck.model);
    for (tag, max_shard_bytes) in [("single", 5_000_000_000), ("sharded", 20_000)] {
        let dir = scratch(&format!("fused-bf16-{tag}"));
        export::export_checkpoint(&run, &dir, &fused_opts(max_shard_bytes, export::WeightDtype::Bf16)).unwrap();
        assert_eq!(read_json(&dir.join("config.json"))["torch_dtype"], "bfloat16");
        let files = assert_fused_files(&dir, &recipe.model, &rounded);
        assert!(files.entries.values().all(|e| e.dtype == safetensors::Dtype::BF16), "{tag}");
        assert_eq!(dir.join("model.safetensors.index.json").is_file(), tag == "sharded");
        assert_eq!(bits(&hf::load(&dir).unwrap().tensors), bits(&rounded), "{tag}");
    }
}

/// Exported fused, transformers' per-expert Mixtral fixture is its fused one (`save_original_format=False`):
/// the same names, dims, dtype and values, and it reads back as the weights it came from.
#[test]
fn the_fused_export_of_the_mixtral_fixture_is_transformers_own_fused_files() {
    let hub = hf::load(&fixtures().join("mixtral")).unwrap();
    let dir = scratch("fused-fixture");
    export::write_dir(
        &dir,
        hub.model(),
        128,
        &hub.tensors,
        None,
        &fused_opts(5_000_000_000, export::WeightDtype::Bf16),
    )
    .unwrap();
    let ours = WeightFiles::open(&dir).unwrap();
    let theirs = WeightFiles::open(&fixtures().join("mixtral-fused")).unwrap();
    let names = |f: &WeightFiles| {
        let mut n: Vec<String> = f.entries.keys().cloned().collect();
        n.sort();
        n
    };
    assert_eq!(names(&ours), names(&theirs));
    for n in names(&theirs) {
        let (a, b) = (&ours.entries[&n], &theirs.entries[&n]);
        assert_eq!((&a.shape, a.dtype), (&b.shape, b.dtype), "{n}");
        assert!(f32_bits(&ours.read_f32(&n).unwrap()) == f32_bits(&theirs.read_f32(&n).unwrap()), "{n}: other values");
    }
    assert_eq!(bits(&hf::load(&dir).unwrap().tensors), bits(&hub.tensors));
    // And transformers' fused files, exported fused again, are themselves.
    let fused = hf::load(&fixtures().join("mixtral-fused")).unwrap();
    let re = scratch("fused-fixture-again");
    export::write_dir(
        &re,
        fused.model(),
        128,
        &fused.tensors,
        None,
        &fused_opts(5_000_000_000, export::WeightDtype::F32),
    )
    .unwrap();
    assert_eq!(bits(&hf::load(&re).unwrap().tensors), bits(&fused.tensors));
}

/// `--experts fused` for a model without experts (a Llama run, the Nemotron fixture) is an error naming the option
/// and the model, before anything is written; an unknown `--experts` value is an error listing the known ones.
#[test]
fn fused_experts_without_experts_is_an_error_naming_it() {
    let recipe = tiny_recipe(&[]);
    let run = scratch("fused-llama-run");
    train(&recipe, &RunOptions { out: run.to_path_buf(), quiet: true, ..Default::default() }).unwrap();
    let parent = scratch("fused-llama");
    let dir = parent.join("out");
    match export::export_checkpoint(&run, &dir, &fused_opts(5_000_000_000, export::WeightDtype::F32)) {
        Err(TrainError::ExportOption { option, detail }) => {
            assert_eq!(option, "--experts fused");
            assert!(detail.contains("llama") && detail.contains("experts"), "{detail}");
        }
        other => panic!("{other:?}"),
    }
    assert!(!dir.exists(), "nothing written");
    let nem = hf::load(&fixtures().join("nemotron")).unwrap();
    let e =
        export::write_dir(&dir, nem.model(), 128, &nem.tensors, None, &fused_opts(5_000_000_000, Default::default()))
            .unwrap_err();
    assert!(matches!(&e, TrainError::ExportOption { detail, .. } if detail.contains("nemotron")), "{e}");
    assert!(!dir.exists(), "nothing written");

    for (value, needles) in
        [("fused", &["--experts fused", "llama"][..]), ("interleaved", &["interleaved", "per-expert", "fused"])]
    {
        let out = Command::new(env!("CARGO_BIN_EXE_longctx"))
            .args(["export", "--experts", value, "--hf"])
            .arg(&dir)
            .arg("--checkpoint")
            .arg(&*run)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        println!("longctx export --experts {value} (a Llama): {}", err.trim());
        assert!(!out.status.success(), "{value}");
        assert!(needles.iter().all(|n| err.contains(n)), "{value}: {err}");
        assert!(!dir.exists(), "nothing written");
    }
}

/// A two-step run `--init-from` the Llama fixture (whose `tokenizer.json` reads the corpus, `eos_token_id` 2,
/// `bos_token_id` 1), in two sessions: stopped after step 1, then resumed without `--init-from`, so the last
/// checkpoint has the tokenizer only if a resumed run takes it from its own checkpoint.
fn trained_from_llama(tag: &str) -> (HfCheckpoint, Scratch) {
    let src = hf::load(&fixtures().join("llama")).unwrap();
    let sets: Vec<String> = [
        "train.seq_len=64",
        "train.batch=1",
        "train.steps=2",
        "train.warmup=1",
        "train.eval_every=0",
        "parallel.threads=1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let recipe = hf::recipe_from(&Recipe::load("tiny-llama", &sets).unwrap(), &sets, &src.config).unwrap();
    let out = scratch(tag);
    let opts = RunOptions { out: out.to_path_buf(), quiet: true, stop_at: Some(1), ..Default::default() };
    train_from(&recipe, &opts, Some(&src)).unwrap();
    let s = train_from(&recipe, &RunOptions { resume: true, stop_at: None, ..opts }, None).unwrap();
    assert_eq!(s.last_step, 2);
    (src, out)
}

fn encode(t: &tokenizers::Tokenizer, text: &str) -> Vec<u32> {
    t.encode(text, true).unwrap().get_ids().to_vec()
}

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// The checkpoint carries the run's tokenizer: `eval --checkpoint` reads text through it, and export writes it
/// with the special tokens' ids, so the exported directory tokenizes as the pretrained one did.
#[test]
fn the_runs_tokenizer_travels_through_its_checkpoints_and_export() {
    let (src, run) = trained_from_llama("tok-run");
    let text = std::fs::read_to_string(fixtures().join("text.txt")).unwrap();
    let want = encode(src.tokenizer.as_ref().unwrap(), &text);
    let ck = longctx_trainer::checkpoint::load(&run).unwrap();
    assert_eq!(ck.step, 2);
    let manifest = read_json(&ck.dir.join("state.json"));
    assert!(manifest["manifest"]["files"]["tokenizer.json"]["crc32"].is_string(), "{manifest}");
    let saved = ck.tokenizer.as_ref().expect("the resumed run's checkpoint carries the tokenizer");
    assert_eq!((saved.eos_token_id, saved.bos_token_id), (2, Some(1)));
    assert_eq!(encode(&saved.tokenizer, &text), want);

    // `longctx eval --checkpoint RUN --tokens text.txt`: the text through the saved tokenizer, not as bytes.
    let out = Command::new(env!("CARGO_BIN_EXE_longctx"))
        .args(["eval", "--checkpoint"])
        .arg(&*run)
        .arg("--tokens")
        .arg(fixtures().join("text.txt"))
        .args(["--seq", "32"])
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{printed} {}", String::from_utf8_lossy(&out.stderr));
    let by_ids = evaluate(&run, &want, 32, 1).unwrap();
    println!("longctx eval --checkpoint (text): {}", printed.trim());
    assert!(
        printed.starts_with(&format!("loss {:.6} nats/token over {} tokens", by_ids.loss, by_ids.tokens)),
        "{printed}"
    );

    let dir = scratch("tok-export");
    let files = export::export_checkpoint(&run, &dir, &export::ExportOptions::default()).unwrap();
    assert!(files.contains(&dir.join("tokenizer.json")) && files.contains(&dir.join("tokenizer_config.json")));
    let config = read_json(&dir.join("config.json"));
    assert_eq!((config["eos_token_id"].as_u64(), config["bos_token_id"].as_u64()), (Some(2), Some(1)));
    let tc = read_json(&dir.join("tokenizer_config.json"));
    assert_eq!((tc["eos_token"].as_str(), tc["bos_token"].as_str()), (Some("</s>"), Some("<s>")));
    let back = hf::load(&dir).unwrap();
    assert_eq!((back.config.eos_token_id, back.config.bos_token_id), (Some(2), Some(1)));
    assert_eq!(encode(back.tokenizer.as_ref().unwrap(), &text), want);
    // `eval --init-from` the export reads the text the same way and computes the same loss, bit for bit (f32).
    let ids = read_tokens_with(&fixtures().join("text.txt"), back.tokenizer.as_ref()).unwrap();
    assert_eq!(ids, want);
    assert_eq!(evaluate_hf(&back, &ids, 32, 1).unwrap().loss.to_bits(), by_ids.loss.to_bits());
    // And a run from the export carries the tokenizer on.
    assert_eq!(back.saved_tokenizer().map(|t| (t.eos_token_id, t.bos_token_id)), Some((2, Some(1))));
}

/// Rounds `x` to the nearest bf16, ties to even (finite `x`), written out rather than taken from `half`.
fn bf16_nearest_even(x: f32) -> f32 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000;
    f32::from_bits(rounded)
}

/// The export in `dir` reads back as the checkpoint `tensors` of `model` bit for bit, and gives its loss `a`
/// over `ids`: the same bits at CP 1, within 1e-6 at CP 2.
fn reads_back_as_the_checkpoint(dir: &Path, tensors: &[LoadedTensor], model: &ModelConfig, ids: &[u32], a: f64) {
    let back = hf::load(dir).unwrap();
    assert_eq!(bits(&back.tensors), bits(tensors), "{}", dir.display());
    let mut read = back.model().clone();
    read.init_std = model.init_std;
    assert_eq!(&read, model, "{}", dir.display());
    let b = evaluate_hf(&back, ids, 64, 1).unwrap().loss;
    println!("{}: trainer checkpoint {a:.9}, exported and imported {b:.9}", dir.display());
    assert_eq!(a.to_bits(), b.to_bits());
    assert!(rel(a, evaluate_hf(&back, ids, 64, 2).unwrap().loss) <= 1e-6);
}

/// Each value of `model` rounded to the nearest bf16 (ties to even) and widened: what a bf16 export reads back
/// as. Round to nearest, not truncation: some values round up, which the caller's checks then exercise.
fn rounded_to_bf16(model: &[LoadedTensor]) -> Vec<LoadedTensor> {
    let up =
        model.iter().flat_map(|t| &t.data).filter(|x| x.to_bits() & 0xffff_0000 != bf16_nearest_even(**x).to_bits());
    assert!(up.count() > 1000, "rounding up is exercised");
    model
        .iter()
        .map(|t| LoadedTensor { data: t.data.iter().map(|&x| bf16_nearest_even(x)).collect(), ..t.clone() })
        .collect()
}

/// `--dtype bf16`: every tensor BF16 in the files, `torch_dtype` bfloat16, and the import is exactly each f32
/// value of the checkpoint rounded to the nearest bf16; single-file and sharded, with the tokenizer.
#[test]
fn a_bf16_export_imports_as_each_value_rounded_to_nearest_bf16() {
    let (_src, run) = trained_from_llama("bf16-run");
    let ck = longctx_trainer::checkpoint::load(&run).unwrap();
    let rounded = rounded_to_bf16(&ck.model);
    let mut sizes = Vec::new();
    for (tag, max_shard_bytes) in [("single", 5_000_000_000), ("sharded", 40_000)] {
        let dir = scratch(&format!("bf16-{tag}"));
        if tag == "single" {
            // Through the command line, as a user runs it.
            let out = Command::new(env!("CARGO_BIN_EXE_longctx"))
                .args(["export", "--dtype", "bf16", "--hf"])
                .arg(&*dir)
                .arg("--checkpoint")
                .arg(&*run)
                .output()
                .unwrap();
            let printed = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "{printed} {}", String::from_utf8_lossy(&out.stderr));
            assert!(printed.contains("tokenizer.json"), "{printed}");
        } else {
            let opts =
                export::ExportOptions { max_shard_bytes, dtype: export::WeightDtype::Bf16, ..Default::default() };
            export::export_checkpoint(&run, &dir, &opts).unwrap();
        }
        assert_eq!(read_json(&dir.join("config.json"))["torch_dtype"], "bfloat16");
        let files = hf::weights::WeightFiles::open(&dir).unwrap();
        assert!(files.entries.values().all(|e| e.dtype == safetensors::Dtype::BF16), "{tag}");
        let back = hf::load(&dir).unwrap();
        assert_eq!(bits(&back.tensors), bits(&rounded), "{tag}");
        assert!(back.tokenizer.is_some() && back.config.eos_token_id == Some(2), "{tag}");
        if tag == "single" {
            sizes.push(std::fs::metadata(dir.join("model.safetensors")).unwrap().len());
        } else {
            assert!(dir.join("model.safetensors.index.json").is_file());
        }
    }
    let f32_dir = scratch("bf16-vs-f32");
    export::export_checkpoint(&run, &f32_dir, &export::ExportOptions::default()).unwrap();
    let f32_size = std::fs::metadata(f32_dir.join("model.safetensors")).unwrap().len();
    assert!(sizes[0] * 2 <= f32_size + 4096, "bf16 {} bytes, f32 {f32_size}", sizes[0]);
}

/// A trainer checkpoint's `tokenizer.json` is checked against its manifest like its tensor files: cut short or
/// with a flipped byte, loading, evaluating or exporting it is an error naming the file.
#[test]
fn a_corrupt_tokenizer_in_a_trainer_checkpoint_is_an_error_naming_it() {
    let (_src, run) = trained_from_llama("tok-corrupt");
    let dir = longctx_trainer::checkpoint::latest(&run).unwrap().unwrap();
    let path = dir.join("tokenizer.json");
    let good = std::fs::read(&path).unwrap();
    let mut flipped = good.clone();
    flipped[good.len() / 2] ^= 0x20;
    for (case, bytes, needle) in
        [("cut short", &good[..good.len() - 10], "truncated"), ("flipped", &flipped[..], "CRC-32")]
    {
        std::fs::write(&path, bytes).unwrap();
        match longctx_trainer::checkpoint::load(&run).unwrap_err() {
            longctx_trainer::TrainError::Checkpoint { path: p, detail } => {
                assert_eq!(p, path, "{case}");
                assert!(detail.contains(needle), "{case}: {detail}");
            }
            other => panic!("{case}: {other}"),
        }
        let e = export::export_checkpoint(&run, &scratch("tok-corrupt-export"), &Default::default()).unwrap_err();
        assert!(e.to_string().contains("tokenizer.json") && e.to_string().contains(needle), "{case}: {e}");
        let e = evaluate(&run, &tokens(), 64, 1).unwrap_err().to_string();
        assert!(e.contains("tokenizer.json"), "{case}: {e}");
    }
    std::fs::write(&path, &good).unwrap();
    assert!(longctx_trainer::checkpoint::load(&run).unwrap().tokenizer.is_some());
}

fn err_of(dir: &Path) -> String {
    hf::load(dir).unwrap_err().to_string()
}

fn rewrite_safetensors(path: &Path, f: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>)) {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut ts: Vec<_> =
        st.tensors().into_iter().map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec())).collect();
    f(&mut ts);
    let views: Vec<_> = ts
        .iter()
        .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn bad_config_fields_are_errors_naming_them() {
    for (field, value, needle) in [
        ("model_type", Value::from("gpt2"), "model_type"),
        ("attention_bias", Value::from(true), "attention_bias"),
        ("mlp_bias", Value::from(true), "mlp_bias"),
        ("hidden_act", Value::from("gelu"), "hidden_act"),
        ("sliding_window", Value::from(4096), "sliding_window"),
        ("head_dim", Value::from(20), "head_dim"),
        ("num_key_value_heads", Value::from(3), "num_key_value_heads"),
        ("rope_parameters", serde_json::json!({"rope_type": "su", "factor": 2.0}), "rope_parameters.rope_type"),
        (
            "rope_parameters",
            serde_json::json!({"rope_type": "linear", "factor": 2.0, "beta": 1}),
            "rope_parameters.beta",
        ),
    ] {
        let dir = copy_fixture("llama", "badcfg");
        edit_config(&dir, |c| {
            c.insert(field.into(), value.clone());
        });
        let e = err_of(&dir);
        assert!(e.contains("config.json") && e.contains(needle), "{field}={value}: {e}");
    }
    for (fixture, field, value, needle) in [
        ("mixtral", "router_jitter_noise", Value::from(0.1), "router_jitter_noise"),
        ("mixtral", "sliding_window", Value::from(4096), "sliding_window"),
        ("mixtral", "hidden_act", Value::from("gelu"), "hidden_act"),
        ("mixtral", "num_experts_per_tok", Value::from(5), "num_experts_per_tok"),
        ("mixtral", "norm_eps", Value::from(1e-5), "norm_eps"),
        ("mixtral", "moe_intermediate_size", Value::from(16), "moe_intermediate_size"),
        ("nemotron", "hidden_act", Value::from("silu"), "hidden_act"),
        ("nemotron", "mlp_bias", Value::from(true), "mlp_bias"),
        ("nemotron", "attention_bias", Value::from(true), "attention_bias"),
        ("nemotron", "rms_norm_eps", Value::from(1e-5), "rms_norm_eps"),
        ("nemotron", "model_type", Value::from("nemotron_h"), "model_type"),
    ] {
        let dir = copy_fixture(fixture, "badcfg-family");
        edit_config(&dir, |c| {
            c.insert(field.into(), value.clone());
        });
        let e = err_of(&dir);
        assert!(e.contains("config.json") && e.contains(needle), "{fixture} {field}={value}: {e}");
    }
    // Bookkeeping fields are accepted.
    let dir = copy_fixture("llama", "bookkeeping");
    edit_config(&dir, |c| {
        c.insert("torch_dtype".into(), "float32".into());
        c.insert("_name_or_path".into(), "meta-llama/Llama-3.1-8B".into());
        c.insert("initializer_range".into(), 0.02.into());
    });
    hf::load(&dir).unwrap();
}

#[test]
fn bad_tensors_are_errors_naming_file_and_tensor() {
    let q0 = "model.layers.0.self_attn.q_proj.weight";
    // A shape config.json does not imply (head_dim 48 makes q_proj [96, 64]).
    let dir = copy_fixture("llama", "badshape");
    edit_config(&dir, |c| {
        c.insert("head_dim".into(), 48.into());
    });
    let e = err_of(&dir);
    assert!(
        e.contains("model.safetensors") && e.contains(q0) && e.contains("[96, 64]") && e.contains("head_dim"),
        "{e}"
    );

    let dir = copy_fixture("llama", "missing");
    rewrite_safetensors(&dir.join("model.safetensors"), |ts| ts.retain(|t| t.0 != q0));
    let e = err_of(&dir);
    assert!(e.contains("model.safetensors") && e.contains(q0) && e.contains("missing"), "{e}");

    let dir = copy_fixture("llama", "extra");
    rewrite_safetensors(&dir.join("model.safetensors"), |ts| {
        ts.push(("model.layers.0.self_attn.q_proj.bias".into(), safetensors::Dtype::F32, vec![64], vec![0; 256]))
    });
    let e = err_of(&dir);
    assert!(e.contains("model.safetensors") && e.contains("q_proj.bias") && e.contains("not a tensor"), "{e}");

    let dir = copy_fixture("llama", "dtype");
    rewrite_safetensors(&dir.join("model.safetensors"), |ts| {
        let t = ts.iter_mut().find(|t| t.0 == "model.norm.weight").unwrap();
        t.1 = safetensors::Dtype::I32;
    });
    let e = err_of(&dir);
    assert!(e.contains("model.norm.weight") && e.contains("I32"), "{e}");

    let dir = copy_fixture("llama", "truncated");
    let f = dir.join("model.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::File::options().write(true).open(&f).unwrap().set_len(len - 100).unwrap();
    let e = err_of(&dir);
    assert!(e.contains("model.safetensors") && e.contains("truncated") && e.contains("tensor `"), "{e}");

    let dir = copy_fixture("llama3-sharded", "noshard");
    std::fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
    let e = err_of(&dir);
    assert!(e.contains("model-00002-of-00002.safetensors") && e.contains("tensor `") && e.contains("missing"), "{e}");
}

#[test]
fn bad_mixtral_and_nemotron_tensors_are_errors_naming_file_and_tensor() {
    // A missing expert, an extra one, and a router of another shape (num_local_experts 3 makes it [3, 64]).
    let w2 = "model.layers.1.block_sparse_moe.experts.2.w2.weight";
    let dir = copy_fixture("mixtral", "moe-missing");
    rewrite_safetensors(&dir.join("model.safetensors"), |ts| ts.retain(|t| t.0 != w2));
    let e = err_of(&dir);
    assert!(e.contains("model.safetensors") && e.contains(w2) && e.contains("missing"), "{e}");

    let dir = copy_fixture("mixtral", "moe-extra");
    rewrite_safetensors(&dir.join("model.safetensors"), |ts| {
        let t = ts.iter().find(|t| t.0 == w2).unwrap().clone();
        ts.push(("model.layers.1.block_sparse_moe.experts.4.w2.weight".into(), t.1, t.2, t.3));
    });
    let e = err_of(&dir);
    assert!(e.contains("experts.4.w2.weight") && e.contains("not a tensor"), "{e}");

    let dir = copy_fixture("mixtral", "moe-shape");
    edit_config(&dir, |c| {
        c.insert("num_local_experts".into(), 3.into());
    });
    let e = err_of(&dir);
    assert!(
        e.contains("model.layers.0.block_sparse_moe.gate.weight")
            && e.contains("[4, 64]")
            && e.contains("num_local_experts"),
        "{e}"
    );

    // The fused layout: a gate_up_proj of another width names it and the fields it comes from.
    let dir = copy_fixture("mixtral-fused", "fused-shape");
    edit_config(&dir, |c| {
        c.insert("intermediate_size".into(), 8.into());
    });
    let e = err_of(&dir);
    assert!(
        e.contains("model.layers.0.mlp.experts") && e.contains("intermediate_size") && e.contains("[4, 32, 64]"),
        "{e}"
    );

    // Nemotron: a LayerNorm without its bias, and a gate projection its MLP does not have.
    let bias = "model.layers.0.post_attention_layernorm.bias";
    let dir = copy_fixture("nemotron", "nem-missing");
    rewrite_safetensors(&dir.join("model.safetensors"), |ts| ts.retain(|t| t.0 != bias));
    let e = err_of(&dir);
    assert!(e.contains("model.safetensors") && e.contains(bias) && e.contains("missing"), "{e}");

    let dir = copy_fixture("nemotron", "nem-gated");
    rewrite_safetensors(&dir.join("model.safetensors"), |ts| {
        let t = ts.iter().find(|t| t.0 == "model.layers.0.mlp.up_proj.weight").unwrap().clone();
        ts.push(("model.layers.0.mlp.gate_proj.weight".into(), t.1, t.2, t.3));
    });
    let e = err_of(&dir);
    assert!(e.contains("model.layers.0.mlp.gate_proj.weight") && e.contains("not a tensor"), "{e}");
}

#[test]
fn tied_embeddings_load_tied() {
    let dir = copy_fixture("llama", "tied");
    edit_config(&dir, |c| {
        c.insert("tie_word_embeddings".into(), true.into());
    });
    rewrite_safetensors(&dir.join("model.safetensors"), |ts| ts.retain(|t| t.0 != "lm_head.weight"));
    let ck = hf::load(&dir).unwrap();
    assert!(ck.model().tie_embeddings);
    assert_eq!(ck.tensors.last().unwrap().name, "model.norm.weight", "no lm_head.weight in a tied model");
}

#[test]
fn train_init_from_starts_from_the_checkpoint_and_refuses_other_shapes() {
    let ck = hf::load(&fixtures().join("llama")).unwrap();
    let base = Recipe::load("tiny-llama", &[]).unwrap();
    let e = hf::recipe_from(&base, &["model.layers=3".into()], &ck.config).unwrap_err().to_string();
    assert!(e.contains("model.layers"), "{e}");
    // The recipe takes the checkpoint's shapes (2 layers, where tiny-llama has 4).
    assert_eq!(hf::recipe_from(&base, &[], &ck.config).unwrap().model.layers, 2);
    one_step_starts_from(&ck, "initfrom");
}

/// One step from `ck` over CP 2 at a learning rate of 1e-12, which moves no weight measurably: the saved
/// weights are the checkpoint's, tensor by tensor, so the run started from them.
fn one_step_starts_from(ck: &HfCheckpoint, tag: &str) {
    let sets: Vec<String> = [
        "train.seq_len=64",
        "train.batch=1",
        "train.steps=1",
        "train.lr=1e-12",
        "train.min_lr=0",
        "train.warmup=0",
        "train.eval_every=1",
        "train.eval_seqs=1",
        "parallel.threads=1",
        "parallel.cp=2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let recipe = hf::recipe_from(&Recipe::load("tiny-llama", &sets).unwrap(), &sets, &ck.config).unwrap();
    let out = scratch(tag);
    let s = train_from(&recipe, &RunOptions { out: out.to_path_buf(), quiet: true, ..Default::default() }, Some(ck))
        .unwrap();
    let saved = longctx_trainer::checkpoint::load(&out).unwrap();
    assert_eq!(saved.model.len(), ck.tensors.len());
    for (a, b) in saved.model.iter().zip(&ck.tensors) {
        let d = a.data.iter().zip(&b.data).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(a.name == b.name && d < 1e-6, "{}: moved {d}", a.name);
    }
    // A run from pretrained weights measures their held-out loss before its first step (step 0): with a
    // learning rate that moves nothing, step 1's is the same loss.
    let steps: Vec<u64> = s.val_losses.iter().map(|v| v.0).collect();
    assert_eq!(steps, [0, 1], "{tag}");
    let (before, after) = (s.val_losses[0].1, s.val_losses[1].1);
    assert!(before.is_finite() && ((before - after) / before).abs() < 1e-5, "{tag}: {before} {after}");
    // With a learning rate that does move the weights, step 0's loss is still the pretrained weights' (the
    // same bits), and step 1's is another.
    let mut moving = recipe.clone();
    moving.train.lr = 1e-2;
    let out = scratch(&format!("{tag}-moving"));
    let m = train_from(&moving, &RunOptions { out: out.to_path_buf(), quiet: true, ..Default::default() }, Some(ck))
        .unwrap();
    assert_eq!(m.val_losses[0], (0, before), "{tag}");
    assert_ne!(m.val_losses[1].1, after, "{tag}");
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert!(metrics.lines().next().is_some_and(|l| l.contains("\"step\":0") && l.contains("val_loss")), "{metrics}");
}

/// `--init-from` a Mixtral or Nemotron: the recipe takes the checkpoint's family, experts and rotary share; a
/// recipe change of family or of the experts' count (shapes the tensors have) is an error naming the field.
#[test]
fn init_from_takes_the_checkpoints_family_and_refuses_other_shapes() {
    let base = Recipe::load("tiny-llama", &[]).unwrap();
    let mix = hf::load(&fixtures().join("mixtral")).unwrap();
    let r = hf::recipe_from(&base, &[], &mix.config).unwrap();
    assert_eq!((r.model.family, r.model.moe), (Family::Mixtral, mix.model().moe));
    let e = hf::recipe_from(&base, &["model.moe.experts=8".into()], &mix.config).unwrap_err().to_string();
    assert!(e.contains("model.moe.experts"), "{e}");
    // The load-balancing coefficient is the recipe's to change (it shapes no tensor).
    let r = hf::recipe_from(&base, &["model.moe.aux_loss_coef=0.0".into()], &mix.config).unwrap();
    assert_eq!(r.model.moe.map(|m| m.aux_loss_coef), Some(0.0));
    let nem = hf::load(&fixtures().join("nemotron")).unwrap();
    let r = hf::recipe_from(&base, &[], &nem.config).unwrap();
    assert_eq!((r.model.family, r.model.partial_rotary_factor), (Family::Nemotron, Some(0.5)));
    let mut other = r.model.clone();
    other.family = Family::Llama;
    let e = hf::check_model(&other, &nem.config).unwrap_err().to_string();
    assert!(e.contains("model.family") && e.contains("nemotron"), "{e}");
    // One step from each over CP 2 starts from the checkpoint's weights.
    one_step_starts_from(&mix, "initfrom-mixtral");
    one_step_starts_from(&nem, "initfrom-nemotron");
}

#[test]
fn eval_command_prints_the_loss_at_any_cp() {
    for (name, cps) in [("llama", &["1", "2"][..]), ("nemotron", &["1", "4"]), ("mixtral", &["1", "4"])] {
        let want = expected()["loss"][name].as_f64().unwrap();
        // The Mixtral's vocabulary is 257: its ids as a .npy of their own.
        let own = (name == "mixtral").then(|| {
            let s = scratch("mixtral-ids");
            write_npy(&s.join("ids.npy"), &tokens_for(257));
            s
        });
        let tok_file = own.as_ref().map_or(fixtures().join("tokens.npy"), |s| s.join("ids.npy"));
        let mut losses = Vec::new();
        for cp in cps {
            let out = Command::new(env!("CARGO_BIN_EXE_longctx"))
                .args(["eval", "--init-from"])
                .arg(fixtures().join(name))
                .arg("--tokens")
                .arg(&tok_file)
                .args(["--seq", "64", "--cp", cp])
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "{text} {}", String::from_utf8_lossy(&out.stderr));
            let loss: f64 = text.split_whitespace().nth(1).unwrap().parse().unwrap();
            println!("longctx eval --init-from {name} --cp {cp}: {}", text.trim());
            assert!(rel(loss, want) <= 1e-5, "{name}: {text} vs transformers {want}");
            losses.push(loss);
        }
        assert_eq!(losses[0], losses[1], "{name}: printed to 6 decimals, cp {cps:?} agree");
    }
}

/// `longctx eval --init-from DIR --tokens ids.npy` needs no tokenizer, so it takes a checkpoint whose vocabulary
/// is below the byte tokenizer's 257 tokens (the Llama fixture cut to 200, without its tokenizer.json); the ids
/// are checked against the model's vocabulary instead, the first out of range named with its position. The byte
/// tokenizer's rule is checked where text goes through it (a run on the byte-level corpus).
#[test]
fn eval_of_token_ids_checks_them_against_the_models_vocabulary() {
    let vocab = 200;
    let dir = copy_fixture("llama", "small-vocab");
    edit_config(&dir, |c| {
        c.insert("vocab_size".into(), vocab.into());
    });
    rewrite_safetensors(&dir.join("model.safetensors"), |ts| {
        for (name, _, shape, data) in ts.iter_mut() {
            if name == "model.embed_tokens.weight" || name == "lm_head.weight" {
                data.truncate(vocab * shape[1] * 4); // f32 rows
                shape[0] = vocab;
            }
        }
    });
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let ids = tokens_for(vocab);
    let mut bad = ids.clone();
    bad[37] = 250;
    let files = scratch("small-vocab-ids");
    write_npy(&files.join("ids.npy"), &ids);
    write_npy(&files.join("bad.npy"), &bad);
    let eval = |tokens: &str| {
        Command::new(env!("CARGO_BIN_EXE_longctx"))
            .args(["eval", "--init-from"])
            .arg(&*dir)
            .arg("--tokens")
            .arg(files.join(tokens))
            .args(["--seq", "64"])
            .output()
            .unwrap()
    };

    let out = eval("ids.npy");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text} {}", String::from_utf8_lossy(&out.stderr));
    let printed: f64 = text.split_whitespace().nth(1).unwrap().parse().unwrap();
    let ck = hf::load(&dir).unwrap();
    let direct = evaluate_hf(&ck, &ids, 64, 1).unwrap();
    assert!(direct.loss.is_finite() && (printed - direct.loss).abs() <= 1e-6, "{text} vs {direct:?}");

    let e = evaluate_hf(&ck, &bad, 64, 1).unwrap_err();
    assert!(matches!(e, TrainError::TokenOutOfVocab { id: 250, position: 37, vocab: 200 }), "{e}");
    let out = eval("bad.npy");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains(&e.to_string()), "{stderr}");

    // The byte tokenizer's rule is where text goes through it: training on the byte-level corpus, refused before
    // the run writes anything.
    let recipe = Recipe::load("tiny-llama", &["model.vocab=200".into()]).unwrap();
    let out = files.join("byte-run");
    let opts = RunOptions { out: out.clone(), resume: false, quiet: true, stop_at: None };
    let e = train(&recipe, &opts).unwrap_err();
    assert!(
        matches!(&e, TrainError::InvalidField { field, detail } if field == "model.vocab"
            && detail.contains("byte tokenizer's 257 tokens")),
        "{e}"
    );
    assert!(!out.exists(), "a refused run wrote {}", out.display());
}

/// `ids` as a one-dimensional little-endian int64 `.npy` (what `read_tokens` reads).
fn write_npy(path: &Path, ids: &[u32]) {
    let mut header = format!("{{'descr': '<i8', 'fortran_order': False, 'shape': ({},), }}", ids.len());
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend((header.len() as u16).to_le_bytes());
    bytes.extend(header.as_bytes());
    for &t in ids {
        bytes.extend((t as i64).to_le_bytes());
    }
    std::fs::write(path, bytes).unwrap();
}

/// The Python to run transformers with: `$LONGCTX_PYTHON`, else `python3`; `None` (the test then skips, saying
/// so) when it cannot import transformers and torch, as on CI.
fn python() -> Option<String> {
    let py = std::env::var("LONGCTX_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = Command::new(&py).args(["-c", "import transformers, torch"]).output();
    if probe.as_ref().is_ok_and(|o| o.status.success()) {
        Some(py)
    } else {
        println!(
            "SKIPPED: {py} cannot import transformers and torch (LONGCTX_PYTHON names another); the committed \
             fixtures stand in for it"
        );
        None
    }
}

/// transformers' mean next-token loss over windows of 64 of `ids` for the checkpoint `dir`, as `longctx eval`
/// cuts them, and the class it loaded.
fn transformers_loss(py: &str, dir: &Path, ids: &[u32]) -> (f64, String) {
    let script = format!(
        r#"
import torch, transformers
m = transformers.AutoModelForCausalLM.from_pretrained("{dir}", dtype=torch.float32, attn_implementation="eager").eval()
ids = {ids:?}
total = 0.0
for w in range((len(ids) - 1) // 64):
    c = torch.tensor(ids[w * 64 : w * 64 + 65]).unsqueeze(0)
    with torch.no_grad():
        logits = m(input_ids=c[:, :-1]).logits.double()
    total += torch.nn.functional.cross_entropy(logits[0], c[0, 1:], reduction="sum").item()
print(type(m).__name__)
print(repr(total / (64 * ((len(ids) - 1) // 64))))
"#,
        dir = dir.display()
    );
    let out = Command::new(py).args(["-c", &script]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines = text.trim().lines().rev();
    let loss = lines.next().unwrap().parse().unwrap();
    (loss, lines.next().unwrap_or("").to_string())
}

/// transformers loads what export writes and computes the loss this trainer computes. Skips (passing, saying
/// so) where no Python can import transformers, as on CI.
#[test]
fn live_transformers_loads_the_export() {
    let Some(py) = python() else { return };
    let (run, _single, sharded) = trained_and_exported("live");
    let ids: Vec<u32> = tokens_for(257);
    let ours = evaluate(&run, &ids, 64, 2).unwrap().loss;
    let (theirs, _) = transformers_loss(&py, &sharded, &ids);
    println!("exported (sharded, llama3 scaling) in transformers: {theirs:.9}; longctx eval cp 2: {ours:.9}");
    assert!(rel(ours, theirs) <= 1e-5, "{ours} vs transformers {theirs}");
}

/// The same for a trained tiny Mixtral (exported in the Hub's per-expert layout) and Nemotron, single-file and
/// sharded. Skips like the Llama one.
#[test]
fn live_transformers_loads_the_mixtral_and_nemotron_exports() {
    let Some(py) = python() else { return };
    let ids: Vec<u32> = tokens_for(257);
    for (recipe, class) in [("tiny-mixtral", "MixtralForCausalLM"), ("tiny-nemotron", "NemotronForCausalLM")] {
        let (run, single, sharded) = trained_family(recipe, &format!("live-{recipe}"));
        let ours = evaluate(&run, &ids, 64, 2).unwrap().loss;
        for dir in [&single, &sharded] {
            let (theirs, loaded) = transformers_loss(&py, dir, &ids);
            println!("{recipe} exported, in transformers ({loaded}): {theirs:.9}; longctx eval cp 2: {ours:.9}");
            assert_eq!(loaded, class);
            assert!(rel(ours, theirs) <= 1e-5, "{recipe}: {ours} vs transformers {theirs}");
        }
    }
}

/// What transformers made of a checkpoint's tensor names: the keys its model wanted and did not find, those it
/// found and did not want, and those of another shape (`output_loading_info`), as one line.
fn transformers_loading_report(py: &str, dir: &Path) -> String {
    let script = format!(
        r#"
import torch, transformers
m, info = transformers.AutoModelForCausalLM.from_pretrained("{dir}", dtype=torch.float32, output_loading_info=True)
print("missing", sorted(info.get("missing_keys", [])), "unexpected", sorted(info.get("unexpected_keys", [])),
      "mismatched", sorted(str(k) for k in info.get("mismatched_keys", [])))
"#,
        dir = dir.display()
    );
    let out = Command::new(py).args(["-c", &script]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().lines().last().unwrap_or("").to_string()
}

/// The fused export (`--experts fused`) of a trained tiny Mixtral, f32 single-file and sharded and bf16: transformers
/// finds every tensor it wants under its own name and shape, and computes the loss `longctx eval --init-from`
/// computes on the same directory. Skips like the others.
#[test]
fn live_transformers_loads_the_fused_mixtral_export() {
    let Some(py) = python() else { return };
    let ids: Vec<u32> = tokens_for(257);
    let run = fused_run("live-fused");
    let cases = [
        ("f32", fused_opts(5_000_000_000, export::WeightDtype::F32)),
        ("f32-sharded", fused_opts(40_000, export::WeightDtype::F32)),
        ("bf16", fused_opts(5_000_000_000, export::WeightDtype::Bf16)),
    ];
    for (tag, opts) in cases {
        let dir = scratch(&format!("live-fused-{tag}"));
        export::export_checkpoint(&run, &dir, &opts).unwrap();
        let report = transformers_loading_report(&py, &dir);
        println!("fused {tag} export in transformers: {report}");
        assert_eq!(report, "missing [] unexpected [] mismatched []", "{tag}");
        let ours = evaluate_hf(&hf::load(&dir).unwrap(), &ids, 64, 2).unwrap().loss;
        let (theirs, class) = transformers_loss(&py, &dir, &ids);
        println!("fused {tag} export in transformers ({class}): {theirs:.9}; longctx cp 2: {ours:.9}");
        assert_eq!(class, "MixtralForCausalLM");
        assert!(rel(ours, theirs) <= 1e-5, "{tag}: {ours} vs transformers {theirs}");
    }
}

/// transformers loads a bf16 export of a run `--init-from` the Llama fixture, model and tokenizer: its loss is
/// `longctx eval --init-from` on the same directory's (≤ 1e-5 relative), and `AutoTokenizer` gives the ids this
/// trainer gives the text, with the end-of-sequence token config.json names. Skips like the others.
#[test]
fn live_transformers_loads_the_bf16_export_and_its_tokenizer() {
    let Some(py) = python() else { return };
    let (_src, run) = trained_from_llama("live-bf16");
    let dir = scratch("live-bf16-export");
    let opts = export::ExportOptions { dtype: export::WeightDtype::Bf16, ..Default::default() };
    export::export_checkpoint(&run, &dir, &opts).unwrap();
    let ids = tokens();
    let out = Command::new(env!("CARGO_BIN_EXE_longctx"))
        .args(["eval", "--init-from"])
        .arg(&*dir)
        .arg("--tokens")
        .arg(fixtures().join("tokens.npy"))
        .args(["--seq", "64", "--cp", "2"])
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{printed} {}", String::from_utf8_lossy(&out.stderr));
    let ours: f64 = printed.split_whitespace().nth(1).unwrap().parse().unwrap();
    let (theirs, class) = transformers_loss(&py, &dir, &ids);
    println!("bf16 export in transformers ({class}): {theirs:.9}; longctx eval --init-from: {}", printed.trim());
    assert_eq!(class, "LlamaForCausalLM");
    assert!(rel(ours, theirs) <= 1e-5, "{ours} vs transformers {theirs}");

    let script = format!(
        r#"
import transformers
t = transformers.AutoTokenizer.from_pretrained("{dir}")
print(t.eos_token_id)
print(t(open("{text}").read()).input_ids)
"#,
        dir = dir.display(),
        text = fixtures().join("text.txt").display()
    );
    let out = Command::new(&py).args(["-c", &script]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines = text.trim().lines().rev();
    let theirs: Vec<u32> = serde_json::from_str(lines.next().unwrap()).unwrap();
    let eos = lines.next().unwrap().trim().to_string();
    let want = read_tokens_with(&fixtures().join("text.txt"), hf::load(&dir).unwrap().tokenizer.as_ref()).unwrap();
    println!("AutoTokenizer on the export: eos {eos}, {} ids of text.txt", theirs.len());
    assert_eq!(theirs, want, "AutoTokenizer and this trainer tokenize text.txt alike");
    assert_eq!(eos, "2");
}

/// transformers 5's fused expert tensors (`save_original_format=False`) and the Hub's per-expert ones read into
/// the same weights, bit for bit; the families' distinctive configuration is read as transformers reads it.
#[test]
fn mixtral_fused_and_hub_layouts_read_the_same() {
    let hub = hf::load(&fixtures().join("mixtral")).unwrap();
    let fused = hf::load(&fixtures().join("mixtral-fused")).unwrap();
    assert_eq!(bits(&hub.tensors), bits(&fused.tensors));
    assert_eq!(hub.model(), fused.model());
    let m = hub.model();
    assert_eq!(m.family, Family::Mixtral);
    assert_eq!(m.moe, Some(MoeConfig { experts: 4, top_k: 2, aux_loss_coef: 0.02 }));
    assert_eq!(m.rope_theta, 1e6);
    assert!(hub.config.notes.iter().any(|n| n.contains("output_router_logits")), "{:?}", hub.config.notes);
    let nem = hf::load(&fixtures().join("nemotron")).unwrap();
    assert_eq!(nem.model().family, Family::Nemotron);
    assert_eq!(nem.model().partial_rotary_factor, Some(0.5));
    assert_eq!(nem.model().rotary_dim(), 16);
}

/// An absent field means what transformers' config class of the architecture assumes: Mixtral's RoPE base is
/// 1e6 (the fixture's, so the loss still matches) and its KV heads 8 (which 2 query heads cannot group).
#[test]
fn absent_fields_take_transformers_defaults_per_architecture() {
    let dir = copy_fixture("mixtral", "defaults-theta");
    edit_config(&dir, |c| {
        c.remove("rope_parameters");
    });
    let ck = hf::load(&dir).unwrap();
    assert_eq!(ck.model().rope_theta, 1e6);
    let want = expected()["loss"]["mixtral"].as_f64().unwrap();
    let got = evaluate_hf(&ck, &tokens_for(257), 64, 1).unwrap().loss;
    assert!(rel(got, want) <= 1e-5, "{got} vs {want}");
    let dir = copy_fixture("mixtral", "defaults-kv");
    edit_config(&dir, |c| {
        c.remove("num_key_value_heads");
    });
    let e = err_of(&dir);
    assert!(e.contains("num_key_value_heads") && e.contains('8'), "{e}");
    // Llama's base is 10000 (its fixture's, too).
    let dir = copy_fixture("llama", "defaults-llama");
    edit_config(&dir, |c| {
        c.remove("rope_parameters");
    });
    assert_eq!(hf::load(&dir).unwrap().model().rope_theta, 10_000.0);
}

/// Nemotron's `partial_rotary_factor` is read wherever transformers reads it (top level, inside
/// `rope_parameters`, or absent: 0.5), and a value the head cannot take is an error naming it.
#[test]
fn nemotron_partial_rotary_factor_reads_as_transformers_reads_it() {
    let want = expected()["loss"]["nemotron"].as_f64().unwrap();
    let ids = tokens();
    for (case, edit) in [("top-level", Some(0.5)), ("absent", None)] {
        let dir = copy_fixture("nemotron", &format!("prf-{case}"));
        edit_config(&dir, |c| {
            c["rope_parameters"].as_object_mut().unwrap().remove("partial_rotary_factor");
            if let Some(p) = edit {
                c.insert("partial_rotary_factor".into(), p.into());
            }
        });
        let ck = hf::load(&dir).unwrap();
        assert_eq!(ck.model().partial_rotary_factor, Some(0.5), "{case}");
        let got = evaluate_hf(&ck, &ids, 64, 1).unwrap().loss;
        assert!(rel(got, want) <= 1e-5, "{case}: {got} vs {want}");
    }
    for (name, edit) in [
        ("disagree", ("partial_rotary_factor", Value::from(0.25))),
        ("odd", ("partial_rotary_factor", Value::from(0.3))),
    ] {
        let dir = copy_fixture("nemotron", &format!("prf-{name}"));
        edit_config(&dir, |c| {
            if name == "odd" {
                c["rope_parameters"].as_object_mut().unwrap().remove("partial_rotary_factor");
            }
            c.insert(edit.0.into(), edit.1.clone());
        });
        let e = err_of(&dir);
        assert!(e.contains("config.json") && e.contains("partial_rotary_factor"), "{name}: {e}");
    }
    // The fixture tells: rotating the whole head instead moves the loss well past the tolerance.
    let mut whole = hf::load(&fixtures().join("nemotron")).unwrap();
    whole.config.model.partial_rotary_factor = None;
    let got = evaluate_hf(&whole, &ids, 64, 1).unwrap().loss;
    println!("nemotron with every dim rotating: {got:.6} (transformers, half rotating: {want:.6})");
    assert!(rel(got, want) > 1e-3, "{got} vs {want}");
    // Llama and Mixtral rotate the whole head.
    let dir = copy_fixture("mixtral", "prf-mixtral");
    edit_config(&dir, |c| {
        c.insert("partial_rotary_factor".into(), 0.5.into());
    });
    let e = err_of(&dir);
    assert!(e.contains("partial_rotary_factor") && e.contains("MixtralForCausalLM"), "{e}");
}

/// The logits themselves, not only their loss: the final hidden states times `lm_head` at a few positions of
/// window 0 match transformers' (`expected.json` `logits[position][token 0..8]`, and `family_logits` for the
/// Mixtral and Nemotron fixtures).
#[test]
fn logits_match_transformers() {
    let want = expected();
    for (name, logits) in [
        ("llama", &want["logits"]),
        ("mixtral", &want["family_logits"]["mixtral"]),
        ("nemotron", &want["family_logits"]["nemotron"]),
    ] {
        let worst = logits_vs(name, logits);
        println!("{name} logits at positions 0, 1, 31, 63 (tokens 0..8): worst difference {worst:.1e} (relative to max(|x|, 1))");
    }
}

fn logits_vs(name: &str, want: &Value) -> f64 {
    use longctx_ring_attn::{
        Backend, ContextParallel, CpConfig, CpMask, CpShape, CpuBackend, DType, Partition, Schedule, ThreadWorld, View,
    };
    use longctx_trainer::model::{Model, Params};
    use std::sync::Arc;

    let ck = hf::load(&fixtures().join(name)).unwrap();
    let cfg = ck.model().clone();
    let ids: Vec<u32> = tokens_for(cfg.vocab)[..64].to_vec();
    let out = ThreadWorld::run(1, |comm| {
        let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new());
        let mut w = Params::zeros(&*backend, &cfg, DType::F32).unwrap();
        for (t, src) in w.tensors.iter_mut().zip(&ck.tensors) {
            backend.copy(t.view_mut(), View::new(&src.data, src.dims.as_slice()).unwrap()).unwrap();
        }
        let mut model = Model::new(cfg.clone(), w, backend.clone()).unwrap();
        model.set_sequence_length(64).unwrap();
        let cp = ContextParallel::new(
            comm,
            backend,
            CpConfig { partition: Partition::Contiguous, schedule: Schedule::Ring, scale: None },
        )
        .unwrap();
        let shape = CpShape {
            batch: 1,
            q_heads: cfg.heads,
            kv_heads: cfg.kv_heads,
            seq_len: 64,
            head_dim: cfg.head_dim(),
            dtype: DType::F32,
        };
        let mut plan = cp.plan(&shape, &CpMask::causal()).unwrap();
        let pos = plan.positions().to_vec();
        let saved = model.forward(&ids, &mut plan).unwrap();
        (pos, saved.h_final.view().as_typed::<f32>("h").unwrap().to_vec())
    })
    .unwrap();
    let (pos, h) = &out[0];
    let (c, head) = (cfg.d_model, &ck.tensors.last().unwrap().data);
    assert_eq!(ck.tensors.last().unwrap().name, "lm_head.weight");
    let mut worst = 0.0f64;
    for (p, row) in want.as_object().unwrap() {
        let p: i64 = p.parse().unwrap();
        let local = pos.iter().position(|&x| x == p).unwrap();
        for (tok, w) in row.as_array().unwrap().iter().enumerate() {
            let got: f64 = (0..c).map(|i| h[local * c + i] as f64 * head[tok * c + i] as f64).sum();
            let w = w.as_f64().unwrap();
            worst = worst.max((got - w).abs() / w.abs().max(1.0));
            assert!((got - w).abs() <= 2e-5 * w.abs().max(1.0), "{name} logit [{p}][{tok}]: {got} vs transformers {w}");
        }
    }
    worst
}
