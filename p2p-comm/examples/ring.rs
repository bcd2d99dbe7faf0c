//! Ring pass with compute overlap, the communication pattern of ring attention.
//!
//! Each of N ranks holds a block; for N steps it starts shifting its current block to the next rank, "computes"
//! on the block in hand (a checksum), then waits for the shift. Run: `cargo run -p longctx-p2p --example ring`.

use longctx_p2p::{CommError, ReduceOp, ThreadWorld};

fn main() -> Result<(), CommError> {
    let n = 4;
    let block_len = 1 << 20;
    let totals = ThreadWorld::run(n, |comm| -> Result<f64, CommError> {
        let mut block = vec![comm.rank() as f32 + 1.0; block_len];
        let mut incoming = vec![0.0f32; block_len];
        let mut seen = 0.0f64;
        for _step in 0..comm.world_size() {
            // A scope per step: the transfer borrows both blocks until it finishes, and the scope guarantees it
            // does before they are swapped.
            comm.scope(|s| {
                let shift = s.isendrecv(&block, &mut incoming)?; // post the next block's transfer...
                seen += block.iter().map(|&x| x as f64).sum::<f64>(); // ...compute on the block in hand...
                shift.wait() // ...then take the next block.
            })?;
            std::mem::swap(&mut block, &mut incoming);
        }
        let mut total = [seen];
        comm.all_reduce(&mut total, ReduceOp::Sum)?;
        Ok(total[0])
    })?;
    let s = totals[0].as_ref().map_err(|e| CommError::InvalidArgument(e.to_string()))?;
    let expected = (n * (n + 1) / 2 * block_len * n) as f64;
    println!("every rank saw every block: total {s} (expected {expected})");
    assert_eq!(*s, expected);
    Ok(())
}
