//! Token ids in NumPy `.npy` files: the way pre-tokenized corpora usually arrive.
//!
//! This module owns reading such a file into `Vec<u32>` token ids, and writing one (for tests
//! and tools). It reads format versions 1.0, 2.0 and 3.0 with any little-endian integer dtype
//! (`|u1 |i1 <u2 <i2 <u4 <i4 <u8 <i8`) and any number of dims, flattened in C order. It refuses,
//! naming the file and the problem, everything it could only read by guessing: big-endian
//! data, Fortran order, floats, a header it cannot parse, a file shorter or longer than its
//! header says, and values that are not token ids (negative, or above `u32::MAX`, naming the
//! element).
//!
//! The file is streamed, not read whole: a corpus can be gigabytes, and the ids are the only
//! copy worth holding.

use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::Path;

use crate::error::{Result, TrainError};

const MAGIC: &[u8; 6] = b"\x93NUMPY";

/// Reads the token ids of a `.npy` file, flattened in C order.
///
/// Errors (`TrainError::TokenFile`, naming the file): an unreadable header, an unsupported version,
/// a non-integer, big-endian or structured dtype, Fortran order (for arrays where it changes the
/// layout), a data section of the wrong length, and a value that is negative or above
/// `u32::MAX` (naming its index). I/O failures are `TrainError::Io`.
pub fn read_token_ids(path: &Path) -> Result<Vec<u32>> {
    let file = File::open(path).map_err(|e| TrainError::io(path, e))?;
    let file_len = file.metadata().map_err(|e| TrainError::io(path, e))?.len();
    let mut r = BufReader::with_capacity(1 << 16, file);
    let header = read_header(path, &mut r)?;

    let data_len = file_len.saturating_sub(header.offset);
    let want = (header.count as u64).saturating_mul(header.dtype.size as u64);
    if data_len != want {
        let how = if data_len < want { "truncated" } else { "longer than its header says" };
        return Err(bad(
            path,
            format!(
                "{how}: shape {:?} of {} needs {want} bytes of data, the file has {data_len}",
                header.shape, header.dtype.descr
            ),
        ));
    }

    let mut ids = Vec::with_capacity(header.count);
    let size = header.dtype.size;
    // Whole elements per read, so no element straddles two buffers.
    let mut buf = vec![0u8; (1 << 16) / size * size];
    let mut index = 0usize;
    while index < header.count {
        let n = (header.count - index).min(buf.len() / size);
        let chunk = &mut buf[..n * size];
        r.read_exact(chunk).map_err(|e| TrainError::io(path, e))?;
        for raw in chunk.chunks_exact(size) {
            let value = header.dtype.decode(raw);
            let id = u32::try_from(value).map_err(|_| {
                let why = if value < 0 { "token ids cannot be negative" } else { "token ids must fit in u32" };
                bad(path, format!("element {} is {value}: {why}", describe_index(index, &header.shape)))
            })?;
            ids.push(id);
            index += 1;
        }
    }
    Ok(ids)
}

/// Writes `ids` as a 1-D `<u4` array in `.npy` format 1.0 (what `numpy.load` reads).
pub fn write_token_ids(path: &Path, ids: &[u32]) -> Result<()> {
    let dict = format!("{{'descr': '<u4', 'fortran_order': False, 'shape': ({},), }}", ids.len());
    // The format pads the header with spaces and a final newline so the data starts at a
    // multiple of 64 bytes (aligned for memory-mapping readers).
    let unpadded = MAGIC.len() + 2 + 2 + dict.len() + 1;
    let header_len = dict.len() + 1 + (64 - unpadded % 64) % 64;
    let header_len16 = u16::try_from(header_len)
        .map_err(|_| bad(path, format!("a {header_len}-byte header does not fit format 1.0")))?;

    let file = File::create(path).map_err(|e| TrainError::io(path, e))?;
    let mut w = BufWriter::with_capacity(1 << 16, file);
    let io = |e| TrainError::io(path, e);
    w.write_all(MAGIC).map_err(io)?;
    w.write_all(&[1, 0]).map_err(io)?;
    w.write_all(&header_len16.to_le_bytes()).map_err(io)?;
    w.write_all(dict.as_bytes()).map_err(io)?;
    w.write_all(&vec![b' '; header_len - dict.len() - 1]).map_err(io)?;
    w.write_all(b"\n").map_err(io)?;
    for chunk in ids.chunks(1 << 14) {
        let le: Vec<u8> = chunk.iter().flat_map(|id| id.to_le_bytes()).collect();
        w.write_all(&le).map_err(io)?;
    }
    w.into_inner().map_err(|e| TrainError::io(path, e.into_error()))?.sync_all().map_err(io)
}

