//! The reference binary `pipeline`. Today it has one subcommand, `isp`, which runs the ISP on one
//! frame of any source and writes what the model will see as 8-bit RGB; `run`, `devices`,
//! `generate` and the rest arrive with their issues (#6, #8, #9).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use isp_v4l2::isp::{Layout, Matrix, Preprocess, Range, preprocess};
use isp_v4l2::{Pacing, open_source};

#[derive(Parser, Debug)]
#[command(
    name = "pipeline",
    about = "Zero-copy camera -> ISP -> ViT -> decoder runtime (reference binary)"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum MatrixArg {
    Bt601,
    Bt709,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum RangeArg {
    Limited,
    Full,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run the ISP on one frame and write what the model sees (8-bit RGB, .png or raw .rgb).
    Isp {
        /// pattern:WxH@FPS[:nv12|i420|yuyv], file:clip.y4m, file:image.png or file:folder
        #[arg(long)]
        source: String,
        /// Which frame (0-based).
        #[arg(long, default_value_t = 0)]
        frame: u64,
        /// Output size, WIDTHxHEIGHT.
        #[arg(long, default_value = "512x512")]
        size: String,
        #[arg(long, value_enum, default_value = "bt601")]
        matrix: MatrixArg,
        #[arg(long, value_enum, default_value = "limited")]
        range: RangeArg,
        /// Output file: .png, or .rgb for raw interleaved bytes.
        #[arg(long)]
        out: PathBuf,
    },
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    match cli.command {
        Cmd::Isp {
            source,
            frame,
            size,
            matrix,
            range,
            out,
        } => {
            let (w, h) = size
                .split_once('x')
                .and_then(|(w, h)| Some((w.parse::<usize>().ok()?, h.parse::<usize>().ok()?)))
                .filter(|&(w, h)| w > 0 && h > 0)
                .ok_or_else(|| format!("--size {size}: expected WIDTHxHEIGHT"))?;
            let mut src = open_source(&source, Pacing::AsFastAsPossible)?;
            let mut picked = None;
            for _ in 0..=frame {
                picked = src.next_frame()?;
                if picked.is_none() {
                    return Err(format!("{source} ends before frame {frame}").into());
                }
            }
            let f = picked.expect("loop ran at least once");
            let access = f
                .buffer
                .cpu_access(0..f.desc.byte_len(), uvm_alloc::Access::Read)?;
            // What the model sees, before normalisation: RGB scaled to 0..1, back to 8 bits.
            let p = Preprocess {
                matrix: match matrix {
                    MatrixArg::Bt601 => Matrix::Bt601,
                    MatrixArg::Bt709 => Matrix::Bt709,
                },
                range: match range {
                    RangeArg::Limited => Range::Limited,
                    RangeArg::Full => Range::Full,
                },
                width: w,
                height: h,
                mean: [0.0; 3],
                std: [1.0; 3],
                layout: Layout::Hwc,
                ..Default::default()
            };
            let mut values = vec![0f32; 3 * w * h];
            preprocess(&f.desc, access.bytes(), &p, &mut values)?;
            let bytes: Vec<u8> = values
                .iter()
                .map(|v| (v * 255.0).round().clamp(0.0, 255.0) as u8)
                .collect();
            match out.extension().and_then(|e| e.to_str()) {
                Some("png") => image::RgbImage::from_raw(w as u32, h as u32, bytes)
                    .ok_or("image size mismatch")?
                    .save(&out)?,
                Some("rgb") => std::fs::write(&out, bytes)?,
                _ => return Err(format!("--out {}: use .png or .rgb", out.display()).into()),
            }
            eprintln!(
                "wrote {} ({w}x{h}) from frame {} of {source} ({:?} {}x{})",
                out.display(),
                f.sequence,
                f.desc.format,
                f.desc.width,
                f.desc.height
            );
            Ok(())
        }
    }
}
