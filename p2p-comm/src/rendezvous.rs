//! A small TCP key-value store for bootstrapping: rank 0 hosts it, every rank sets and gets keys.
//!
//! Used to exchange transport addresses (UCX worker addresses) before the communicator exists. The host binds
//! only the address it is given. Every connection must first present the job token; a connection that does not
//! (within [`HANDSHAKE_TIMEOUT`]) is closed without reading anything else, so a stray process on the network
//! can neither read nor write keys.
//!
//! Wire format (all integers little-endian u32): client hello `len, token`; server answers one byte (1 = ok).
//! Requests `op (1 = set, 2 = get), len, key, [len, value]`; answers `status (1 = ok, 0 = timeout), len, value`.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::sync::lock;
use crate::CommError;

/// How long the host waits for a new connection's token before closing it.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest key or value accepted (1 MiB): bounds what a peer can make the host allocate.
const MAX_FRAME: usize = 1 << 20;
const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_REGISTER: u8 = 3;

#[derive(Default)]
struct Table {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    /// Registered connections still open.
    live: AtomicUsize,
}

/// The host side: serves the store on a background thread until dropped.
pub struct StoreHost {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    rejected: Arc<AtomicUsize>,
    table: Arc<Table>,
    linger: Duration,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for StoreHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreHost").field("addr", &self.addr).finish()
    }
}

impl StoreHost {
    /// Binds `addr` (port 0 picks a free port) and serves connections that present `token`.
    pub fn bind(addr: impl ToSocketAddrs, token: &str) -> Result<StoreHost, CommError> {
        let listener = TcpListener::bind(addr).map_err(|e| CommError::io("rendezvous: binding", e))?;
        let local = listener.local_addr().map_err(|e| CommError::io("rendezvous: local address", e))?;
        listener.set_nonblocking(true).map_err(|e| CommError::io("rendezvous: listener", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let rejected = Arc::new(AtomicUsize::new(0));
        let table = Arc::new(Table::default());
        let (stop2, rejected2, token) = (stop.clone(), rejected.clone(), token.to_owned());
        let table2 = table.clone();
        let thread = std::thread::Builder::new()
            .name("longctx-rendezvous".into())
            .spawn(move || {
                while !stop2.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((s, _)) => {
                            let (table, token, rejected, stop) =
                                (table2.clone(), token.clone(), rejected2.clone(), stop2.clone());
                            let _ = std::thread::Builder::new()
                                .name("longctx-rendezvous-conn".into())
                                .spawn(move || serve(s, &table, &token, &rejected, &stop));
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(10)),
                    }
                }
            })
            .map_err(|e| CommError::io("rendezvous: spawning the server", e))?;
        Ok(StoreHost { addr: local, stop, rejected, table, linger: Duration::ZERO, thread: Some(thread) })
    }

    /// The address the store listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections refused so far for a missing or wrong token.
    pub fn rejected(&self) -> usize {
        self.rejected.load(Ordering::Relaxed)
    }
}

impl StoreHost {
    /// On drop, keep serving until every registered rank has disconnected, for at most `d` (default zero).
    /// Ranks learn that a peer died through the store, so its host should outlive them.
    pub fn set_linger(&mut self, d: Duration) {
        self.linger = d;
    }
}

impl Drop for StoreHost {
    fn drop(&mut self) {
        let t0 = Instant::now();
        while self.table.live.load(Ordering::SeqCst) > 0 && t0.elapsed() < self.linger {
            std::thread::sleep(Duration::from_millis(10));
        }
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn read_u32(s: &mut TcpStream) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_frame(s: &mut TcpStream, max: usize) -> std::io::Result<Vec<u8>> {
    let len = read_u32(s)? as usize;
    if len > max {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "frame too large"));
    }
    let mut v = vec![0u8; len];
    s.read_exact(&mut v)?;
    Ok(v)
}

