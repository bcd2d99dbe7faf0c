//! The transport-generic test suite: every test is written once as a per-rank body over a [`World`] and
//! instantiated per transport by `suite_tests!` (threads always, UCX processes with the `ucx` feature).
#![allow(dead_code)]

use std::time::{Duration, Instant};

use half::bf16;
use longctx_p2p::{CommError, Communicator, Reduce, ReduceOp};

/// Starts `n` ranks, runs `body` on each and returns each rank's outcome (a dead rank is an `Err`).
pub trait World {
    /// Runs the body on `n` ranks with the given communicator timeout.
    fn run(
        n: usize,
        timeout: Duration,
        name: &str,
        body: &(dyn Fn(Communicator) -> Result<(), String> + Sync),
    ) -> Vec<Result<(), String>>;
    /// Makes this rank die abruptly (thread panic / process exit).
    fn die() -> !;
    /// Whether the sender of a message the receiver rejected (wrong length) learns of it (threads) or sees its
    /// send complete (UCX: see its module docs). Every other error is the same variant on every transport.
    const SENDER_SEES_REJECTION: bool;
}

pub fn all_ok(outcomes: Vec<Result<(), String>>) {
    let failed: Vec<String> =
        outcomes.iter().enumerate().filter_map(|(r, o)| o.as_ref().err().map(|e| format!("rank {r}: {e}"))).collect();
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

pub fn e2s(e: CommError) -> String {
    e.to_string()
}

/// [`e2s`] for an owned request's error, dropping the buffer it handed back.
pub fn oe2s<B>((e, _): (CommError, B)) -> String {
    e.to_string()
}

/// splitmix64: deterministic data every rank can regenerate for every other rank.
pub struct Rng(u64);
impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

pub trait Gen: Reduce + PartialEq + std::fmt::Debug {
    fn gen(r: &mut Rng) -> Self;
    fn close(a: Self, b: Self, n: usize) -> bool;
}
impl Gen for f32 {
    fn gen(r: &mut Rng) -> Self {
        r.f32()
    }
    fn close(a: Self, b: Self, n: usize) -> bool {
        (a - b).abs() <= 1e-5 * n as f32
    }
}
impl Gen for f64 {
    fn gen(r: &mut Rng) -> Self {
        r.f32() as f64
    }
    fn close(a: Self, b: Self, n: usize) -> bool {
        (a - b).abs() <= 1e-12 * n as f64
    }
}
impl Gen for bf16 {
    fn gen(r: &mut Rng) -> Self {
        bf16::from_f32(r.f32())
    }
    fn close(a: Self, b: Self, n: usize) -> bool {
        (a.to_f32() - b.to_f32()).abs() <= 1e-5 * n as f32 + b.to_f32().abs() / 128.0
    }
}
impl Gen for i32 {
    fn gen(r: &mut Rng) -> Self {
        r.next() as i32
    }
    fn close(a: Self, b: Self, _: usize) -> bool {
        a == b
    }
}
impl Gen for i64 {
    fn gen(r: &mut Rng) -> Self {
        r.next() as i64
    }
    fn close(a: Self, b: Self, _: usize) -> bool {
        a == b
    }
}
impl Gen for u64 {
    fn gen(r: &mut Rng) -> Self {
        r.next()
    }
    fn close(a: Self, b: Self, _: usize) -> bool {
        a == b
    }
}

fn data<T: Gen>(seed: u64, rank: usize, len: usize) -> Vec<T> {
    let mut r = Rng::new(seed.wrapping_mul(1000).wrapping_add(rank as u64));
    (0..len).map(|_| T::gen(&mut r)).collect()
}

/// Sequential reference: reduce every rank's data in rank order, accumulating in `T::Acc`.
fn reference<T: Gen>(seed: u64, n: usize, len: usize, op: ReduceOp) -> Vec<T> {
    let mut acc: Vec<T::Acc> = data::<T>(seed, 0, len).into_iter().map(T::to_acc).collect();
    for r in 1..n {
        for (a, x) in acc.iter_mut().zip(data::<T>(seed, r, len)) {
            *a = a.combine(x.to_acc(), op);
        }
    }
    acc.into_iter().map(T::from_acc).collect()
}

fn check<T: Gen>(what: &str, got: &[T], want: &[T], n: usize) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: length {} != {}", got.len(), want.len()));
    }
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if !T::close(g, w, n) {
            return Err(format!("{what}: element {i}: got {g:?}, want {w:?}"));
        }
    }
    Ok(())
}

fn reduce_case<T: Gen>(c: &Communicator, seed: u64, len: usize) -> Result<(), String> {
    let (r, n) = (c.rank(), c.world_size());
    let ty = std::any::type_name::<T>();
    for op in [ReduceOp::Sum, ReduceOp::Max] {
        let mut buf = data::<T>(seed, r, len);
        c.all_reduce(&mut buf, op).map_err(e2s)?;
        check(&format!("all_reduce {op:?} {ty}"), &buf, &reference::<T>(seed, n, len, op), n)?;
        // Bit-identical on every rank: gather everyone's result and compare with ours.
        let mut all = vec![T::zeroed(); n * len];
        c.all_gather(&buf, &mut all).map_err(e2s)?;
        if all
            .chunks(len.max(1))
            .any(|ch| len > 0 && bytemuck::cast_slice::<T, u8>(ch) != bytemuck::cast_slice::<T, u8>(&buf))
        {
            return Err(format!("all_reduce {op:?} {ty}: ranks disagree bitwise"));
        }
        let k = len / n;
        let send = data::<T>(seed, r, k * n);
        let mut recv = vec![T::zeroed(); k];
        c.reduce_scatter(&send, &mut recv, op).map_err(e2s)?;
        let full = reference::<T>(seed, n, k * n, op);
        check(&format!("reduce_scatter {op:?} {ty}"), &recv, &full[r * k..(r + 1) * k], n)?;
    }
    Ok(())
}

/// Every collective against a sequential reference on random data of `len` elements.
pub fn collectives(c: Communicator, seed: u64, len: usize) -> Result<(), String> {
    let (r, n) = (c.rank(), c.world_size());
    reduce_case::<f32>(&c, seed, len)?;
    reduce_case::<f64>(&c, seed, len)?;
    reduce_case::<bf16>(&c, seed, len)?;
    reduce_case::<i32>(&c, seed, len)?;
    reduce_case::<i64>(&c, seed, len)?;
    reduce_case::<u64>(&c, seed, len)?;
    // all_gather
    let mine = data::<u64>(seed, r, len);
    let mut all = vec![0u64; n * len];
    c.all_gather(&mine, &mut all).map_err(e2s)?;
    for q in 0..n {
        check("all_gather", &all[q * len..(q + 1) * len], &data::<u64>(seed, q, len), n)?;
    }
    // broadcast from every root
    for root in 0..n {
        let mut buf = if r == root { data::<f32>(seed, root, len) } else { vec![0.0; len] };
        c.broadcast(&mut buf, root).map_err(e2s)?;
        check("broadcast", &buf, &data::<f32>(seed, root, len), 1)?;
    }
    // all_to_all: chunk j of rank q's data goes to rank j
    let k = len / n;
    let send = data::<i32>(seed, r, k * n);
    let mut recv = vec![0i32; k * n];
    c.all_to_all(&send, &mut recv).map_err(e2s)?;
    for q in 0..n {
        check("all_to_all", &recv[q * k..(q + 1) * k], &data::<i32>(seed, q, k * n)[r * k..(r + 1) * k], 1)?;
    }
    c.barrier().map_err(e2s)
}

