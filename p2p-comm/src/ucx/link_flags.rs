//! Which peers a process has closed its link to, in shared memory that the processes of one host read.
//!
//! Why: a send that fails (a receiver stalled past the timeout) is withdrawn by force-closing the endpoint and
//! returning the buffer to the caller. Over shared memory the *receiver* pulls a large message from the sender's
//! memory (CMA), and a receiver that was only stopped goes on pulling when it resumes: from freed memory (UCX
//! before 1.22 then aborts the process; 1.22 fails the receive) or from reused memory, which would complete the
//! receive with whatever it holds.
//! So before it gives up on a send, a process raises the flag of that receiver in its own segment; a receive
//! from a peer on this host only counts as done if that peer's flag for this rank is still down after UCX
//! finished it. The flag goes up before the buffer is returned, the buffer is reused after that, and the
//! receiver reads the flag after the data, so a receive that read reused memory always sees it.
//!
//! Each process creates a small file under `/dev/shm` (else the temporary directory; mode 0600) holding a
//! random nonce and one flag per world rank, publishes its path and nonce through the rendezvous store, maps
//! every peer's file read-only (a path that does not open or whose nonce differs belongs to a process on
//! another host), and unlinks its own file once every rank has mapped it (the mappings outlive the name). Peers
//! on other hosts are not covered: between hosts UCX pushes over TCP, where a withdrawn send leaves the receive
//! unfinished; RDMA reads (InfiniBand) are the case left open.

use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{fence, AtomicU32, Ordering};

const NONCE: usize = 16;

/// One mapped segment: a nonce, then one flag per world rank.
struct Segment {
    base: *mut u8,
    len: usize,
    ranks: usize,
}

// SAFETY: the mapping is only accessed through atomics (the flags) or read once at attach (the nonce).
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

impl Segment {
    fn size(ranks: usize) -> usize {
        NONCE + 4 * ranks
    }

