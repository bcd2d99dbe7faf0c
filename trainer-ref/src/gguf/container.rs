//! The GGUF container (llama.cpp's file format, versions 2 and 3): a header, typed key/value metadata, a table
//! of tensors (name, dims, GGML type, offset), then the aligned tensor data.
//!
//! ```text
//! u32 magic "GGUF" · u32 version · u64 tensor_count · u64 kv_count
//! kv_count × { string key · u32 type · value }           (strings: u64 length + UTF-8 bytes)
//! tensor_count × { string name · u32 n_dims · u64 ne[n_dims] · u32 ggml_type · u64 offset }
//! padding to `general.alignment` (default 32) · tensor data (each offset relative to its start)
//! ```
//!
//! Written here rather than taken from a crate: the GGUF crates on crates.io either pull a CLI's dependencies
//! (clap, a table printer, a logger) and turn on `serde_json`'s `arbitrary_precision` for the whole workspace,
//! or come inside a whole framework (candle); the container is a page of code, and reading it ourselves lets
//! every error name the file and the tensor.
//!
//! Every length read from the file is checked against the file's size before anything is allocated, so a
//! truncated or corrupt file is an error naming what was being read, never a huge allocation or a panic.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::error::{Result, TrainError};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Any unsigned integer type.
    U64(u64),
    /// Any signed integer type.
    I64(i64),
    /// `f32` or `f64`.
    F64(f64),
    /// A boolean.
    Bool(bool),
    /// A UTF-8 string.
    Str(String),
    /// An array of one element type.
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U64(v) => Some(v),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    /// The value as a float, if it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F64(v) => Some(v),
            Value::U64(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => None,
        }
    }
    /// The value as a string, if it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    /// The value as an array, if it is one.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One entry of the tensor table.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// GGUF name (`blk.3.attn_q.weight`).
    pub name: String,
    /// Dims, fastest first (GGML's `ne`: a `[rows, cols]` matrix is `[cols, rows]`).
    pub ne: Vec<u64>,
    /// GGML type id.
    pub ggml_type: u32,
    /// Absolute byte offset of the data in the file.
    pub offset: u64,
}