/// Ring shift (blocking and non-blocking) all the way round: after n shifts every rank holds its own block.
pub fn ring_shift(c: Communicator) -> Result<(), String> {
    let (r, n) = (c.rank(), c.world_size());
    let len = 1000 + 7;
    let mut block = data::<f32>(7, r, len);
    let mut next = vec![0.0f32; len];
    c.sendrecv(&block, &mut next).map_err(e2s)?;
    check("sendrecv", &next, &data::<f32>(7, (r + n - 1) % n, len), 1)?;
    std::mem::swap(&mut block, &mut next);
    for _ in 1..n {
        c.scope(|s| s.isendrecv(&block, &mut next)?.wait()).map_err(e2s)?;
        std::mem::swap(&mut block, &mut next);
    }
    check("full circle", &block, &data::<f32>(7, r, len), 1)?;
    let s = c.stats();
    let bytes = (n * len * 4) as u64;
    if s.bytes_sent != bytes || s.bytes_received != bytes || s.messages_sent != n as u64 {
        return Err(format!("stats {s:?}, expected {bytes} bytes in {n} messages each way"));
    }
    // test() polling completes too.
    c.scope(|s| {
        let mut req = s.isendrecv(&block, &mut next).map_err(e2s)?;
        let t0 = Instant::now();
        while !req.test().map_err(e2s)? {
            if t0.elapsed() > Duration::from_secs(20) {
                return Err("test() never completed".to_string());
            }
            std::thread::yield_now();
        }
        Ok(())
    })?;
    check("after test()", &next, &data::<f32>(7, (r + n - 1) % n, len), 1)
}

/// Messages of the given byte sizes from every rank to the next one, many in flight, random contents.
pub fn send_recv_sizes(c: Communicator, seed: u64, sizes: &[usize]) -> Result<(), String> {
    let (r, n) = (c.rank(), c.world_size());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let outs: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, &s)| bytes(seed + i as u64, r, s)).collect();
    let mut ins: Vec<Vec<u8>> = sizes.iter().map(|&s| vec![0u8; s]).collect();
    c.scope(|s| {
        let mut reqs = Vec::new();
        // Post receives in reverse order to exercise tag matching out of order.
        for (i, buf) in ins.iter_mut().enumerate().rev() {
            reqs.push(s.irecv(prev, i as u32, buf)?);
        }
        for (i, buf) in outs.iter().enumerate() {
            reqs.push(s.isend(next, i as u32, buf)?);
        }
        reqs.into_iter().try_for_each(|q| q.wait())
    })
    .map_err(e2s)?;
    for (i, buf) in ins.iter().enumerate() {
        if buf != &bytes(seed + i as u64, prev, sizes[i]) {
            return Err(format!("message {i} of {} bytes corrupted", sizes[i]));
        }
    }
    // Blocking send/recv pairs, ordered to avoid the synchronous-send cycle.
    if n == 1 {
        return Ok(()); // a synchronous send to oneself cannot complete before the receive is posted
    }
    let payload = bytes(seed, r, 4097);
    let mut got = vec![0u8; 4097];
    if r % 2 == 0 {
        c.send(next, 99, &payload).map_err(e2s)?;
        c.recv(prev, 99, &mut got).map_err(e2s)?;
    } else {
        c.recv(prev, 99, &mut got).map_err(e2s)?;
        c.send(next, 99, &payload).map_err(e2s)?;
    }
    if got != bytes(seed, prev, 4097) {
        return Err("blocking send/recv corrupted".into());
    }
    Ok(())
}

fn bytes(seed: u64, rank: usize, len: usize) -> Vec<u8> {
    let mut r = Rng::new(seed.wrapping_mul(31).wrapping_add(rank as u64));
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        let x = r.next().to_le_bytes();
        v.extend_from_slice(&x[..(len - v.len()).min(8)]);
    }
    v
}

/// Ranks 0 and 1 send `mib` MiB to each other at the same time (non-blocking sends, then blocking receives).
pub fn bidirectional(c: Communicator, mib: usize) -> Result<(), String> {
    let r = c.rank();
    if r > 1 {
        return Ok(());
    }
    let peer = 1 - r;
    let len = mib << 20;
    let out = bytes(5, r, len);
    let mut inp = vec![0u8; len];
    c.scope(|s| {
        let req = s.isend(peer, 1, &out)?;
        c.recv(peer, 1, &mut inp)?;
        req.wait()
    })
    .map_err(e2s)?;
    if inp != bytes(5, peer, len) {
        return Err("payload corrupted".into());
    }
    Ok(())
}

/// A scope finishes what its requests leave: a receive whose request was leaked (`std::mem::forget`) has its
/// data when the scope returns, and the buffer can be read; a send leaked the same way is delivered. Then the
/// same for a leaked ring shift. Two ranks.
pub fn scope_finishes_leaked_requests(c: Communicator) -> Result<(), String> {
    let (r, n) = (c.rank(), c.world_size());
    if n != 2 {
        return Err(format!("written for 2 ranks, run on {n}"));
    }
    let peer = 1 - r;
    let out = bytes(21, r, 300_000);
    let mut inp = vec![0u8; 300_000];
    let t0 = Instant::now();
    c.scope(|s| {
        if r == 1 {
            std::thread::sleep(Duration::from_millis(200)); // rank 0's scope must wait for this
        }
        std::mem::forget(s.irecv(peer, 3, &mut inp)?);
        std::mem::forget(s.isend(peer, 3, &out)?);
        Ok::<(), CommError>(())
    })
    .map_err(e2s)?;
    if r == 0 && t0.elapsed() < Duration::from_millis(150) {
        return Err(format!("the scope returned after {:?}, before the peer sent", t0.elapsed()));
    }
    if inp != bytes(21, peer, 300_000) {
        return Err("a leaked receive's buffer did not have the message when its scope returned".into());
    }
    // The same with a leaked ring shift (on threads, the exchange channels rather than the mailboxes). With two
    // ranks the ring's next and previous rank are both the peer.
    let mut shifted = vec![0u8; 300_000];
    c.scope(|s| {
        if r == 1 {
            std::thread::sleep(Duration::from_millis(200));
        }
        std::mem::forget(s.isendrecv(&out, &mut shifted)?);
        Ok::<(), CommError>(())
    })
    .map_err(e2s)?;
    if shifted != bytes(21, peer, 300_000) {
        return Err("a leaked ring shift's buffer did not have the block when its scope returned".into());
    }
    Ok(())
}