/// What the header says about the data.
#[derive(Debug)]
struct Header {
    dtype: IntDtype,
    shape: Vec<usize>,
    /// The number of elements, the product of `shape`.
    count: usize,
    /// Where the data starts in the file.
    offset: u64,
}

/// A little-endian integer dtype.
#[derive(Debug)]
struct IntDtype {
    /// As the header spells it, for errors.
    descr: String,
    signed: bool,
    /// Bytes per element: 1, 2, 4 or 8.
    size: usize,
}

impl IntDtype {
    /// One element, widened; `raw` is `size` bytes.
    fn decode(&self, raw: &[u8]) -> i128 {
        let mut le = [0u8; 8];
        le[..self.size].copy_from_slice(raw);
        let unsigned = u64::from_le_bytes(le);
        if self.signed {
            // Sign-extend from the element's width.
            let shift = 64 - 8 * self.size as u32;
            (((unsigned << shift) as i64) >> shift) as i128
        } else {
            unsigned as i128
        }
    }
}

fn read_header(path: &Path, r: &mut impl Read) -> Result<Header> {
    let mut lead = [0u8; 8];
    read_or_short(path, r, &mut lead, "the magic string and version")?;
    if &lead[..6] != MAGIC {
        return Err(bad(path, "not a .npy file: it does not start with \\x93NUMPY"));
    }
    let (major, minor) = (lead[6], lead[7]);
    let (len, len_bytes) = match major {
        1 => {
            let mut b = [0u8; 2];
            read_or_short(path, r, &mut b, "the header length")?;
            (u16::from_le_bytes(b) as usize, 2)
        }
        2 | 3 => {
            let mut b = [0u8; 4];
            read_or_short(path, r, &mut b, "the header length")?;
            (u32::from_le_bytes(b) as usize, 4)
        }
        _ => {
            return Err(bad(path, format!("format version {major}.{minor}; this reader knows 1.0, 2.0 and 3.0")));
        }
    };
    // Real headers are a few hundred bytes; a huge length is a corrupt file, not a reason to
    // allocate gigabytes.
    if len > 1 << 20 {
        return Err(bad(path, format!("bad header: its length field says {len} bytes")));
    }
    let mut text = vec![0u8; len];
    read_or_short(path, r, &mut text, "the header")?;
    // Versions 1 and 2 are Latin-1 (in practice ASCII), version 3 is UTF-8.
    let text = String::from_utf8(text).map_err(|_| bad(path, "bad header: it is not text"))?;
    let offset = (8 + len_bytes + len) as u64;

    let dict = match Parser::new(&text).literal() {
        Ok(Py::Dict(entries)) => entries,
        Ok(_) => return Err(bad(path, format!("bad header: not a dict: {}", text.trim()))),
        Err(e) => return Err(bad(path, format!("bad header: {e}: {}", text.trim()))),
    };
    let get = |key: &str| {
        dict.iter()
            .find(|(k, _)| matches!(k, Py::Str(s) if s == key))
            .map(|(_, v)| v)
            .ok_or_else(|| bad(path, format!("bad header: no '{key}' key: {}", text.trim())))
    };
    let dtype = match get("descr")? {
        Py::Str(descr) => parse_dtype(path, descr)?,
        _ => {
            return Err(bad(path, "dtype: a structured dtype (a list of fields); token ids must be one integer array"))
        }
    };
    let fortran = match get("fortran_order")? {
        Py::Bool(b) => *b,
        _ => return Err(bad(path, "bad header: 'fortran_order' is not True or False")),
    };
    let shape = match get("shape")? {
        Py::Tuple(dims) => dims
            .iter()
            .map(|d| match d {
                Py::Int(n) => usize::try_from(*n).ok(),
                _ => None,
            })
            .collect::<Option<Vec<usize>>>()
            .ok_or_else(|| bad(path, "bad header: 'shape' is not a tuple of sizes"))?,
        _ => return Err(bad(path, "bad header: 'shape' is not a tuple")),
    };
    let count = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| bad(path, format!("bad header: shape {shape:?} overflows")))?;
    // With at most one dim longer than 1, C and Fortran order are the same bytes.
    if fortran && shape.iter().filter(|&&d| d > 1).count() > 1 {
        return Err(bad(
            path,
            format!("fortran_order is True for shape {shape:?}; save it in C order (numpy.ascontiguousarray)"),
        ));
    }
    Ok(Header { dtype, shape, count, offset })
}

