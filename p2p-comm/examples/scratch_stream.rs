use longctx_p2p::ThreadWorld;
use std::time::Instant;
fn main() {
    let bytes: usize = std::env::args().nth(1).and_then(|v| v.parse().ok()).unwrap_or(65536);
    let secs: f64 = std::env::args().nth(2).and_then(|v| v.parse().ok()).unwrap_or(2.0);
    let mode = std::env::args().nth(3).unwrap_or("send".into());
    let it = ((secs * 20e9) as usize / bytes).max(10);
    let r = ThreadWorld::run(2, |c| {
        let send = vec![c.rank() as u8 + 1; bytes];
        let mut recv = vec![0u8; bytes];
        let mut go = |n: usize| {
            for _ in 0..n {
                match (mode.as_str(), c.rank()) {
                    ("send", 0) => c.send(1, 1, &send).unwrap(),
                    ("send", _) => c.recv(0, 1, &mut recv).unwrap(),
                    _ => c.sendrecv(&send, &mut recv).unwrap(),
                }
            }
        };
        go(100);
        c.barrier().unwrap();
        let t = Instant::now();
        go(it);
        let dt = t.elapsed().as_secs_f64();
        bytes as f64 * it as f64 / dt / (1u64 << 30) as f64
    })
    .unwrap();
    println!(
        "{mode} {bytes} B: {:.2} GiB/s ({:.0} ns/msg)",
        r[0].min(r[1]),
        bytes as f64 / r[0].min(r[1]) / (1u64 << 30) as f64 * 1e9
    );
}