/// `split` by parity with reversed keys; the child's traffic must not meet the parent's with the same tag.
pub fn split(c: Communicator) -> Result<(), String> {
    let (r, n) = (c.rank(), c.world_size());
    let color = (r % 2) as u32;
    let sub = c.split(color, (n - r) as u32).map_err(e2s)?;
    let members: Vec<usize> = (0..n).filter(|q| q % 2 == r % 2).rev().collect();
    let want_rank = members.iter().position(|&q| q == r).ok_or("rank missing")?;
    if sub.rank() != want_rank || sub.world_size() != members.len() {
        return Err(format!("sub rank {} of {}, want {want_rank} of {}", sub.rank(), sub.world_size(), members.len()));
    }
    // Same tag on parent and child, both in flight: each must receive its own message.
    let (pn, pp) = ((r + 1) % n, (r + n - 1) % n);
    let sn = sub.world_size();
    let (cn, cp) = ((sub.rank() + 1) % sn, (sub.rank() + sn - 1) % sn);
    let (mut from_parent, mut from_child) = ([0u64; 4], [0u64; 4]);
    let parent_msg = [r as u64 + 1000; 4];
    let child_msg = [r as u64 + 2000; 4];
    c.scope(|ps| {
        sub.scope(|cs| {
            let rp = ps.irecv(pp, 7, &mut from_parent)?;
            let rc = cs.irecv(cp, 7, &mut from_child)?;
            let sc = cs.isend(cn, 7, &child_msg)?;
            let sp = ps.isend(pn, 7, &parent_msg)?;
            [rp, rc, sc, sp].into_iter().try_for_each(|q| q.wait())
        })
    })
    .map_err(e2s)?;
    if from_parent[0] != pp as u64 + 1000 {
        return Err(format!("parent got {}", from_parent[0]));
    }
    if from_child[0] != members[cp] as u64 + 2000 {
        return Err(format!("child got {}", from_child[0]));
    }
    let mut x = [r as u64];
    sub.all_reduce(&mut x, ReduceOp::Sum).map_err(e2s)?;
    if x[0] != members.iter().map(|&q| q as u64).sum::<u64>() {
        return Err(format!("sub all_reduce {}", x[0]));
    }
    let before = c.stats();
    let mut y = [1u64];
    sub.all_reduce(&mut y, ReduceOp::Sum).map_err(e2s)?;
    if c.stats() != before {
        return Err("child traffic counted on the parent".into());
    }
    c.barrier().map_err(e2s)
}

fn words(seed: u64, len: usize) -> Vec<u32> {
    (0..len as u64).map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) as u32).collect()
}

/// Owned sends and receives (`Vec` and `Box<[T]>`) and an owned ring shift around the ring, small and large:
/// the data arrives and every buffer comes back.
pub fn owned_round_trip(c: Communicator) -> Result<(), String> {
    let (r, n) = (c.rank(), c.world_size());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    for len in [0usize, 3, 5000, 300_000] {
        let send = c.isend(next, 1, words(r as u64, len)).map_err(oe2s)?;
        let recv = c.irecv(prev, 1, vec![0u32; len].into_boxed_slice()).map_err(oe2s)?;
        if send.buf() != &words(r as u64, len)[..] {
            return Err("an owned send's buffer reads wrong while in flight".into());
        }
        let got = recv.wait().map_err(oe2s)?;
        let sent = send.wait().map_err(oe2s)?;
        if *got != words(prev as u64, len)[..] || sent != words(r as u64, len) {
            return Err(format!("owned send/recv of {len} words: wrong data"));
        }
        let (sent, got) = c.isendrecv(sent, vec![0u32; len]).and_then(|q| q.wait()).map_err(oe2s)?;
        if got != words(prev as u64, len) || sent != words(r as u64, len) {
            return Err(format!("owned ring shift of {len} words: wrong data"));
        }
    }
    c.barrier().map_err(e2s)
}

/// A steady owned ring rotation: the two buffers move into each exchange and back out of its `wait`, so every
/// step reuses the same two allocations (the alloc tests count that no step allocates), and each step delivers
/// the block from `step` hops back.
pub fn owned_ring_reuses_buffers(c: Communicator) -> Result<(), String> {
    let (r, n) = (c.rank(), c.world_size());
    let (mut cur, mut nxt) = (words(r as u64, 20_000), vec![0u32; 20_000]);
    let allocations = [cur.as_ptr() as usize, nxt.as_ptr() as usize];
    for step in 1..=2 * n {
        let req = c.isendrecv(cur, nxt).map_err(oe2s)?;
        (cur, nxt) = req.wait().map_err(oe2s)?;
        std::mem::swap(&mut cur, &mut nxt);
        if cur != words(((r + 2 * n - step) % n) as u64, 20_000) {
            return Err(format!("step {step}: wrong block"));
        }
        let mut now = [cur.as_ptr() as usize, nxt.as_ptr() as usize];
        now.sort_unstable();
        let mut want = allocations;
        want.sort_unstable();
        if now != want {
            return Err(format!("step {step}: the ring's buffers are not the two it started with"));
        }
    }
    Ok(())
}

/// An owned request that fails (its peer never answers and it times out; its peer is gone; it cannot start)
/// hands its buffer back with its contents.
pub fn owned_buffer_comes_back_on_error<W: World>(n: usize) {
    let timeout = Duration::from_millis(300);
    let out = W::run(n, Duration::from_secs(10), "owned_buffer_comes_back_on_error", &|c: Communicator| {
        let r = c.rank();
        let data = words(7, 50_000);
        // Cannot start: the rank does not exist.
        match c.isend(n, 0, data.clone()) {
            Err((CommError::InvalidRank { .. }, back)) if back == data => {}
            other => return Err(format!("isend to rank {n}: {:?}", other.map(drop).map_err(|(e, b)| (e, b.len())))),
        }
        c.barrier().map_err(e2s)?;
        let mut c = c;
        if r == 1 {
            // Answers nothing, then leaves.
            return c.barrier().map_err(e2s);
        }
        if r == 2 {
            // Never receives rank 0's send; waits (ignoring the outcome) until rank 0 is done with it and leaves.
            c.barrier().map_err(e2s)?;
            c.set_timeout(Duration::from_secs(30));
            let _ = c.recv(0, 9, &mut [0u8]);
            return Ok(());
        }
        // A receive nobody sends times out and is withdrawn: its buffer is as it was.
        c.set_timeout(timeout);
        match c.irecv(1, 5, data.clone()).map_err(oe2s)?.wait() {
            Err((CommError::Timeout { peer: 1, .. }, back)) if back == data => {}
            other => return Err(format!("recv timeout: {:?}", other.map(drop).map_err(|(e, b)| (e, b.len())))),
        }
        c.barrier().map_err(e2s)?;
        // Rank 1 is leaving: a receive from it fails naming it and hands the buffer back.
        c.set_timeout(Duration::from_secs(20));
        let t0 = Instant::now();
        match c.irecv(1, 6, data.clone()).and_then(|q| q.wait()) {
            Err((CommError::PeerGone { rank: 1 }, back)) if back == data => {}
            other => {
                return Err(format!("recv from a gone rank: {:?}", other.map(drop).map_err(|(e, b)| (e, b.len()))))
            }
        }
        if t0.elapsed() > Duration::from_secs(10) {
            return Err(format!("the gone rank was noticed after {:?}", t0.elapsed()));
        }
        // A send nobody receives times out (last: with UCX it closes the link to its peer), or completes where
        // the transport buffers it (UCX 1.22 with peer error handling once did); either way the buffer comes back
        // intact.
        c.set_timeout(timeout);
        match c.isend(2, 4, data.clone()).map_err(oe2s)?.wait() {
            Err((CommError::Timeout { peer: 2, .. }, back)) if back == data => {}
            Ok(back) if back == data => {}
            other => return Err(format!("send timeout: {:?}", other.map(drop).map_err(|(e, b)| (e, b.len())))),
        }
        Ok(())
    });
    all_ok(out);
}

