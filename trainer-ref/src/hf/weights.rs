//! The safetensors files of a Hugging Face checkpoint: one `model.safetensors`, or shards listed by
//! `model.safetensors.index.json` (`{"weight_map": {tensor: file}}`).
//!
//! Reading is two passes so that bad input fails before any work: [`WeightFiles::open`] reads and checks every
//! header (a missing shard, a header that does not parse, a file cut short, a tensor the index and its file
//! disagree on), [`WeightFiles::check`] compares names, shapes and dtypes with what `config.json` implies, and
//! only then [`WeightFiles::read_f32`] reads the data, converting bf16 and f16 to f32 exactly.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Metadata, TensorView};
use safetensors::Dtype;
use serde_json::{json, Value};

use crate::error::{Result, TrainError};

/// The single-file weights' name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The shard index's name.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The largest header a file may declare (the safetensors crate's own limit).
const MAX_HEADER: u64 = 100_000_000;

/// Where one tensor lies.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// Its file.
    pub file: PathBuf,
    /// Its dtype as stored.
    pub dtype: Dtype,
    /// Its dims.
    pub shape: Vec<usize>,
    /// Byte range within the file.
    pub range: (u64, u64),
}

/// Every tensor of a checkpoint directory, headers read and checked, data not yet read.
#[derive(Debug, Clone)]
pub struct WeightFiles {
    /// The index, or the single file: where a missing tensor is reported.
    pub listing: PathBuf,
    /// By name.
    pub entries: HashMap<String, Entry>,
}

fn tensor_err(path: &Path, tensor: &str, detail: impl Into<String>) -> TrainError {
    TrainError::HfTensor { path: path.to_path_buf(), tensor: tensor.to_string(), detail: detail.into() }
}

fn file_err(path: &Path, detail: impl Into<String>) -> TrainError {
    TrainError::Checkpoint { path: path.to_path_buf(), detail: detail.into() }
}

/// Reads one file's header and checks the file holds every byte the header promises.
fn read_header(path: &Path) -> Result<HashMap<String, Entry>> {
    let mut f = File::open(path).map_err(|e| TrainError::io(path, e))?;
    let len = f.metadata().map_err(|e| TrainError::io(path, e))?.len();
    if len < 8 {
        return Err(file_err(path, format!("truncated: {len} bytes, not even the 8-byte header length")));
    }
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(|e| TrainError::io(path, e))?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER {
        return Err(file_err(path, format!("not a safetensors file: a header of {n} bytes")));
    }
    if 8 + n > len {
        return Err(file_err(path, format!("truncated: the header needs {} bytes, the file has {len}", 8 + n)));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).map_err(|e| TrainError::io(path, e))?;
    let meta: Metadata =
        serde_json::from_slice(&header).map_err(|e| file_err(path, format!("not a valid safetensors header: {e}")))?;
    let base = 8 + n;
    let mut out = HashMap::new();
    for name in meta.offset_keys() {
        let Some(info) = meta.info(&name) else { continue };
        let (s, e) = (base + info.data_offsets.0 as u64, base + info.data_offsets.1 as u64);
        if e > len {
            return Err(tensor_err(
                path,
                &name,
                format!("truncated: its bytes end at {e}, the file has {len} (the file was cut short)"),
            ));
        }
        out.insert(
            name,
            Entry { file: path.to_path_buf(), dtype: info.dtype, shape: info.shape.clone(), range: (s, e) },
        );
    }
    let end = base + meta.data_len() as u64;
    if end != len {
        return Err(file_err(path, format!("{len} bytes where the header accounts for {end}")));
    }
    Ok(out)
}