    fn map(file: &std::fs::File, ranks: usize, writable: bool) -> std::io::Result<Segment> {
        let len = Self::size(ranks);
        let prot = if writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
        // SAFETY: maps `len` bytes of a file that has at least that length (checked or set by the callers).
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, file.as_raw_fd(), 0) };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Segment { base: p.cast(), len, ranks })
    }

    fn flag(&self, rank: usize) -> &AtomicU32 {
        assert!(rank < self.ranks, "rank {rank} outside the segment's {} ranks", self.ranks);
        // SAFETY: in bounds (above), 4-byte aligned (page-aligned base + 16 + 4k), and only ever accessed
        // atomically while the segment is mapped, which `self` guarantees.
        unsafe { &*(self.base.add(NONCE + 4 * rank) as *const AtomicU32) }
    }

    fn nonce(&self) -> [u8; NONCE] {
        let mut n = [0u8; NONCE];
        // SAFETY: the first NONCE bytes of the mapping; written by the owner before it published the path.
        unsafe { std::ptr::copy_nonoverlapping(self.base, n.as_mut_ptr(), NONCE) };
        n
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `map` mapped; no reference into it outlives `self`.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// This process's flags (writable) and those of the peers on this host (read-only).
pub(crate) struct LinkFlags {
    me: usize,
    own: Option<(Segment, PathBuf)>,
    peers: Vec<Option<Segment>>,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl LinkFlags {
    /// Creates this process's segment for a world of `ranks`; returns the flags and what to publish to the
    /// peers. Without a usable `/dev/shm`, the flags cover nobody (and say so in what they publish).
    pub(crate) fn create(me: usize, ranks: usize) -> (LinkFlags, String) {
        let none = || (LinkFlags { me, own: None, peers: (0..ranks).map(|_| None).collect() }, String::from("-"));
        let mut nonce = [0u8; NONCE];
        if std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut nonce)).is_err() {
            return none();
        }
        let name = format!("longctx-{}-{}", std::process::id(), hex(&nonce[..8]));
        // A file in the temporary directory, mapped shared, works as well where there is no /dev/shm.
        for dir in [PathBuf::from("/dev/shm"), std::env::temp_dir()] {
            let path = dir.join(&name);
            let made =
                OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(&path).and_then(|mut f| {
                    f.write_all(&nonce)?;
                    f.set_len(Segment::size(ranks) as u64)?;
                    Segment::map(&f, ranks, true)
                });
            match made {
                Ok(seg) => {
                    let published = format!("{} {}", path.display(), hex(&nonce));
                    let mut flags = none().0;
                    flags.own = Some((seg, path));
                    return (flags, published);
                }
                Err(_) => {
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        none()
    }

    /// Maps `peer`'s segment from what it published, if it is on this host.
    pub(crate) fn attach(&mut self, peer: usize, published: &str) {
        if peer == self.me {
            return;
        }
        let Some((path, nonce)) = published.split_once(' ') else { return };
        let ranks = self.peers.len();
        let Ok(f) = std::fs::File::open(path) else { return }; // another host's, or no /dev/shm here
        if f.metadata().map_or(true, |m| m.len() < Segment::size(ranks) as u64) {
            return;
        }
        if let Ok(seg) = Segment::map(&f, ranks, false) {
            if hex(&seg.nonce()) == nonce {
                self.peers[peer] = Some(seg);
            }
        }
    }

    /// Removes this process's file once every peer has mapped it (the mappings stay).
    pub(crate) fn unlink(&self) {
        if let Some((_, path)) = &self.own {
            let _ = std::fs::remove_file(path);
        }
    }

    /// Raises `peer`'s flag: this process is about to give up a send to it. Returns once the flag is visible
    /// before anything this thread writes afterwards (the caller's reuse of the buffer).
    pub(crate) fn close_link_to(&self, peer: usize) {
        if let Some((seg, _)) = &self.own {
            seg.flag(peer).fetch_add(1, Ordering::SeqCst);
            fence(Ordering::SeqCst);
        }
    }

    /// Whether `peer` (on this host) gave up a send to this process. Read after a receive's data has landed.
    pub(crate) fn closed_by(&self, peer: usize) -> bool {
        fence(Ordering::SeqCst);
        self.peers.get(peer).and_then(Option::as_ref).is_some_and(|s| s.flag(self.me).load(Ordering::SeqCst) > 0)
    }

    /// How many peers' segments are mapped (peers on this host).
    #[cfg(test)]
    pub(crate) fn attached(&self) -> usize {
        self.peers.iter().filter(|p| p.is_some()).count()
    }
}

impl Drop for LinkFlags {
    fn drop(&mut self) {
        self.unlink();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_see_each_others_flags_and_only_theirs() {
        let (mut a, pa) = LinkFlags::create(0, 3);
        let (mut b, pb) = LinkFlags::create(1, 3);
        assert_ne!(pa, "-", "neither /dev/shm nor the temporary directory takes a file here");
        a.attach(1, &pb);
        b.attach(0, &pa);
        a.attach(2, "/dev/shm/longctx-no-such 00"); // another host's
        assert_eq!((a.attached(), b.attached()), (1, 1));
        // A wrong nonce (a same-named file of another job) is not attached.
        let (mut c, _) = LinkFlags::create(2, 3);
        c.attach(0, &format!("{} {}", pa.split_once(' ').unwrap().0, "00".repeat(16)));
        assert_eq!(c.attached(), 0);
        // The names go; the mappings stay.
        a.unlink();
        b.unlink();
        assert!(!std::path::Path::new(pa.split_once(' ').unwrap().0).exists());
        assert!(!b.closed_by(0) && !a.closed_by(1));
        a.close_link_to(2);
        assert!(!b.closed_by(0), "a flag for rank 2 is not one for rank 1");
        a.close_link_to(1);
        assert!(b.closed_by(0));
        assert!(!a.closed_by(1));
    }
}
