//! `longctx eval`: the mean next-token cross-entropy of a checkpoint over a file of tokens, with any number of
//! context-parallel ranks (the loss does not depend on it).

use std::path::Path;

use longctx_kernels::{DType, View};
use longctx_p2p::{ReduceOp, ThreadWorld};
use longctx_ring_attn::{ContextParallel, CpConfig};

use crate::checkpoint::{self, LoadedTensor};
use crate::data::{encode, Sequence, TextTokenizer, EOT};
use crate::device::Device;
use crate::error::{Result, TrainError};
use crate::hf::HfCheckpoint;
use crate::model::{param_shapes, Model, Params};
use crate::recipe::{ModelConfig, Recipe};

/// What an evaluation measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalResult {
    /// Mean cross-entropy per scored token (nats).
    pub loss: f64,
    /// Tokens scored.
    pub tokens: usize,
    /// Windows of `seq` tokens evaluated.
    pub windows: usize,
}

/// Reads token ids: a `.npy` of integers, or any other file as UTF-8 text through the byte tokenizer.
pub fn read_tokens(path: &Path) -> Result<Vec<u32>> {
    read_tokens_with(path, None)
}

/// Reads token ids: a `.npy` of integers, or any other file as UTF-8 text through `tokenizer` (a Hugging Face
/// tokenizer, with its special tokens added as transformers' `tokenizer(text)` adds them) or, without one, the
/// byte tokenizer.
pub fn read_tokens_with(path: &Path, tokenizer: Option<&tokenizers::Tokenizer>) -> Result<Vec<u32>> {
    if path.extension().is_some_and(|e| e == "npy") {
        return crate::npy::read_token_ids(path);
    }
    let text = std::fs::read_to_string(path).map_err(|e| TrainError::io(path, e))?;
    let Some(t) = tokenizer else { return Ok(encode(&text)) };
    let enc = t.encode(text, true).map_err(|e| TrainError::Tokenizer {
        context: format!("the checkpoint's tokenizer failed on {}", path.display()),
        detail: e.to_string(),
    })?;
    Ok(enc.get_ids().to_vec())
}

/// Reads token ids for the trainer checkpoint `ck` as its run read text: a `.npy` of ids as they are, any other
/// file through the tokenizer the run saved or, without one, the byte tokenizer, whose 257 tokens the model's
/// vocabulary must then hold (the ids are checked against the vocabulary when evaluated).
///
/// Errors: the file cannot be read; [`TrainError::InvalidField`] naming `model.vocab` for text through bytes
/// and a smaller vocabulary.
pub fn read_checkpoint_tokens(ck: &checkpoint::Checkpoint, path: &Path) -> Result<Vec<u32>> {
    let tokenizer = ck.tokenizer.as_ref().map(|t| &t.tokenizer);
    let is_text = path.extension().is_none_or(|e| e != "npy");
    if is_text && tokenizer.is_none() {
        TextTokenizer::Bytes.check_vocab(checkpoint_recipe(ck)?.model.vocab)?;
    }
    read_tokens_with(path, tokenizer)
}

/// The recipe a checkpoint was trained with (from its `state.json`).
pub fn checkpoint_recipe(ck: &checkpoint::Checkpoint) -> Result<Recipe> {
    let path = ck.dir.join("state.json");
    let text = ck
        .state
        .get("recipe")
        .and_then(|r| r.as_str())
        .ok_or_else(|| TrainError::Checkpoint { path: path.clone(), detail: "field `recipe` is missing".into() })?;
    Recipe::parse("checkpoint", text, &[])
        .map_err(|e| TrainError::Checkpoint { path, detail: format!("field `recipe`: {e}") })
}

/// The mean loss of the checkpoint in `dir` over `tokens`, cut into consecutive windows of `seq` inputs (each
/// with the next token as the last target), computed over `cp` thread ranks.
pub fn evaluate(dir: &Path, tokens: &[u32], seq: usize, cp: usize) -> Result<EvalResult> {
    evaluate_checkpoint(&checkpoint::load(dir)?, tokens, seq, cp)
}