impl WeightFiles {
    /// Finds and checks the weight files of `dir`: the index and every shard it names, or `model.safetensors`.
    pub fn open(dir: &Path) -> Result<WeightFiles> {
        let index = dir.join(INDEX_FILE);
        if !index.is_file() {
            let single = dir.join(SINGLE_FILE);
            if !single.is_file() {
                return Err(file_err(dir, format!("no {SINGLE_FILE} nor {INDEX_FILE}: not a Hugging Face checkpoint")));
            }
            return Ok(WeightFiles { entries: read_header(&single)?, listing: single });
        }
        let text = std::fs::read(&index).map_err(|e| TrainError::io(&index, e))?;
        let doc: Value = serde_json::from_slice(&text).map_err(|e| file_err(&index, format!("not valid JSON: {e}")))?;
        let map = doc
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| file_err(&index, "no `weight_map` object"))?;
        // Shard by shard, in a stable order, each with the tensors the index puts there.
        let mut shards: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (tensor, file) in map {
            let file = file.as_str().ok_or_else(|| tensor_err(&index, tensor, format!("{file} is not a file name")))?;
            if file.contains('/') || file.contains('\\') || file == ".." {
                return Err(tensor_err(&index, tensor, format!("`{file}` is not a file of this directory")));
            }
            shards.entry(file.to_string()).or_default().push(tensor.clone());
        }
        for (file, tensors) in &shards {
            let path = dir.join(file);
            if !path.is_file() {
                return Err(tensor_err(
                    &path,
                    &tensors[0],
                    format!("the shard is missing ({INDEX_FILE} puts {} tensors in it)", tensors.len()),
                ));
            }
        }
        let mut entries = HashMap::new();
        for (file, tensors) in &shards {
            let path = dir.join(file);
            let mut found = read_header(&path)?;
            for t in tensors {
                let e = found
                    .remove(t)
                    .ok_or_else(|| tensor_err(&path, t, format!("listed in {INDEX_FILE} but not in this file")))?;
                entries.insert(t.clone(), e);
            }
            if let Some(extra) = found.keys().min() {
                return Err(tensor_err(&path, extra, format!("in this file but not listed in {INDEX_FILE}")));
            }
        }
        Ok(WeightFiles { listing: index, entries })
    }

    /// Checks the tensors are exactly `want` (name and dims, in any order), each of a readable dtype; names
    /// `ignore` accepts may be present and are not read. The first problem is the error, with how many more
    /// there are.
    pub fn check(&self, want: &[(String, Vec<usize>)], ignore: impl Fn(&str) -> bool) -> Result<()> {
        let mut problems = Vec::new();
        for (name, dims) in want {
            match self.entries.get(name) {
                None => problems.push(tensor_err(
                    &self.listing,
                    name,
                    format!("missing (config.json implies dims {dims:?})"),
                )),
                Some(e) if &e.shape != dims => problems.push(tensor_err(
                    &e.file,
                    name,
                    format!("dims {:?}, config.json implies {dims:?}", e.shape),
                )),
                Some(e) if !matches!(e.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) => problems.push(tensor_err(
                    &e.file,
                    name,
                    format!("dtype {:?} (this importer reads F32, BF16 and F16)", e.dtype),
                )),
                Some(_) => {}
            }
        }
        let wanted: std::collections::HashSet<&str> = want.iter().map(|(n, _)| n.as_str()).collect();
        let mut extra: Vec<(&String, &Entry)> =
            self.entries.iter().filter(|(n, _)| !wanted.contains(n.as_str()) && !ignore(n)).collect();
        extra.sort_by(|a, b| a.0.cmp(b.0));
        for (name, e) in extra {
            problems.push(tensor_err(
                &e.file,
                name,
                format!("dims {:?}: not a tensor of the model config.json describes", e.shape),
            ));
        }
        let more = problems.len().saturating_sub(1);
        match problems.into_iter().next() {
            None => Ok(()),
            Some(TrainError::HfTensor { path, tensor, detail }) if more > 0 => Err(TrainError::HfTensor {
                path,
                tensor,
                detail: format!("{detail} (and {more} more problems with this checkpoint's tensors)"),
            }),
            Some(e) => Err(e),
        }
    }

    /// Reads tensor `name` as f32 (bf16 and f16 widen exactly).
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>> {
        let e = self.entries.get(name).ok_or_else(|| tensor_err(&self.listing, name, "missing"))?;
        let mut f = File::open(&e.file).map_err(|err| TrainError::io(&e.file, err))?;
        f.seek(SeekFrom::Start(e.range.0)).map_err(|err| TrainError::io(&e.file, err))?;
        let mut raw = vec![0u8; (e.range.1 - e.range.0) as usize];
        f.read_exact(&mut raw).map_err(|err| tensor_err(&e.file, name, format!("reading its bytes: {err}")))?;
        Ok(match e.dtype {
            Dtype::F32 => raw.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            Dtype::BF16 => raw.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            Dtype::F16 => raw.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            other => return Err(tensor_err(&e.file, name, format!("dtype {other:?} (reads F32, BF16 and F16)"))),
        })
    }
}

