//! The GPU backend against the CPU reference NPU: one small random transformer (three layers,
//! grouped-query attention), every weight format and every KV page dtype, through a 100-token
//! prefill batch (the GEMM and tiled attention kernels, several tiles each), single-token steps
//! (GEMV, per-row attention), a short batch (GEMV over 8 tokens) and a 20-token batch over the
//! cached keys, logits compared after each.
//!
//! On CI the GPU is lavapipe. Without any Vulkan adapter the test fails when `CI=true` and
//! otherwise prints a visible skip; it never passes without having run on a GPU.
#![cfg(feature = "vulkan")]

use std::io::Write;
use std::sync::Arc;

use kv_paged::{KvCache, KvLayout, PageDtype};
use mx_quant::gemv::MxMatrix;
use mx_quant::{ElemFormat, QuantOptions};
use npu_hal::ggml::{BlockMatrix, BlockType};
use npu_hal::{
    Batch, CpuConfig, CpuNpu, DenseMatrix, Device, HostWait, Numerics, Op, RopeStyle, Rows,
    Submission, TensorId, VulkanConfig, VulkanNpu, Weight,
};
use uvm_alloc::{Access, UnifiedBuffer};

const HIDDEN: usize = 64;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 32;
const INTER: usize = 128;
const VOCAB: usize = 96;
const LAYERS: usize = 3;
const MAX_ROWS: usize = 128;
const LOGIT_ROWS: usize = 4;

/// Small deterministic numbers.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn matrix(&mut self, rows: usize, cols: usize, scale: f32) -> Vec<f32> {
        (0..rows * cols).map(|_| self.next() * scale).collect()
    }
}

#[derive(Clone, Copy, Debug)]
enum Storage {
    Mx(ElemFormat),
    /// Block-rotated MX matrices (the embedding stays plain): the GPU rotates activations in
    /// its own kernel, the CPU in its linear op.
    RotatedMx(ElemFormat),
    F32,
    F16,
    Block(BlockType),
}

fn weight(storage: Storage, rows: usize, cols: usize, rng: &mut Rng) -> Weight {
    let scale = 1.0 / (cols as f32).sqrt();
    let data = rng.matrix(rows, cols, scale);
    match storage {
        Storage::Mx(f) => Weight::Mx(
            MxMatrix::quantize(f, QuantOptions::default(), rows, cols, &data).expect("quantize"),
        ),
        Storage::RotatedMx(f) => {
            let mut rotated = data;
            mx_quant::hadamard::rotate_weights(&mut rotated).expect("whole blocks");
            Weight::Mx(
                MxMatrix::quantize(f, QuantOptions::default(), rows, cols, &rotated)
                    .expect("quantize")
                    .with_block_rotation(true),
            )
        }
        Storage::F32 => Weight::Dense(DenseMatrix::new(rows, cols, data).expect("shape")),
        Storage::F16 => {
            let rounded = data
                .iter()
                .map(|&v| half::f16::from_f32(v).to_f32())
                .collect();
            Weight::Dense(DenseMatrix::new(rows, cols, rounded).expect("shape"))
        }
        Storage::Block(ty) => {
            let mut bytes = Vec::new();
            for _ in 0..rows * cols / 32 {
                // Block scales that keep every weight within about +-scale, like the others.
                let d = if ty == BlockType::Q8_0 {
                    scale / 127.0
                } else {
                    scale / 8.0
                };
                let d = half::f16::from_f32(d).to_le_bytes();
                bytes.extend_from_slice(&d);
                match ty {
                    BlockType::Q8_0 => {
                        bytes.extend((0..32).map(|_| (rng.next() * 127.0) as i8 as u8));
                    }
                    BlockType::Q4_0 | BlockType::Q4_1 => {
                        if ty == BlockType::Q4_1 {
                            bytes.extend_from_slice(&half::f16::from_f32(-scale).to_le_bytes());
                        }
                        bytes.extend((0..16).map(|_| ((rng.next() + 1.0) * 127.9) as u8));
                    }
                }
            }
            Weight::Block(BlockMatrix::new(ty, rows, cols, bytes).expect("block matrix"))
        }
    }
}

fn vector(len: usize, rng: &mut Rng) -> Weight {
    Weight::Vector((0..len).map(|_| 1.0 + 0.2 * rng.next()).collect())
}

/// The model's programs on one device: the body (every row) and the head (selected rows).
struct Model {
    body: Vec<Op>,
    head: Vec<Op>,
    logits: TensorId,
}

fn load(device: &mut dyn Device, storage: Storage, seed: u64) -> Model {
    let mut rng = Rng(seed);
    let w = |d: &mut dyn Device, weight: Weight| d.load_weight(weight).expect("load");
    let table = match storage {
        Storage::RotatedMx(f) => Storage::Mx(f),
        other => other,
    };
    let embd = w(device, weight(table, VOCAB, HIDDEN, &mut rng));
    let mut t = |width| device.create_tensor(width, MAX_ROWS).expect("tensor");
    let (x, xn, q, k, v, attn, o, gate, up, act) = (
        t(HIDDEN),
        t(HIDDEN),
        t(HEADS * HEAD_DIM),
        t(KV_HEADS * HEAD_DIM),
        t(KV_HEADS * HEAD_DIM),
        t(HEADS * HEAD_DIM),
        t(HIDDEN),
        t(INTER),
        t(INTER),
        t(INTER),
    );
    let logits = device.create_tensor(VOCAB, LOGIT_ROWS).expect("tensor");
    let mut body = vec![Op::Embed {
        table: embd,
        out: x,
    }];
    let linear = |weight, x, out| Op::Linear {
        weight,
        x,
        out,
        rows: Rows::All,
    };
    for layer in 0..LAYERS {
        let attn_norm = w(device, vector(HIDDEN, &mut rng));
        let wq = w(device, weight(storage, HEADS * HEAD_DIM, HIDDEN, &mut rng));
        let wk = w(
            device,
            weight(storage, KV_HEADS * HEAD_DIM, HIDDEN, &mut rng),
        );
        let wv = w(
            device,
            weight(storage, KV_HEADS * HEAD_DIM, HIDDEN, &mut rng),
        );
        let wo = w(device, weight(storage, HIDDEN, HEADS * HEAD_DIM, &mut rng));
        let ffn_norm = w(device, vector(HIDDEN, &mut rng));
        let wg = w(device, weight(storage, INTER, HIDDEN, &mut rng));
        let wu = w(device, weight(storage, INTER, HIDDEN, &mut rng));
        let wd = w(device, weight(storage, HIDDEN, INTER, &mut rng));
        // Both pairings, each in a layer whose K the GPU folds into its KV write (every layer
        // but the last, whose K is never overwritten).
        let style = if layer % 2 == 0 {
            RopeStyle::Interleaved
        } else {
            RopeStyle::HalfSplit
        };
        let rope = |x| Op::Rope {
            x,
            head_dim: HEAD_DIM,
            theta: 10000.0,
            style,
            numerics: Numerics::Standard,
        };
        body.extend([
            Op::RmsNorm {
                x,
                weight: attn_norm,
                eps: 1e-5,
                out: xn,
            },
            linear(wq, xn, q),
            linear(wk, xn, k),
            linear(wv, xn, v),
            rope(q),
            rope(k),
            Op::Attention {
                layer,
                q,
                k,
                v,
                out: attn,
                q_heads: HEADS,
                numerics: Numerics::Standard,
            },
            linear(wo, attn, o),
            Op::Add { acc: x, x: o },
            Op::RmsNorm {
                x,
                weight: ffn_norm,
                eps: 1e-5,
                out: xn,
            },
            linear(wg, xn, gate),
            linear(wu, xn, up),
            Op::SwiGlu {
                gate,
                up,
                out: act,
                numerics: Numerics::Standard,
            },
            linear(wd, act, o),
            Op::Add { acc: x, x: o },
        ]);
    }
    let out_norm = w(device, vector(HIDDEN, &mut rng));
    body.push(Op::RmsNorm {
        x,
        weight: out_norm,
        eps: 1e-5,
        out: xn,
    });
    let head = vec![Op::Linear {
        weight: embd,
        x: xn,
        out: logits,
        rows: Rows::Selected,
    }];
    Model { body, head, logits }
}