fn write_frame(s: &mut TcpStream, data: &[u8]) -> std::io::Result<()> {
    let len = u32::try_from(data.len()).map_err(|_| std::io::Error::other("frame too large"))?;
    s.write_all(&len.to_le_bytes())?;
    s.write_all(data)
}

/// Compares without an early exit, so timing does not reveal a prefix of the token.
fn same_token(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn serve(mut s: TcpStream, table: &Table, token: &str, rejected: &AtomicUsize, stop: &AtomicBool) {
    let _ = s.set_nonblocking(false);
    let _ = s.set_nodelay(true);
    let _ = s.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
    let ok = matches!(read_frame(&mut s, 4096), Ok(t) if same_token(&t, token.as_bytes()));
    if !ok {
        rejected.fetch_add(1, Ordering::Relaxed);
        let _ = s.write_all(&[0]);
        return;
    }
    if s.write_all(&[1]).is_err() || s.set_read_timeout(None).is_err() {
        return;
    }
    let mut rank = None;
    let _ = serve_requests(&mut s, table, stop, &mut rank);
    // The connection of a registered rank closed: its process exited or dropped its communicator.
    if let Some(r) = rank {
        table.live.fetch_sub(1, Ordering::SeqCst);
        lock(&table.map).insert(format!("gone/{r}"), Vec::new());
        table.changed.notify_all();
    }
}

fn serve_requests(
    s: &mut TcpStream,
    table: &Table,
    stop: &AtomicBool,
    rank: &mut Option<String>,
) -> std::io::Result<()> {
    loop {
        let mut op = [0u8; 1];
        s.read_exact(&mut op)?;
        let key = String::from_utf8_lossy(&read_frame(s, MAX_FRAME)?).into_owned();
        match op[0] {
            OP_SET => {
                let value = read_frame(s, MAX_FRAME)?;
                lock(&table.map).insert(key, value);
                table.changed.notify_all();
                s.write_all(&[1])?;
                write_frame(s, &[])?;
            }
            OP_REGISTER => {
                if rank.replace(key).is_none() {
                    table.live.fetch_add(1, Ordering::SeqCst);
                }
                s.write_all(&[1])?;
                write_frame(s, &[])?;
            }
            OP_GET => {
                let wait_ms = read_u32(s)?;
                let deadline = Instant::now() + Duration::from_millis(wait_ms.into());
                let mut map = lock(&table.map);
                let found = loop {
                    if let Some(v) = map.get(&key) {
                        break Some(v.clone());
                    }
                    let now = Instant::now();
                    if now >= deadline || stop.load(Ordering::Relaxed) {
                        break None;
                    }
                    let wait = (deadline - now).min(Duration::from_millis(100));
                    map = table.changed.wait_timeout(map, wait).unwrap_or_else(PoisonError::into_inner).0;
                };
                drop(map);
                s.write_all(&[u8::from(found.is_some())])?;
                write_frame(s, found.as_deref().unwrap_or(&[]))?;
            }
            _ => return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "unknown op")),
        }
    }
}

/// A connection to the store (every rank has one, rank 0 too).
#[derive(Debug)]
pub struct Store {
    stream: Mutex<TcpStream>,
    addr: SocketAddr,
    timeout: Duration,
    /// Set when a request gave up waiting for its answer: a late answer would be read as the next request's,
    /// so the connection is not used again.
    abandoned: AtomicBool,
}