/// Leaked owned requests (`std::mem::forget`: a send, a receive, a ring shift, small and large) still move
/// their messages (into or out of the leaked buffer, which stays allocated), and the traffic after them is in
/// step and intact.
pub fn leaked_owned_requests_corrupt_nothing(c: Communicator) -> Result<(), String> {
    let (r, n) = (c.rank(), c.world_size());
    let peer = 1 - r;
    for len in [1000usize, 100_000] {
        if r == 0 {
            std::mem::forget(c.isend(peer, 1, words(1, len)).map_err(oe2s)?);
            std::mem::forget(c.irecv(peer, 2, vec![0u32; len]).map_err(oe2s)?);
        } else {
            let mut got = vec![0u32; len];
            c.recv(peer, 1, &mut got).map_err(e2s)?;
            if got != words(1, len) {
                return Err(format!("the leaked send's message ({len} words) arrived wrong"));
            }
            c.send(peer, 2, &words(2, len)).map_err(e2s)?;
        }
        std::mem::forget(c.isendrecv(words(r as u64 + 3, len), vec![0u32; len]).map_err(oe2s)?);
        // More exchanges than a channel has slots, after the leaked one.
        for i in 0..12u64 {
            let mut got = vec![0u32; len];
            c.sendrecv(&words(i * 10 + r as u64, len), &mut got).map_err(e2s)?;
            if got != words(i * 10 + peer as u64, len) {
                return Err(format!("exchange {i} after the leaked requests ({len} words): wrong data"));
            }
        }
        let mut x = [r as f32 + 1.0];
        c.all_reduce(&mut x, ReduceOp::Sum).map_err(e2s)?;
        if x[0] != (n * (n + 1) / 2) as f32 {
            return Err("all_reduce after the leaked requests".into());
        }
    }
    Ok(())
}

/// Rank 1 aborts with a reason while the others wait on it: their pending operation and their later ones with
/// it fail with `PeerFailed` naming it and carrying the reason, and so do its own later operations.
pub fn failed_peer<W: World>(n: usize) {
    let out = W::run(n, Duration::from_secs(20), "failed_peer", &|c: Communicator| {
        let r = c.rank();
        c.barrier().map_err(e2s)?;
        let is_why =
            |e: &CommError| matches!(e, CommError::PeerFailed { rank: 1, reason } if reason.contains("shard 3"));
        if r == 1 {
            std::thread::sleep(Duration::from_millis(200)); // the others' receives are posted
            c.abort("bad input: shard 3 is empty");
            return match c.recv(0, 5, &mut [0u8; 4]) {
                Err(e) if is_why(&e) => Ok(()),
                other => Err(format!("an operation after abort: {other:?}")),
            };
        }
        let t0 = Instant::now();
        let mut buf = [0u8; 16];
        match c.recv(1, 3, &mut buf) {
            Err(e) if is_why(&e) => {}
            other => return Err(format!("pending receive from the failed rank: {other:?}")),
        }
        match c.recv(1, 4, &mut buf) {
            Err(e) if is_why(&e) => {}
            other => return Err(format!("later receive from the failed rank: {other:?}")),
        }
        if t0.elapsed() > Duration::from_secs(10) {
            return Err(format!("noticed only after {:?}", t0.elapsed()));
        }
        Ok(())
    });
    all_ok(out);
}

/// Rank `victim` dies while the others wait on it: they must get an error naming it, well within the timeout.
pub fn killed_peer<W: World>(n: usize, victim: usize) {
    let timeout = Duration::from_secs(20);
    let name = if victim == 0 { "killed_rank_0" } else { "killed_peer" };
    let out = W::run(n, timeout, name, &|c: Communicator| {
        let r = c.rank();
        c.barrier().map_err(e2s)?;
        if r == victim {
            std::thread::sleep(Duration::from_millis(200));
            W::die();
        }
        let t0 = Instant::now();
        let mut buf = [0u8; 16];
        match c.recv(victim, 3, &mut buf) {
            Err(CommError::PeerGone { rank }) if rank == victim => {}
            Err(e) => return Err(format!("wrong error: {e}")),
            Ok(()) => return Err("recv from a dead rank succeeded".into()),
        }
        if t0.elapsed() > timeout / 2 {
            return Err(format!("noticed only after {:?}", t0.elapsed()));
        }
        Ok(())
    });
    for (r, o) in out.iter().enumerate() {
        if r == victim {
            assert!(o.is_err(), "the killed rank reported success");
        } else {
            assert!(o.is_ok(), "rank {r}: {o:?}");
        }
    }
}

/// Rank `victim` dies while the others wait on a transfer of device memory with it (a receive into a fake device's
/// memory, and a send from it posted beside): the receive fails with an error naming it, well within the timeout,
/// and leaves the device bytes as they were; so does the send where the transport tells a sender its receiver's
/// fate (threads; UCX completes a small send once buffered).
pub fn killed_peer_device<W: World>(n: usize, victim: usize) {
    let timeout = Duration::from_secs(20);
    let out = W::run(n, timeout, "killed_peer_device", &|c: Communicator| {
        let r = c.rank();
        c.barrier().map_err(e2s)?;
        if r == victim {
            std::thread::sleep(Duration::from_millis(200));
            W::die();
        }
        let t0 = Instant::now();
        let (inbox, outbox) = (FakeDevice::new(64, false), FakeDevice::new(64, false));
        let before = inbox.read(0, 64);
        let (sent, received) = c
            .scope(|s| -> Result<_, CommError> {
                let send = s.isend_bytes(victim, 5, longctx_p2p::Bytes::Device(outbox.bytes(0, 64)))?;
                let recv = s.irecv_bytes(victim, 5, longctx_p2p::BytesMut::Device(inbox.bytes(0, 64)))?;
                Ok((send.wait(), recv.wait()))
            })
            .map_err(e2s)?;
        for (side, got) in [("send", sent), ("receive", received)] {
            match got {
                Err(CommError::PeerGone { rank }) if rank == victim => {}
                // UCX completes a small (eager) send once it is buffered, whether the receiver lives or not.
                Ok(()) if side == "send" && !W::SENDER_SEES_REJECTION => {}
                other => return Err(format!("the {side} with a dead rank gave {other:?}")),
            }
        }
        expect(inbox.read(0, 64) == before, "a failed receive wrote the device bytes")?;
        if t0.elapsed() > timeout / 2 {
            return Err(format!("noticed only after {:?}", t0.elapsed()));
        }
        Ok(())
    });
    for (r, o) in out.iter().enumerate() {
        if r == victim {
            assert!(o.is_err(), "the killed rank reported success");
        } else {
            assert!(o.is_ok(), "rank {r}: {o:?}");
        }
    }
}