/// Runs `chunks` through body and head and returns the logits of each chunk's last
/// `LOGIT_ROWS.min(len)` rows, all chunks concatenated; the body reports its attention to
/// `tracker` when one is given.
fn run(
    device: &mut dyn Device,
    model: &Model,
    kv: &mut KvCache,
    chunks: &[Vec<u32>],
    mut tracker: Option<&mut kv_paged::prune::AttentionTracker>,
) -> Vec<f32> {
    let mut out = Vec::new();
    let mut pos = 0;
    // Only the head's input outlives the body, and only the logits the head: the GPU folds
    // the last layer's ops as it does the others'.
    let Some(&Op::Linear { x: head_input, .. }) = model.head.first() else {
        panic!("the head is a linear layer");
    };
    for chunk in chunks {
        let appended = kv.append(0, chunk).expect("append");
        device
            .submit(Submission {
                ops: &model.body,
                batch: Batch {
                    tokens: chunk,
                    first_pos: pos,
                    seq: 0,
                    slots: &appended.slots,
                    select: 0..0,
                    embeddings: None,
                },
                kv: Some(kv),
                attention: tracker.as_deref_mut(),
                wait: None,
                signal: None,
                live: Some(&[head_input]),
            })
            .expect("body");
        let rows = LOGIT_ROWS.min(chunk.len());
        device
            .submit(Submission {
                ops: &model.head,
                batch: Batch {
                    tokens: chunk,
                    first_pos: pos,
                    seq: 0,
                    slots: &appended.slots,
                    select: chunk.len() - rows..chunk.len(),
                    embeddings: None,
                },
                kv: None,
                attention: None,
                wait: None,
                signal: None,
                live: Some(&[model.logits]),
            })
            .expect("head");
        let mut logits = vec![0f32; rows * VOCAB];
        device
            .read_tensor(model.logits, 0..rows, &mut logits)
            .expect("read");
        out.extend(logits);
        pos += chunk.len();
    }
    out
}

/// Submits `ops` over a batch of `tokens` at position 0 with no KV cache, no attention
/// statistics and no timeline wait or signal: one stateless program.
fn submit_without_cache(
    device: &mut dyn Device,
    ops: &[Op],
    tokens: &[u32],
) -> Result<(), npu_hal::Error> {
    device.submit(Submission {
        ops,
        batch: Batch {
            tokens,
            first_pos: 0,
            seq: 0,
            slots: &[],
            select: 0..0,
            embeddings: None,
        },
        kv: None,
        attention: None,
        wait: None,
        signal: None,
        live: None,
    })
}

/// The CPU reference NPU every comparison runs against.
fn cpu() -> CpuNpu {
    CpuNpu::new(CpuConfig {
        threads: 2,
        ..CpuConfig::default()
    })
    .expect("cpu")
}

/// The GPU backend with the tiled prefill attention (its keys cut over up to 3 workgroups per
/// row block and head: uneven ranges), decode attention split over 4 workgroups per head (each
/// merged by the last to finish) and a spinning host wait, none of which lavapipe takes by
/// default.
fn gpu() -> Option<VulkanNpu> {
    gpu_with(VulkanConfig {
        tiled_attention: Some(true),
        attention_splits: Some(4),
        tiled_attention_splits: Some(3),
        host_wait: Some(HostWait::Spin),
        ..VulkanConfig::default()
    })
}

/// A GPU backend opened with `config`, as [`gpu`].
fn gpu_with(config: VulkanConfig) -> Option<VulkanNpu> {
    match VulkanNpu::new(config) {
        Ok(d) => Some(d),
        Err(e) => {
            let msg = format!(
                "no Vulkan device for the GPU backend ({e}); install a Vulkan driver \
                 (Debian/Ubuntu: `apt-get install mesa-vulkan-drivers libvulkan1` for lavapipe)"
            );
            let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
            assert!(!ci, "{msg}: CI must run the GPU backend for real");
            let _ = writeln!(std::io::stderr(), "\nSKIPPED: {msg}\n");
            None
        }
    }
}

fn kv_cache(dtype: PageDtype) -> KvCache {
    KvCache::new(
        KvLayout {
            layers: LAYERS,
            kv_heads: KV_HEADS,
            head_dim: HEAD_DIM,
            block_tokens: 4,
            dtype,
        },
        64,
        None,
    )
    .map(|mut kv| {
        kv.add_sequence(0, &[]).expect("sequence");
        kv
    })
    .expect("kv cache")
}

/// (max |gpu - cpu|, mean |gpu - cpu|) over max |cpu|.
fn errors(gpu: &[f32], cpu: &[f32]) -> (f32, f32) {
    // A non-finite logit is a failure however the rest compares (f32::max drops NaNs).
    let bad = gpu.iter().filter(|v| !v.is_finite()).count();
    assert_eq!(bad, 0, "{bad} of {} GPU logits are not finite", gpu.len());
    let scale = cpu.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    let diff: Vec<f32> = gpu.iter().zip(cpu).map(|(a, b)| (a - b).abs()).collect();
    let max = diff.iter().fold(0f32, |m, &d| m.max(d));
    let mean = diff.iter().sum::<f32>() / diff.len() as f32;
    (max / scale, mean / scale)
}

fn chunks() -> Vec<Vec<u32>> {
    let prompt: Vec<u32> = (0..100).map(|i| (i * 37 + 5) % VOCAB as u32).collect();
    vec![
        prompt,
        vec![7],
        vec![11],
        (0..5).map(|i| i * 13 % VOCAB as u32).collect(),
        vec![3],
        // A long batch over cached keys: the prefill kernels with a non-empty cache.
        (0..20).map(|i| (i * 29 + 1) % VOCAB as u32).collect(),
    ]
}

