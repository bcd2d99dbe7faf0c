//! Training checkpoints: written atomically, verified on load.
//!
//! This module owns the on-disk layout of a run's checkpoints and nothing else: the caller
//! hands it named f32 tensors (the model's weights, the optimizer's master weights and
//! moments) and a JSON value (the step's schedule, data cursor, RNG state…), and gets the
//! same back, bit for bit. What the tensors mean is the caller's business.
//!
//! ```text
//! OUT/checkpoints/step-00000030/
//!     model.safetensors   the model's weights, f32, under the names the caller gives
//!     optim.safetensors   the optimizer's tensors, f32
//!     tokenizer.json      optional: the run's tokenizer (a run from a pretrained checkpoint that has one)
//!     state.json          {"manifest": {...}, "state": <the caller's JSON>,
//!                          "tokenizer": {"eos_token_id", "bos_token_id"} with tokenizer.json}, written last
//! ```
//!
//! Why it is built this way:
//! - A run killed mid-save (preempted, out of disk, a crash) must never cost the checkpoint it
//!   would resume from. So a save writes into a temporary sibling (`.step-00000030.tmp-<pid>`),
//!   `fsync`s every file and the directory, and only then `rename`s it into place; a rerun that
//!   replaces an existing step moves the old one aside first and deletes it only once the new
//!   one is durably in place. Leftovers of a crash are cleaned (or, for a set-aside checkpoint
//!   whose replacement never landed, restored) by the next save.
//! - A checkpoint that silently loads wrong data is worse than none. So `state.json` carries a
//!   manifest (format version, step, each file's length and CRC-32), and [`load`] checks every
//!   file against it before parsing, naming the file and what is wrong.
//! - The weights are safetensors with the caller's (Hugging Face-style) names, so other tools
//!   can read them; tensors are stored in the order given and come back in that order.
//! - A run that reads its corpus through a pretrained tokenizer saves that tokenizer in each
//!   checkpoint (a file of the manifest like the others), so evaluating or exporting the checkpoint
//!   tokenizes text as training did without the pretrained directory at hand. Checkpoints without
//!   one (byte-level runs, and those written before tokenizers were saved) load as before.
//!
//! One out dir has one writer: a save removes every temporary directory it finds.

use std::collections::HashSet;
use std::fs::{self, File};
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensors};
use serde_json::{json, Value};

use crate::error::{Result, TrainError};

/// The version of the layout [`save`] writes and [`load`] reads (the manifest's `format`).
pub const FORMAT_VERSION: u64 = 1;
/// The directory under a run's out dir that holds its checkpoints.
pub const CHECKPOINTS_DIR: &str = "checkpoints";
/// The model's weights inside a checkpoint directory.
pub const MODEL_FILE: &str = "model.safetensors";
/// The optimizer's tensors inside a checkpoint directory.
pub const OPTIM_FILE: &str = "optim.safetensors";
/// The manifest and the caller's state inside a checkpoint directory; written last.
pub const STATE_FILE: &str = "state.json";
/// The run's tokenizer inside a checkpoint directory, when it has one: Hugging Face's file name and
/// format, so an export copies it as it is.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// The tokenizer a run reads its corpus with, and the special tokens it needs: saved with each
/// checkpoint so that text is tokenized later as training tokenized it.
#[derive(Debug, Clone)]
pub struct SavedTokenizer {
    /// The tokenizer (a Hugging Face `tokenizer.json`, or one built from a GGUF file's vocabulary).
    pub tokenizer: tokenizers::Tokenizer,
    /// The end-of-sequence token, which closes each document of the corpus.
    pub eos_token_id: u32,
    /// The beginning-of-sequence token, when the pretrained checkpoint names one.
    pub bos_token_id: Option<u32>,
}

impl SavedTokenizer {
    /// How the corpus becomes tokens with it: each document closed by the end-of-sequence token.
    pub fn text_tokenizer(&self) -> crate::data::TextTokenizer {
        crate::data::TextTokenizer::Pretrained { tokenizer: Box::new(self.tokenizer.clone()), eot: self.eos_token_id }
    }
}

/// One tensor to save: a name, its dims (row-major), and its values, borrowed (a checkpoint
/// copies nothing but what it writes).
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor<'a> {
    /// The name it is stored under, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: String,
    /// Its dims, outermost first; their product is `data.len()`.
    pub dims: Vec<usize>,
    /// Its values in row-major order.
    pub data: &'a [f32],
}

impl<'a> Tensor<'a> {
    /// A tensor to save.
    pub fn new(name: impl Into<String>, dims: &[usize], data: &'a [f32]) -> Self {
        Tensor { name: name.into(), dims: dims.to_vec(), data }
    }
}

/// One tensor read back from a checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedTensor {
    /// The name it was stored under.
    pub name: String,
    /// Its dims, outermost first.
    pub dims: Vec<usize>,
    /// Its values in row-major order, bit-identical to what was saved.
    pub data: Vec<f32>,
}

/// A verified checkpoint, read back whole.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// The checkpoint's directory (`OUT/checkpoints/step-NNNNNNNN`).
    pub dir: PathBuf,
    /// The step it was saved at.
    pub step: u64,
    /// The model's tensors, in the order they were saved.
    pub model: Vec<LoadedTensor>,
    /// The optimizer's tensors, in the order they were saved.
    pub optim: Vec<LoadedTensor>,
    /// The caller's JSON, as it was saved.
    pub state: Value,
    /// The run's tokenizer, when it saved one.
    pub tokenizer: Option<SavedTokenizer>,
}

impl Checkpoint {
    /// The path of its model file, for errors about its tensors (see [`expect_tensors`]).
    pub fn model_path(&self) -> PathBuf {
        self.dir.join(MODEL_FILE)
    }

    /// The path of its optimizer file, for errors about its tensors.
    pub fn optim_path(&self) -> PathBuf {
        self.dir.join(OPTIM_FILE)
    }
}

/// The name of step `step`'s checkpoint directory: `step-00000030`.
pub fn dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// The step a directory name stands for, if it is exactly what [`dir_name`] writes; anything
/// else (a user's `step-30-good`, a temporary dir) is not ours to read or delete.
fn parse_dir_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let step: u64 = digits.parse().ok()?;
    (dir_name(step) == name).then_some(step)
}

