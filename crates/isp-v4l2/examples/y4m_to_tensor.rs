//! Reads every frame of a Y4M file and writes each as the normalised model input tensor: one
//! fused pass per frame from the file's YUV to `3 x SIZE x SIZE` f32 (CHW, SmolVLM's mean/std of
//! 0.5, swscale's area-aware bilinear resize), appended to OUT as raw little-endian f32.
//!
//! `cargo run --release -p isp-v4l2 --example y4m_to_tensor -- fixtures/clips/testsrc2-256x144.y4m 512 frames.f32`

use std::io::Write;

use isp_v4l2::isp::{Preprocess, preprocess};
use isp_v4l2::{FrameSource, Pacing, Y4mSource};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, input, size, out] = args.as_slice() else {
        return Err("usage: y4m_to_tensor INPUT.y4m SIZE OUT.f32".into());
    };
    let size: usize = size
        .parse()
        .map_err(|_| format!("SIZE {size:?} is not a number"))?;
    let mut source = Y4mSource::open(std::path::Path::new(input), Pacing::AsFastAsPossible)?;
    let p = Preprocess {
        width: size,
        height: size,
        mean: [0.5; 3],
        std: [0.5; 3],
        ..Preprocess::default()
    };
    let mut file = std::io::BufWriter::new(std::fs::File::create(out)?);
    let mut tensor = vec![0f32; 3 * size * size];
    let mut frames = 0;
    let start = std::time::Instant::now();
    while let Some(frame) = source.next_frame()? {
        let bytes = frame
            .buffer
            .cpu_access(0..frame.desc.byte_len(), uvm_alloc::Access::Read)?;
        preprocess(&frame.desc, bytes.bytes(), &p, &mut tensor)?;
        file.write_all(bytemuck::cast_slice(&tensor))?;
        frames += 1;
    }
    file.flush()?;
    eprintln!(
        "{frames} frames of {:?} -> {frames} x 3 x {size} x {size} f32 in {out} ({:.2} ms per frame)",
        source.desc(),
        start.elapsed().as_secs_f64() * 1e3 / f64::from(frames.max(1))
    );
    Ok(())
}
