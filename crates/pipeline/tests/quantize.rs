//! `pipeline quantize` on the tiny random LLaMA (fixtures/tiny-llama): the file it writes loads
//! as stored, under the policy it records, and calibrated GPTQ and block rotations bring the
//! quantized model's logits closer to the full-precision model's than round-to-nearest does.

use std::path::{Path, PathBuf};

use kv_paged::PageDtype;
use mx_quant::gptq::{ColumnOrder, GptqOptions};
use pipeline::decoder::{Decoder, DecoderOptions, WeightPolicy};
use pipeline::model::TensorSource;
use pipeline::model::gguf::GgufFile;
use pipeline::quantize::{self, Method, QuantizeOptions};

fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-llama/tiny.gguf")
}

/// A fresh directory for one test's files (removed when the test passes).
struct Scratch(PathBuf);

impl Scratch {
    fn new(test: &str) -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("pipeline-quantize-{}-{test}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn open(model: &Path, policy: &str) -> Decoder {
    let options = DecoderOptions {
        policy: WeightPolicy::parse(policy).unwrap(),
        ctx: 128,
        max_batch: 128,
        max_logit_rows: 8,
        kv_dtype: PageDtype::F32,
        cache: None,
    };
    pipeline::llm::open_decoder(model, options, 2).unwrap().0
}

fn logits(d: &mut Decoder, ids: &[u32]) -> Vec<f32> {
    d.reset().unwrap();
    let mut out = Vec::new();
    d.forward(ids, 0..ids.len(), |_, l| out.extend_from_slice(l))
        .unwrap();
    out
}

/// Token batches from a fixed generator (the tiny model has no tokenizer).
fn batches(seed: u64, count: usize, len: usize) -> Vec<Vec<u32>> {
    let mut s = seed;
    (0..count)
        .map(|_| {
            (0..len)
                .map(|_| {
                    s = s
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((s >> 33) % 320) as u32
                })
                .collect()
        })
        .collect()
}

fn quantize_tiny(out: &Path, policy: &str, method: Method, rotate: bool) {
    let source = GgufFile::open(&tiny()).unwrap();
    let calibration = match method {
        Method::Gptq(_) => {
            let (mut d, _) = quantize::calibration_decoder(&tiny(), 128, 2).unwrap();
            Some(quantize::calibrate(&mut d, &batches(1, 16, 128), 2, |_, _| {}).unwrap())
        }
        Method::RoundToNearest => None,
    };
    let options = QuantizeOptions {
        policy: WeightPolicy::parse(policy).unwrap(),
        method,
        rotate,
        threads: 2,
    };
    quantize::quantize(
        &source,
        calibration.as_ref(),
        &options,
        out,
        "test batches",
        |_, _| {},
    )
    .unwrap();
}

/// Mean squared difference of two logit sets.
fn mse(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::from(x - y).powi(2))
        .sum::<f64>()
        / a.len() as f64
}

#[test]
fn a_quantized_file_records_its_policy_and_loads_as_stored() {
    let dir = Scratch::new("records");
    let out = dir.path().join("tiny-fp4.gguf");
    quantize_tiny(&out, "fp4", Method::RoundToNearest, false);
    let file = GgufFile::open(&out).unwrap();
    assert_eq!(file.recorded_policy().unwrap(), Some("fp4"));
    assert_eq!(
        pipeline::llm::recorded_policy(&out).unwrap().as_deref(),
        Some("fp4")
    );
    assert_eq!(
        file.model_config().unwrap(),
        GgufFile::open(&tiny()).unwrap().model_config().unwrap()
    );
    assert!(matches!(
        file.dtype("blk.0.attn_q"),
        Some(pipeline::model::SourceDtype::Mx(
            mx_quant::ElemFormat::Fp4E2M1
        ))
    ));
    // Loading the file takes its blocks as they are: the same logits, bit for bit, as
    // converting the source at load time with the same rounding.
    let ids = &batches(9, 1, 40)[0];
    let stored = logits(&mut open(&out, "fp4"), ids);
    let converted = logits(&mut open(&tiny(), "fp4"), ids);
    assert_eq!(stored, converted);
    // Under another policy the stored values are read back (dequantized) and converted again.
    let exact = logits(&mut open(&out, "exact-f32"), ids);
    assert!(mse(&exact, &stored) < 1e-3, "{}", mse(&exact, &stored));
}

