//! The layout of a spill file: one page of header, then the tensor's bytes (padded to a page under direct I/O).
//!
//! ```text
//! 0   magic "LCOFFLD1"        24  data length, u64
//! 8   format version, u32     32  CRC-32 of the data, u32
//! 12  dtype code, u8          36  CRC-32 of this page with these 4 bytes zero, u32
//! 13  kind code, u8           40  the tensor's name (its first MAX_NAME bytes), then zeros
//! 14  name length, u16
//! 16  layer, u64              (all little-endian)
//! ```
//!
//! On read the header must match what the ticket says (dtype, kind, layer, name, length) and its own checksum,
//! and the data its checksum: a file that was overwritten, truncated, or swapped for another tensor's is an
//! error naming the tensor, never data handed back.

use crate::aligned::ALIGN;
use crate::tag::{TensorKind, TensorTag};
use crate::tensor::DType;

/// Bytes of the header: one page, so the data starts aligned.
pub(crate) const HEADER_BYTES: usize = ALIGN;

const MAGIC: [u8; 8] = *b"LCOFFLD1";
const VERSION: u32 = 1;
const NAME_AT: usize = 40;
const MAX_NAME: usize = 1024;
const HEADER_CRC_AT: usize = 36;

fn kind_code(kind: TensorKind) -> u8 {
    match kind {
        TensorKind::Activation => 1,
        TensorKind::Weights => 2,
    }
}

fn stored_name(tag: &TensorTag) -> &[u8] {
    let name = tag.name.as_bytes();
    &name[..name.len().min(MAX_NAME)]
}

fn header_crc(page: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&page[..HEADER_CRC_AT]);
    h.update(&[0; 4]);
    h.update(&page[HEADER_CRC_AT + 4..HEADER_BYTES]);
    h.finalize()
}

/// The element type's code in a header (files live only as long as their engine, so the codes need not be
/// stable across releases; they are only checked against the ticket's type).
fn dtype_code(dtype: DType) -> u8 {
    match dtype {
        DType::F32 => 1,
        DType::Bf16 => 2,
        DType::F16 => 4,
    }
}

/// Writes the header of `tag`'s tensor into `page` (at least [`HEADER_BYTES`] long).
pub(crate) fn encode(page: &mut [u8], tag: &TensorTag, dtype: DType, data_len: u64, data_crc: u32) {
    let page = &mut page[..HEADER_BYTES];
    page.fill(0);
    let name = stored_name(tag);
    page[0..8].copy_from_slice(&MAGIC);
    page[8..12].copy_from_slice(&VERSION.to_le_bytes());
    page[12] = dtype_code(dtype);
    page[13] = kind_code(tag.kind);
    page[14..16].copy_from_slice(&(name.len() as u16).to_le_bytes());
    page[16..24].copy_from_slice(&(tag.layer as u64).to_le_bytes());
    page[24..32].copy_from_slice(&data_len.to_le_bytes());
    page[32..36].copy_from_slice(&data_crc.to_le_bytes());
    page[NAME_AT..NAME_AT + name.len()].copy_from_slice(name);
    let crc = header_crc(page);
    page[HEADER_CRC_AT..HEADER_CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
}

fn u32_at(page: &[u8], at: usize) -> u32 {
    let mut b = [0; 4];
    b.copy_from_slice(&page[at..at + 4]);
    u32::from_le_bytes(b)
}

fn u64_at(page: &[u8], at: usize) -> u64 {
    let mut b = [0; 8];
    b.copy_from_slice(&page[at..at + 8]);
    u64::from_le_bytes(b)
}

/// Checks `page` against what the ticket says the file holds; returns the data's stored checksum, or what does
/// not match, in words.
pub(crate) fn check(page: &[u8], tag: &TensorTag, dtype: DType, data_len: u64) -> Result<u32, String> {
    let page = &page[..HEADER_BYTES];
    if page[0..8] != MAGIC {
        return Err("no spill header (bad magic)".into());
    }
    let (stored, computed) = (u32_at(page, HEADER_CRC_AT), header_crc(page));
    if stored != computed {
        return Err(format!("header checksum mismatch (stored {stored:08x}, computed {computed:08x})"));
    }
    let version = u32_at(page, 8);
    if version != VERSION {
        return Err(format!("format version {version}, expected {VERSION}"));
    }
    let name = stored_name(tag);
    let name_len = usize::from(u16::from_le_bytes([page[14], page[15]]));
    let same = page[12] == dtype_code(dtype)
        && page[13] == kind_code(tag.kind)
        && u64_at(page, 16) == tag.layer as u64
        && name_len == name.len()
        && &page[NAME_AT..NAME_AT + name_len.min(MAX_NAME)] == name;
    if !same {
        return Err("the header is another tensor's".into());
    }
    let len = u64_at(page, 24);
    if len != data_len {
        return Err(format!("the header says {len} data bytes, the ticket {data_len}"));
    }
    Ok(u32_at(page, 32))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(layer: usize, name: &'static str) -> TensorTag {
        TensorTag { layer, name: name.into(), kind: TensorKind::Activation }
    }

    #[test]
    fn a_header_round_trips_and_any_change_is_caught() {
        let mut page = vec![0u8; HEADER_BYTES];
        encode(&mut page, &tag(3, "q"), DType::Bf16, 1234, 0xdead_beef);
        assert_eq!(check(&page, &tag(3, "q"), DType::Bf16, 1234), Ok(0xdead_beef));
        assert!(check(&page, &tag(4, "q"), DType::Bf16, 1234).is_err());
        assert!(check(&page, &tag(3, "k"), DType::Bf16, 1234).is_err());
        assert!(check(&page, &tag(3, "q"), DType::F32, 1234).is_err());
        assert!(check(&page, &tag(3, "q"), DType::Bf16, 1235).is_err());
        for at in [0, 9, 13, 20, 33, 37, 40, 4000] {
            let mut bad = page.clone();
            bad[at] ^= 0x10;
            assert!(check(&bad, &tag(3, "q"), DType::Bf16, 1234).is_err(), "flip at {at}");
        }
    }

    #[test]
    fn long_names_are_truncated_not_refused() {
        let long: &'static str = Box::leak("n".repeat(5000).into_boxed_str());
        let mut page = vec![0u8; HEADER_BYTES];
        encode(&mut page, &tag(0, long), DType::F16, 1, 0);
        assert!(check(&page, &tag(0, long), DType::F16, 1).is_ok());
    }
}