/// Saves step `step`'s checkpoint under `out_dir/checkpoints/` and returns its directory.
///
/// When this returns `Ok` the checkpoint is durably in place (every file and directory
/// `fsync`ed), and all but the newest `keep_last` checkpoints are deleted (by step; the one just
/// written is always kept, so resaving an earlier step does not delete itself). A rerun of an
/// existing step replaces it, and the old one is deleted only once the new one is in place. On
/// `Err` the previous checkpoints are as they were.
///
/// Errors: `keep_last` of 0, a tensor whose dims do not match its data, a duplicate or empty
/// tensor name (`TrainError::InvalidArgument`, naming it), and any I/O failure (`TrainError::Io`, naming
/// the path).
pub fn save(
    out_dir: &Path,
    step: u64,
    model: &[Tensor<'_>],
    optim: &[Tensor<'_>],
    state: &Value,
    keep_last: usize,
) -> Result<PathBuf> {
    save_with_tokenizer(out_dir, step, model, optim, state, keep_last, None)
}

/// [`save`], with the run's tokenizer written into the checkpoint as [`TOKENIZER_FILE`] (listed in
/// the manifest and checked on load like the tensor files) when `tokenizer` is given. A tokenizer
/// that cannot be serialised is a `TrainError::Tokenizer`, before anything is written.
pub fn save_with_tokenizer(
    out_dir: &Path,
    step: u64,
    model: &[Tensor<'_>],
    optim: &[Tensor<'_>],
    state: &Value,
    keep_last: usize,
    tokenizer: Option<&SavedTokenizer>,
) -> Result<PathBuf> {
    if keep_last == 0 {
        return Err(TrainError::InvalidArgument {
            name: "keep_last".into(),
            detail: format!(
                "0: at least the checkpoint being written must be kept (saving step {step} under {})",
                out_dir.display()
            ),
        });
    }
    check_tensors(MODEL_FILE, model)?;
    check_tensors(OPTIM_FILE, optim)?;
    let tokenizer = tokenizer
        .map(|t| -> Result<(String, Value)> {
            // Pretty, as Hugging Face writes it: the file is read by people too.
            let text = t.tokenizer.to_string(true).map_err(|e| TrainError::Tokenizer {
                context: format!("checkpoint {TOKENIZER_FILE}: the tokenizer cannot be serialised"),
                detail: e.to_string(),
            })?;
            Ok((text, json!({ "eos_token_id": t.eos_token_id, "bos_token_id": t.bos_token_id })))
        })
        .transpose()?;

    let root = out_dir.join(CHECKPOINTS_DIR);
    let root_existed = root.is_dir();
    fs::create_dir_all(&root).map_err(|e| TrainError::io(&root, e))?;
    if !root_existed {
        // The new `checkpoints` entry itself must survive a power cut.
        sync_dir(out_dir)?;
    }
    recover(&root)?;

    let name = dir_name(step);
    let pid = std::process::id();
    let tmp = root.join(format!(".{name}.tmp-{pid}"));
    let aside = root.join(format!(".{name}.old-{pid}"));
    let dest = root.join(&name);

    let mut moved_aside = false;
    let contents = Contents { model, optim, state, tokenizer: tokenizer.as_ref().map(|(t, ids)| (t.as_bytes(), ids)) };
    let published = write_and_publish(&root, &tmp, &dest, &aside, step, &contents, &mut moved_aside);
    if let Err(e) = published {
        // Best effort: the error being returned matters more than one about the clean-up,
        // and whatever is left here the next save's `recover` handles the same way.
        if moved_aside && !dest.exists() && fs::rename(&aside, &dest).is_ok() {
            let _ = sync_dir(&root);
        }
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if moved_aside {
        // The new checkpoint is durable; only now may the one it replaces go.
        fs::remove_dir_all(&aside).map_err(|e| TrainError::io(&aside, e))?;
    }
    prune(&root, step, keep_last)?;
    Ok(dest)
}

/// What one checkpoint holds, as [`save_with_tokenizer`] was given it.
struct Contents<'a> {
    model: &'a [Tensor<'a>],
    optim: &'a [Tensor<'a>],
    state: &'a Value,
    /// The serialised tokenizer and its `state.json` section (the special tokens' ids).
    tokenizer: Option<(&'a [u8], &'a Value)>,
}

/// The part of [`save`] that may fail midway; `save` undoes what it left on `Err`.
fn write_and_publish(
    root: &Path,
    tmp: &Path,
    dest: &Path,
    aside: &Path,
    step: u64,
    contents: &Contents<'_>,
    moved_aside: &mut bool,
) -> Result<()> {
    fs::create_dir(tmp).map_err(|e| TrainError::io(tmp, e))?;
    let model_entry = write_safetensors(&tmp.join(MODEL_FILE), contents.model)?;
    fault("model-written")?;
    let optim_entry = write_safetensors(&tmp.join(OPTIM_FILE), contents.optim)?;
    let mut files = serde_json::Map::new();
    files.insert(MODEL_FILE.into(), model_entry.to_json());
    files.insert(OPTIM_FILE.into(), optim_entry.to_json());
    if let Some((bytes, _)) = contents.tokenizer {
        // Before state.json, like the tensors: the checkpoint is published complete or not at all.
        let path = tmp.join(TOKENIZER_FILE);
        write_synced(&path, bytes)?;
        files.insert(TOKENIZER_FILE.into(), FileEntry::of(bytes).to_json());
        fault("tokenizer-written")?;
    }
    let mut doc = json!({
        "manifest": { "format": FORMAT_VERSION, "step": step, "files": files },
        "state": contents.state,
    });
    if let (Some((_, ids)), Some(obj)) = (contents.tokenizer, doc.as_object_mut()) {
        obj.insert("tokenizer".into(), ids.clone());
    }
    let state_path = tmp.join(STATE_FILE);
    let bytes = serde_json::to_vec_pretty(&doc)
        .map_err(|e| TrainError::Internal(format!("{}: cannot encode the state: {e}", state_path.display())))?;
    write_synced(&state_path, &bytes)?;
    sync_dir(tmp)?;
    fault("before-publish")?;

    if dest.exists() {
        // A rerun of this step: `rename` cannot replace a non-empty directory, so the old one
        // steps aside (not deleted: it is the only copy until the new one is in place).
        fs::rename(dest, aside).map_err(|e| TrainError::io(dest, e))?;
        *moved_aside = true;
        sync_dir(root)?;
        fault("after-aside")?;
    }
    fs::rename(tmp, dest).map_err(|e| TrainError::io(tmp, e))?;
    sync_dir(root)
}

/// Cleans up after a save that crashed: a set-aside checkpoint whose replacement is in place is
/// deleted, one whose replacement never landed is put back, and temporary dirs are deleted.
fn recover(root: &Path) -> Result<()> {
    let mut changed = false;
    let mut temps = Vec::new();
    for (name, path) in list_dir(root)? {
        if let Some((step_name, _pid)) = name.strip_prefix('.').and_then(|n| n.split_once(".old-")) {
            if parse_dir_name(step_name).is_none() {
                continue;
            }
            let dest = root.join(step_name);
            if dest.join(STATE_FILE).is_file() {
                fs::remove_dir_all(&path).map_err(|e| TrainError::io(&path, e))?;
            } else if !dest.exists() {
                fs::rename(&path, &dest).map_err(|e| TrainError::io(&path, e))?;
                changed = true;
            }
            // Else both are there and neither is complete: not a state a save leaves; keep both.
        } else if let Some((step_name, _pid)) = name.strip_prefix('.').and_then(|n| n.split_once(".tmp-")) {
            if parse_dir_name(step_name).is_some() {
                temps.push(path);
            }
        }
    }
    if changed {
        sync_dir(root)?;
    }
    for path in temps {
        fs::remove_dir_all(&path).map_err(|e| TrainError::io(&path, e))?;
    }
    Ok(())
}

/// Deletes all but the newest `keep_last` checkpoints, never the one just written (`keep`).
///
/// Only complete checkpoints (with a `state.json`) are ranked: a step directory without one is
/// not something a save leaves, so it is neither counted as kept nor deleted.
fn prune(root: &Path, keep: u64, keep_last: usize) -> Result<()> {
    let mut others: Vec<(u64, PathBuf)> = list_dir(root)?
        .into_iter()
        .filter_map(|(name, path)| Some((parse_dir_name(&name)?, path)))
        .filter(|(step, path)| *step != keep && path.join(STATE_FILE).is_file())
        .collect();
    others.sort_by_key(|(step, _)| std::cmp::Reverse(*step));
    for (_, path) in others.into_iter().skip(keep_last - 1) {
        fs::remove_dir_all(&path).map_err(|e| TrainError::io(&path, e))?;
    }
    Ok(())
}

/// The highest-step complete checkpoint under `out_dir/checkpoints/`, if any.
///
/// Only directories named as [`save`] names them count, and only those whose `state.json`
/// exists (it is written last); temporary and set-aside directories are ignored. A run with no
/// `checkpoints` directory yet has none (`Ok(None)`).
pub fn latest(out_dir: &Path) -> Result<Option<PathBuf>> {
    latest_in(&out_dir.join(CHECKPOINTS_DIR))
}

fn latest_in(root: &Path) -> Result<Option<PathBuf>> {
    if !root.is_dir() {
        return Ok(None);
    }
    let best = list_dir(root)?
        .into_iter()
        .filter_map(|(name, path)| Some((parse_dir_name(&name)?, path)))
        .filter(|(_, path)| path.join(STATE_FILE).is_file())
        .max_by_key(|(step, _)| *step);
    Ok(best.map(|(_, path)| path))
}

/// Loads and verifies a checkpoint.
///
/// `dir` is one checkpoint directory, or a run's out dir (then its [`latest`] checkpoint), or
/// the `checkpoints` directory itself. Every file is checked against the manifest before it is
/// parsed; a missing, truncated or corrupt file, a malformed manifest or safetensors header, or
/// a tensor that is not f32 is a `TrainError::Checkpoint` naming the file and the field or
/// tensor.
pub fn load(dir: &Path) -> Result<Checkpoint> {
    let StateDoc { dir, path: state_path, doc, step } = read_state(dir)?;
    let manifest = &doc["manifest"];
    let model = parse_safetensors(&dir.join(MODEL_FILE), &read_verified(&dir, &state_path, manifest, MODEL_FILE)?)?;
    let optim = parse_safetensors(&dir.join(OPTIM_FILE), &read_verified(&dir, &state_path, manifest, OPTIM_FILE)?)?;
    let tokenizer = read_tokenizer(&dir, &state_path, &doc)?;
    let state = doc.get("state").cloned().ok_or_else(|| bad(&state_path, "no `state` field"))?;
    Ok(Checkpoint { dir, step, model, optim, state, tokenizer })
}

/// The tokenizer of the checkpoint `dir` (as [`load`] finds it), verified as [`load`] verifies it,
/// without reading the tensors: what a resumed run needs before it reads its corpus.
pub fn load_tokenizer(dir: &Path) -> Result<Option<SavedTokenizer>> {
    let StateDoc { dir, path, doc, .. } = read_state(dir)?;
    read_tokenizer(&dir, &path, &doc)
}

/// A checkpoint's `state.json`, parsed, its manifest's format and step checked.
struct StateDoc {
    /// The checkpoint directory.
    dir: PathBuf,
    /// Its `state.json`.
    path: PathBuf,
    doc: Value,
    step: u64,
}

fn read_state(dir: &Path) -> Result<StateDoc> {
    let dir = resolve(dir)?;
    let state_path = dir.join(STATE_FILE);
    let text = match fs::read(&state_path) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(bad(&state_path, "missing: the save that wrote this directory did not finish"))
        }
        Err(e) => return Err(TrainError::io(&state_path, e)),
    };
    let doc: Value = serde_json::from_slice(&text).map_err(|e| bad(&state_path, format!("not valid JSON: {e}")))?;
    let manifest = doc.get("manifest").ok_or_else(|| bad(&state_path, "no `manifest` field"))?;
    let format = field_u64(&state_path, manifest, "manifest.format")?;
    if format != FORMAT_VERSION {
        return Err(bad(&state_path, format!("manifest.format is {format}; this build reads format {FORMAT_VERSION}")));
    }
    let step = field_u64(&state_path, manifest, "manifest.step")?;
    if let Some(named) = dir.file_name().and_then(|n| n.to_str()).and_then(parse_dir_name) {
        if named != step {
            return Err(bad(
                &state_path,
                format!("manifest.step is {step} but the directory is named for step {named}"),
            ));
        }
    }
    Ok(StateDoc { dir, path: state_path, doc, step })
}