impl Store {
    /// Connects to the store at `addr`, retrying until `timeout` (the host may not be up yet), and presents
    /// `token`. Fails with [`CommError::BadToken`] if the host refuses it.
    pub fn connect(addr: SocketAddr, token: &str, timeout: Duration) -> Result<Store, CommError> {
        let deadline = Instant::now() + timeout;
        let mut s = loop {
            match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    return Err(CommError::io(format!("rendezvous: connecting to {addr}"), e))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        let io = |e| CommError::io(format!("rendezvous: handshake with {addr}"), e);
        s.set_nodelay(true).map_err(io)?;
        write_frame(&mut s, token.as_bytes()).map_err(io)?;
        let mut ok = [0u8; 1];
        match s.read_exact(&mut ok) {
            Ok(()) if ok[0] == 1 => {}
            _ => return Err(CommError::BadToken { addr: addr.to_string() }),
        }
        Ok(Store { stream: Mutex::new(s), addr, timeout, abandoned: AtomicBool::new(false) })
    }

    fn request(&self, op: u8, key: &str, value: Option<&[u8]>, wait: Duration) -> Result<Option<Vec<u8>>, CommError> {
        self.request_within(op, key, value, wait, None)
    }

    /// [`request`](Self::request) that gives up if the store has not answered within `answer` (`None`: waits
    /// as long as it takes), and then abandons the connection.
    fn request_within(
        &self,
        op: u8,
        key: &str,
        value: Option<&[u8]>,
        wait: Duration,
        answer: Option<Duration>,
    ) -> Result<Option<Vec<u8>>, CommError> {
        let io = |e| CommError::io(format!("rendezvous: talking to {}", self.addr), e);
        let mut s = lock(&self.stream);
        if self.abandoned.load(Ordering::Relaxed) {
            return Err(CommError::io(
                format!("rendezvous: the store at {} stopped answering earlier", self.addr),
                std::io::Error::from(std::io::ErrorKind::TimedOut),
            ));
        }
        if let Err(e) = s.set_read_timeout(answer).and_then(|()| s.set_write_timeout(answer)) {
            return Err(io(e));
        }
        let res = Self::exchange(&mut s, op, key, value, wait);
        if matches!(&res, Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)) {
            self.abandoned.store(true, Ordering::Relaxed);
        }
        res.map_err(|e| match answer {
            Some(d) if self.abandoned.load(Ordering::Relaxed) => CommError::io(
                format!(
                    "rendezvous: the store at {} did not answer within {d:?} (its host, rank 0, is stalled?)",
                    self.addr
                ),
                e,
            ),
            _ => io(e),
        })
    }

    fn exchange(
        s: &mut TcpStream,
        op: u8,
        key: &str,
        value: Option<&[u8]>,
        wait: Duration,
    ) -> std::io::Result<Option<Vec<u8>>> {
        s.write_all(&[op])?;
        write_frame(s, key.as_bytes())?;
        match value {
            Some(v) => write_frame(s, v)?,
            None if op == OP_REGISTER => {}
            None => {
                let ms = u32::try_from(wait.as_millis()).unwrap_or(u32::MAX);
                s.write_all(&ms.to_le_bytes())?
            }
        }
        let mut status = [0u8; 1];
        s.read_exact(&mut status)?;
        let data = read_frame(s, MAX_FRAME)?;
        Ok((status[0] == 1).then_some(data))
    }