/// [`evaluate`] of a checkpoint already loaded (to read its tokenizer first, say).
pub fn evaluate_checkpoint(ck: &checkpoint::Checkpoint, tokens: &[u32], seq: usize, cp: usize) -> Result<EvalResult> {
    evaluate_checkpoint_on(ck, tokens, seq, cp, None)
}

/// [`evaluate_checkpoint`] on `device` (`--device`); `None`: the device the checkpoint's recipe names
/// (`parallel.backend`).
pub fn evaluate_checkpoint_on(
    ck: &checkpoint::Checkpoint,
    tokens: &[u32],
    seq: usize,
    cp: usize,
    device: Option<Device>,
) -> Result<EvalResult> {
    let mut recipe = checkpoint_recipe(ck)?;
    if let Some(d) = device {
        recipe.parallel.backend = d.to_string();
    }
    let shapes = param_shapes(&recipe.model);
    checkpoint::expect_tensors(&ck.dir.join("model.safetensors"), &ck.model, &shapes)?;
    evaluate_tensors(&recipe, &ck.model, tokens, seq, cp)
}

/// The mean loss of the Hugging Face checkpoint `hf` over `tokens`, as [`evaluate`] cuts them (no document
/// masking: transformers attends over the whole window).
pub fn evaluate_hf(hf: &HfCheckpoint, tokens: &[u32], seq: usize, cp: usize) -> Result<EvalResult> {
    evaluate_hf_on(hf, tokens, seq, cp, None)
}

/// [`evaluate_hf`] on `device` (`--device`; `None`: the CPU).
pub fn evaluate_hf_on(
    hf: &HfCheckpoint,
    tokens: &[u32],
    seq: usize,
    cp: usize,
    device: Option<Device>,
) -> Result<EvalResult> {
    let mut recipe = Recipe::load("tiny-llama", &[])?;
    recipe.parallel.backend = device.unwrap_or_default().to_string();
    recipe.model = ModelConfig { init_std: recipe.model.init_std, ..hf.model().clone() };
    recipe.data.document_masking = false;
    evaluate_tensors(&recipe, &hf.tensors, tokens, seq, cp)
}

