//! What a plan keeps between calls on the backend: [`Scratch`], a buffer reused by every call, and [`KvBlock`],
//! a KV block as it travels between ranks.

use longctx_kernels::{Backend, Buffer, DType, Dims, View, ViewMut};

use crate::error::Result;

/// A backend buffer kept between calls and viewed with the dims of each use: allocated on first use and again
/// only when a call needs more elements or another dtype, so a steady loop allocates nothing.
#[derive(Debug, Default)]
pub(crate) struct Scratch(Option<Buffer>);

impl Scratch {
    /// Makes room for `len` elements of `dtype`.
    pub fn ensure(&mut self, backend: &dyn Backend, dtype: DType, len: usize) -> Result<()> {
        let fits = self.0.as_ref().is_some_and(|b| b.dtype() == dtype && b.len() >= len);
        if !fits {
            self.0 = Some(backend.empty(dtype, Dims::new(&[len.max(1)])?)?);
        }
        Ok(())
    }

    fn buffer(&self) -> &Buffer {
        self.0.as_ref().expect("Scratch::ensure runs before a scratch buffer is viewed")
    }

    /// The first elements, viewed with `dims`.
    pub fn view(&self, dims: &[usize]) -> Result<View<'_>> {
        let n = dims.iter().product();
        Ok(self.buffer().view().rows(0, n)?.reshape(dims)?)
    }

    /// The first elements, writable, viewed with `dims`.
    pub fn view_mut(&mut self, dims: &[usize]) -> Result<ViewMut<'_>> {
        let n = dims.iter().product();
        let b = self.0.as_mut().expect("Scratch::ensure runs before a scratch buffer is viewed");
        Ok(b.view_mut().rows(0, n)?.reshape(dims)?)
    }

    /// The first `2·n` elements as two writable halves of `dims` each (`n` their element count).
    pub fn halves_mut(&mut self, dims: &[usize]) -> Result<(ViewMut<'_>, ViewMut<'_>)> {
        let n: usize = dims.iter().product();
        let b = self.0.as_mut().expect("Scratch::ensure runs before a scratch buffer is viewed");
        let (a, c) = b.view_mut().rows(0, 2 * n)?.split_rows(n)?;
        Ok((a.reshape(dims)?, c.reshape(dims)?))
    }

    /// The first `2·n` elements as two halves of `dims` each.
    pub fn halves(&self, dims: &[usize]) -> Result<(View<'_>, View<'_>)> {
        let n: usize = dims.iter().product();
        let v = self.buffer().view();
        Ok((v.rows(0, n)?.reshape(dims)?, v.rows(n, n)?.reshape(dims)?))
    }
}

/// A KV block as it travels between ranks: K and V in the two halves of one backend buffer (two messages, each
/// read and written where the backend keeps it) and, for packed sequences, the block's document ids (host
/// metadata of the mask, a third message).
#[derive(Debug, Default)]
pub(crate) struct KvBlock {
    pub kv: Scratch,
    pub docs: Vec<u32>,
}

impl KvBlock {
    /// Makes room for K and V of `kv_elems` elements of `dtype` each, and `doc_len` document ids.
    pub fn ensure(&mut self, backend: &dyn Backend, dtype: DType, kv_elems: usize, doc_len: usize) -> Result<()> {
        self.kv.ensure(backend, dtype, 2 * kv_elems)?;
        self.docs.resize(doc_len, 0);
        Ok(())
    }
}