/// Rank n-1 stalls past the timeout: the others' waits fail with a timeout naming it.
pub fn stalled_peer<W: World>(n: usize) {
    let timeout = Duration::from_millis(400);
    let out = W::run(n, timeout, "stalled_peer", &|c: Communicator| {
        let (r, n) = (c.rank(), c.world_size());
        if r == n - 1 {
            std::thread::sleep(timeout * 3);
            return Ok(());
        }
        let t0 = Instant::now();
        let mut buf = [0u8; 16];
        match c.recv(n - 1, 3, &mut buf) {
            Err(CommError::Timeout { peer, .. }) if peer == n - 1 => {}
            other => return Err(format!("expected a timeout naming rank {}, got {other:?}", n - 1)),
        }
        let el = t0.elapsed();
        // The upper bound leaves room for a loaded CI machine descheduling this thread; a hang would take forever.
        if el < timeout || el > timeout * 3 + Duration::from_secs(2) {
            return Err(format!("timed out after {el:?}"));
        }
        Ok(())
    });
    all_ok(out);
}

/// Wrong lengths, tags, collective sizes and ranks give typed errors on every rank, never a hang or a panic.
pub fn bad_input<W: World>(n: usize) {
    let timeout = Duration::from_secs(2);
    let out = W::run(n, timeout, "bad_input", &|c: Communicator| {
        let (r, n) = (c.rank(), c.world_size());
        match c.send(n, 0, &[1u8]) {
            Err(CommError::InvalidRank { rank, world_size }) if rank == n && world_size == n => {}
            other => return Err(format!("out-of-range send: {other:?}")),
        }
        let mut b = [0u8; 1];
        if !matches!(c.recv(n + 5, 0, &mut b), Err(CommError::InvalidRank { .. })) {
            return Err("out-of-range recv accepted".into());
        }
        if !matches!(c.broadcast(&mut b, n), Err(CommError::InvalidRank { .. })) {
            return Err("out-of-range root accepted".into());
        }
        // Length mismatch: ring shift where rank 0's buffer is one element short.
        let send = [r as u32; 8];
        let mut recv = vec![0u32; if r == 1 { 7 } else { 8 }];
        let res = c.sendrecv(&send, &mut recv);
        if r == 1 && !matches!(res, Err(CommError::LengthMismatch { message_bytes: 32, buffer_bytes: 28, .. })) {
            return Err(format!("short buffer: {res:?}"));
        }
        if r == 0 && W::SENDER_SEES_REJECTION && !matches!(res, Err(CommError::LengthMismatch { .. })) {
            return Err(format!("sender of a rejected message: {res:?}"));
        }
        c.barrier().map_err(e2s)?;
        // Tag mismatch: rank 0 sends tag 5, rank 1 waits for tag 6.
        let mut short = c.split(0, r as u32).map_err(e2s)?;
        // The receiver gives up while the sender's message is still posted: rank 0 keeps its send pending until
        // the barrier below, so a rank delayed by a loaded machine cannot turn the mismatch into "peer gone".
        short.set_timeout(Duration::from_millis(300));
        let four = [1u8; 4];
        short.scope(|s| {
            let pending = if r == 0 { Some(s.isend(1, 5, &four).map_err(e2s)?) } else { None };
            if r == 1 {
                let mut b = [0u8; 4];
                match short.recv(0, 6, &mut b) {
                    Err(CommError::TagMismatch { src: 0, expected: 6, found: 5, .. }) => {}
                    other => return Err(format!("tag mismatch: {other:?}")),
                }
            }
            c.barrier().map_err(e2s)?;
            // Never matched: dropping the request waits out its timeout and withdraws it.
            drop(pending);
            Ok(())
        })?;
        drop(short);
        c.barrier().map_err(e2s)?;
        // Collective with different sizes: every rank errors, in time.
        let t0 = Instant::now();
        let mut buf = vec![1.0f32; 100 + if r == 0 { 4 } else { 0 }];
        let res = c.all_reduce(&mut buf, ReduceOp::Sum);
        if res.is_ok() {
            return Err("all_reduce with mismatched sizes succeeded".into());
        }
        if t0.elapsed() > timeout * 2 {
            return Err(format!("mismatch noticed after {:?}", t0.elapsed()));
        }
        let _ = r;
        Err(format!("expected: {}", res.err().map(e2s).unwrap_or_default()))
    });
    // The ranks that matched a message of the other size name the collective and the sizes.
    every_rank_failed_naming(&out, "collective all_reduce");
}

/// A stand-in for device memory: bytes the transport must not touch itself, reached only through a copier. As
/// on a real device, an address means the same to every copier of the device in this process (the ranks of a
/// threads world share it): each fake device (by ordinal) is one arena of the process, addresses are `BASE` plus an
/// offset into it, and each `FakeDevice` is one allocation in it with a copier that counts its calls by kind.
struct FakeDevice {
    ordinal: u32,
    start: usize,
    len: usize,
    downloads: std::sync::atomic::AtomicUsize,
    uploads: std::sync::atomic::AtomicUsize,
    withins: std::sync::atomic::AtomicUsize,
    fail: bool,
}

/// Bytes of each fake device's arena.
const ARENA: usize = 16 << 20;

/// The arena of fake device `ordinal` (7 or 8), and the next free offset in it.
fn arena(ordinal: u32) -> &'static (std::sync::Mutex<Vec<u8>>, std::sync::atomic::AtomicUsize) {
    static ARENAS: [std::sync::OnceLock<(std::sync::Mutex<Vec<u8>>, std::sync::atomic::AtomicUsize)>; 2] =
        [std::sync::OnceLock::new(), std::sync::OnceLock::new()];
    ARENAS[(ordinal - 7) as usize].get_or_init(|| (std::sync::Mutex::new(vec![0; ARENA]), Default::default()))
}

impl FakeDevice {
    const BASE: u64 = 1 << 40;

    fn new(len: usize, fail: bool) -> Self {
        Self::on(7, len, fail)
    }