impl TensorInfo {
    /// Elements.
    pub fn numel(&self) -> u64 {
        self.ne.iter().product()
    }
    /// Dims in row-major order, slowest first (what safetensors and the model use).
    pub fn dims(&self) -> Vec<usize> {
        self.ne.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A parsed GGUF file: its metadata and tensor table (the data stays on disk until read).
#[derive(Debug)]
pub struct GgufFile {
    /// The file.
    pub path: PathBuf,
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata by key.
    pub metadata: BTreeMap<String, Value>,
    /// The tensors, in file order.
    pub tensors: Vec<TensorInfo>,
    /// The file's size in bytes.
    pub file_len: u64,
}

struct Reader<'a> {
    r: BufReader<File>,
    path: &'a Path,
    pos: u64,
    len: u64,
}

impl Reader<'_> {
    fn bad(&self, what: &str) -> TrainError {
        TrainError::Checkpoint { path: self.path.to_path_buf(), detail: what.to_string() }
    }
    fn bytes(&mut self, n: u64, what: &str) -> Result<Vec<u8>> {
        if n > self.len.saturating_sub(self.pos) {
            return Err(self.bad(&format!(
                "{what}: needs {n} bytes at offset {} but the file has {} (truncated or corrupt)",
                self.pos, self.len
            )));
        }
        let mut buf = vec![0u8; n as usize];
        self.r.read_exact(&mut buf).map_err(|e| TrainError::io(self.path, e))?;
        self.pos += n;
        Ok(buf)
    }
    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let b = self.bytes(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(&b);
        Ok(a)
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.u64(what)?;
        let b = self.bytes(n, what)?;
        String::from_utf8(b).map_err(|_| self.bad(&format!("{what}: not UTF-8")))
    }
    fn value(&mut self, ty: u32, what: &str) -> Result<Value> {
        Ok(match ty {
            0 => Value::U64(u8::from_le_bytes(self.array(what)?) as u64),
            1 => Value::I64(i8::from_le_bytes(self.array(what)?) as i64),
            2 => Value::U64(u16::from_le_bytes(self.array(what)?) as u64),
            3 => Value::I64(i16::from_le_bytes(self.array(what)?) as i64),
            4 => Value::U64(u32::from_le_bytes(self.array(what)?) as u64),
            5 => Value::I64(i32::from_le_bytes(self.array(what)?) as i64),
            6 => Value::F64(f32::from_le_bytes(self.array(what)?) as f64),
            7 => Value::Bool(u8::from_le_bytes(self.array::<1>(what)?) != 0),
            8 => Value::Str(self.string(what)?),
            9 => {
                let elem = self.u32(what)?;
                if elem == 9 {
                    return Err(self.bad(&format!("{what}: arrays of arrays are not supported")));
                }
                let n = self.u64(what)?;
                // Every element takes at least one byte: a count beyond the bytes left is corrupt.
                if n > self.len.saturating_sub(self.pos) {
                    return Err(self.bad(&format!("{what}: an array of {n} elements is longer than the file")));
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(elem, what)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(u64::from_le_bytes(self.array(what)?)),
            11 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            t => return Err(self.bad(&format!("{what}: unknown metadata type {t}"))),
        })
    }
}

impl GgufFile {
    /// Reads the header, metadata and tensor table of `path`.
    ///
    /// Errors: not a GGUF file, a version other than 2 or 3, a truncated header, or a tensor whose data would
    /// lie outside the file.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let f = File::open(path).map_err(|e| TrainError::io(path, e))?;
        let len = f.metadata().map_err(|e| TrainError::io(path, e))?.len();
        let mut r = Reader { r: BufReader::with_capacity(1 << 20, f), path, pos: 0, len };
        let magic: [u8; 4] = r.array("magic")?;
        if &magic != MAGIC {
            return Err(r.bad(&format!("not a GGUF file (magic {magic:?}, expected \"GGUF\")")));
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(r.bad(&format!("GGUF version {version} is not supported (2 and 3 are)")));
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;
        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = r.string(&format!("metadata key {i}"))?;
            let ty = r.u32(&format!("metadata `{key}` type"))?;
            let v = r.value(ty, &format!("metadata `{key}`"))?;
            metadata.insert(key, v);
        }
        let mut tensors = Vec::new();
        for i in 0..n_tensors {
            let name = r.string(&format!("tensor {i} name"))?;
            let n_dims = r.u32(&format!("tensor `{name}` dims"))?;
            if n_dims == 0 || n_dims > 4 {
                return Err(r.bad(&format!("tensor `{name}`: {n_dims} dims (GGUF allows 1 to 4)")));
            }
            let mut ne = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                ne.push(r.u64(&format!("tensor `{name}` dims"))?);
            }
            let ggml_type = r.u32(&format!("tensor `{name}` type"))?;
            let offset = r.u64(&format!("tensor `{name}` offset"))?;
            tensors.push(TensorInfo { name, ne, ggml_type, offset });
        }
        let alignment = metadata.get("general.alignment").and_then(Value::as_u64).unwrap_or(DEFAULT_ALIGNMENT);
        if alignment == 0 || !alignment.is_power_of_two() {
            return Err(r.bad(&format!("general.alignment = {alignment} is not a power of two")));
        }
        let data_start = r.pos.div_ceil(alignment) * alignment;
        for t in &mut tensors {
            t.offset =
                data_start.checked_add(t.offset).ok_or_else(|| r.bad(&format!("tensor `{}`: offset", t.name)))?;
        }
        Ok(GgufFile { path: path.to_path_buf(), version, metadata, tensors, file_len: len })
    }

    /// A metadata value, or an error naming the missing key.
    pub fn get(&self, key: &str) -> Result<&Value> {
        self.metadata.get(key).ok_or_else(|| self.bad(format!("metadata `{key}` is missing")))
    }

    /// A tensor's table entry by GGUF name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of a tensor (`bytes` long, from the table's offset).
    ///
    /// Errors: the data runs past the end of the file (truncated).
    pub fn read_raw(&self, t: &TensorInfo, bytes: u64) -> Result<Vec<u8>> {
        let end = t.offset.checked_add(bytes).filter(|&e| e <= self.file_len).ok_or_else(|| {
            self.bad(format!(
                "tensor `{}`: its {bytes} bytes at offset {} run past the end of the file ({} bytes): truncated",
                t.name, t.offset, self.file_len
            ))
        })?;
        let mut f = File::open(&self.path).map_err(|e| TrainError::io(&self.path, e))?;
        f.seek(SeekFrom::Start(t.offset)).map_err(|e| TrainError::io(&self.path, e))?;
        let mut buf = vec![0u8; (end - t.offset) as usize];
        f.read_exact(&mut buf).map_err(|e| TrainError::io(&self.path, e))?;
        Ok(buf)
    }

    /// An error about this file.
    pub fn bad(&self, detail: impl Into<String>) -> TrainError {
        TrainError::Checkpoint { path: self.path.clone(), detail: detail.into() }
    }
}
