//! The decoder on the real SmolLM2-135M-Instruct (GGUF Q4_1), against llama.cpp's numbers:
//! the `exact` policy's logits and greedy completion of the reference prompt, bit for bit and
//! token for token, for each llama.cpp build committed under `fixtures/llama-cpp-logits`, and
//! perplexity on the Apache-2.0 text within 1% of llama.cpp's 15.93; the default MX policy's
//! perplexity within 10% of it.
//!
//! The model is fetched, never committed: these tests are ignored until it is there
//! (`cargo xtask fetch-model smollm2-135m`; CI fetches it and runs them with `--ignored`). The
//! path is `$SMOLLM2_GGUF`, else `models/SmolLM2-135M-Instruct.Q4_1.gguf` at the workspace root.

use std::path::PathBuf;

use npu_hal::sampling::SamplingParams;

mod common;
use pipeline::decoder::{Decoder, DecoderOptions, WeightPolicy};

/// llama.cpp's perplexity for this file and text at ctx 512 (issue #6).
const LLAMA_CPP_PPL: f64 = 15.93;
const APACHE: &str = "/usr/share/common-licenses/Apache-2.0";

fn model_path() -> PathBuf {
    std::env::var_os("SMOLLM2_GGUF").map_or_else(
        || {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf")
        },
        PathBuf::from,
    )
}

fn open(policy: &str) -> (Decoder, pipeline::model::tokenizer::Tokenizer) {
    open_on(policy, None)
}

/// [`open`] on `device` (the CPU NPU when `None`).
fn open_on(
    policy: &str,
    device: Option<Box<dyn npu_hal::Device>>,
) -> (Decoder, pipeline::model::tokenizer::Tokenizer) {
    let path = model_path();
    assert!(
        path.is_file(),
        "{} is missing: run `cargo xtask fetch-model smollm2-135m`",
        path.display()
    );
    let options = DecoderOptions {
        policy: WeightPolicy::parse(policy).unwrap(),
        ctx: 512,
        max_logit_rows: 32,
        ..DecoderOptions::default()
    };
    let (d, t) = match device {
        Some(device) => pipeline::llm::open_decoder_on(&path, options, device).unwrap(),
        None => pipeline::llm::open_decoder(&path, options, 0).unwrap(),
    };
    (d, t.expect("the GGUF carries its tokenizer"))
}

/// One committed run of llama.cpp (`fixtures/llama-cpp-logits/BUILD`, made by its `make.py` on
/// a CPU that builds as BUILD): the expected values and the directory they came from.
struct LlamaCppRun {
    build: npu_hal::GgmlBuild,
    expected: serde_json::Value,
    dir: PathBuf,
}

/// The llama.cpp run of each build (both are committed). Each is checked on whatever CPU runs
/// the test: `exact:BUILD` computes that build's orders of operations, whatever the host's
/// vector width.
fn llama_cpp_runs() -> Vec<LlamaCppRun> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/llama-cpp-logits");
    [npu_hal::GgmlBuild::Avx2, npu_hal::GgmlBuild::Avx512]
        .into_iter()
        .map(|build| {
            let dir = root.join(build.name());
            let path = dir.join("expected.json");
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let expected: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(expected["ggml_build"], build.name(), "{}", path.display());
            LlamaCppRun {
                build,
                expected,
                dir,
            }
        })
        .collect()
}

/// A fixture's token ids (a JSON array of integers).
fn token_ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("an array of token ids")
        .iter()
        .map(|t| u32::try_from(t.as_u64().expect("a token id")).expect("a 32-bit token id"))
        .collect()
}