fn compare(storage: Storage, dtype: PageDtype, tolerance: f32) {
    let Some(mut gpu) = gpu() else { return };
    let mut cpu = cpu();
    let mc = load(&mut cpu, storage, 42);
    let mg = load(&mut gpu, storage, 42);
    let (mut kc, mut kg) = (kv_cache(dtype), kv_cache(dtype));
    let want = run(&mut cpu, &mc, &mut kc, &chunks(), None);
    let got = run(&mut gpu, &mg, &mut kg, &chunks(), None);
    let (max, mean) = errors(&got, &want);
    let _ = writeln!(
        std::io::stderr(),
        "device-test detail: {storage:?} / {dtype:?} on {}: max error {max:.2e}, mean {mean:.2e} (of max |logit|)",
        gpu.adapter()
    );
    assert!(
        max <= tolerance,
        "{storage:?} / {dtype:?}: GPU logits differ from the CPU's by up to {max} (tolerance {tolerance})"
    );
}

// MX weights: the CPU rounds activations to int8 for its integer dot products, the GPU keeps
// them in f32, so these agree to about 1%.
#[test]
fn mx_weights_match_the_cpu() {
    for f in [
        ElemFormat::Fp4E2M1,
        ElemFormat::Fp6E2M3,
        ElemFormat::Fp6E3M2,
        ElemFormat::Fp8E4M3,
        ElemFormat::Fp8E5M2,
        ElemFormat::Int8,
    ] {
        compare(Storage::Mx(f), PageDtype::F16, 0.03);
    }
}