fn parse_dtype(path: &Path, descr: &str) -> Result<IntDtype> {
    let mut chars = descr.chars();
    let (order, kind) = (chars.next(), chars.next());
    let size: Option<usize> = chars.as_str().parse().ok();
    let (Some(order), Some(kind), Some(size)) = (order, kind, size) else {
        return Err(bad(path, format!("dtype '{descr}' is not one this reader knows")));
    };
    let signed = match kind {
        'i' => true,
        'u' => false,
        'f' | 'c' => {
            return Err(bad(path, format!("dtype '{descr}' is floating-point; token ids must be an integer dtype")));
        }
        _ => return Err(bad(path, format!("dtype '{descr}' is not an integer dtype"))),
    };
    if ![1, 2, 4, 8].contains(&size) {
        return Err(bad(path, format!("dtype '{descr}' has a size this reader does not know")));
    }
    // Byte order is meaningless for one-byte elements, whatever the header says.
    match order {
        '<' | '|' => {}
        _ if size == 1 => {}
        '>' => {
            return Err(bad(
                path,
                format!("dtype '{descr}' is big-endian; convert it with arr.astype('<{kind}{size}')"),
            ));
        }
        // '=' (native) is never written by numpy, whose headers always spell the order out.
        _ => return Err(bad(path, format!("dtype '{descr}' has a byte order this reader does not know"))),
    }
    Ok(IntDtype { descr: descr.to_string(), signed, size })
}

/// `element 17` for a 1-D array, `element 17 (index (2, 5))` for more dims.
fn describe_index(flat: usize, shape: &[usize]) -> String {
    if shape.len() <= 1 {
        return format!("element {flat}");
    }
    let mut rest = flat;
    let mut index = vec![0; shape.len()];
    for (slot, &dim) in index.iter_mut().zip(shape).rev() {
        *slot = rest % dim;
        rest /= dim;
    }
    let parts: Vec<String> = index.iter().map(usize::to_string).collect();
    format!("element {flat} (index ({}))", parts.join(", "))
}

fn read_or_short(path: &Path, r: &mut impl Read, buf: &mut [u8], what: &str) -> Result<()> {
    r.read_exact(buf).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => bad(path, format!("bad header: the file ends inside {what}")),
        _ => TrainError::io(path, e),
    })
}

fn bad(path: &Path, detail: impl std::fmt::Display) -> TrainError {
    TrainError::TokenFile { path: path.to_path_buf(), detail: detail.to_string() }
}

/// The Python literals a `.npy` header is made of.
#[derive(Debug, PartialEq)]
enum Py {
    Str(String),
    Int(i128),
    Bool(bool),
    None,
    Tuple(Vec<Py>),
    List(Vec<Py>),
    Dict(Vec<(Py, Py)>),
}

