use longctx_kernels::{Backend, CpuBackend, GradMode, LinearGrads, LinearSaved, Result, View, ViewMut};
use std::time::Instant;
fn main() -> Result<()> {
    let cpu = CpuBackend::new();
    let t = 4096usize;
    for (din, dout) in [(256usize, 256usize), (256, 128), (256, 688), (688, 256)] {
        let x = vec![0.01f32; t * din];
        let w = vec![0.02f32; dout * din];
        let mut y = vec![0.0f32; t * dout];
        let dy = vec![0.01f32; t * dout];
        let mut dx = vec![0.0f32; t * din];
        let mut dw = vec![0.0f32; dout * din];
        let reps = 20;
        for _ in 0..2 {
            cpu.linear_forward(
                ViewMut::new(&mut y, [t, dout])?,
                View::new(&x, [t, din])?,
                View::new(&w, [dout, din])?,
                None,
            )?;
        }
        let s = Instant::now();
        for _ in 0..reps {
            cpu.linear_forward(
                ViewMut::new(&mut y, [t, dout])?,
                View::new(&x, [t, din])?,
                View::new(&w, [dout, din])?,
                None,
            )?;
        }
        let f = s.elapsed().as_secs_f64() / reps as f64;
        let s = Instant::now();
        for _ in 0..reps {
            let g = LinearGrads {
                dx: Some(ViewMut::new(&mut dx, [t, din])?),
                dw: ViewMut::new(&mut dw, [dout, din])?,
                dbias: None,
            };
            cpu.linear_backward(
                g,
                View::new(&dy, [t, dout])?,
                LinearSaved { x: View::new(&x, [t, din])? },
                View::new(&w, [dout, din])?,
                GradMode::Overwrite,
            )?;
        }
        let b = s.elapsed().as_secs_f64() / reps as f64;
        let fl = 2.0 * (t * din * dout) as f64;
        println!(
            "{t}x{din}->{dout}: fwd {:.2} ms {:.1} GF/s  bwd {:.2} ms {:.1} GF/s",
            f * 1e3,
            fl / f / 1e9,
            b * 1e3,
            2.0 * fl / b / 1e9
        );
    }
    Ok(())
}