/// One prefill-sized linear layer (the GEMM kernel: 100 tokens, a partial tile in both
/// directions, a 4100-row matrix of 65 row tiles, and 160 columns, five steps of 32) with or
/// without its RMSNorm folded in, every output compared; a mismatch names the first token and
/// row that differ.
#[test]
fn a_long_batch_linear_matches_the_cpu() {
    let mut cpu = cpu();
    let tokens: Vec<u32> = (0..100).map(|i| (i * 37 + 5) % VOCAB as u32).collect();
    let mut failures = Vec::new();
    let Some(mut gpu) = gpu() else {
        return;
    };
    for (storage, norm, rows, cols) in [
        (Storage::Mx(ElemFormat::Fp4E2M1), true, 100, HIDDEN),
        (Storage::Mx(ElemFormat::Fp4E2M1), false, 100, HIDDEN),
        (Storage::Mx(ElemFormat::Fp8E4M3), true, 100, 160),
        (Storage::Block(BlockType::Q4_1), true, 100, HIDDEN),
        (Storage::F32, true, 100, 160),
        (Storage::Mx(ElemFormat::Fp6E2M3), true, 4100, HIDDEN),
        (Storage::Block(BlockType::Q4_1), false, 4100, HIDDEN),
    ] {
        let want = linear_outputs(&mut cpu, storage, norm, false, rows, cols, &tokens, false);
        let got = linear_outputs(&mut gpu, storage, norm, false, rows, cols, &tokens, false);
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let first_bad = got
            .iter()
            .zip(&want)
            .position(|(g, w)| !g.is_finite() || (g - w).abs() > 0.03 * scale);
        let (max, mean) = if first_bad.is_none() {
            errors(&got, &want)
        } else {
            (f32::NAN, f32::NAN)
        };
        let _ = writeln!(
            std::io::stderr(),
            "device-test detail: {storage:?} GEMM, {rows} x {cols} (RMSNorm folded in: {norm}) on {}: max error {max:.2e}, mean {mean:.2e} (of max |y|)",
            gpu.adapter()
        );
        if let Some(i) = first_bad {
            failures.push(format!(
                "{storage:?}, {rows} x {cols}: output (token {}, row {}) is {} \
                 on the GPU, {} on the CPU; {} of {} outputs are not finite",
                i / rows,
                i % rows,
                got[i],
                want[i],
                got.iter().filter(|v| !v.is_finite()).count(),
                got.len()
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `y = W x` (or `W rms_norm(x)`; with `residual`, `y = r + W x` for embedded rows `r`, the
/// residual add folded into the linear layer) for `tokens`, read back: the linear-layer
/// program of the GEMV and GEMM tests. `readback` puts `y` where the GPU writes logits (host
/// memory on a discrete GPU).
#[allow(clippy::too_many_arguments)]
fn linear_outputs(
    device: &mut dyn Device,
    storage: Storage,
    norm: bool,
    residual: bool,
    rows: usize,
    cols: usize,
    tokens: &[u32],
    readback: bool,
) -> Vec<f32> {
    let mut rng = Rng(7);
    let table = device
        .load_weight(weight(storage, VOCAB, cols, &mut rng))
        .expect("table");
    let gain = device.load_weight(vector(cols, &mut rng)).expect("gain");
    let w = device
        .load_weight(weight(storage, rows, cols, &mut rng))
        .expect("weight");
    let x = device.create_tensor(cols, MAX_ROWS).expect("x");
    let xn = device.create_tensor(cols, MAX_ROWS).expect("xn");
    let y = if readback {
        device.create_readback_tensor(rows, MAX_ROWS)
    } else {
        device.create_tensor(rows, MAX_ROWS)
    }
    .expect("y");
    let mut ops = vec![Op::Embed { table, out: x }];
    if norm {
        ops.push(Op::RmsNorm {
            x,
            weight: gain,
            eps: 1e-5,
            out: xn,
        });
    }
    ops.push(Op::Linear {
        weight: w,
        x: if norm { xn } else { x },
        out: y,
        rows: Rows::All,
    });
    let mut result = y;
    if residual {
        let residual_table = device
            .load_weight(weight(Storage::F32, VOCAB, rows, &mut rng))
            .expect("residual table");
        let r = device.create_tensor(rows, MAX_ROWS).expect("r");
        ops.insert(
            0,
            Op::Embed {
                table: residual_table,
                out: r,
            },
        );
        ops.push(Op::Add { acc: r, x: y });
        result = r;
    }
    submit_without_cache(device, &ops, tokens).expect("submit");
    let mut out = vec![0f32; tokens.len() * rows];
    device
        .read_tensor(result, 0..tokens.len(), &mut out)
        .expect("read");
    out
}

// Every lane count the decode GEMV takes, for one token and a short batch (the kernel's two
// token widths), on narrow, wide (past the wide-row threshold) and tall (an output head in
// readback memory) matrices: the tree, the stores and the tall-matrix choice at each width;
// and tall matrices whose lane groups take several rows (a last workgroup only partly full).
#[test]
fn every_gemv_lane_count_matches_the_cpu() {
    let mut cpu = cpu();
    let storage = Storage::Mx(ElemFormat::Fp6E2M3);
    let shapes = [
        (true, 100, 160, false),
        (false, 100, 1120, false),
        (true, 8200, 160, true),
    ];
    let mut failures = Vec::new();
    let one_row = [8, 16, 32, 64, 128, 256].map(|lanes| (lanes, 1));
    for (lanes, tall_rows) in one_row
        .into_iter()
        .chain([(16, 2), (16, 4), (8, 8), (64, 4)])
    {
        let Some(mut gpu) = gpu_with(VulkanConfig {
            gemv_lanes: Some(lanes),
            gemv_wide_lanes: Some(lanes),
            gemv_tall_lanes: Some(lanes),
            gemv_tall_rows: Some(tall_rows),
            ..VulkanConfig::default()
        }) else {
            return;
        };
        for tokens in [&[5u32][..], &[5, 17, 60]] {
            for (norm, rows, cols, readback) in shapes {
                let want =
                    linear_outputs(&mut cpu, storage, norm, false, rows, cols, tokens, false);
                let got =
                    linear_outputs(&mut gpu, storage, norm, false, rows, cols, tokens, readback);
                let (max, _) = errors(&got, &want);
                // As mx_weights_match_the_cpu: the CPU rounds activations to int8.
                if max > 0.03 {
                    failures.push(format!(
                        "{lanes} lanes ({tall_rows} tall rows), {} tokens, {rows} x {cols} (norm {norm}): max error {max}",
                        tokens.len()
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// The prefill GEMM split over column ranges (VulkanConfig::gemm_split_groups, forced here:
// lavapipe never splits by default), with the RMSNorm and the residual add folded in, against
// the CPU and against the same GPU unsplit, which it matches but for the rounding of the
// ranges' sums.
#[test]
fn a_split_k_gemm_matches_the_cpu() {
    let mut cpu = cpu();
    let (Some(mut split), Some(mut whole)) = (
        gpu_with(VulkanConfig {
            gemm_split_groups: Some(100_000),
            ..VulkanConfig::default()
        }),
        gpu_with(VulkanConfig {
            gemm_split_groups: Some(0),
            ..VulkanConfig::default()
        }),
    ) else {
        return;
    };
    let tokens: Vec<u32> = (0..70).map(|i| (i * 37 + 5) % VOCAB as u32).collect();
    let mut failures = Vec::new();
    // 1120 columns: four ranges of 288 (the last 256); 576: two of 288.
    for (storage, norm, residual, rows, cols) in [
        (Storage::Mx(ElemFormat::Fp6E2M3), true, false, 100, 1120),
        (Storage::Mx(ElemFormat::Fp6E2M3), false, true, 576, 576),
        (Storage::Block(BlockType::Q4_1), true, true, 576, 576),
        (Storage::F32, false, false, 130, 1120),
    ] {
        let args = (storage, norm, residual, rows, cols);
        let run = |device: &mut dyn Device| {
            linear_outputs(
                device, args.0, args.1, args.2, args.3, args.4, &tokens, false,
            )
        };
        let want = run(&mut cpu);
        let got = run(&mut split);
        let unsplit = run(&mut whole);
        let (max, mean) = errors(&got, &want);
        let (vs_unsplit, _) = errors(&got, &unsplit);
        let _ = writeln!(
            std::io::stderr(),
            "device-test detail: {storage:?} split-K GEMM, {rows} x {cols} (norm {norm}, residual {residual}) on {}: max error {max:.2e}, mean {mean:.2e} against the CPU, {vs_unsplit:.2e} against unsplit",
            split.adapter()
        );
        if max > 0.03 || vs_unsplit > 1e-5 {
            failures.push(format!(
                "{storage:?}, {rows} x {cols} (norm {norm}, residual {residual}): max error \
                 {max} against the CPU, {vs_unsplit} against the unsplit GEMM"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The prefill GEMM on tensor cores (VulkanConfig::tensor_cores: cooperative matrices, weights
/// and activations rounded to f16 as they are staged, f32 sums) against the CPU and against the
/// SIMT GEMM on the same GPU: every weight format it takes, the RMSNorm and the residual add
/// folded in, split over column ranges and not, at token counts just past the GEMV's batches,
/// one partial token tile and two. Needs an adapter with cooperative matrices (not lavapipe in
/// Mesa 22.3): `cargo xtask device-test` runs it where one has them.
#[test]
#[ignore = "needs a Vulkan adapter with cooperative matrices (cargo xtask device-test)"]
fn tensor_core_gemms_match_the_cpu_and_the_simt_gemm() {
    let mut cpu = cpu();
    let open = |tensor_cores, split| {
        VulkanNpu::new(VulkanConfig {
            tensor_cores: Some(tensor_cores),
            gemm_split_groups: Some(split),
            ..VulkanConfig::default()
        })
        .unwrap_or_else(|e| panic!("no GPU backend with tensor_cores {tensor_cores}: {e}"))
    };
    let mut failures = Vec::new();
    let mut worst_vs_simt = 0f32;
    for split in [0, 100_000] {
        let (mut coop, mut simt) = (open(true, split), open(false, split));
        for count in [9u32, 70, 128] {
            let tokens: Vec<u32> = (0..count).map(|i| (i * 37 + 5) % VOCAB as u32).collect();
            for (storage, norm, residual, rows, cols) in [
                (Storage::Mx(ElemFormat::Fp4E2M1), true, false, 100, 1120),
                (Storage::Mx(ElemFormat::Fp8E4M3), false, true, 576, 576),
                (Storage::Mx(ElemFormat::Fp6E2M3), true, true, 132, 160),
                (Storage::Block(BlockType::Q4_0), true, false, 576, 576),
                (Storage::Block(BlockType::Q4_1), false, true, 100, 1120),
                (Storage::Block(BlockType::Q8_0), true, true, 4100, HIDDEN),
                (Storage::F16, true, false, 130, 1120),
            ] {
                let run = |device: &mut dyn Device| {
                    linear_outputs(device, storage, norm, residual, rows, cols, &tokens, false)
                };
                let want = run(&mut cpu);
                let got = run(&mut coop);
                let reference = run(&mut simt);
                let (max, mean) = errors(&got, &want);
                let (vs_simt, vs_simt_mean) = errors(&got, &reference);
                worst_vs_simt = worst_vs_simt.max(vs_simt);
                let _ = writeln!(
                    std::io::stderr(),
                    "device-test detail: {storage:?} tensor-core GEMM, {count} tokens, {rows} x {cols} (norm {norm}, residual {residual}, split {}) on {}: max error {max:.2e}, mean {mean:.2e} against the CPU; {vs_simt:.2e}, mean {vs_simt_mean:.2e} against the SIMT GEMM",
                    split > 0,
                    coop.adapter()
                );
                // As mx_weights_match_the_cpu: the CPU rounds activations to int8 (f16 weights:
                // it keeps f32, so the f16 rounding of x is all that differs).
                let tolerance = if matches!(storage, Storage::F16) {
                    5e-3
                } else {
                    0.03
                };
                if max > tolerance || vs_simt > 5e-3 {
                    failures.push(format!(
                        "{storage:?}, {count} tokens, {rows} x {cols} (norm {norm}, residual \
                         {residual}, split {}): max error {max} against the CPU (tolerance \
                         {tolerance}), {vs_simt} against the SIMT GEMM (tolerance 5e-3)",
                        split > 0
                    ));
                }
            }
        }
    }
    let _ = writeln!(
        std::io::stderr(),
        "device-test detail: tensor-core GEMMs within {worst_vs_simt:.2e} of the SIMT GEMM (of max |y|)"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// The host's ways of waiting change when it wakes, never what it reads: the same program
// gives the same logits, bit for bit, blocking, spinning and napping (whose estimates are
// warm after the first runs of each command buffer).
#[test]
fn every_host_wait_reads_the_same_logits() {
    let mut outs = Vec::new();
    for host_wait in [HostWait::Block, HostWait::Spin, HostWait::Nap] {
        let Some(mut gpu) = gpu_with(VulkanConfig {
            host_wait: Some(host_wait),
            ..VulkanConfig::default()
        }) else {
            return;
        };
        let model = load(&mut gpu, Storage::Mx(ElemFormat::Fp6E2M3), 42);
        let mut kv = kv_cache(PageDtype::F16);
        let _ = run(&mut gpu, &model, &mut kv, &chunks(), None);
        let mut kv = kv_cache(PageDtype::F16);
        outs.push((host_wait, run(&mut gpu, &model, &mut kv, &chunks(), None)));
    }
    for (mode, logits) in &outs[1..] {
        assert!(
            logits
                .iter()
                .zip(&outs[0].1)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{mode:?} read other logits than {:?}",
            outs[0].0
        );
    }
}

#[test]
fn block_rotated_mx_weights_match_the_cpu() {
    for f in [ElemFormat::Fp4E2M1, ElemFormat::Int8] {
        compare(Storage::RotatedMx(f), PageDtype::F16, 0.03);
    }
}

/// The GPU's rotation of a linear layer's input has the bits of the CPU's
/// (`mx_quant::hadamard::rotate_activations`): read through a rotated identity matrix, whose
/// products are exact, for a decode row, a short batch and a prefill batch. On the SIMT GEMM:
/// the tensor-core GEMM rounds its input to f16 (`block_rotated_mx_weights_match_the_cpu`
/// covers rotated weights there).
#[test]
fn the_gpu_rotates_activations_with_the_cpus_bits() {
    let Some(mut gpu) = gpu_with(VulkanConfig {
        tensor_cores: Some(false),
        ..VulkanConfig::default()
    }) else {
        return;
    };
    let n = 96;
    let mut identity = vec![0f32; n * n];
    for i in 0..n {
        identity[i * n + i] = 1.0;
    }
    // Stored as it is but marked rotated: y = I (H x) = H x.
    let w = MxMatrix::quantize(ElemFormat::Int8, QuantOptions::default(), n, n, &identity)
        .unwrap()
        .with_block_rotation(true);
    let w = gpu.load_weight(Weight::Mx(w)).unwrap();
    let (x, y) = (
        gpu.create_tensor(n, 16).unwrap(),
        gpu.create_tensor(n, 16).unwrap(),
    );
    let program = [Op::Linear {
        weight: w,
        x,
        out: y,
        rows: Rows::All,
    }];
    let mut rng = Rng(5);
    for tokens in [1usize, 8, 16] {
        let input: Vec<f32> = (0..tokens * n).map(|_| rng.next() * 3.0).collect();
        gpu.write_tensor(x, 0..tokens, &input).unwrap();
        let ids = vec![0u32; tokens];
        submit_without_cache(&mut gpu, &program, &ids).unwrap();
        let mut got = vec![0f32; tokens * n];
        gpu.read_tensor(y, 0..tokens, &mut got).unwrap();
        let mut want = input.clone();
        mx_quant::hadamard::rotate_activations(&mut want).unwrap();
        let same = got
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "{tokens} tokens: the GPU's rotation differs from the CPU's"
        );
    }
}

#[test]
fn dense_and_ggml_weights_match_the_cpu() {
    compare(Storage::F32, PageDtype::F32, 1e-4);
    compare(Storage::F16, PageDtype::F16, 1e-3);
    for ty in [BlockType::Q8_0, BlockType::Q4_0, BlockType::Q4_1] {
        // ggml's CPU dot products round activations to 8-bit blocks.
        compare(Storage::Block(ty), PageDtype::F16, 0.03);
    }
}

#[test]
fn every_kv_dtype_matches_the_cpu() {
    for dtype in PageDtype::ALL {
        // The MX encoders agree on scales and rounding; an element that lands on a rounding tie
        // may still round differently after the two devices' f32 sums.
        let tolerance = match dtype {
            PageDtype::F32 => 1e-4,
            PageDtype::F16 | PageDtype::Bf16 => 1e-2,
            PageDtype::Mxfp8 | PageDtype::Mxfp4 => 5e-2,
        };
        compare(Storage::F32, dtype, tolerance);
    }
}

/// What the GPU cannot run is refused by name before anything is submitted, and the device
/// keeps working.
#[test]
fn unsupported_programs_are_refused_by_name() {
    let Some(mut gpu) = gpu() else { return };
    let gain = gpu.load_weight(Weight::Vector(vec![1.0; HIDDEN])).unwrap();
    let x = gpu.create_tensor(HIDDEN, 4).unwrap();
    let in_place = [Op::RmsNorm {
        x,
        weight: gain,
        eps: 1e-5,
        out: x,
    }];
    let err = submit_without_cache(&mut gpu, &in_place, &[0]).unwrap_err();
    assert!(matches!(err, npu_hal::Error::Unsupported { .. }), "{err}");
    assert!(err.to_string().contains("RMSNorm in place"), "{err}");
    let y = gpu.create_tensor(HIDDEN, 4).unwrap();
    let ok = [Op::RmsNorm {
        x,
        weight: gain,
        eps: 1e-5,
        out: y,
    }];
    gpu.write_tensor(x, 0..1, &[2.0; HIDDEN]).unwrap();
    submit_without_cache(&mut gpu, &ok, &[0]).unwrap();
    let mut out = vec![0f32; HIDDEN];
    gpu.read_tensor(y, 0..1, &mut out).unwrap();
    assert!(out.iter().all(|&v| (v - 1.0).abs() < 1e-5), "{out:?}");
    // A program checked once for a batch shape is checked again for another: 5 rows do not
    // fit tensors of 4, however many 1-row batches passed before.
    let err = submit_without_cache(&mut gpu, &ok, &[0; 5]).unwrap_err();
    assert!(err.to_string().contains("rms_norm"), "{err}");
}

/// A decode program whose ops were checked at one batch shape still checks what changes from
/// step to step: the token ids, and KV slots that do not match the batch.
#[test]
fn a_program_checked_once_still_refuses_bad_steps() {
    let Some(mut gpu) = gpu() else { return };
    let model = load(&mut gpu, Storage::Mx(ElemFormat::Fp6E2M3), 7);
    let mut kv = kv_cache(PageDtype::F16);
    let submit = |gpu: &mut VulkanNpu, kv: &mut KvCache, tokens: &[u32], slots: &[_], pos| {
        gpu.submit(Submission {
            ops: &model.body,
            batch: Batch {
                tokens,
                first_pos: pos,
                seq: 0,
                slots,
                select: 0..0,
                embeddings: None,
            },
            kv: Some(kv),
            attention: None,
            wait: None,
            signal: None,
            live: None,
        })
    };
    for pos in 0..3 {
        let appended = kv.append(0, &[pos as u32]).expect("append");
        submit(&mut gpu, &mut kv, &[pos as u32], &appended.slots, pos).expect("a good step");
    }
    let appended = kv.append(0, &[1]).expect("append");
    let err = submit(&mut gpu, &mut kv, &[VOCAB as u32], &appended.slots, 3).unwrap_err();
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    let err = submit(&mut gpu, &mut kv, &[1], &[], 3).unwrap_err();
    assert!(err.to_string().contains("slots"), "{err}");
    submit(&mut gpu, &mut kv, &[1], &appended.slots, 3).expect("the step, good again");
}

/// Runs a 100-token prefill whose rows 10..40 take their embeddings from `data` (instead of the
/// table), then the head; returns the last rows' logits.
fn run_spliced(
    device: &mut dyn Device,
    model: &Model,
    data: npu_hal::EmbeddingData<'_>,
    wait: Option<(&dyn sync_timeline::Timeline, u64)>,
) -> Vec<f32> {
    let mut kv = kv_cache(PageDtype::F16);
    let chunk = &chunks()[0];
    let appended = kv.append(0, chunk).expect("append");
    let batch = |select| Batch {
        tokens: chunk,
        first_pos: 0,
        seq: 0,
        slots: &appended.slots,
        select,
        embeddings: None,
    };
    device
        .submit(Submission {
            ops: &model.body,
            batch: Batch {
                embeddings: Some(npu_hal::Embeddings {
                    rows: SPLICED,
                    data,
                }),
                ..batch(0..0)
            },
            kv: Some(&mut kv),
            attention: None,
            wait,
            signal: None,
            live: None,
        })
        .expect("body");
    let rows = LOGIT_ROWS;
    device
        .submit(Submission {
            ops: &model.head,
            batch: batch(chunk.len() - rows..chunk.len()),
            kv: None,
            attention: None,
            wait: None,
            signal: None,
            live: None,
        })
        .expect("head");
    let mut logits = vec![0f32; rows * VOCAB];
    device
        .read_tensor(model.logits, 0..rows, &mut logits)
        .expect("read");
    logits
}

const SPLICED: std::ops::Range<usize> = 10..40;

/// Held by every test that splices host rows into a GPU batch while another counts the
/// process-wide `gpu-splice-upload` ledger: the tests of this binary run in parallel, and a
/// host splice in one would otherwise land between another's before-and-after readings.
static SPLICE_LEDGER: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `rows` embedding rows, `skip` rows into a unified buffer (so the source has an offset),
/// and the same values on the host.
fn unified_rows(rows: usize, skip: usize, seed: u64) -> (Arc<UnifiedBuffer>, Vec<f32>) {
    let mut rng = Rng(seed);
    let values: Vec<f32> = (0..rows * HIDDEN).map(|_| rng.next()).collect();
    let buffer = Arc::new(UnifiedBuffer::memfd((skip + rows) * HIDDEN * 4).expect("memfd"));
    {
        let mut g = buffer
            .cpu_access(0..buffer.len(), Access::Write)
            .expect("write guard");
        let all = g.typed_mut::<f32>().expect("f32 view");
        all[skip * HIDDEN..].copy_from_slice(&values);
    }
    (buffer, values)
}

fn unified(buffer: &Arc<UnifiedBuffer>, skip: usize) -> npu_hal::EmbeddingData<'_> {
    npu_hal::EmbeddingData::Unified {
        buffer,
        offset: skip * HIDDEN * 4,
        len: SPLICED.len() * HIDDEN,
    }
}

/// Embedding rows another engine left in a unified buffer are read in place: the logits are
/// those of the same rows given from host memory, on the GPU (bit for bit: the same kernel reads
/// the same values) and on the CPU NPU, and the GPU's upload of spliced rows (the copy the
/// ledger counts as `gpu-splice-upload`) is not made. More buffers than the GPU keeps imported
/// at once are cycled through, and each still gives its own rows' logits.
#[test]
fn unified_embeddings_are_read_in_place() {
    let Some(mut gpu) = gpu() else { return };
    let mut cpu = cpu();
    let storage = Storage::Mx(ElemFormat::Int8);
    let (mc, mg) = (load(&mut cpu, storage, 7), load(&mut gpu, storage, 7));
    let _ledger = SPLICE_LEDGER.lock().unwrap_or_else(|e| e.into_inner());
    let uploads = uvm_alloc::CopyLedger::global().stage("gpu-splice-upload");
    let skip = 3;
    // 20 buffers: past the 16 imports the GPU keeps, so the oldest are evicted and re-imported.
    let sources: Vec<_> = (0..20)
        .map(|i| unified_rows(SPLICED.len(), skip, 100 + i))
        .collect();
    for round in 0..2 {
        for (i, (buffer, values)) in sources.iter().enumerate() {
            if round == 1 && i % 4 != 0 {
                continue;
            }
            let host = npu_hal::EmbeddingData::Host(values);
            let before = uploads.bytes();
            let gpu_unified = run_spliced(&mut gpu, &mg, unified(buffer, skip), None);
            assert_eq!(uploads.bytes(), before, "unified rows must not be uploaded");
            let gpu_host = run_spliced(&mut gpu, &mg, host, None);
            assert!(
                uploads.bytes() > before,
                "host rows are uploaded (and counted)"
            );
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&gpu_unified), bits(&gpu_host), "GPU, buffer {i}");
            if round == 0 && i < 3 {
                let cpu_unified = run_spliced(&mut cpu, &mc, unified(buffer, skip), None);
                let cpu_host = run_spliced(&mut cpu, &mc, host, None);
                assert_eq!(bits(&cpu_unified), bits(&cpu_host), "CPU, buffer {i}");
                let (max, _) = errors(&gpu_unified, &cpu_unified);
                assert!(max < 0.03, "GPU against CPU, buffer {i}: {max}");
            }
        }
    }
    // A source past its buffer's end is refused by name.
    let (small, _) = unified_rows(SPLICED.len(), 0, 1);
    let err = npu_hal::EmbeddingData::Unified {
        buffer: &small,
        offset: 8,
        len: SPLICED.len() * HIDDEN,
    }
    .unified_bytes()
    .unwrap_err();
    assert!(err.to_string().contains("do not fit"), "{err}");
}

/// Another device's timeline, imported through an opaque fd, is waited on in this device's
/// queue: the submission returns at once with no host wait, the work does not run before the
/// value is signalled, and it completes after. Needs an adapter that exports timeline
/// semaphores (not lavapipe in Mesa 22.3): `cargo xtask device-test` runs it where one does.
#[test]
#[ignore = "needs a Vulkan adapter that exports timeline semaphores (cargo xtask device-test)"]
fn a_gpu_waits_on_another_devices_timeline_in_its_queue() {
    let (Some(mut gpu), Some(other)) = (gpu(), gpu()) else {
        panic!("no Vulkan adapter")
    };
    let storage = Storage::Mx(ElemFormat::Int8);
    let model = load(&mut gpu, storage, 7);
    let _ledger = SPLICE_LEDGER.lock().unwrap_or_else(|e| e.into_inner());
    let (buffer, values) = unified_rows(SPLICED.len(), 0, 9);
    let want = run_spliced(
        &mut gpu,
        &model,
        npu_hal::EmbeddingData::Host(&values),
        None,
    );
    let upstream = other.timeline().expect("the GPU has a timeline");
    assert!(
        gpu.waits_in_queue(&*upstream),
        "{}: the other device's timeline is not importable",
        gpu.adapter()
    );
    let own = gpu.timeline().expect("timeline");
    let mut kv = kv_cache(PageDtype::F16);
    let chunk = &chunks()[0];
    // A first run over this cache, its logits read: the device mirrors a new cache's pages
    // (a clear the host waits for) and every run before is done, so only the submission
    // below is counted.
    run(&mut gpu, &model, &mut kv, std::slice::from_ref(chunk), None);
    kv.free_sequence(0).expect("free");
    kv.add_sequence(0, &[]).expect("sequence");
    let before = gpu.stats();
    let at = upstream.value().unwrap() + 1;
    // The body waits for `at` in the queue and signals `own`; the host thread is not blocked.
    let appended = kv.append(0, chunk).expect("append");
    let own_next = own.value().unwrap() + 1;
    gpu.submit(Submission {
        ops: &model.body,
        batch: Batch {
            tokens: chunk,
            first_pos: 0,
            seq: 0,
            slots: &appended.slots,
            select: 0..0,
            embeddings: Some(npu_hal::Embeddings {
                rows: SPLICED,
                data: unified(&buffer, 0),
            }),
        },
        kv: Some(&mut kv),
        attention: None,
        wait: Some((&*upstream, at)),
        signal: Some((&*own, own_next)),
        live: None,
    })
    .expect("submitted");
    let after = gpu.stats();
    assert_eq!(after.queue_waits, before.queue_waits + 1);
    assert_eq!(
        after.host_waits, before.host_waits,
        "no host wait at submit"
    );
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert!(
        own.value().unwrap() < own_next,
        "the work ran before the value it waits for"
    );
    upstream.signal(at).unwrap();
    own.wait(own_next, std::time::Duration::from_secs(10))
        .expect("the work completes once the value is signalled");
    let rows = LOGIT_ROWS;
    gpu.submit(Submission {
        ops: &model.head,
        batch: Batch {
            tokens: chunk,
            first_pos: 0,
            seq: 0,
            slots: &appended.slots,
            select: chunk.len() - rows..chunk.len(),
            embeddings: None,
        },
        kv: None,
        attention: None,
        wait: None,
        signal: None,
        live: None,
    })
    .expect("head");
    let mut got = vec![0f32; rows * VOCAB];
    gpu.read_tensor(model.logits, 0..rows, &mut got).unwrap();
    assert_eq!(got, want, "the rows read after the wait are the buffer's");
    let _ = writeln!(
        std::io::stderr(),
        "device-test detail: {} waited on another device's timeline in its queue",
        gpu.adapter()
    );
}

/// The attention statistics a pruning policy ranks pages by (`Submission::attention`): the GPU
/// reports the mass each cached token received (summed over heads and queries), the last row's
/// distribution and the query counts as the CPU NPU does, through a 24-token prefill (the
/// paged kernel), a short batch and single steps (the in-batch kernel). (Short, because every
/// probability is a float add by compare-and-swap, which the VM lab's emulated CPUs run
/// slowly.)
#[test]
fn attention_statistics_match_the_cpu() {
    let Some(mut gpu) = gpu() else { return };
    let mut cpu = cpu();
    let (mc, mg) = (
        load(&mut cpu, Storage::F32, 11),
        load(&mut gpu, Storage::F32, 11),
    );
    let mut trackers = Vec::new();
    for (device, model) in [
        (&mut cpu as &mut dyn Device, &mc),
        (&mut gpu as &mut dyn Device, &mg),
    ] {
        let mut kv = kv_cache(PageDtype::F32);
        let mut tracker = kv_paged::prune::AttentionTracker::new(LAYERS);
        let prompt: Vec<u32> = (0..24).map(|i| (i * 37 + 5) % VOCAB as u32).collect();
        let chunks = [prompt, vec![7], vec![2, 9, 4, 1, 30], vec![11]];
        run(device, model, &mut kv, &chunks, Some(&mut tracker));
        trackers.push(tracker);
    }
    let (want, got) = (&trackers[0], &trackers[1]);
    for layer in 0..LAYERS {
        assert_eq!(
            got.seen[layer], want.seen[layer],
            "layer {layer}: query counts"
        );
        for (name, g, w) in [
            ("mass", &got.mass[layer], &want.mass[layer]),
            ("last", &got.last[layer], &want.last[layer]),
        ] {
            assert_eq!(g.len(), w.len(), "layer {layer} {name}: lengths");
            let worst = g
                .iter()
                .zip(w.iter())
                .map(|(a, b)| (a - b).abs() / b.abs().max(1e-3))
                .fold(0f32, f32::max);
            assert!(
                worst < 1e-3,
                "layer {layer} {name}: the GPU's attention differs from the CPU's by {worst} (relative)"
            );
        }
    }
    let _ = writeln!(
        std::io::stderr(),
        "device-test detail: attention statistics on {} match the CPU NPU's",
        gpu.adapter()
    );
}

/// Held submissions (`Device::submit_held`): a held decode step runs once released and computes
/// what the same step submitted plainly computes, bit for bit; while it is held the device
/// refuses other work by name; a release of another shape is refused, yet the step still runs
/// (as a discard), so the device takes work again. With timestamps on, a CPU implementation
/// (lavapipe) holds nothing and says why.
#[test]
fn a_held_step_runs_on_release_as_a_plain_one() {
    let Some(timed) = gpu() else {
        return;
    };
    let Some(mut gpu) = gpu_with(VulkanConfig {
        timestamps: false,
        ..VulkanConfig::default()
    }) else {
        return;
    };
    let storage = Storage::Mx(ElemFormat::Int8);
    let model = load(&mut gpu, storage, 21);
    let Some(&Op::Linear { x: head_input, .. }) = model.head.first() else {
        panic!("the head is a linear layer");
    };
    let prompt = chunks()[0].clone();
    let mut plain = kv_cache(PageDtype::F16);
    let want = run(
        &mut gpu,
        &model,
        &mut plain,
        &[prompt.clone(), vec![7]],
        None,
    );
    let want = &want[want.len() - VOCAB..];
    let mut kv = kv_cache(PageDtype::F16);
    run(
        &mut gpu,
        &model,
        &mut kv,
        std::slice::from_ref(&prompt),
        None,
    );
    let pos = prompt.len();
    let step = |tokens: &'static [u32], slots| Batch {
        tokens,
        first_pos: pos,
        seq: 0,
        slots,
        select: 0..0,
        embeddings: None,
    };
    let (live_body, live_head) = ([head_input], [model.logits]);
    let placeholder = [kv_paged::Slot {
        block: 0,
        offset: 0,
    }];
    let hold = |gpu: &mut VulkanNpu, kv: &mut KvCache| {
        gpu.submit_held(Submission {
            ops: &model.body,
            batch: step(&[0], &placeholder),
            kv: Some(kv),
            attention: None,
            wait: None,
            signal: None,
            live: Some(&live_body),
        })
        .expect("held")
    };
    let held = hold(&mut gpu, &mut kv);
    let head = |tokens: &'static [u32]| Submission {
        ops: &model.head,
        batch: Batch {
            select: 0..1,
            ..step(tokens, &[])
        },
        kv: None,
        attention: None,
        wait: None,
        signal: None,
        live: Some(&live_head),
    };
    let err = gpu.submit(head(&[7])).unwrap_err().to_string();
    assert!(err.contains("held submission"), "{err}");
    let appended = kv.append(0, &[7]).expect("append");
    gpu.release(held, step(&[7], &appended.slots), Some(&kv))
        .expect("release");
    gpu.submit(head(&[7])).expect("head");
    let mut got = vec![0f32; VOCAB];
    gpu.read_tensor(model.logits, 0..1, &mut got).expect("read");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&got),
        bits(want),
        "a released step against a plain one"
    );
    // A release of two tokens for a one-token hold: refused, and the step runs anyway.
    let held = hold(&mut gpu, &mut kv);
    let err = gpu
        .release(held, step(&[7, 8], &appended.slots), Some(&kv))
        .unwrap_err()
        .to_string();
    assert!(err.contains("held with 1 tokens"), "{err}");
    gpu.submit(head(&[7]))
        .expect("the device takes work after a refused release");
    // With timestamps, a CPU implementation refuses to hold, by name.
    let mut timed = timed;
    if !timed.holds() {
        let model = load(&mut timed, storage, 21);
        let err = timed
            .submit_held(Submission {
                ops: &model.head,
                batch: step(&[7], &[]),
                kv: None,
                attention: None,
                wait: None,
                signal: None,
                live: None,
            })
            .unwrap_err()
            .to_string();
        assert!(err.contains("timestamps"), "{err}");
    }
}

/// `Device::row_argmax` where the output head's GEMV keeps maxima in its readback tensor (one
/// token, a short batch) and where it keeps none (a batch long enough for the GEMM): the index
/// and the value's bits of `kernels::argmax` over the row read back, for outputs that repeat in
/// other workgroups (the first wins), outputs all equal, and rows whose outputs are NaN (never
/// taken), on tall heads (an output head's GEMV) and a short one; the device's counter shows
/// which answers came from the maxima.
#[test]
fn row_argmax_is_the_argmax_of_the_row() {
    let cols = 64;
    // Tall heads (an output head's GEMV) at the GPU defaults (16 lanes, 4 rows a group: 64
    // rows a workgroup, 16 in a short batch, which keeps no maxima), at a full workgroup of
    // rows, and at lavapipe's defaults (8 rows a workgroup: no maxima); a short head at 8
    // lanes (32 rows a workgroup). `maxima`: which batches' answers come from maxima (one
    // token, a short batch).
    let heads = [
        (8200usize, Some(16), Some(4), (true, false)),
        (8200, Some(8), Some(8), (true, true)),
        (8200, Some(32), Some(1), (false, false)),
        (520, Some(8), None, (true, true)),
    ];
    for (rows, lanes, tall_rows, maxima) in heads {
        let Some(mut gpu) = gpu_with(VulkanConfig {
            gemv_lanes: lanes,
            gemv_tall_lanes: lanes,
            gemv_tall_rows: tall_rows,
            ..VulkanConfig::default()
        }) else {
            return;
        };
        let mut rng = Rng(11);
        let half = rng.matrix(rows / 2, cols, 0.125);
        let mut nan_rows = rng.matrix(rows, cols, 0.125);
        for r in (0..rows).step_by(3) {
            nan_rows[r * cols + 5] = f32::NAN;
        }
        let cases = [
            (
                "repeated",
                half.iter().chain(&half).copied().collect::<Vec<_>>(),
            ),
            ("all equal", vec![0.01; rows * cols]),
            ("NaN rows", nan_rows),
            ("every output NaN", vec![f32::NAN; rows * cols]),
        ];
        let long: Vec<u32> = (0..20).map(|i| (i * 7) % VOCAB as u32).collect();
        for (name, data) in cases {
            let table = gpu
                .load_weight(Weight::Dense(
                    DenseMatrix::new(VOCAB, cols, rng.matrix(VOCAB, cols, 1.0)).expect("shape"),
                ))
                .expect("table");
            let w = gpu
                .load_weight(Weight::Dense(
                    DenseMatrix::new(rows, cols, data).expect("shape"),
                ))
                .expect("weight");
            let x = gpu.create_tensor(cols, MAX_ROWS).expect("x");
            let y = gpu.create_readback_tensor(rows, MAX_ROWS).expect("y");
            let ops = [
                Op::Embed { table, out: x },
                Op::Linear {
                    weight: w,
                    x,
                    out: y,
                    rows: Rows::All,
                },
            ];
            for tokens in [&[5u32][..], &[5, 17, 60], &long] {
                submit_without_cache(&mut gpu, &ops, tokens).expect("submit");
                let before = gpu.stats().argmax_from_maxima;
                let mut row = vec![0f32; rows];
                for t in 0..tokens.len() {
                    gpu.read_tensor(y, t..t + 1, &mut row).expect("read");
                    let want = npu_hal::kernels::argmax(&row).map(|(i, v)| (i, v.to_bits()));
                    let got = gpu.row_argmax(y, t).expect("row_argmax");
                    assert_eq!(
                        got.map(|(i, v)| (i, v.to_bits())),
                        want,
                        "{name}, {rows} rows ({lanes:?} lanes, {tall_rows:?} rows a group), \
                         {} tokens, row {t}",
                        tokens.len()
                    );
                }
                // The GEMV shapes that keep maxima answer from them; the GEMM's leaves none.
                let from_maxima = gpu.stats().argmax_from_maxima - before;
                let expected = match tokens.len() {
                    1 if maxima.0 => 1,
                    2..=8 if maxima.1 => tokens.len(),
                    _ => 0,
                };
                assert_eq!(
                    from_maxima as usize,
                    expected,
                    "{name}, {rows} rows, {} tokens: answers from maxima",
                    tokens.len()
                );
            }
            // Rows past the last run's are scanned, not taken from older maxima.
            submit_without_cache(&mut gpu, &ops, &[9]).expect("submit");
            let before = gpu.stats().argmax_from_maxima;
            gpu.row_argmax(y, 2).expect("row_argmax");
            assert_eq!(
                gpu.stats().argmax_from_maxima,
                before,
                "{name}: a stale row"
            );
        }
    }
}