/// A parser for the subset of Python literal syntax `numpy.save` writes (`ast.literal_eval`'s
/// dicts, tuples, lists, strings, integers, `True`, `False`, `None`).
struct Parser<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> Parser<'a> {
    fn new(text: &'a str) -> Self {
        Parser { text, pos: 0 }
    }

    /// The whole text as one literal, with nothing but whitespace after it.
    fn literal(&mut self) -> std::result::Result<Py, String> {
        let value = self.value()?;
        self.skip_ws();
        if self.pos != self.text.len() {
            return Err(format!("unexpected text at byte {}", self.pos));
        }
        Ok(value)
    }

    fn skip_ws(&mut self) {
        let rest = &self.text[self.pos..];
        self.pos += rest.len() - rest.trim_start().len();
    }

    fn peek(&mut self) -> Option<char> {
        self.skip_ws();
        self.text[self.pos..].chars().next()
    }

    fn value(&mut self) -> std::result::Result<Py, String> {
        match self.peek() {
            Some('{') => {
                let items = self.items('{', '}', true)?;
                Ok(Py::Dict(items.into_iter().map(|(k, v)| (k, v.unwrap_or(Py::None))).collect()))
            }
            Some('(') => Ok(Py::Tuple(self.items('(', ')', false)?.into_iter().map(|(k, _)| k).collect())),
            Some('[') => Ok(Py::List(self.items('[', ']', false)?.into_iter().map(|(k, _)| k).collect())),
            Some(q @ ('\'' | '"')) => self.string(q),
            Some(c) if c.is_ascii_digit() || c == '-' => self.int(),
            Some(c) if c.is_ascii_alphabetic() => {
                let start = self.pos;
                while self.text[self.pos..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
                    self.pos += 1;
                }
                match &self.text[start..self.pos] {
                    "True" => Ok(Py::Bool(true)),
                    "False" => Ok(Py::Bool(false)),
                    "None" => Ok(Py::None),
                    word => Err(format!("unexpected `{word}` at byte {start}")),
                }
            }
            Some(c) => Err(format!("unexpected `{c}` at byte {}", self.pos)),
            None => Err("it ends early".to_string()),
        }
    }

    /// A bracketed, comma-separated sequence (a trailing comma allowed), of `key: value`
    /// pairs when `pairs`, else of values (in the pair's first slot).
    fn items(&mut self, open: char, close: char, pairs: bool) -> std::result::Result<Vec<(Py, Option<Py>)>, String> {
        self.pos += open.len_utf8();
        let mut items = Vec::new();
        loop {
            if self.peek() == Some(close) {
                self.pos += close.len_utf8();
                return Ok(items);
            }
            let key = self.value()?;
            let value = if pairs {
                if self.peek() != Some(':') {
                    return Err(format!("expected `:` at byte {}", self.pos));
                }
                self.pos += 1;
                Some(self.value()?)
            } else {
                None
            };
            items.push((key, value));
            match self.peek() {
                Some(',') => self.pos += 1,
                Some(c) if c == close => {}
                _ => return Err(format!("expected `,` or `{close}` at byte {}", self.pos)),
            }
        }
    }

    fn string(&mut self, quote: char) -> std::result::Result<Py, String> {
        let start = self.pos;
        self.pos += 1;
        let rest = &self.text[self.pos..];
        // numpy's keys and dtype strings hold no quotes or escapes; refusing them keeps this
        // parser from having to be Python's.
        let end = rest.find([quote, '\\']).ok_or_else(|| format!("unterminated string at byte {start}"))?;
        if rest[end..].starts_with('\\') {
            return Err(format!("an escape in the string at byte {start}"));
        }
        self.pos += end + 1;
        Ok(Py::Str(rest[..end].to_string()))
    }

    fn int(&mut self) -> std::result::Result<Py, String> {
        let start = self.pos;
        if self.text[self.pos..].starts_with('-') {
            self.pos += 1;
        }
        while self.text[self.pos..].starts_with(|c: char| c.is_ascii_digit()) {
            self.pos += 1;
        }
        let digits = &self.text[start..self.pos];
        // Python 2's numpy wrote long sizes as `3L`.
        if self.text[self.pos..].starts_with('L') {
            self.pos += 1;
        }
        digits.parse().map(Py::Int).map_err(|_| format!("bad integer `{digits}` at byte {start}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `.npy` file as numpy would write it: `version`, a header dict, then `data`.
    fn npy(version: u8, dict: &str, data: &[u8]) -> Vec<u8> {
        let mut header = dict.as_bytes().to_vec();
        let len_bytes = if version == 1 { 2 } else { 4 };
        while !(8 + len_bytes + header.len() + 1).is_multiple_of(64) {
            header.push(b' ');
        }
        header.push(b'\n');
        let mut out = MAGIC.to_vec();
        out.extend([version, 0]);
        if version == 1 {
            out.extend((header.len() as u16).to_le_bytes());
        } else {
            out.extend((header.len() as u32).to_le_bytes());
        }
        out.extend(header);
        out.extend(data);
        out
    }

    fn dict(descr: &str, fortran: bool, shape: &str) -> String {
        let fortran = if fortran { "True" } else { "False" };
        format!("{{'descr': '{descr}', 'fortran_order': {fortran}, 'shape': {shape}, }}")
    }

    fn read_bytes(bytes: &[u8]) -> Result<Vec<u32>> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens.npy");
        std::fs::write(&path, bytes).unwrap();
        read_token_ids(&path)
    }

    /// The error for `bytes`, which must name the file.
    fn error(bytes: &[u8]) -> String {
        let msg = match read_bytes(bytes) {
            Err(e @ TrainError::TokenFile { .. }) => e.to_string(),
            other => panic!("expected a token file error, got {other:?}"),
        };
        assert!(msg.contains("tokens.npy"), "{msg}");
        msg
    }

    #[test]
    fn round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ids.npy");
        for ids in [vec![], vec![0, 1, 2, 50_256, u32::MAX], (0..100_000).map(|i| i * 7919).collect()] {
            write_token_ids(&path, &ids).unwrap();
            let bytes = std::fs::read(&path).unwrap();
            let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
            assert_eq!((10 + header_len) % 64, 0, "data is 64-byte aligned");
            assert_eq!(read_token_ids(&path).unwrap(), ids);
        }
    }

    #[test]
    fn reads_a_hand_built_i64_file_in_2d() {
        let values: [i64; 6] = [0, 1, 2, 3, 4_294_967_295, 17];
        let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let ids = read_bytes(&npy(1, &dict("<i8", false, "(2, 3)"), &data)).unwrap();
        assert_eq!(ids, [0, 1, 2, 3, u32::MAX, 17]);
    }

    #[test]
    fn reads_a_hand_built_u16_file_in_every_version() {
        let values: [u16; 4] = [65_535, 0, 1, 50_000];
        let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        for version in [1, 2, 3] {
            let ids = read_bytes(&npy(version, &dict("<u2", false, "(4,)"), &data)).unwrap();
            assert_eq!(ids, [65_535, 0, 1, 50_000], "version {version}");
        }
    }

    #[test]
    fn reads_the_other_integer_dtypes() {
        let ids = read_bytes(&npy(1, &dict("|u1", false, "(3,)"), &[0, 255, 7])).unwrap();
        assert_eq!(ids, [0, 255, 7]);
        let ids = read_bytes(&npy(1, &dict("|i1", false, "(2,)"), &[127, 0])).unwrap();
        assert_eq!(ids, [127, 0]);
        let data: Vec<u8> = [32_767i16, 5].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(read_bytes(&npy(1, &dict("<i2", false, "(1, 2)"), &data)).unwrap(), [32_767, 5]);
        let data: Vec<u8> = [2_147_483_647i32, 9].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(read_bytes(&npy(1, &dict("<i4", false, "(2,)"), &data)).unwrap(), [2_147_483_647, 9]);
        let data: Vec<u8> = [u32::MAX as u64, 3].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(read_bytes(&npy(1, &dict("<u8", false, "(2L,)"), &data)).unwrap(), [u32::MAX, 3]);
        // A scalar is one element; Fortran order is harmless when only one dim is longer than 1.
        assert_eq!(read_bytes(&npy(1, &dict("<u4", true, "()"), &42u32.to_le_bytes())).unwrap(), [42]);
        let data: Vec<u8> = [1u32, 2, 3].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(read_bytes(&npy(1, &dict("<u4", true, "(1, 3)"), &data)).unwrap(), [1, 2, 3]);
        // Keys in another order, double quotes, no trailing comma.
        let d = "{\"shape\": (2,), \"fortran_order\": False, \"descr\": \"<u4\"}";
        let data: Vec<u8> = [8u32, 9].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(read_bytes(&npy(1, d, &data)).unwrap(), [8, 9]);
    }

    #[test]
    fn values_that_are_not_token_ids_name_the_index() {
        let data: Vec<u8> = [5i64, 6, 7, -1].iter().flat_map(|v| v.to_le_bytes()).collect();
        let msg = error(&npy(1, &dict("<i8", false, "(2, 2)"), &data));
        assert!(msg.contains("element 3 (index (1, 1)) is -1") && msg.contains("negative"), "{msg}");

        let msg = error(&npy(1, &dict("|i1", false, "(3,)"), &[1, 2, 0xff]));
        assert!(msg.contains("element 2 is -1"), "{msg}");

        let data: Vec<u8> = [1u64, 1 << 32].iter().flat_map(|v| v.to_le_bytes()).collect();
        let msg = error(&npy(1, &dict("<u8", false, "(2,)"), &data));
        assert!(msg.contains("element 1 is 4294967296") && msg.contains("u32"), "{msg}");
    }

    #[test]
    fn layouts_it_cannot_read_are_named() {
        let four = [0u8; 16];
        let msg = error(&npy(1, &dict(">u4", false, "(4,)"), &four));
        assert!(msg.contains("'>u4' is big-endian"), "{msg}");
        let msg = error(&npy(1, &dict("<u4", true, "(2, 2)"), &four));
        assert!(msg.contains("fortran_order is True for shape [2, 2]"), "{msg}");
        let msg = error(&npy(1, &dict("<f4", false, "(4,)"), &four));
        assert!(msg.contains("'<f4' is floating-point"), "{msg}");
        let msg = error(&npy(1, &dict("|b1", false, "(4,)"), &four[..4]));
        assert!(msg.contains("'|b1' is not an integer dtype"), "{msg}");
        let msg = error(&npy(1, "{'descr': [('a', '<u4')], 'fortran_order': False, 'shape': (4,), }", &four));
        assert!(msg.contains("structured dtype"), "{msg}");
    }

    #[test]
    fn bad_files_and_headers_are_named() {
        let msg = error(b"PK\x03\x04 not numpy at all");
        assert!(msg.contains("not a .npy file"), "{msg}");
        let msg = error(b"\x93NUMPY\x01");
        assert!(msg.contains("ends inside the magic string"), "{msg}");
        let mut v4 = npy(1, &dict("<u4", false, "(0,)"), &[]);
        v4[6] = 4;
        let msg = error(&v4);
        assert!(msg.contains("format version 4.0"), "{msg}");
        let msg = error(&npy(1, "{'descr': '<u4', 'fortran_order': False}", &[]));
        assert!(msg.contains("no 'shape' key"), "{msg}");
        let msg = error(&npy(1, "{'descr': '<u4', 'fortran_order': False, 'shape': (4,)", &[]));
        assert!(msg.contains("bad header"), "{msg}");
        let msg = error(&npy(1, "{'descr': '<u4', 'fortran_order': Maybe, 'shape': (4,)}", &[]));
        assert!(msg.contains("unexpected `Maybe`"), "{msg}");
        let msg = error(&npy(1, &dict("<u4", false, "(-4,)"), &[]));
        assert!(msg.contains("'shape' is not a tuple of sizes"), "{msg}");
        let mut cut = npy(1, &dict("<u4", false, "(4,)"), &[0; 16]);
        cut.truncate(40);
        let msg = error(&cut);
        assert!(msg.contains("ends inside the header"), "{msg}");

        let msg = error(&npy(2, &dict("<u4", false, "(4,)"), &[0; 15]));
        assert!(msg.contains("truncated") && msg.contains("needs 16 bytes") && msg.contains("has 15"), "{msg}");
        let msg = error(&npy(3, &dict("<u4", false, "(4,)"), &[0; 17]));
        assert!(msg.contains("longer than its header says"), "{msg}");
    }
}