/// A logits row's SHA-256 over its little-endian f32 bytes, as `make.py` hashes llama.cpp's.
fn row_sha256(row: &[f32]) -> String {
    use sha2::{Digest, Sha256};
    let bytes: Vec<u8> = row.iter().flat_map(|v| v.to_le_bytes()).collect();
    Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The `exact:BUILD` policy's greedy completion of the README's prompt is llama.cpp's, every
/// one of its 20 tokens, for each committed build.
#[test]
#[ignore = "needs the SmolLM2-135M model: cargo xtask fetch-model smollm2-135m"]
fn exact_policy_completes_the_prompt_as_llama_cpp_does() {
    for run in llama_cpp_runs() {
        let (mut d, tok) = open(&format!("exact:{}", run.build.name()));
        let prompt = tok
            .encode(run.expected["prompt"].as_str().unwrap(), false)
            .unwrap();
        let want = token_ids(&run.expected["completion_ids"]);
        let mut ids = Vec::new();
        pipeline::llm::generate(
            &mut d,
            &prompt,
            want.len(),
            SamplingParams::default(),
            &[],
            |t| {
                ids.push(t);
                true
            },
        )
        .unwrap();
        let agree = ids.iter().zip(&want).take_while(|(a, b)| a == b).count();
        assert_eq!(
            agree,
            want.len(),
            "{:?}: only {agree} of {} tokens agree with llama.cpp's completion {:?}; got {:?}",
            run.build,
            want.len(),
            run.expected["completion_text"],
            tok.decode(&ids).unwrap()
        );
    }
}

fn ppl(policy: &str) -> f64 {
    ppl_on(policy, None, None)
}

/// Perplexity of the Apache-2.0 text in chunks of 512 tokens (its first `max_chunks` where
/// given) with `policy`, on `device` (the CPU NPU when `None`).
fn ppl_on(
    policy: &str,
    device: Option<Box<dyn npu_hal::Device>>,
    max_chunks: Option<usize>,
) -> f64 {
    let (mut d, tok) = open_on(policy, device);
    let text = std::fs::read_to_string(APACHE).expect("Debian's common-licenses/Apache-2.0");
    let mut tokens = tok.encode(&text, false).unwrap();
    if let Some(chunks) = max_chunks {
        tokens.truncate(chunks * 512);
    }
    let r = pipeline::llm::perplexity(&mut d, &tokens, 512, None, |_, _| {}).unwrap();
    eprintln!(
        "{policy} on {}: perplexity {:.4} over {} chunks",
        d.device().info().name,
        r.ppl,
        r.chunks
    );
    r.ppl
}

#[test]
#[ignore = "needs the SmolLM2-135M model: cargo xtask fetch-model smollm2-135m"]
fn exact_policy_perplexity_is_within_one_percent_of_llama_cpp() {
    let p = ppl("exact");
    assert!(
        (p / LLAMA_CPP_PPL - 1.0).abs() < 0.01,
        "exact perplexity {p} vs llama.cpp {LLAMA_CPP_PPL}"
    );
}

#[test]
#[ignore = "needs the SmolLM2-135M model: cargo xtask fetch-model smollm2-135m"]
fn default_mx_policy_perplexity_is_within_ten_percent_of_q4_1() {
    let p = ppl("default");
    assert!(p <= LLAMA_CPP_PPL * 1.10, "default-policy perplexity {p}");
}

/// The `exact:BUILD` policy's logits against llama.cpp's, bit for bit, for each committed
/// build: every position of the README's prompt, each row's little-endian f32 bytes hashed as
/// `fixtures/llama-cpp-logits/make.py` (llama-cpp-python 0.3.36, CPU, flash attention on)
/// hashed llama.cpp's. The last row is compared value by value to say how far off it is.
#[test]
#[ignore = "needs the SmolLM2-135M model: cargo xtask fetch-model smollm2-135m"]
fn exact_policy_logits_are_bit_identical_to_llama_cpp() {
    let mut failures = Vec::new();
    for run in llama_cpp_runs() {
        let (mut d, tok) = open(&format!("exact:{}", run.build.name()));
        let prompt = run.expected["prompt"].as_str().unwrap();
        let tokens = token_ids(&run.expected["tokens"]);
        assert_eq!(tok.encode(prompt, false).unwrap(), tokens, "tokenization");
        let mut rows: Vec<Vec<f32>> = Vec::new();
        d.forward(&tokens, 0..tokens.len(), |_, l| rows.push(l.to_vec()))
            .unwrap();
        let want: Vec<&str> = run.expected["row_sha256"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_str().unwrap())
            .collect();
        let last: Vec<f32> = std::fs::read(run.dir.join("last_row.f32"))
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let max_diff = rows
            .last()
            .unwrap()
            .iter()
            .zip(&last)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        let differing: Vec<usize> = rows
            .iter()
            .zip(&want)
            .enumerate()
            .filter(|(_, (row, h))| row_sha256(row) != **h)
            .map(|(i, _)| i)
            .collect();
        eprintln!(
            "{:?}: {} of {} positions bit-identical; last row max |diff| {max_diff}",
            run.build,
            rows.len() - differing.len(),
            rows.len()
        );
        if !differing.is_empty() || max_diff != 0.0 || rows.len() != want.len() {
            failures.push(format!(
                "{:?}: positions {differing:?} of {} differ from llama.cpp's logits; last row max \
                 |diff| {max_diff}",
                run.build,
                rows.len()
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("; "));
}

/// The `exact:BUILD` policy's decode steps against llama.cpp's, bit for bit: the prompt, then the
/// 20 completion tokens one at a time, each step's logits hashed against the fixture's
/// `completion_row_sha256` (llama.cpp fed one token per step too). Only the AVX2 fixture has
/// them: the AVX-512 one was made before `make.py` recorded them, on a machine not at hand since.
#[test]
#[ignore = "needs the SmolLM2-135M model: cargo xtask fetch-model smollm2-135m"]
fn exact_policy_decode_steps_are_bit_identical_to_llama_cpp() {
    let mut checked = 0;
    for run in llama_cpp_runs() {
        let Some(want) = run.expected["completion_row_sha256"].as_array() else {
            eprintln!("{:?}: no decode-step hashes in the fixture", run.build);
            continue;
        };
        let (mut d, _) = open(&format!("exact:{}", run.build.name()));
        let prompt = token_ids(&run.expected["tokens"]);
        let completion = token_ids(&run.expected["completion_ids"]);
        assert_eq!(want.len(), completion.len());
        d.forward(&prompt, prompt.len() - 1..prompt.len(), |_, _| {})
            .unwrap();
        let mut differing = Vec::new();
        for (step, (&t, h)) in completion.iter().zip(want).enumerate() {
            let mut row = None;
            d.forward(&[t], 0..1, |_, l| row = Some(row_sha256(l)))
                .unwrap();
            if row.as_deref() != h.as_str() {
                differing.push(step);
            }
        }
        eprintln!(
            "{:?}: {} of {} decode steps bit-identical",
            run.build,
            want.len() - differing.len(),
            want.len()
        );
        assert!(
            differing.is_empty(),
            "{:?}: decode steps {differing:?} differ from llama.cpp's",
            run.build
        );
        checked += 1;
    }
    assert!(checked > 0, "no fixture has decode-step hashes");
}

/// npu-hal's GPU backend (lavapipe on CI), which must exist: these run only with `--ignored`.
fn gpu() -> Box<dyn npu_hal::Device> {
    use npu_hal::Backend;
    npu_hal::VulkanBackend::default()
        .open()
        .expect("a Vulkan device for the GPU decoder (lavapipe: mesa-vulkan-drivers)")
}

const README_PROMPT: &str = "Once upon a time, there was a little robot who";

/// The default policy on the GPU against the CPU NPU: logits of every prompt position (max and
/// mean error printed; the CPU rounds activations to int8 for its MX dot products, the GPU does
/// not, which measured 7.5% of the largest logit at most and 1.6% on average on the H200) and the
/// greedy completion of the README's prompt, 16 tokens at least.
#[test]
#[ignore = "needs the SmolLM2-135M model: cargo xtask fetch-model smollm2-135m"]
fn smollm2_gpu_decoder_agrees_with_the_cpu() {
    let (mut cpu, tok) = open("default");
    let (mut gpu, _) = open_on("default", Some(gpu()));
    let prompt = tok.encode(README_PROMPT, false).unwrap();
    let logits = |d: &mut Decoder| {
        let mut rows = Vec::new();
        d.forward(&prompt, 0..prompt.len(), |_, l| rows.extend_from_slice(l))
            .unwrap();
        d.reset().unwrap();
        rows
    };
    let (want, got) = (logits(&mut cpu), logits(&mut gpu));
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff: Vec<f32> = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).collect();
    let max = diff.iter().fold(0f32, |m, &d| m.max(d)) / scale;
    let mean = diff.iter().sum::<f32>() / diff.len() as f32 / scale;
    eprintln!(
        "SmolLM2 default policy, {} positions on {}: max error {max:.2e}, mean {mean:.2e} (of max |logit| {scale:.1})",
        prompt.len(),
        gpu.device().info().name
    );
    assert!(
        max < 0.1 && mean < 0.03,
        "GPU logits differ from the CPU's by up to {max} (mean {mean})"
    );
    let run = |d: &mut Decoder| {
        let mut ids = Vec::new();
        pipeline::llm::generate(d, &prompt, 20, SamplingParams::default(), &[], |t| {
            ids.push(t);
            true
        })
        .unwrap();
        ids
    };
    let (want, got) = (run(&mut cpu), run(&mut gpu));
    let agree = want.iter().zip(&got).take_while(|(a, b)| a == b).count();
    eprintln!("greedy ids agree for {agree} of 20 tokens");
    assert!(
        agree >= 16,
        "only {agree} greedy ids agree\ncpu {}\ngpu {}",
        tok.decode(&want).unwrap(),
        tok.decode(&got).unwrap()
    );
}

/// The default policy's perplexity on the GPU within 1% of the CPU NPU's, over the whole
/// Apache-2.0 text on a GPU. On a CPU implementation of Vulkan (lavapipe, in CI) both take its
/// first two chunks (1024 tokens): its prefill runs under 1 GFLOP/s there (README, "Decoder on
/// the GPU"), and the whole text took 14-18 minutes of a CI run.
#[test]
#[ignore = "needs the SmolLM2-135M model: cargo xtask fetch-model smollm2-135m"]
fn smollm2_gpu_perplexity_is_within_one_percent_of_the_cpu() {
    let gpu_device = gpu();
    // npu-hal names a CPU implementation's kind so (`Adapter::kind_name`).
    let software = gpu_device.info().name.contains("CPU (software Vulkan)");
    let chunks = software.then_some(2);
    let gpu = ppl_on("default", Some(gpu_device), chunks);
    let cpu = ppl_on("default", None, chunks);
    assert!(
        (gpu / cpu - 1.0).abs() < 0.01,
        "GPU perplexity {gpu} against the CPU's {cpu}"
    );
}

/// Speculative decoding on the real model: 128 greedy tokens of the story prompt and of the
/// copy-heavy passage, with n-gram drafts, are those of plain decoding, and drafts were taken.
#[test]
#[ignore = "needs the SmolLM2-135M model: cargo xtask fetch-model smollm2-135m"]
fn speculative_greedy_output_is_plain_greedy_output() {
    use pipeline::speculative::{CPU_ROW_COST, DraftControl, Drafter, NgramDrafter};
    let (mut d, tok) = open("default");
    let passage = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/prompts/repeat-passage.txt"),
    )
    .unwrap();
    for text in [
        "Once upon a time, there was a little robot who",
        passage.trim_end(),
    ] {
        let prompt = tok.encode(text, d.config().add_bos).unwrap();
        let mut run = |drafting: bool| {
            let mut ngram = NgramDrafter::default();
            let drafter = drafting.then(|| {
                (
                    &mut ngram as &mut dyn Drafter,
                    DraftControl::new(8, CPU_ROW_COST),
                )
            });
            common::generate_ids(&mut d, &prompt, 128, &SamplingParams::default(), drafter)
        };
        let (plain, _) = run(false);
        let (spec, stats) = run(true);
        assert_eq!(spec, plain, "{text:?}");
        assert!(stats.draft.accepted > 0, "{text:?}: no draft was accepted");
    }
}