/// The tokenizer the manifest lists, checked against its entry, parsed, with its special tokens'
/// ids from the `tokenizer` section (each one the tokenizer has). None when the manifest lists
/// none: the run had no tokenizer, or the checkpoint predates saving one.
fn read_tokenizer(dir: &Path, state_path: &Path, doc: &Value) -> Result<Option<SavedTokenizer>> {
    let manifest = &doc["manifest"];
    if manifest.get("files").and_then(|f| f.get(TOKENIZER_FILE)).is_none() {
        return Ok(None);
    }
    let path = dir.join(TOKENIZER_FILE);
    let bytes = read_verified(dir, state_path, manifest, TOKENIZER_FILE)?;
    let tokenizer =
        tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| bad(&path, format!("not a usable tokenizer: {e}")))?;
    let ids = doc.get("tokenizer").ok_or_else(|| {
        bad(state_path, format!("no `tokenizer` field, though manifest.files lists {TOKENIZER_FILE}"))
    })?;
    let id = |field: &str| -> Result<Option<u32>> {
        let name = format!("tokenizer.{field}");
        let Some(v) = ids.get(field).filter(|v| !v.is_null()) else { return Ok(None) };
        let id = v
            .as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(|| bad(state_path, format!("{name} is {v}, not a token id")))?;
        if tokenizer.id_to_token(id).is_none() {
            return Err(bad(state_path, format!("{name} is {id}, a token {TOKENIZER_FILE} does not have")));
        }
        Ok(Some(id))
    };
    let eos_token_id =
        id("eos_token_id")?.ok_or_else(|| bad(state_path, "tokenizer.eos_token_id is missing or not a token id"))?;
    let bos_token_id = id("bos_token_id")?;
    Ok(Some(SavedTokenizer { tokenizer, eos_token_id, bos_token_id }))
}