    /// An allocation of `len` bytes on fake device `ordinal`, zeroed.
    fn on(ordinal: u32, len: usize, fail: bool) -> Self {
        use std::sync::atomic::Ordering::Relaxed;
        let (bytes, next) = arena(ordinal);
        // Allocations are never freed: the tests that use them take far less than the arena, and wrap if not.
        let mut start = next.fetch_add(len.next_multiple_of(64), Relaxed);
        if start + len > ARENA {
            next.store(len.next_multiple_of(64), Relaxed);
            start = 0;
        }
        bytes.lock().unwrap()[start..start + len].fill(0);
        let zero = std::sync::atomic::AtomicUsize::new(0);
        let (downloads, uploads) = (std::sync::atomic::AtomicUsize::new(0), std::sync::atomic::AtomicUsize::new(0));
        Self { ordinal, start, len, downloads, uploads, withins: zero, fail }
    }

    fn bytes(&self, off: usize, len: usize) -> longctx_p2p::DeviceBytes<'_> {
        assert!(off + len <= self.len);
        let ptr = Self::BASE + (self.start + off) as u64;
        longctx_p2p::DeviceBytes { ptr, len, ordinal: self.ordinal, copy: self }
    }

    fn read(&self, off: usize, len: usize) -> Vec<u8> {
        arena(self.ordinal).0.lock().unwrap()[self.start + off..self.start + off + len].to_vec()
    }

    fn fill_at(&self, off: usize, src: &[u8]) {
        arena(self.ordinal).0.lock().unwrap()[self.start + off..self.start + off + src.len()].copy_from_slice(src);
    }

    /// The arena range of `len` bytes at device address `addr`, checked to lie in the arena.
    fn range(&self, addr: u64, len: usize) -> Result<std::ops::Range<usize>, String> {
        let off = addr.checked_sub(Self::BASE).ok_or("an address below the fake device's")? as usize;
        if off + len > ARENA {
            return Err(format!("{len} bytes at {addr:#x} are outside fake device {}", self.ordinal));
        }
        Ok(off..off + len)
    }

    fn refuse(&self) -> Result<(), String> {
        if self.fail {
            return Err("the fake device refuses".into());
        }
        Ok(())
    }

    /// (downloads, uploads, copies within the device) this allocation's copier made.
    fn calls(&self) -> (usize, usize, usize) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.downloads.load(Relaxed), self.uploads.load(Relaxed), self.withins.load(Relaxed))
    }
}

impl longctx_p2p::DeviceCopy for FakeDevice {
    fn download(&self, src: u64, dst: &mut [u8]) -> Result<(), String> {
        self.refuse()?;
        self.downloads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        dst.copy_from_slice(&arena(self.ordinal).0.lock().unwrap()[self.range(src, dst.len())?]);
        Ok(())
    }
    fn upload(&self, dst: u64, src: &[u8]) -> Result<(), String> {
        self.refuse()?;
        self.uploads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let r = self.range(dst, src.len())?;
        arena(self.ordinal).0.lock().unwrap()[r].copy_from_slice(src);
        Ok(())
    }
    fn copy_within(&self, dst: u64, src: u64, len: usize) -> Result<(), String> {
        self.refuse()?;
        self.withins.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (d, s) = (self.range(dst, len)?, self.range(src, len)?);
        arena(self.ordinal).0.lock().unwrap().copy_within(s, d.start);
        Ok(())
    }
}

