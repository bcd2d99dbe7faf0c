//! A KV block as it travels between ranks: keys, values and (for packed sequences) document ids in one
//! 4-byte-aligned buffer, so one message carries the whole block and the receiver views it without a copy.

use half::{bf16, f16};
use longctx_kernels::{DType, HostSlice};

/// Where the parts of a packed block lie.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvPacking {
    pub dtype: DType,
    /// Elements of K (and of V).
    pub kv_elems: usize,
    /// Document ids carried (one per token).
    pub doc_len: usize,
}

impl KvPacking {
    /// The packing of a block of `kv_elems` keys (and as many values) of `dtype`, with `docs` if given.
    pub fn for_block(dtype: DType, kv_elems: usize, docs: Option<&[u32]>) -> Self {
        Self { dtype, kv_elems, doc_len: docs.map_or(0, |d| d.len()) }
    }

    /// 32-bit words for K (or V).
    fn words(&self) -> usize {
        match self.dtype {
            DType::F32 => self.kv_elems,
            // head dims are multiples of 8, so the element count is even.
            DType::Bf16 | DType::F16 => self.kv_elems / 2,
        }
    }
    /// Words in the packed block.
    pub fn len(&self) -> usize {
        2 * self.words() + self.doc_len
    }

    /// Packs `k`, `v` (same dtype) and `docs` into `buf` (replacing what it held, keeping its allocation).
    pub fn pack_into(&self, buf: &mut Vec<u32>, k: HostSlice<'_>, v: HostSlice<'_>, docs: Option<&[u32]>) {
        buf.clear();
        buf.reserve(self.len());
        for x in [k, v] {
            match x {
                HostSlice::F32(s) => buf.extend_from_slice(bytemuck::cast_slice::<f32, u32>(s)),
                HostSlice::Bf16(s) => buf.extend_from_slice(bytemuck::cast_slice::<bf16, u32>(s)),
                HostSlice::F16(s) => buf.extend_from_slice(bytemuck::cast_slice::<f16, u32>(s)),
            }
        }
        if let Some(d) = docs {
            buf.extend_from_slice(d);
        }
    }

    /// Views a packed buffer as `(k, v, docs)`.
    pub fn view<'a>(&self, buf: &'a [u32]) -> (HostSlice<'a>, HostSlice<'a>, Option<&'a [u32]>) {
        let w = self.words();
        let part = |s: &'a [u32]| match self.dtype {
            DType::F32 => HostSlice::F32(bytemuck::cast_slice(s)),
            DType::Bf16 => HostSlice::Bf16(bytemuck::cast_slice(s)),
            DType::F16 => HostSlice::F16(bytemuck::cast_slice(s)),
        };
        let docs = (self.doc_len > 0).then(|| &buf[2 * w..2 * w + self.doc_len]);
        (part(&buf[..w]), part(&buf[w..2 * w]), docs)
    }
}
