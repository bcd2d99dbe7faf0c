//! Collectives, written once over the point-to-point layer of any transport.
//!
//! Every message of a collective carries a 64-bit descriptor of the call (operation, byte count, root or
//! reduction operator). The transports compare the descriptors of matched messages, so ranks that call
//! different collectives or pass different sizes get [`CommError::CollectiveMismatch`] instead of corrupt data.
//!
//! Ring algorithms (n ranks, chunk `c` of a buffer is its `c`-th of n near-equal parts; next = r+1, prev = r-1):
//! - reduce-scatter: at step `s` in `0..n-1` rank `r` sends its partial chunk `r-s-1` and adds the received
//!   partial chunk `r-s-2`; after n-1 steps it holds chunk `r` fully reduced.
//! - all-gather: at step `s` rank `r` forwards chunk `r-s` and receives chunk `r-s-1` in place.
//! - all-reduce: reduce-scatter then all-gather, 2(n-1)/n of the buffer sent per rank (bandwidth-optimal). Each
//!   chunk is reduced by one rank and then copied, so all ranks end with bit-identical results.

use std::any::TypeId;
use std::ops::Range;

use bytemuck::Pod;

use crate::communicator::Communicator;
use crate::error::CommError;
use crate::op::{meta, ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BARRIER, BROADCAST, INTERNAL, REDUCE_SCATTER};
use crate::reduce::{combine_into, Reduce, ReduceOp};

/// Range of chunk `c` when `len` elements are cut into `n` parts whose sizes differ by at most one.
fn chunk(len: usize, n: usize, c: usize) -> Range<usize> {
    let (base, rem) = (len / n, len % n);
    let start = c * base + c.min(rem);
    start..start + base + usize::from(c < rem)
}