/// Which checkpoint directory `load(dir)` means.
fn resolve(dir: &Path) -> Result<PathBuf> {
    if dir.join(STATE_FILE).is_file() {
        return Ok(dir.to_path_buf());
    }
    let is_step_dir = dir.file_name().and_then(|n| n.to_str()).and_then(parse_dir_name).is_some();
    if !is_step_dir {
        let root = dir.join(CHECKPOINTS_DIR);
        // A run's out dir, or its `checkpoints` directory.
        for root in [root.as_path(), dir] {
            if let Some(found) = latest_in(root)? {
                return Ok(found);
            }
        }
        if root.is_dir() {
            return Err(bad(&root, "no complete checkpoint (no step-NNNNNNNN directory with a state.json)"));
        }
    }
    Err(bad(
        &dir.join(STATE_FILE),
        "missing: not a checkpoint directory, nor a run's out dir with a checkpoint under checkpoints/",
    ))
}

/// Reads `file` of checkpoint `dir` and checks it against its manifest entry (length, then CRC-32).
fn read_verified(dir: &Path, state_path: &Path, manifest: &Value, file: &str) -> Result<Vec<u8>> {
    let entry = manifest
        .get("files")
        .and_then(|files| files.get(file))
        .ok_or_else(|| bad(state_path, format!("manifest.files has no entry for {file}")))?;
    let want_len = field_u64(state_path, entry, &format!("manifest.files.{file}.bytes"))?;
    let crc_field = format!("manifest.files.{file}.crc32");
    let want_crc = entry
        .get("crc32")
        .and_then(Value::as_str)
        .and_then(|s| u32::from_str_radix(s, 16).ok())
        .ok_or_else(|| bad(state_path, format!("{crc_field} is missing or not a hex CRC-32")))?;

    let path = dir.join(file);
    let bytes = match read_file(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(bad(&path, "missing (the manifest lists it)"));
        }
        Err(e) => return Err(TrainError::io(&path, e)),
    };
    let got_len = bytes.len() as u64;
    if got_len < want_len {
        return Err(bad(&path, format!("truncated: {got_len} bytes, the manifest says {want_len}")));
    }
    if got_len > want_len {
        return Err(bad(&path, format!("{got_len} bytes, longer than the manifest's {want_len}")));
    }
    let got_crc = crc32fast::hash(&bytes);
    if got_crc != want_crc {
        return Err(bad(
            &path,
            format!("corrupt: CRC-32 is {got_crc:08x}, the manifest says {want_crc:08x} ({crc_field})"),
        ));
    }
    Ok(bytes)
}

/// Parses a safetensors file whose every tensor must be f32, in the file's (= saved) order.
fn parse_safetensors(path: &Path, bytes: &[u8]) -> Result<Vec<LoadedTensor>> {
    let (header_len, metadata) =
        SafeTensors::read_metadata(bytes).map_err(|e| bad(path, format!("not a valid safetensors file: {e}")))?;
    let data = &bytes[8 + header_len..];
    let mut tensors = Vec::new();
    for name in metadata.offset_keys() {
        let Some(info) = metadata.info(&name) else {
            return Err(bad(path, format!("tensor `{name}` is listed without its info")));
        };
        if info.dtype != Dtype::F32 {
            return Err(bad(path, format!("tensor `{name}` is {:?}; checkpoints hold F32 only", info.dtype)));
        }
        let (start, end) = info.data_offsets;
        // `read_metadata` checked the offsets tile the data exactly; `get` keeps that a
        // checked fact here rather than a trusted one.
        let raw = data.get(start..end).ok_or_else(|| bad(path, format!("tensor `{name}`: offsets out of range")))?;
        let values = raw.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        tensors.push(LoadedTensor { name, dims: info.shape.clone(), data: values });
    }
    Ok(tensors)
}

/// Checks that a checkpoint file's tensors are exactly the ones a model wants, of the dims it
/// wants (`want` is `(name, dims)`, in any order).
///
/// The error, a `TrainError::Checkpoint` on `ckpt_file`, lists every problem: a wanted tensor
/// that is missing, one whose dims differ (naming both), and one the model has no place for.
pub fn expect_tensors(ckpt_file: &Path, got: &[LoadedTensor], want: &[(String, Vec<usize>)]) -> Result<()> {
    let mut problems = Vec::new();
    for (name, dims) in want {
        match got.iter().find(|t| &t.name == name) {
            None => problems.push(format!("tensor `{name}` is missing (the model wants dims {dims:?})")),
            Some(t) if &t.dims != dims => {
                problems.push(format!("tensor `{name}` has dims {:?}, the model wants {dims:?}", t.dims))
            }
            Some(_) => {}
        }
    }
    let wanted: HashSet<&str> = want.iter().map(|(name, _)| name.as_str()).collect();
    for t in got.iter().filter(|t| !wanted.contains(t.name.as_str())) {
        problems.push(format!("tensor `{}` (dims {:?}) is not one the model has", t.name, t.dims));
    }
    if problems.is_empty() {
        return Ok(());
    }
    // A wrong config can mismatch hundreds of tensors; the first few say what happened.
    const SHOWN: usize = 8;
    let more = problems.len().saturating_sub(SHOWN);
    let mut detail = problems.into_iter().take(SHOWN).collect::<Vec<_>>().join("; ");
    if more > 0 {
        detail.push_str(&format!("; and {more} more"));
    }
    Err(bad(ckpt_file, detail))
}