/// The mean loss of the model `recipe.model` with weights `tensors` (in [`param_shapes`] order) over `tokens`,
/// as [`evaluate`] computes it, on the device the recipe names (`parallel.backend`).
pub fn evaluate_tensors(
    recipe: &Recipe,
    tensors: &[LoadedTensor],
    tokens: &[u32],
    seq: usize,
    cp: usize,
) -> Result<EvalResult> {
    let mut recipe = recipe.clone();
    recipe.parallel.cp = cp.max(1);
    recipe.parallel.dp = 1;
    recipe.train.seq_len = seq;
    recipe.train.batch = 1;
    // Token ids: whatever made them (a `.npy`, a tokenizer), they are checked against the model's vocabulary
    // below, which may be smaller than the byte tokenizer's (checked where text goes through it).
    recipe.validate()?;
    let shapes = param_shapes(&recipe.model);
    if shapes.len() != tensors.len() || shapes.iter().zip(tensors).any(|((n, d), t)| *n != t.name || *d != t.dims) {
        return Err(TrainError::InvalidArgument {
            name: "tensors".into(),
            detail: format!(
                "the weights ({} tensors) are not the model's {} tensors in order",
                tensors.len(),
                shapes.len()
            ),
        });
    }
    let vocab = recipe.model.vocab;
    if let Some((position, &id)) = tokens.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
        return Err(TrainError::TokenOutOfVocab { id, position, vocab });
    }
    let windows = tokens.len().saturating_sub(1) / seq;
    if windows == 0 {
        return Err(TrainError::InvalidArgument {
            name: "tokens".into(),
            detail: format!("{} tokens are fewer than one window of --seq {seq} plus its last target", tokens.len()),
        });
    }
    let device = recipe.device()?;
    crate::device::check_compiled(device)?;
    let threads = (std::thread::available_parallelism().map_or(1, |n| n.get()) / recipe.parallel.cp).max(1);
    let backends = &crate::device::RankBackends::new(device, threads)?;
    let recipe = &recipe;
    let results = ThreadWorld::try_run(recipe.parallel.cp, |comm| -> Result<EvalResult> {
        let backend = backends.for_rank()?;
        let mut weights = Params::zeros(&*backend, &recipe.model, DType::F32)?;
        for (t, src) in weights.tensors.iter_mut().zip(tensors) {
            backend.upload(t.view_mut(), View::new(&src.data, src.dims.as_slice())?)?;
        }
        let mut model = Model::new(recipe.model.clone(), weights, backend.clone())?;
        model.set_sequence_length(seq)?;
        let cfg = CpConfig { partition: recipe.partition()?, schedule: recipe.schedule()?, scale: None };
        let cp = ContextParallel::new(comm, backend, cfg)?;
        let mut plan = recipe.cp_plan(&cp, seq, DType::F32)?;
        let mut sums = [0.0f64, 0.0];
        for w in 0..windows {
            let seq_tokens = &tokens[w * seq..w * seq + seq + 1];
            let s = window(seq_tokens);
            let (ids, targets, docs) = s.share(plan.positions());
            if recipe.data.document_masking {
                plan.set_documents(&docs)?;
            }
            let l = model.loss(&ids, &targets, recipe.train.loss_chunk, &mut plan)?;
            sums[0] += l.sum;
            sums[1] += l.tokens as f64;
        }
        cp.comm().all_reduce(&mut sums, ReduceOp::Sum)?;
        Ok(EvalResult { loss: sums[0] / sums[1].max(1.0), tokens: sums[1] as usize, windows })
    })?;
    results.into_iter().next().ok_or_else(|| TrainError::Internal("no ranks ran".into()))?
}

/// A window of `n + 1` tokens as `n` inputs and targets; documents end after each end-of-document token.
fn window(t: &[u32]) -> Sequence {
    let n = t.len() - 1;
    let mut docs = Vec::with_capacity(n);
    let mut id = 0;
    for &tok in &t[..n] {
        docs.push(id);
        if tok == EOT {
            id += 1;
        }
    }
    Sequence { inputs: t[..n].to_vec(), targets: t[1..].iter().map(|&x| x as i64).collect(), docs }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A trainer checkpoint of a model whose vocabulary is below the byte tokenizer's (a pretrained model's,
    /// say), without a saved tokenizer: its recipe reads, a `.npy` of ids needs no tokenizer, and text, which
    /// would go through bytes, is refused naming the byte tokenizer.
    #[test]
    fn a_small_vocabulary_refuses_text_through_bytes_but_not_ids() {
        let recipe = Recipe::load("tiny-llama", &["model.vocab=200".into()]).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let ck = checkpoint::Checkpoint {
            dir: dir.path().to_path_buf(),
            step: 1,
            model: Vec::new(),
            optim: Vec::new(),
            state: serde_json::json!({ "recipe": recipe.to_toml() }),
            tokenizer: None,
        };
        assert_eq!(checkpoint_recipe(&ck).unwrap().model.vocab, 200);

        let npy = dir.path().join("ids.npy");
        crate::npy::write_token_ids(&npy, &[1, 199, 0]).unwrap();
        assert_eq!(read_checkpoint_tokens(&ck, &npy).unwrap(), vec![1, 199, 0]);

        let txt = dir.path().join("text.txt");
        std::fs::write(&txt, "plain ASCII, every byte below 200").unwrap();
        let e = read_checkpoint_tokens(&ck, &txt).unwrap_err();
        assert!(
            matches!(&e, TrainError::InvalidField { field, detail } if field == "model.vocab"
                && detail.contains("200 is below the byte tokenizer's 257 tokens")),
            "{e}"
        );
    }
}