/// One tensor to write.
#[derive(Debug, Clone, Copy)]
pub struct OutTensor<'a> {
    /// Its name.
    pub name: &'a str,
    /// Its dims.
    pub dims: &'a [usize],
    /// Its values.
    pub data: &'a [f32],
}

/// The number format [`write()`] stores the weights in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightDtype {
    /// f32: the trainer's values exactly.
    #[default]
    F32,
    /// bfloat16, each value rounded to the nearest (ties to even): half the bytes, what most Hub checkpoints
    /// hold, and what [`WeightFiles::read_f32`] widens back exactly.
    Bf16,
}

impl WeightDtype {
    /// `f32` or `bf16`, as the command line spells it.
    pub fn parse(s: &str) -> Option<WeightDtype> {
        match s {
            "f32" | "float32" => Some(WeightDtype::F32),
            "bf16" | "bfloat16" => Some(WeightDtype::Bf16),
            _ => None,
        }
    }

    /// Its name in `config.json`'s `torch_dtype`.
    pub fn torch_dtype(self) -> &'static str {
        match self {
            WeightDtype::F32 => "float32",
            WeightDtype::Bf16 => "bfloat16",
        }
    }

    fn safetensors(self) -> Dtype {
        match self {
            WeightDtype::F32 => Dtype::F32,
            WeightDtype::Bf16 => Dtype::BF16,
        }
    }

    fn bytes_per_value(self) -> u64 {
        match self {
            WeightDtype::F32 => 4,
            WeightDtype::Bf16 => 2,
        }
    }

    /// `data` in this format, little-endian.
    fn encode(self, data: &[f32]) -> Vec<u8> {
        match self {
            WeightDtype::F32 => data.iter().flat_map(|x| x.to_le_bytes()).collect(),
            WeightDtype::Bf16 => data.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect(),
        }
    }
}

/// Writes `tensors` as safetensors of `dtype` into `dir`: one `model.safetensors` when they fit in
/// `max_shard_bytes`, else shards of at most that size (a tensor larger than it gets a shard of its own) named as
/// transformers names them, `model-00001-of-00003.safetensors`, with the index. Returns the files written.
pub fn write(dir: &Path, tensors: &[OutTensor<'_>], max_shard_bytes: u64, dtype: WeightDtype) -> Result<Vec<PathBuf>> {
    let mut shards: Vec<Vec<OutTensor<'_>>> = vec![Vec::new()];
    let mut size = 0u64;
    for t in tensors {
        let bytes = t.data.len() as u64 * dtype.bytes_per_value();
        if size > 0 && size + bytes > max_shard_bytes {
            shards.push(Vec::new());
            size = 0;
        }
        size += bytes;
        if let Some(last) = shards.last_mut() {
            last.push(*t);
        }
    }
    let n = shards.len();
    let name =
        |i: usize| if n == 1 { SINGLE_FILE.to_string() } else { format!("model-{:05}-of-{n:05}.safetensors", i + 1) };
    let mut written = Vec::new();
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    for (i, shard) in shards.iter().enumerate() {
        let path = dir.join(name(i));
        let le: Vec<Vec<u8>> = shard.iter().map(|t| dtype.encode(t.data)).collect();
        let mut views = Vec::with_capacity(shard.len());
        for (t, bytes) in shard.iter().zip(&le) {
            let v = TensorView::new(dtype.safetensors(), t.dims.to_vec(), bytes)
                .map_err(|e| tensor_err(&path, t.name, format!("cannot be written: {e}")))?;
            views.push((t.name.to_string(), v));
            weight_map.insert(t.name.to_string(), name(i));
            total += bytes.len() as u64;
        }
        // transformers refuses files whose metadata names another framework; "pt" is what it writes.
        let meta = Some(HashMap::from([("format".to_string(), "pt".to_string())]));
        safetensors::serialize_to_file(views, meta, &path).map_err(|e| file_err(&path, format!("writing: {e}")))?;
        written.push(path);
    }
    if n > 1 {
        let path = dir.join(INDEX_FILE);
        let doc = json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
        let text = serde_json::to_vec_pretty(&doc).map_err(|e| file_err(&path, e.to_string()))?;
        std::fs::write(&path, text).map_err(|e| TrainError::io(&path, e))?;
        written.push(path);
    }
    Ok(written)
}