    /// Sets `key` to `value` (at most 1 MiB).
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), CommError> {
        if value.len() > MAX_FRAME || key.len() > MAX_FRAME {
            return Err(CommError::InvalidArgument(format!("rendezvous: value of {} bytes is too large", value.len())));
        }
        self.request(OP_SET, key, Some(value), Duration::ZERO).map(|_| ())
    }

    /// Registers this connection as rank `rank`'s: when it closes, the host sets key `gone/{rank}`.
    pub fn register(&self, rank: usize) -> Result<(), CommError> {
        self.request(OP_REGISTER, &rank.to_string(), None, Duration::ZERO).map(|_| ())
    }

    /// Gets `key` if some rank has set it, without waiting.
    pub fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>, CommError> {
        self.request(OP_GET, key, None, Duration::ZERO)
    }

    /// [`try_get`](Self::try_get) that fails if the store has not answered within `answer`: a host that is
    /// stalled (stopped, swapped out) must not stall its callers. After such a failure this connection is not
    /// used again (every later request fails at once).
    pub fn try_get_within(&self, key: &str, answer: Duration) -> Result<Option<Vec<u8>>, CommError> {
        self.request_within(OP_GET, key, None, Duration::ZERO, Some(answer.max(Duration::from_millis(1))))
    }

    /// Gets `key`, waiting until some rank sets it or the store's timeout elapses.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, CommError> {
        self.request(OP_GET, key, None, self.timeout)?.ok_or_else(|| {
            CommError::Bootstrap(format!("rendezvous: key {key:?} was not set within {:?}", self.timeout))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_exchange_keys() {
        let host = StoreHost::bind("127.0.0.1:0", "tok").unwrap();
        let addr = host.addr();
        std::thread::scope(|s| {
            for r in 0..3 {
                s.spawn(move || {
                    let st = Store::connect(addr, "tok", Duration::from_secs(5)).unwrap();
                    st.set(&format!("addr/{r}"), &[r as u8; 3]).unwrap();
                    for q in 0..3 {
                        assert_eq!(st.get(&format!("addr/{q}")).unwrap(), vec![q as u8; 3]);
                    }
                });
            }
        });
    }

    #[test]
    fn a_registered_rank_that_disconnects_is_marked_gone() {
        let host = StoreHost::bind("127.0.0.1:0", "tok").unwrap();
        let watcher = Store::connect(host.addr(), "tok", Duration::from_secs(2)).unwrap();
        let leaver = Store::connect(host.addr(), "tok", Duration::from_secs(2)).unwrap();
        leaver.register(4).unwrap();
        assert_eq!(watcher.try_get("gone/4").unwrap(), None);
        drop(leaver);
        assert_eq!(watcher.get("gone/4").unwrap(), Vec::<u8>::new());
    }

    #[test]
    fn get_of_a_missing_key_times_out() {
        let host = StoreHost::bind("127.0.0.1:0", "tok").unwrap();
        let st = Store::connect(host.addr(), "tok", Duration::from_millis(200)).unwrap();
        assert!(matches!(st.get("nope"), Err(CommError::Bootstrap(_))));
    }

    #[test]
    fn stray_connections_without_the_token_are_refused() {
        let host = StoreHost::bind("127.0.0.1:0", "secret").unwrap();
        // Wrong token through the client.
        match Store::connect(host.addr(), "guess", Duration::from_secs(2)) {
            Err(CommError::BadToken { .. }) => {}
            other => panic!("{other:?}"),
        }
        // A raw connection that sends a request instead of a token gets nothing back but a refusal.
        let mut raw = TcpStream::connect(host.addr()).unwrap();
        raw.write_all(&[OP_GET, 4, 0, 0, 0]).unwrap();
        raw.write_all(b"addr").unwrap();
        raw.shutdown(std::net::Shutdown::Write).unwrap();
        let mut buf = Vec::new();
        let _ = raw.read_to_end(&mut buf);
        assert_eq!(buf, vec![0], "a refused peer only learns it was refused");
        // The store still serves the right token.
        let st = Store::connect(host.addr(), "secret", Duration::from_secs(2)).unwrap();
        st.set("k", b"v").unwrap();
        assert_eq!(st.get("k").unwrap(), b"v");
        assert_eq!(host.rejected(), 2);
    }

    #[test]
    fn a_store_that_stops_answering_fails_bounded_requests_and_is_not_used_again() {
        // A "store" that takes the token and then never answers, as one in a stopped process.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mute = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let _ = read_frame(&mut s, 4096);
            s.write_all(&[1]).unwrap();
            std::thread::sleep(Duration::from_secs(2));
            drop(s);
        });
        let st = Store::connect(addr, "tok", Duration::from_secs(5)).unwrap();
        let t0 = Instant::now();
        let e = st.try_get_within("gone/1", Duration::from_millis(200)).unwrap_err().to_string();
        assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
        assert!(e.contains("did not answer within 200ms"), "{e}");
        let t0 = Instant::now();
        let e = st.try_get("gone/1").unwrap_err().to_string();
        assert!(t0.elapsed() < Duration::from_millis(100) && e.contains("stopped answering"), "{e}");
        mute.join().unwrap();
    }
}
