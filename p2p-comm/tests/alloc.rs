//! A ring exchange of a fixed size allocates nothing after its first call (threads transport).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use longctx_p2p::{ReduceOp, ThreadWorld};

struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.with(|a| a.set(a.get() + 1));
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.with(|a| a.set(a.get() + 1));
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(|a| a.get())
}

#[test]
fn steady_state_ring_exchange_owned_requests_and_all_reduce_do_not_allocate() {
    let counts = ThreadWorld::run(4, |c| {
        let mut send = vec![c.rank() as f32; 1 << 16];
        let mut recv = vec![0.0f32; 1 << 16];
        // Owned buffers of a steady ring rotation: moved into each exchange and back out of its `wait`.
        let (mut cur, mut nxt) = (vec![c.rank() as f32; 1 << 16], vec![0.0f32; 1 << 16]);
        let mut acc = vec![1.0f32; 1 << 15];
        // Warm up: pools and queues reach their steady size.
        for _ in 0..3 {
            c.sendrecv(&send, &mut recv).unwrap();
            c.scope(|s| s.isendrecv(&send, &mut recv)?.wait()).unwrap();
            (cur, nxt) = c.isendrecv(cur, nxt).unwrap().wait().unwrap();
            std::mem::swap(&mut cur, &mut nxt);
            let (next, prev) = ((c.rank() + 1) % 4, (c.rank() + 3) % 4);
            let s_req = c.isend(next, 1, send).unwrap();
            recv = c.irecv(prev, 1, recv).unwrap().wait().unwrap();
            send = s_req.wait().unwrap();
            c.all_reduce(&mut acc, ReduceOp::Sum).unwrap();
        }
        c.barrier().unwrap();
        let (next, prev) = ((c.rank() + 1) % 4, (c.rank() + 3) % 4);
        let before = allocs();
        for _ in 0..20 {
            c.sendrecv(&send, &mut recv).unwrap();
            c.scope(|s| s.isendrecv(&send, &mut recv)?.wait()).unwrap();
            let req = c.isendrecv(cur, nxt).unwrap();
            (cur, nxt) = req.wait().unwrap();
            std::mem::swap(&mut cur, &mut nxt);
            // Owned point-to-point: send one buffer on, receive the other's next one.
            let s_req = c.isend(next, 1, send).unwrap();
            let r_req = c.irecv(prev, 1, recv).unwrap();
            recv = r_req.wait().unwrap();
            send = s_req.wait().unwrap();
            c.all_reduce(&mut acc, ReduceOp::Max).unwrap();
        }
        allocs() - before
    })
    .unwrap();
    assert_eq!(counts, vec![0; 4], "allocations per rank in 20 steady-state rounds");
}