/// Two disjoint parts of one buffer, the first shared, the second exclusive.
fn disjoint<T>(buf: &mut [T], a: Range<usize>, b: Range<usize>) -> (&[T], &mut [T]) {
    debug_assert!(a.end <= b.start || b.end <= a.start);
    if a.start < b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

fn bytes<T: Pod>(s: &[T]) -> &[u8] {
    bytemuck::cast_slice(s)
}

fn bytes_mut<T: Pod>(s: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(s)
}

impl Communicator {
    fn ring(&self) -> (usize, usize, usize, usize) {
        let (r, n) = (self.rank(), self.world_size());
        (r, n, (r + 1) % n, (r + n - 1) % n)
    }

    /// Ring reduce-scatter in place over `n` chunks given by `range`; rank r ends with chunk r reduced.
    fn ring_reduce_scatter<A: Reduce<Acc = A>>(
        &self,
        buf: &mut [A],
        range: impl Fn(usize) -> Range<usize>,
        op: ReduceOp,
        m: u64,
    ) -> Result<(), CommError> {
        let (r, n, next, prev) = self.ring();
        let max = (0..n).map(|c| range(c).len()).max().unwrap_or(0);
        self.with_scratch::<A, _>(max, |tmp| {
            for s in 0..n - 1 {
                let sc = range((r + 2 * n - s - 1) % n);
                let rc = range((r + 2 * n - s - 2) % n);
                let tmp = &mut tmp[..rc.len()];
                self.exchange(INTERNAL | (m >> 56), m, (next, bytes(&buf[sc])), (prev, bytes_mut(tmp)))?;
                combine_into(&mut buf[rc], tmp, op);
            }
            Ok(())
        })
    }

    /// Ring all-gather in place: rank r contributes chunk r.
    fn ring_all_gather<A: Pod>(
        &self,
        buf: &mut [A],
        range: impl Fn(usize) -> Range<usize>,
        m: u64,
    ) -> Result<(), CommError> {
        let (r, n, next, prev) = self.ring();
        for s in 0..n - 1 {
            let (send, recv) = disjoint(buf, range((r + n - s) % n), range((r + 2 * n - s - 1) % n));
            self.exchange(INTERNAL | (m >> 56), m, (next, bytes(send)), (prev, bytes_mut(recv)))?;
        }
        Ok(())
    }

    fn all_reduce_acc<A: Reduce<Acc = A>>(&self, buf: &mut [A], op: ReduceOp, m: u64) -> Result<(), CommError> {
        let (len, n) = (buf.len(), self.world_size());
        self.ring_reduce_scatter(buf, |c| chunk(len, n, c), op, m)?;
        self.ring_all_gather(buf, |c| chunk(len, n, c), m)
    }

    /// Synchronises all ranks: returns once every rank has entered (dissemination, ⌈log2 n⌉ rounds).
    pub fn barrier(&self) -> Result<(), CommError> {
        let (r, n) = (self.rank(), self.world_size());
        let m = meta(BARRIER, 0, 0);
        let mut k = 1;
        while k < n {
            self.exchange(INTERNAL | BARRIER, m, ((r + k) % n, &[]), ((r + n - k) % n, &mut []))?;
            k <<= 1;
        }
        Ok(())
    }

    /// Reduces `buf` element-wise over all ranks, in place on every rank (ring reduce-scatter + all-gather).
    /// `bf16` is accumulated and exchanged in `f32`. Every rank ends with bit-identical values.
    pub fn all_reduce<T: Reduce>(&self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        if self.world_size() == 1 {
            return Ok(());
        }
        let m = meta(ALL_REDUCE, std::mem::size_of_val(buf), op as u64);
        if TypeId::of::<T>() == TypeId::of::<T::Acc>() {
            // T is its own accumulator: reduce in place, no allocation.
            self.all_reduce_acc::<T::Acc>(bytemuck::cast_slice_mut(buf), op, m)
        } else {
            let mut acc: Vec<T::Acc> = buf.iter().map(|x| x.to_acc()).collect();
            self.all_reduce_acc(&mut acc, op, m)?;
            for (x, a) in buf.iter_mut().zip(acc) {
                *x = T::from_acc(a);
            }
            Ok(())
        }
    }

    /// Gathers every rank's `send` into `recv`, concatenated in rank order (`recv.len() = n * send.len()`).
    pub fn all_gather<T: Pod>(&self, send: &[T], recv: &mut [T]) -> Result<(), CommError> {
        let (r, n) = (self.rank(), self.world_size());
        let k = send.len();
        if recv.len() != n * k {
            return Err(CommError::InvalidArgument(format!(
                "all_gather: recv has {} elements, expected world_size {n} x send {k}",
                recv.len()
            )));
        }
        recv[r * k..(r + 1) * k].copy_from_slice(send);
        self.ring_all_gather(recv, |c| c * k..(c + 1) * k, meta(ALL_GATHER, std::mem::size_of_val(send), 0))
    }

    /// Reduces `send` (n chunks of `recv.len()`) over all ranks and leaves chunk `rank` of the result in `recv`.
    pub fn reduce_scatter<T: Reduce>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        let (r, n) = (self.rank(), self.world_size());
        let k = recv.len();
        if send.len() != n * k {
            return Err(CommError::InvalidArgument(format!(
                "reduce_scatter: send has {} elements, expected world_size {n} x recv {k}",
                send.len()
            )));
        }
        let mut acc: Vec<T::Acc> = send.iter().map(|x| x.to_acc()).collect();
        let m = meta(REDUCE_SCATTER, std::mem::size_of_val(send), op as u64);
        self.ring_reduce_scatter(&mut acc, |c| c * k..(c + 1) * k, op, m)?;
        for (x, &a) in recv.iter_mut().zip(&acc[r * k..(r + 1) * k]) {
            *x = T::from_acc(a);
        }
        Ok(())
    }

    /// Copies `buf` of rank `root` into `buf` of every rank (binomial tree, ⌈log2 n⌉ rounds).
    pub fn broadcast<T: Pod>(&self, buf: &mut [T], root: usize) -> Result<(), CommError> {
        let (r, n) = (self.rank(), self.world_size());
        if root >= n {
            return Err(CommError::InvalidRank { rank: root, world_size: n });
        }
        let m = meta(BROADCAST, std::mem::size_of_val(buf), root as u64);
        let key = INTERNAL | BROADCAST;
        let vr = (r + n - root) % n;
        let mut mask = 1;
        while mask < n {
            if vr & mask != 0 {
                let src = (vr - mask + root) % n;
                self.recv_bytes(src, key, m, bytes_mut(buf))?;
                break;
            }
            mask <<= 1;
        }
        mask >>= 1;
        while mask > 0 {
            if vr + mask < n {
                let dst = (vr + mask + root) % n;
                self.send_bytes(dst, key, m, bytes(buf))?;
            }
            mask >>= 1;
        }
        Ok(())
    }

    /// Personalised exchange: chunk `i` of `send` goes to rank `i`, and chunk `j` of `recv` comes from rank `j`
    /// (equal chunks of `len / n`; pairwise exchange in n-1 steps).
    pub fn all_to_all<T: Pod>(&self, send: &[T], recv: &mut [T]) -> Result<(), CommError> {
        let (r, n) = (self.rank(), self.world_size());
        if send.len() != recv.len() || !send.len().is_multiple_of(n) {
            return Err(CommError::InvalidArgument(format!(
                "all_to_all: send ({}) and recv ({}) must have the same length, a multiple of world_size {n}",
                send.len(),
                recv.len()
            )));
        }
        let k = send.len() / n;
        let m = meta(ALL_TO_ALL, std::mem::size_of_val(send), 0);
        recv[r * k..(r + 1) * k].copy_from_slice(&send[r * k..(r + 1) * k]);
        for s in 1..n {
            let (dst, src) = ((r + s) % n, (r + n - s) % n);
            let out = bytes(&send[dst * k..(dst + 1) * k]);
            self.exchange(INTERNAL | ALL_TO_ALL, m, (dst, out), (src, bytes_mut(&mut recv[src * k..(src + 1) * k])))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_buffer() {
        for len in 0..20 {
            for n in 1..6 {
                let mut next = 0;
                for c in 0..n {
                    let r = chunk(len, n, c);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn disjoint_both_orders() {
        let mut v = [0, 1, 2, 3, 4, 5];
        let (a, b) = disjoint(&mut v, 4..6, 0..2);
        assert_eq!(a, &[4, 5]);
        b[0] = 9;
        let (a, b) = disjoint(&mut v, 0..2, 3..4);
        assert_eq!(a, &[9, 1]);
        assert_eq!(b, &mut [3]);
    }
}