/// Messages between device and host memory in every combination (non-blocking in a scope and blocking), between
/// two devices, all-gather and all-to-all into and out of device memory, and a copier's failure as a typed error.
/// Where the transport reaches device memory (threads), a message is one copy by the copier of the side in device
/// memory; where it stages, a download and an upload.
pub fn device_bytes(c: Communicator) -> Result<(), String> {
    use longctx_p2p::{Bytes, BytesMut};
    let (r, n) = (c.rank(), c.world_size());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let direct = c.reaches_device(7);
    let len = 1000 + 8 * n;
    let dev = FakeDevice::new(4 * len, false);
    let mine = bytes(21, r, len);
    dev.fill_at(0, &mine);
    // Device → device around the ring: one copy within the device by the receiver's copier, or staged.
    let inbox = FakeDevice::new(len, false);
    c.scope(|s| -> Result<(), CommError> {
        let send = s.isend_bytes(next, 1, Bytes::Device(dev.bytes(0, len)))?;
        let recv = s.irecv_bytes(prev, 1, BytesMut::Device(inbox.bytes(0, len)))?;
        recv.wait()?;
        send.wait()
    })
    .map_err(|e| e.to_string())?;
    expect(inbox.read(0, len) == bytes(21, prev, len), "device to device")?;
    let want = if direct { (0, 0, 1) } else { (0, 1, 0) };
    if inbox.calls() != want {
        return Err(format!("device to device: the receiver's copier made {:?} calls, not {want:?}", inbox.calls()));
    }
    // Device → host: one download by the sender's copier (the receiver has none).
    let mut host = vec![0u8; len];
    c.scope(|s| -> Result<(), CommError> {
        let send = s.isend_bytes(next, 2, Bytes::Device(dev.bytes(0, len)))?;
        let recv = s.irecv_bytes(prev, 2, BytesMut::Host(&mut host))?;
        recv.wait()?;
        send.wait()
    })
    .map_err(|e| e.to_string())?;
    expect(host == bytes(21, prev, len), "device to host")?;
    let (tx, rx) = (mine.clone(), 2 * len);
    // Blocking sends are synchronous: even ranks send first, odd ones receive first (one rank has no peer).
    if n > 1 && r % 2 == 0 {
        c.send_bytes_in(next, 3, Bytes::Host(&tx)).map_err(|e| e.to_string())?;
        c.recv_bytes_in(prev, 3, BytesMut::Device(dev.bytes(rx, len))).map_err(|e| e.to_string())?;
    } else if n > 1 {
        c.recv_bytes_in(prev, 3, BytesMut::Device(dev.bytes(rx, len))).map_err(|e| e.to_string())?;
        c.send_bytes_in(next, 3, Bytes::Host(&tx)).map_err(|e| e.to_string())?;
    }
    expect(n == 1 || dev.read(rx, len) == bytes(21, prev, len), "host to device, blocking")?;
    // Between two devices: through host memory (a download by the sender's copier, an upload by the receiver's).
    let other = FakeDevice::on(8, len, false);
    c.scope(|s| -> Result<(), CommError> {
        let send = s.isend_bytes(next, 5, Bytes::Device(dev.bytes(0, len)))?;
        let recv = s.irecv_bytes(prev, 5, BytesMut::Device(other.bytes(0, len)))?;
        recv.wait()?;
        send.wait()
    })
    .map_err(|e| e.to_string())?;
    expect(other.read(0, len) == bytes(21, prev, len), "device 7 to device 8")?;
    expect(other.calls() == (0, 1, 0), "device 7 to device 8: one upload into device 8")?;
    // A device buffer of another length than the message: the length mismatch, as with host buffers.
    let short = FakeDevice::new(len - 8, false);
    if direct {
        let got = c.scope(|s| -> Result<(), CommError> {
            let send = s.isend_bytes(next, 6, Bytes::Device(dev.bytes(0, len)))?;
            let recv = s.irecv_bytes(prev, 6, BytesMut::Device(short.bytes(0, len - 8)))?;
            let (r, s) = (recv.wait(), send.wait());
            r.and(s)
        });
        match got {
            Err(CommError::LengthMismatch { message_bytes, buffer_bytes, .. })
                if message_bytes == len && buffer_bytes == len - 8 => {}
            other => return Err(format!("a device buffer 8 bytes short gave {other:?}")),
        }
    }
    // Collectives out of and into device memory.
    let gathered = FakeDevice::new(n * len, false);
    c.all_gather_bytes(Bytes::Device(dev.bytes(0, len)), BytesMut::Device(gathered.bytes(0, n * len)))
        .map_err(|e| e.to_string())?;
    for j in 0..n {
        expect(gathered.read(j * len, len) == bytes(21, j, len), "all_gather_bytes")?;
    }
    // Direct: each part one copy within the device by the receiver's copier; staged: one upload of the whole.
    let want = if direct { (0, 0, n) } else { (0, 1, 0) };
    if gathered.calls() != want {
        return Err(format!("all_gather_bytes: the receiver's copier made {:?} calls, not {want:?}", gathered.calls()));
    }
    // From host memory into device memory: every rank's part arrives.
    let into = FakeDevice::new(n * len, false);
    c.all_gather_bytes(Bytes::Host(&mine), BytesMut::Device(into.bytes(0, n * len))).map_err(|e| e.to_string())?;
    for j in 0..n {
        expect(into.read(j * len, len) == bytes(21, j, len), "all_gather_bytes, host to device")?;
    }
    // A receive buffer of the wrong size is refused before anything moves.
    match c.all_gather_bytes(Bytes::Device(dev.bytes(0, len)), BytesMut::Device(into.bytes(0, n * len - 1))) {
        Err(CommError::InvalidArgument(_)) | Err(CommError::LengthMismatch { .. }) => {}
        other => return Err(format!("all_gather_bytes into a buffer a byte short gave {other:?}")),
    }
    let chunk = len / n;
    let out = FakeDevice::new(chunk * n, false);
    c.all_to_all_bytes(Bytes::Device(dev.bytes(0, chunk * n)), BytesMut::Device(out.bytes(0, chunk * n)))
        .map_err(|e| e.to_string())?;
    for j in 0..n {
        expect(out.read(j * chunk, chunk) == bytes(21, j, len)[r * chunk..(r + 1) * chunk], "all_to_all_bytes")?;
    }
    // All-reduce of f32 elements in device memory and in host bytes: the same values as the plain all-reduce.
    let vals: Vec<f32> = (0..257).map(|i| ((i * 37 + r * 11) % 101) as f32 * 0.25 - 3.0).collect();
    let mut want = vals.clone();
    c.all_reduce(&mut want, longctx_p2p::ReduceOp::Sum).map_err(|e| e.to_string())?;
    let sums = FakeDevice::new(4 * vals.len(), false);
    sums.fill_at(0, bytemuck::cast_slice(&vals));
    c.all_reduce_bytes::<f32>(BytesMut::Device(sums.bytes(0, 4 * vals.len())), longctx_p2p::ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    expect(sums.read(0, 4 * vals.len()) == bytemuck::cast_slice::<f32, u8>(&want), "all_reduce_bytes, device")?;
    let mut host_vals = vals.clone();
    c.all_reduce_bytes::<f32>(BytesMut::Host(bytemuck::cast_slice_mut(&mut host_vals)), longctx_p2p::ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    expect(host_vals == want, "all_reduce_bytes, host")?;
    match c.all_reduce_bytes::<f32>(BytesMut::Host(&mut [0u8; 6]), longctx_p2p::ReduceOp::Sum) {
        Err(CommError::InvalidArgument(m)) if m.contains("whole elements") => {}
        other => return Err(format!("6 bytes of f32 gave {other:?}")),
    }
    expect(dev.calls().0 > 0, "the copier was used")?;
    // A copier that fails, as a typed error naming the device. Staged: the send fails on this rank before
    // anything is posted. Direct: the copy fails at the match, and both sides learn it.
    let broken = FakeDevice::new(len, true);
    if !direct {
        return match c.scope(|s| s.isend_bytes(next, 4, Bytes::Device(broken.bytes(0, len))).map(drop)) {
            Err(CommError::DeviceCopy { ordinal: 7, reason }) if reason.contains("refuses") => Ok(()),
            other => Err(format!("a failing copier gave {other:?}")),
        };
    }
    let mut host = vec![0u8; len];
    let (sent, received) = c
        .scope(|s| -> Result<_, CommError> {
            let send = s.isend_bytes(next, 4, Bytes::Device(broken.bytes(0, len)))?;
            let recv = s.irecv_bytes(prev, 4, BytesMut::Host(&mut host))?;
            Ok((send.wait(), recv.wait()))
        })
        .map_err(|e| e.to_string())?;
    for (side, got) in [("send", sent), ("receive", received)] {
        match got {
            Err(CommError::DeviceCopy { ordinal: 7, reason }) if reason.contains("refuses") => {}
            other => return Err(format!("the {side} of a failing copier's bytes gave {other:?}")),
        }
    }
    Ok(())
}

/// Where a message's buffer lies in [`device_messages`]: host memory, or fake device 7 or 8.
#[derive(Debug, Clone, Copy)]
pub enum Place {
    Host,
    Device7,
    Device8,
}

/// Messages of `(bytes, where the send lies, where the receive lies)` around the ring, all in flight at once:
/// receives posted in reverse order, then the sends in a seeded shuffle, so either side may match first. Every
/// message arrives intact whatever the pair of places.
pub fn device_messages(c: Communicator, seed: u64, msgs: &[(usize, Place, Place)]) -> Result<(), String> {
    use longctx_p2p::{Bytes, BytesMut};
    let (r, n) = (c.rank(), c.world_size());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let alloc = |place: Place, len: usize| match place {
        Place::Host => None,
        Place::Device7 => Some(FakeDevice::on(7, len, false)),
        Place::Device8 => Some(FakeDevice::on(8, len, false)),
    };
    let outs: Vec<Vec<u8>> = msgs.iter().enumerate().map(|(i, m)| bytes(seed + i as u64, r, m.0)).collect();
    let send_dev: Vec<Option<FakeDevice>> = msgs.iter().map(|m| alloc(m.1, m.0)).collect();
    let recv_dev: Vec<Option<FakeDevice>> = msgs.iter().map(|m| alloc(m.2, m.0)).collect();
    for (d, out) in send_dev.iter().zip(&outs) {
        if let Some(d) = d {
            d.fill_at(0, out);
        }
    }
    let mut ins: Vec<Vec<u8>> = msgs.iter().map(|m| vec![0u8; m.0]).collect();
    let mut order: Vec<usize> = (0..msgs.len()).collect();
    let mut x = seed | 1;
    for i in (1..order.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    c.scope(|s| {
        let mut reqs = Vec::new();
        for (i, (host, dev)) in ins.iter_mut().zip(&recv_dev).enumerate().rev() {
            let buf = match dev {
                Some(d) => BytesMut::Device(d.bytes(0, msgs[i].0)),
                None => BytesMut::Host(host),
            };
            reqs.push(s.irecv_bytes(prev, i as u32, buf)?);
        }
        for &i in &order {
            let buf = match &send_dev[i] {
                Some(d) => Bytes::Device(d.bytes(0, msgs[i].0)),
                None => Bytes::Host(&outs[i]),
            };
            reqs.push(s.isend_bytes(next, i as u32, buf)?);
        }
        reqs.into_iter().try_for_each(|q| q.wait())
    })
    .map_err(e2s)?;
    for (i, (host, dev)) in ins.iter().zip(&recv_dev).enumerate() {
        let got = dev.as_ref().map_or_else(|| host.clone(), |d| d.read(0, msgs[i].0));
        if got != bytes(seed + i as u64, prev, msgs[i].0) {
            return Err(format!("message {i} ({:?}) corrupted", msgs[i]));
        }
    }
    Ok(())
}

fn expect(ok: bool, what: &str) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(format!("{what}: wrong bytes"))
    }
}

/// Every rank's body ended with an expected error (`Err("expected: …")`), and at least one names `what`.
fn every_rank_failed_naming(out: &[Result<(), String>], what: &str) {
    let named = out.iter().filter(|o| matches!(o, Err(e) if e.contains(what))).count();
    assert!(named >= 1, "no rank reported {what:?}: {out:?}");
    for (r, o) in out.iter().enumerate() {
        match o {
            Err(e) if e.starts_with("expected: ") => {}
            other => panic!("rank {r}: {other:?} (all: {out:?})"),
        }
    }
}

/// Ranks that call different collectives at the same point all fail in time, and a rank that received the other
/// collective's message names both.
pub fn different_collectives<W: World>(n: usize) {
    let timeout = Duration::from_secs(2);
    let out = W::run(n, timeout, "different_collectives", &|c: Communicator| {
        let t0 = Instant::now();
        let res = if c.rank() == 0 {
            let mut all = vec![0u32; 4 * c.world_size()];
            c.all_gather(&[7u32; 4], &mut all)
        } else {
            c.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum)
        };
        if res.is_ok() {
            return Err("different collectives succeeded".into());
        }
        if t0.elapsed() > timeout * 3 {
            return Err(format!("mismatch noticed after {:?}", t0.elapsed()));
        }
        Err(format!("expected: {}", res.err().map(e2s).unwrap_or_default()))
    });
    // Rank 1 waits on rank 0 in the all-reduce ring while rank 0's all-gather message waits for it.
    every_rank_failed_naming(&out, "collective all_reduce");
}