/// Refuses, before anything is written, tensors that cannot be saved as given.
fn check_tensors(file: &str, tensors: &[Tensor<'_>]) -> Result<()> {
    let mut seen = HashSet::new();
    for t in tensors {
        let which = format!("checkpoint {file}: tensor `{}`", t.name);
        if t.name.is_empty() || t.name == "__metadata__" {
            return Err(TrainError::InvalidArgument { name: which, detail: "not a usable tensor name".into() });
        }
        if !seen.insert(t.name.as_str()) {
            return Err(TrainError::InvalidArgument { name: which, detail: "given twice".into() });
        }
        let count = t.dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        if count != Some(t.data.len()) {
            return Err(TrainError::InvalidArgument {
                name: which,
                detail: format!("dims {:?} do not hold the {} values given", t.dims, t.data.len()),
            });
        }
    }
    Ok(())
}

/// A written file's manifest entry.
struct FileEntry {
    bytes: u64,
    crc32: u32,
}

impl FileEntry {
    /// The entry of a file whose bytes are `bytes`.
    fn of(bytes: &[u8]) -> Self {
        FileEntry { bytes: bytes.len() as u64, crc32: crc32fast::hash(bytes) }
    }

    fn to_json(&self) -> Value {
        json!({ "bytes": self.bytes, "crc32": format!("{:08x}", self.crc32) })
    }
}

/// A writer that counts and checksums what passes through, so a file is hashed as it is
/// written rather than read back.
struct Hashing<W> {
    inner: W,
    crc: crc32fast::Hasher,
    bytes: u64,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.crc.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Writes `tensors` as a safetensors file at `path` (streamed, in the order given), `fsync`ed.
fn write_safetensors(path: &Path, tensors: &[Tensor<'_>]) -> Result<FileEntry> {
    let header = safetensors_header(tensors).map_err(|e| bad(path, format!("cannot build the header: {e}")))?;
    let file = File::create_new(path).map_err(|e| TrainError::io(path, e))?;
    let mut w = Hashing { inner: BufWriter::with_capacity(1 << 20, file), crc: crc32fast::Hasher::new(), bytes: 0 };
    let io = |e| TrainError::io(path, e);
    w.write_all(&(header.len() as u64).to_le_bytes()).map_err(io)?;
    w.write_all(&header).map_err(io)?;
    for t in tensors {
        write_f32_le(&mut w, t.data).map_err(io)?;
    }
    let Hashing { inner, crc, bytes } = w;
    let file = inner.into_inner().map_err(|e| TrainError::io(path, e.into_error()))?;
    file.sync_all().map_err(io)?;
    Ok(FileEntry { bytes, crc32: crc.finalize() })
}

/// The safetensors header for `tensors` laid out back to back in the order given, padded to
/// 8 bytes with spaces as the format asks. Built with the crate's own `Metadata` so the format
/// details stay the crate's.
fn safetensors_header(tensors: &[Tensor<'_>]) -> std::result::Result<Vec<u8>, safetensors::SafeTensorError> {
    let mut offset = 0;
    let infos = tensors
        .iter()
        .map(|t| {
            let n = t.data.len() * 4;
            let info = TensorInfo { dtype: Dtype::F32, shape: t.dims.clone(), data_offsets: (offset, offset + n) };
            offset += n;
            (t.name.clone(), info)
        })
        .collect();
    let metadata = Metadata::new(None, infos)?;
    let mut header = serde_json::to_vec(&metadata)?;
    header.resize(header.len().next_multiple_of(8), b' ');
    Ok(header)
}

fn write_f32_le(w: &mut impl Write, data: &[f32]) -> io::Result<()> {
    if cfg!(target_endian = "little") {
        w.write_all(bytemuck::cast_slice(data))
    } else {
        for chunk in data.chunks(1 << 14) {
            let le: Vec<u8> = chunk.iter().flat_map(|x| x.to_le_bytes()).collect();
            w.write_all(&le)?;
        }
        Ok(())
    }
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut file = File::create_new(path).map_err(|e| TrainError::io(path, e))?;
    file.write_all(bytes).map_err(|e| TrainError::io(path, e))?;
    file.sync_all().map_err(|e| TrainError::io(path, e))
}

fn read_file(path: &Path) -> io::Result<Vec<u8>> {
    let mut file = File::open(path)?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// Makes a directory's entries (a created file, a rename) durable.
fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| TrainError::io(dir, e))?;
    // Elsewhere a directory cannot be opened for fsync; the renames are as durable as the
    // platform makes them.
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// The entries of `dir` whose names are UTF-8 (ours all are), with their paths.
fn list_dir(dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| TrainError::io(dir, e))? {
        let entry = entry.map_err(|e| TrainError::io(dir, e))?;
        if let Ok(name) = entry.file_name().into_string() {
            out.push((name, entry.path()));
        }
    }
    Ok(out)
}

fn field_u64(path: &Path, obj: &Value, field: &str) -> Result<u64> {
    let key = field.rsplit('.').next().unwrap_or(field);
    obj.get(key)
        .and_then(Value::as_u64)
        .ok_or_else(|| bad(path, format!("{field} is missing or not an unsigned integer")))
}

fn bad(path: &Path, detail: impl Into<String>) -> TrainError {
    TrainError::Checkpoint { path: path.to_path_buf(), detail: detail.into() }
}

#[cfg(test)]
thread_local! {
    /// The stage at which the next save on this thread fails, for the crash tests.
    static FAIL_AT: std::cell::Cell<Option<&'static str>> = const { std::cell::Cell::new(None) };
}

/// A failure injected by the tests at `stage`; nothing outside tests.
fn fault(stage: &'static str) -> Result<()> {
    #[cfg(test)]
    if FAIL_AT.with(|f| f.get()) == Some(stage) {
        return Err(TrainError::io(stage, io::Error::other(format!("injected failure at {stage}"))));
    }
    let _ = stage;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Owned tensors to save, so tests can build them in a loop.
    struct Owned {
        name: String,
        dims: Vec<usize>,
        data: Vec<f32>,
    }

    impl Owned {
        fn new(name: &str, dims: &[usize], seed: u32) -> Self {
            let n = dims.iter().product();
            // Varied bit patterns, not just round numbers.
            let data =
                (0..n).map(|i| f32::from_bits(0x3f00_0000 ^ (seed.wrapping_mul(2_654_435_761) ^ i as u32))).collect();
            Owned { name: name.to_string(), dims: dims.to_vec(), data }
        }

        fn view(&self) -> Tensor<'_> {
            Tensor::new(self.name.as_str(), &self.dims, &self.data)
        }
    }

    fn views(ts: &[Owned]) -> Vec<Tensor<'_>> {
        ts.iter().map(Owned::view).collect()
    }

    fn model(seed: u32) -> Vec<Owned> {
        vec![
            Owned::new("model.embed_tokens.weight", &[16, 8], seed),
            Owned::new("model.layers.0.self_attn.q_proj.weight", &[8, 8], seed + 1),
            Owned::new("model.norm.weight", &[8], seed + 2),
            Owned::new("lm_head.weight", &[16, 8], seed + 3),
        ]
    }

    fn optim(seed: u32) -> Vec<Owned> {
        vec![Owned::new("exp_avg.model.norm.weight", &[8], seed + 10), Owned::new("step_scalar", &[], seed + 11)]
    }

    fn save_step(out: &Path, step: u64, keep_last: usize) -> Result<PathBuf> {
        let (m, o) = (model(step as u32), optim(step as u32));
        save(out, step, &views(&m), &views(&o), &json!({"step": step, "lr": 1e-3}), keep_last)
    }

    fn assert_same(got: &[LoadedTensor], want: &[Owned]) {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert_eq!(g.name, w.name);
            assert_eq!(g.dims, w.dims);
            let gb: Vec<u32> = g.data.iter().map(|x| x.to_bits()).collect();
            let wb: Vec<u32> = w.data.iter().map(|x| x.to_bits()).collect();
            assert_eq!(gb, wb, "tensor {}", w.name);
        }
    }

    fn assert_step_intact(dir: &Path, step: u64) {
        let c = load(dir).unwrap();
        assert_eq!(c.step, step);
        assert_same(&c.model, &model(step as u32));
        assert_same(&c.optim, &optim(step as u32));
    }

    fn entries(root: &Path) -> Vec<String> {
        let mut names: Vec<String> = list_dir(root).unwrap().into_iter().map(|(n, _)| n).collect();
        names.sort();
        names
    }

    fn detail(e: TrainError) -> (PathBuf, String) {
        match e {
            TrainError::Checkpoint { path, detail } => (path, detail),
            other => panic!("expected a checkpoint error, got {other:?}"),
        }
    }

    #[test]
    fn round_trip_is_bit_exact_and_in_order() {
        let tmp = tempfile::tempdir().unwrap();
        let mut m = model(7);
        // The awkward values: NaN payloads, signed zero, infinities, subnormals.
        m[2].data = vec![
            f32::from_bits(0x7fc0_1234),
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::from_bits(1),
            0.0,
            1.0,
            -1.5,
        ];
        let o = optim(7);
        let state = json!({"data": {"cursor": 12345}, "rng": [1, 2, 3], "note": "é"});
        let dir = save(tmp.path(), 30, &views(&m), &views(&o), &state, 3).unwrap();
        assert_eq!(dir, tmp.path().join("checkpoints/step-00000030"));

        for from in [dir.as_path(), tmp.path(), &tmp.path().join(CHECKPOINTS_DIR)] {
            let c = load(from).unwrap();
            assert_eq!(c.dir, dir);
            assert_eq!(c.step, 30);
            assert_same(&c.model, &m);
            assert_same(&c.optim, &o);
            assert_eq!(c.state, state);
        }
        // Nothing but the checkpoint is left behind.
        assert_eq!(entries(&tmp.path().join(CHECKPOINTS_DIR)), ["step-00000030"]);
        // Other tools can read the weights.
        let bytes = fs::read(dir.join(MODEL_FILE)).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("model.norm.weight").unwrap().shape(), [8]);
    }

    #[test]
    fn keeps_the_last_k_by_step() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join(CHECKPOINTS_DIR);
        // Directories that are not ours to delete.
        fs::create_dir_all(root.join("step-30-good")).unwrap();
        fs::create_dir_all(root.join("step-7")).unwrap();
        // Not a checkpoint (no state.json): neither counted among the kept nor deleted.
        fs::create_dir_all(root.join("step-00000099")).unwrap();
        for step in [10, 20, 30, 40, 50] {
            save_step(tmp.path(), step, 2).unwrap();
        }
        assert_eq!(entries(&root), ["step-00000040", "step-00000050", "step-00000099", "step-30-good", "step-7"]);
        assert_eq!(latest(tmp.path()).unwrap(), Some(root.join("step-00000050")));
        assert_step_intact(&root.join("step-00000040"), 40);

        // Resaving an earlier step (a run resumed from it) keeps it, and the newest other one.
        save_step(tmp.path(), 30, 2).unwrap();
        assert_eq!(entries(&root), ["step-00000030", "step-00000050", "step-00000099", "step-30-good", "step-7"]);

        let e = save_step(tmp.path(), 60, 0).unwrap_err();
        assert!(matches!(e, TrainError::InvalidArgument { ref name, .. } if name == "keep_last"), "{e}");
    }

    #[test]
    fn a_rerun_replaces_the_step() {
        let tmp = tempfile::tempdir().unwrap();
        save_step(tmp.path(), 10, 3).unwrap();
        let (m, o) = (model(99), optim(99));
        let dir = save(tmp.path(), 10, &views(&m), &views(&o), &json!("rerun"), 3).unwrap();
        let c = load(&dir).unwrap();
        assert_same(&c.model, &m);
        assert_eq!(c.state, json!("rerun"));
        assert_eq!(entries(&tmp.path().join(CHECKPOINTS_DIR)), ["step-00000010"]);
    }

    #[test]
    fn a_save_that_fails_midway_leaves_the_previous_checkpoint() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join(CHECKPOINTS_DIR);
        save_step(tmp.path(), 10, 1).unwrap();
        save_step(tmp.path(), 20, 1).unwrap();
        for stage in ["model-written", "before-publish"] {
            FAIL_AT.with(|f| f.set(Some(stage)));
            let e = save_step(tmp.path(), 30, 1).unwrap_err();
            FAIL_AT.with(|f| f.set(None));
            assert!(e.to_string().contains(stage), "{e}");
            assert_eq!(entries(&root), ["step-00000020"], "after a failure at {stage}");
            assert_eq!(latest(tmp.path()).unwrap(), Some(root.join("step-00000020")));
            assert_step_intact(tmp.path(), 20);
        }
        // A rerun of step 20 that fails between setting the old one aside and publishing the
        // new one puts the old one back.
        FAIL_AT.with(|f| f.set(Some("after-aside")));
        let e = save(tmp.path(), 20, &views(&model(5)), &views(&optim(5)), &json!(null), 1).unwrap_err();
        FAIL_AT.with(|f| f.set(None));
        assert!(e.to_string().contains("after-aside"), "{e}");
        assert_eq!(entries(&root), ["step-00000020"]);
        assert_step_intact(tmp.path(), 20);
    }

    #[test]
    fn the_next_save_cleans_up_after_a_crash() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join(CHECKPOINTS_DIR);
        save_step(tmp.path(), 10, 5).unwrap();
        // What a crash leaves: a half-written temp dir, a complete one never renamed, and a
        // set-aside step 10 whose replacement never landed (so step-00000010 is gone).
        let half = root.join(".step-00000020.tmp-4242");
        fs::create_dir(&half).unwrap();
        fs::write(half.join(MODEL_FILE), b"\x10\0\0").unwrap();
        let whole = root.join(".step-00000030.tmp-4243");
        fs::create_dir(&whole).unwrap();
        for f in [MODEL_FILE, OPTIM_FILE, STATE_FILE] {
            fs::copy(root.join("step-00000010").join(f), whole.join(f)).unwrap();
        }
        fs::rename(root.join("step-00000010"), root.join(".step-00000010.old-4244")).unwrap();
        // A step directory whose save never wrote its state.json is not a checkpoint.
        fs::create_dir(root.join("step-00000090")).unwrap();

        assert_eq!(latest(tmp.path()).unwrap(), None, "temp and set-aside dirs are not checkpoints");
        let (path, msg) = detail(load(&root.join("step-00000090")).unwrap_err());
        assert_eq!(path, root.join("step-00000090").join(STATE_FILE));
        assert!(msg.contains("missing"), "{msg}");

        save_step(tmp.path(), 40, 5).unwrap();
        assert_eq!(entries(&root), ["step-00000010", "step-00000040", "step-00000090"]);
        assert_step_intact(&root.join("step-00000010"), 10);
        assert_eq!(latest(tmp.path()).unwrap(), Some(root.join("step-00000040")));
    }

    #[test]
    fn a_truncated_file_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = save_step(tmp.path(), 10, 1).unwrap();
        let path = dir.join(OPTIM_FILE);
        let len = fs::metadata(&path).unwrap().len();
        File::options().write(true).open(&path).unwrap().set_len(len - 5).unwrap();
        let (got, msg) = detail(load(&dir).unwrap_err());
        assert_eq!(got, path);
        assert!(msg.contains("truncated") && msg.contains(&(len - 5).to_string()), "{msg}");
    }

    #[test]
    fn a_flipped_byte_fails_the_checksum() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = save_step(tmp.path(), 10, 1).unwrap();
        let path = dir.join(MODEL_FILE);
        let mut bytes = fs::read(&path).unwrap();
        let last = bytes.len() - 3;
        bytes[last] ^= 0x01;
        fs::write(&path, &bytes).unwrap();
        let (got, msg) = detail(load(&dir).unwrap_err());
        assert_eq!(got, path);
        assert!(msg.contains("CRC-32") && msg.contains("crc32"), "{msg}");
    }

    #[test]
    fn a_missing_file_or_manifest_field_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = save_step(tmp.path(), 10, 1).unwrap();
        fs::remove_file(dir.join(MODEL_FILE)).unwrap();
        let (got, msg) = detail(load(&dir).unwrap_err());
        assert_eq!(got, dir.join(MODEL_FILE));
        assert!(msg.contains("missing"), "{msg}");

        let dir = save_step(tmp.path(), 20, 1).unwrap();
        let state_path = dir.join(STATE_FILE);
        let mut doc: Value = serde_json::from_slice(&fs::read(&state_path).unwrap()).unwrap();
        doc["manifest"]["files"][OPTIM_FILE].as_object_mut().unwrap().remove("bytes");
        fs::write(&state_path, serde_json::to_vec(&doc).unwrap()).unwrap();
        let (got, msg) = detail(load(&dir).unwrap_err());
        assert_eq!(got, state_path);
        assert!(msg.contains("manifest.files.optim.safetensors.bytes"), "{msg}");

        doc["manifest"]["format"] = json!(2);
        fs::write(&state_path, serde_json::to_vec(&doc).unwrap()).unwrap();
        let (_, msg) = detail(load(&dir).unwrap_err());
        assert!(msg.contains("manifest.format is 2"), "{msg}");

        fs::write(&state_path, b"{\"manifest\": ").unwrap();
        let (got, msg) = detail(load(&dir).unwrap_err());
        assert_eq!(got, state_path);
        assert!(msg.contains("not valid JSON"), "{msg}");

        let (got, msg) = detail(load(&tmp.path().join("nowhere")).unwrap_err());
        assert_eq!(got, tmp.path().join("nowhere").join(STATE_FILE));
        assert!(msg.contains("not a checkpoint directory"), "{msg}");
    }

    /// Rewrites a checkpoint file and its manifest entry, as a valid but foreign file would be.
    fn replace_file(dir: &Path, file: &str, bytes: &[u8]) {
        fs::write(dir.join(file), bytes).unwrap();
        let state_path = dir.join(STATE_FILE);
        let mut doc: Value = serde_json::from_slice(&fs::read(&state_path).unwrap()).unwrap();
        doc["manifest"]["files"][file] =
            FileEntry { bytes: bytes.len() as u64, crc32: crc32fast::hash(bytes) }.to_json();
        fs::write(&state_path, serde_json::to_vec(&doc).unwrap()).unwrap();
    }

    #[test]
    fn a_bad_safetensors_file_or_dtype_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = save_step(tmp.path(), 10, 1).unwrap();
        replace_file(&dir, MODEL_FILE, b"\x08\0\0\0\0\0\0\0not json");
        let (got, msg) = detail(load(&dir).unwrap_err());
        assert_eq!(got, dir.join(MODEL_FILE));
        assert!(msg.contains("not a valid safetensors file"), "{msg}");

        let bf16 = safetensors::tensor::TensorView::new(Dtype::BF16, vec![2], &[0u8; 4]).unwrap();
        let bytes = safetensors::serialize([("model.norm.weight", bf16)], None).unwrap();
        replace_file(&dir, MODEL_FILE, &bytes);
        let (got, msg) = detail(load(&dir).unwrap_err());
        assert_eq!(got, dir.join(MODEL_FILE));
        assert!(msg.contains("`model.norm.weight`") && msg.contains("BF16"), "{msg}");
    }

    /// The Llama fixture's byte-level BPE tokenizer (`<s>` 1, `</s>` 2).
    fn fixture_tokenizer() -> SavedTokenizer {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama/tokenizer.json");
        let tokenizer = tokenizers::Tokenizer::from_file(path).unwrap();
        SavedTokenizer { tokenizer, eos_token_id: 2, bos_token_id: Some(1) }
    }

    fn save_with_fixture_tokenizer(out: &Path, step: u64) -> PathBuf {
        let (m, o) = (model(step as u32), optim(step as u32));
        let tok = fixture_tokenizer();
        save_with_tokenizer(out, step, &views(&m), &views(&o), &json!({"step": step}), 5, Some(&tok)).unwrap()
    }

    #[test]
    fn a_tokenizer_is_saved_listed_and_loaded() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = save_with_fixture_tokenizer(tmp.path(), 10);
        let want = fixture_tokenizer();
        let c = load(&dir).unwrap();
        assert_same(&c.model, &model(10));
        let t = c.tokenizer.unwrap();
        assert_eq!((t.eos_token_id, t.bos_token_id), (2, Some(1)));
        let text = "A checkpoint carries the run's tokenizer.";
        let ids = |t: &tokenizers::Tokenizer| t.encode(text, true).unwrap().get_ids().to_vec();
        assert_eq!(ids(&t.tokenizer), ids(&want.tokenizer));
        let doc: Value = serde_json::from_slice(&fs::read(dir.join(STATE_FILE)).unwrap()).unwrap();
        let entry = &doc["manifest"]["files"][TOKENIZER_FILE];
        assert_eq!(entry["bytes"].as_u64(), Some(fs::metadata(dir.join(TOKENIZER_FILE)).unwrap().len()));
        let found = load_tokenizer(tmp.path()).unwrap().unwrap();
        assert_eq!(ids(&found.tokenizer), ids(&want.tokenizer));

        // A checkpoint without one (a byte-level run, or one saved before tokenizers were) has none.
        let plain = save_step(tmp.path(), 20, 5).unwrap();
        assert!(load(&plain).unwrap().tokenizer.is_none() && !plain.join(TOKENIZER_FILE).exists());
        assert!(load_tokenizer(&plain).unwrap().is_none());

        // A save that fails once the tokenizer is written leaves nothing of itself behind.
        FAIL_AT.with(|f| f.set(Some("tokenizer-written")));
        let (m, o) = (model(30), optim(30));
        let e = save_with_tokenizer(tmp.path(), 30, &views(&m), &views(&o), &json!({}), 5, Some(&want)).unwrap_err();
        FAIL_AT.with(|f| f.set(None));
        assert!(e.to_string().contains("tokenizer-written"), "{e}");
        assert_eq!(entries(&tmp.path().join(CHECKPOINTS_DIR)), ["step-00000010", "step-00000020"]);
    }

    #[test]
    fn a_bad_tokenizer_or_token_id_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = save_with_fixture_tokenizer(tmp.path(), 10);
        let path = dir.join(TOKENIZER_FILE);
        let mut bytes = fs::read(&path).unwrap();
        bytes[100] ^= 0x01;
        fs::write(&path, &bytes).unwrap();
        let (got, msg) = detail(load(&dir).unwrap_err());
        assert_eq!(got, path);
        assert!(msg.contains("CRC-32") && msg.contains("manifest.files.tokenizer.json.crc32"), "{msg}");
        let (got, _) = detail(load_tokenizer(&dir).unwrap_err());
        assert_eq!(got, path);

        // Listed and intact, but not a tokenizer.
        replace_file(&dir, TOKENIZER_FILE, b"{\"model\": 3}");
        let (got, msg) = detail(load(&dir).unwrap_err());
        assert_eq!(got, path);
        assert!(msg.contains("not a usable tokenizer"), "{msg}");

        // The special tokens' ids: missing, or not tokens of the tokenizer.
        let dir = save_with_fixture_tokenizer(tmp.path(), 20);
        let state_path = dir.join(STATE_FILE);
        let mut doc: Value = serde_json::from_slice(&fs::read(&state_path).unwrap()).unwrap();
        for (edit, needle) in [
            (json!({"bos_token_id": 1}), "tokenizer.eos_token_id is missing"),
            (json!({"eos_token_id": 2, "bos_token_id": 99999}), "tokenizer.bos_token_id is 99999"),
            (json!({"eos_token_id": "2"}), "tokenizer.eos_token_id is \"2\""),
        ] {
            doc["tokenizer"] = edit;
            fs::write(&state_path, serde_json::to_vec(&doc).unwrap()).unwrap();
            let (got, msg) = detail(load(&dir).unwrap_err());
            assert_eq!(got, state_path);
            assert!(msg.contains(needle), "{msg}");
        }
        doc.as_object_mut().unwrap().remove("tokenizer");
        fs::write(&state_path, serde_json::to_vec(&doc).unwrap()).unwrap();
        let (_, msg) = detail(load(&dir).unwrap_err());
        assert!(msg.contains("no `tokenizer` field"), "{msg}");
    }

    #[test]
    fn expect_tensors_names_the_tensor_and_both_dims() {
        let file = Path::new("out/checkpoints/step-00000010/model.safetensors");
        let got = vec![
            LoadedTensor { name: "a.weight".into(), dims: vec![4, 8], data: vec![0.0; 32] },
            LoadedTensor { name: "b.weight".into(), dims: vec![8], data: vec![0.0; 8] },
        ];
        let want = |specs: &[(&str, &[usize])]| -> Vec<(String, Vec<usize>)> {
            specs.iter().map(|(n, d)| (n.to_string(), d.to_vec())).collect()
        };
        expect_tensors(file, &got, &want(&[("b.weight", &[8]), ("a.weight", &[4, 8])])).unwrap();

        let (path, msg) =
            detail(expect_tensors(file, &got, &want(&[("a.weight", &[4, 16]), ("b.weight", &[8])])).unwrap_err());
        assert_eq!(path, file);
        assert!(msg.contains("`a.weight` has dims [4, 8], the model wants [4, 16]"), "{msg}");

        let wanted = want(&[("a.weight", &[4, 8]), ("b.weight", &[8]), ("c.bias", &[3])]);
        let (_, msg) = detail(expect_tensors(file, &got, &wanted).unwrap_err());
        assert!(msg.contains("`c.bias` is missing"), "{msg}");

        let (_, msg) = detail(expect_tensors(file, &got, &want(&[("a.weight", &[4, 8])])).unwrap_err());
        assert!(msg.contains("`b.weight` (dims [8]) is not one the model has"), "{msg}");
    }

    #[test]
    fn tensors_that_cannot_be_saved_are_refused_before_writing() {
        let tmp = tempfile::tempdir().unwrap();
        let data = [0.0f32; 5];
        for (tensors, needle) in [
            (vec![Tensor::new("x", &[2, 3], &data)], "dims [2, 3] do not hold the 5 values"),
            (vec![Tensor::new("x", &[5], &data), Tensor::new("x", &[5], &data)], "given twice"),
            (vec![Tensor::new("", &[5], &data)], "not a usable tensor name"),
        ] {
            let e = save(tmp.path(), 1, &tensors, &[], &json!({}), 1).unwrap_err();
            let m = e.to_string();
            assert!(
                matches!(e, TrainError::InvalidArgument { .. }) && m.contains(needle) && m.contains(MODEL_FILE),
                "{e}"
            );
        }
        assert_eq!(latest(tmp.path()).unwrap(), None);
    }
}