#[test]
fn calibrated_gptq_rotations_and_refinement_beat_round_to_nearest_on_held_out_tokens() {
    let dir = Scratch::new("gptq");
    let held_out = batches(77, 2, 64);
    let reference: Vec<Vec<f32>> = {
        let mut d = open(&tiny(), "exact-f32");
        held_out.iter().map(|ids| logits(&mut d, ids)).collect()
    };
    let error = |name: &str, method: Method, rotate: bool| {
        let out = dir.path().join(format!("{name}.gguf"));
        quantize_tiny(&out, "fp4", method, rotate);
        let mut d = open(&out, "fp4");
        let e = held_out
            .iter()
            .zip(&reference)
            .map(|(ids, r)| mse(&logits(&mut d, ids), r))
            .sum::<f64>();
        eprintln!("{name}: logit MSE {e:.4e}");
        e
    };
    let gptq = |order, refine_passes| {
        Method::Gptq(GptqOptions {
            order,
            refine_passes,
            ..GptqOptions::default()
        })
    };
    let rtn = error("rtn", Method::RoundToNearest, false);
    let rtn_rotated = error("rtn-rotated", Method::RoundToNearest, true);
    let natural = error("gptq", gptq(ColumnOrder::Natural, 0), false);
    let act_order = error("gptq-act-order", gptq(ColumnOrder::ActOrder, 0), false);
    let both = error("gptq-rotated", gptq(ColumnOrder::Natural, 0), true);
    let refined = error("gptq-rotated-refined", gptq(ColumnOrder::Natural, 8), true);
    for (name, e) in [
        ("gptq", natural),
        ("gptq act order", act_order),
        ("gptq rotated", both),
        ("gptq rotated refined", refined),
    ] {
        assert!(
            e < rtn,
            "{name}: {e:.4e} against round-to-nearest {rtn:.4e}"
        );
    }
    assert!(
        refined < both,
        "refinement passes: {refined:.4e} against GPTQ's {both:.4e}"
    );
    assert!(
        rtn_rotated < rtn,
        "rotation alone: {rtn_rotated:.4e} against {rtn:.4e}"
    );
}

#[test]
fn a_rotated_file_reads_back_the_weights_it_was_made_from() {
    let dir = Scratch::new("rotated");
    let out = dir.path().join("tiny-int8-rotated.gguf");
    quantize_tiny(&out, "int8", Method::RoundToNearest, true);
    let (file, source) = (
        GgufFile::open(&out).unwrap(),
        GgufFile::open(&tiny()).unwrap(),
    );
    assert!(file.block_rotation("blk.1.ffn_down"));
    assert!(
        !file.block_rotation("token_embd"),
        "the embedding is never rotated"
    );
    let (rows, cols) = source.shape("blk.1.ffn_down").unwrap();
    let (mut a, mut b) = (vec![0f32; rows * cols], vec![0f32; rows * cols]);
    source.read_rows("blk.1.ffn_down", 0..rows, &mut a).unwrap();
    file.read_rows("blk.1.ffn_down", 0..rows, &mut b).unwrap();
    let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        worst < 0.02 * scale,
        "MXINT8 after rotation: {worst} of {scale}"
    );
}

#[test]
fn a_rotation_list_naming_a_tensor_the_file_lacks_is_refused() {
    // The quantizer's own output, with the rotation list pointed at a tensor it lacks.
    let dir = Scratch::new("refused");
    let out = dir.path().join("tiny.gguf");
    quantize_tiny(&out, "fp4", Method::RoundToNearest, true);
    let bytes = std::fs::read(&out).unwrap();
    let needle = b"blk.0.attn_q.weight";
    // The first occurrence is in the metadata (the rotation list precedes the tensor infos).
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap();
    let mut bad = bytes.clone();
    bad[at..at + needle.len()].copy_from_slice(b"blk.0.attn_n.weight");
    let e = GgufFile::from_bytes("bad.gguf", bad)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not an MX tensor"), "{e}");
}