/// Instantiates the suite for a world type.
#[macro_export]
macro_rules! suite_tests {
    ($w:ty, $big:expr) => {
        #[test]
        fn ring_shift() {
            for n in [1, 2, 3, 4] {
                suite::all_ok(<$w>::run(n, std::time::Duration::from_secs(30), "ring_shift", &suite::ring_shift));
            }
        }
        #[test]
        fn send_recv_random_sizes() {
            let sizes = [0usize, 1, 3, 4096, 65_537, 1 << 20, 3_000_001];
            suite::all_ok(<$w>::run(3, std::time::Duration::from_secs(30), "send_recv_random_sizes", &|c| {
                suite::send_recv_sizes(c, 11, &sizes)
            }));
        }
        #[test]
        fn send_recv_64mib() {
            suite::all_ok(<$w>::run(2, std::time::Duration::from_secs(60), "send_recv_64mib", &|c| {
                suite::send_recv_sizes(c, 12, &[64 << 20])
            }));
        }
        #[test]
        fn bidirectional_large() {
            suite::all_ok(<$w>::run(2, std::time::Duration::from_secs(60), "bidirectional_large", &|c| {
                suite::bidirectional(c, $big)
            }));
        }
        #[test]
        fn collectives_fixed() {
            for (n, len) in [(2usize, 0usize), (3, 1), (4, 1000), (3, 70_001)] {
                suite::all_ok(<$w>::run(n, std::time::Duration::from_secs(30), "collectives_fixed", &|c| {
                    suite::collectives(c, 3 + len as u64, len)
                }));
            }
        }
        #[test]
        fn split() {
            for n in [1, 3, 4] {
                suite::all_ok(<$w>::run(n, std::time::Duration::from_secs(30), "split", &suite::split));
            }
        }
        #[test]
        fn scope_finishes_leaked_requests() {
            suite::all_ok(<$w>::run(2, std::time::Duration::from_secs(30), "scope_finishes_leaked_requests", &|c| {
                suite::scope_finishes_leaked_requests(c)
            }));
        }
        #[test]
        fn owned_round_trip() {
            for n in [1, 2, 3] {
                suite::all_ok(<$w>::run(
                    n,
                    std::time::Duration::from_secs(30),
                    "owned_round_trip",
                    &suite::owned_round_trip,
                ));
            }
        }
        #[test]
        fn owned_ring_reuses_buffers() {
            for n in [1, 3] {
                suite::all_ok(<$w>::run(
                    n,
                    std::time::Duration::from_secs(30),
                    "owned_ring_reuses_buffers",
                    &suite::owned_ring_reuses_buffers,
                ));
            }
        }
        #[test]
        fn device_bytes() {
            for n in [1, 2, 3] {
                suite::all_ok(<$w>::run(n, std::time::Duration::from_secs(30), "device_bytes", &suite::device_bytes));
            }
        }
        #[test]
        fn owned_buffer_comes_back_on_error() {
            suite::owned_buffer_comes_back_on_error::<$w>(3);
        }
        #[test]
        fn leaked_owned_requests_corrupt_nothing() {
            suite::all_ok(<$w>::run(
                2,
                std::time::Duration::from_secs(30),
                "leaked_owned_requests_corrupt_nothing",
                &suite::leaked_owned_requests_corrupt_nothing,
            ));
        }
        #[test]
        fn failed_peer() {
            suite::failed_peer::<$w>(3);
        }
        #[test]
        fn killed_peer() {
            suite::killed_peer::<$w>(3, 2);
        }
        #[test]
        fn killed_peer_device() {
            suite::killed_peer_device::<$w>(3, 2);
        }
        /// Rank 0 dies: with UCX it also hosts the rendezvous store, through which the others learn who left.
        #[test]
        fn killed_rank_0() {
            suite::killed_peer::<$w>(3, 0);
        }
        #[test]
        fn stalled_peer() {
            suite::stalled_peer::<$w>(3);
        }
        #[test]
        fn bad_input() {
            suite::bad_input::<$w>(3);
        }
        #[test]
        fn different_collectives() {
            suite::different_collectives::<$w>(3);
        }
    };
}
