//! The SigLIP vision tower and the Idefics3/SmolVLM connector, as SmolVLM uses them: the CPU
//! reference the GPU (WGSL) encoder is held to, and the fallback where no GPU exists.
//!
//! - Patch embedding: the stride-`p` convolution as a GEMM over flattened `3 x p x p` patches.
//! - Learned position embeddings (one per patch of the native `image_size` grid).
//! - `layers x` [LayerNorm, multi-head attention with biases, residual, LayerNorm, MLP with
//!   tanh-GELU, residual], then the post-LayerNorm.
//! - Connector: pixel shuffle by `scale_factor` (each `f x f` block of patches becomes one token of
//!   `f^2` times the width, in transformers' element order), then a bias-free linear projection to
//!   the text model's width.
//!
//! Weights come from Hugging Face safetensors under SmolVLM's names (`model.vision_model.*`,
//! `model.connector.*`), f32/f16/bf16, every shape checked against `config.json` before use.
//! Sizes other than the native image size (position-embedding interpolation) are not supported
//! yet and are refused by name.

use std::collections::HashMap;
use std::path::Path;

use npu_hal::DenseMatrix;

use crate::model::LoadError;
use crate::npy::{NPY_HEADER_MAX, parse_pixels_npy};

/// Why the vision encoder could not be loaded or run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VisionError {
    /// A file or one of its tensors is unusable; `what` says how.
    #[error("{path}: {what}")]
    File {
        path: std::path::PathBuf,
        what: String,
    },
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The input image does not fit the tower.
    #[error("{0}")]
    Input(String),
}

fn file_error(path: &Path, what: impl std::fmt::Display) -> VisionError {
    VisionError::File {
        path: path.to_path_buf(),
        what: what.to_string(),
    }
}

/// Reads a `3 x size x size` f32 `.npy` (leading dimensions of 1 allowed) from `path`, the
/// tower's input. The file is untrusted: its size is bounded by what the tower takes (plus a
/// header) before it is read.
///
/// # Errors
/// [`VisionError::Input`] for a file too large, not a `.npy`, of another shape or type.
pub fn read_pixels_npy(path: &Path, size: usize) -> Result<Vec<f32>, VisionError> {
    let max = (3 * size * size * 4 + NPY_HEADER_MAX) as u64;
    let bad = |what: String| VisionError::Input(format!("{}: {what}", path.display()));
    let file_size = std::fs::metadata(path)
        .map_err(|e| bad(format!("cannot read it: {e}")))?
        .len();
    if file_size > max {
        return Err(bad(format!(
            "{file_size} bytes, more than a 3x{size}x{size} f32 .npy ({max} at most)"
        )));
    }
    let bytes = std::fs::read(path).map_err(|e| bad(format!("cannot read it: {e}")))?;
    parse_pixels_npy(&bytes, size).map_err(bad)
}

/// The tower's and connector's shape, from `config.json` (`vision_config`, `scale_factor`,
/// `text_config.hidden_size`).
#[derive(Clone, Debug, PartialEq)]
pub struct VisionConfig {
    pub image_size: usize,
    pub patch_size: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub layer_norm_eps: f32,
    pub scale_factor: usize,
    pub text_hidden: usize,
}

impl VisionConfig {
    /// Patches per side of the native image.
    pub fn patches_per_side(&self) -> usize {
        self.image_size / self.patch_size
    }

    /// Tokens the connector produces per image.
    pub fn image_tokens(&self) -> usize {
        self.patches_per_side().pow(2) / (self.scale_factor * self.scale_factor)
    }

    pub(crate) fn validate(&self, path: &Path) -> Result<(), VisionError> {
        let bad = |what: &str| file_error(path, format!("vision config: {what}"));
        if [
            self.image_size,
            self.patch_size,
            self.hidden,
            self.intermediate,
            self.layers,
            self.heads,
            self.scale_factor,
            self.text_hidden,
        ]
        .contains(&0)
        {
            return Err(bad("every size must be at least 1"));
        }
        if !self.image_size.is_multiple_of(self.patch_size) {
            return Err(bad("image_size must be a multiple of patch_size"));
        }
        if !self.hidden.is_multiple_of(self.heads) {
            return Err(bad("hidden_size must be a multiple of num_attention_heads"));
        }
        if !self.patches_per_side().is_multiple_of(self.scale_factor) {
            return Err(bad("patches per side must be a multiple of scale_factor"));
        }
        if self.image_size > 8192 || self.hidden > 65536 || self.layers > 1024 {
            return Err(bad("sizes past any real SigLIP tower"));
        }
        Ok(())
    }
}

/// How the learned `N x N` position grid serves an image whose patch grid is `n x n`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PositionResampling {
    /// SmolVLM's own rule (transformers' `Idefics3VisionEmbeddings`): patch `i` of `n` takes
    /// the position of the bucket its fractional coordinate `i / n` falls in among `N` equal
    /// buckets (NaViT-style). What SmolVLM does with an image of another size.
    #[default]
    Bucket,
    /// SigLIP's `interpolate_pos_encoding`: the grid resampled bicubically (a = -0.75,
    /// half-pixel centres, edge clamping), as `torch.nn.functional.interpolate(mode="bicubic",
    /// align_corners=False)` does it.
    Bicubic,
}

/// `torch.arange(start, end, step)` in f32, as torch computes it (size and values in f64).
fn arange_f32(start: f64, end: f64, step: f64) -> Vec<f32> {
    let len = ((end - start) / step).ceil().max(0.0) as usize;
    (0..len).map(|i| (start + i as f64 * step) as f32).collect()
}

/// [`PositionResampling::Bucket`]: `bucketize(arange(0, 1 - 1e-6, 1/n), arange(1/N, 1, 1/N),
/// right=True)` per axis, then row-major lookup.
fn bucket_positions(grid: &[f32], from: usize, to: usize, h: usize) -> Vec<f32> {
    let boundaries = arange_f32(1.0 / from as f64, 1.0, 1.0 / from as f64);
    let coords = arange_f32(0.0, 1.0 - 1e-6, 1.0 / to as f64);
    // right=True: the number of boundaries <= x.
    let bucket: Vec<usize> = coords
        .iter()
        .map(|&x| boundaries.iter().filter(|&&b| b <= x).count().min(from - 1))
        .collect();
    let mut out = Vec::with_capacity(to * to * h);
    for &r in &bucket {
        for &c in &bucket {
            let at = (r * from + c) * h;
            out.extend_from_slice(&grid[at..at + h]);
        }
    }
    out
}

/// [`PositionResampling::Bicubic`], following torch's `upsample_bicubic2d` (CPU, f32).
fn bicubic_positions(grid: &[f32], from: usize, to: usize, h: usize) -> Vec<f32> {
    const A: f32 = -0.75;
    let conv1 = |x: f32| ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0;
    let conv2 = |x: f32| ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A;
    let scale = from as f32 / to as f32;
    // For each output index: the four source indices (clamped) and their weights.
    let taps: Vec<([usize; 4], [f32; 4])> = (0..to)
        .map(|o| {
            let real = scale * (o as f32 + 0.5) - 0.5;
            let base = real.floor();
            let t = real - base;
            let w = [conv2(t + 1.0), conv1(t), conv1(1.0 - t), conv2(2.0 - t)];
            let idx = std::array::from_fn(|k| {
                (base as isize - 1 + k as isize).clamp(0, from as isize - 1) as usize
            });
            (idx, w)
        })
        .collect();
    let mut out = vec![0f32; to * to * h];
    for (oy, (ys, wy)) in taps.iter().enumerate() {
        for (ox, (xs, wx)) in taps.iter().enumerate() {
            let dst = &mut out[(oy * to + ox) * h..][..h];
            for d in 0..h {
                // Along x within each of the four rows, then along y, as torch does.
                let mut acc = 0f32;
                for ky in 0..4 {
                    let row = |kx: usize| grid[(ys[ky] * from + xs[kx]) * h + d];
                    let along_x = row(0) * wx[0] + row(1) * wx[1] + row(2) * wx[2] + row(3) * wx[3];
                    acc += along_x * wy[ky];
                }
                dst[d] = acc;
            }
        }
    }
    out
}

#[derive(Clone)]
pub(crate) struct Layer {
    pub(crate) ln1: (Vec<f32>, Vec<f32>),
    pub(crate) q: (DenseMatrix, Vec<f32>),
    pub(crate) k: (DenseMatrix, Vec<f32>),
    pub(crate) v: (DenseMatrix, Vec<f32>),
    pub(crate) o: (DenseMatrix, Vec<f32>),
    pub(crate) ln2: (Vec<f32>, Vec<f32>),
    pub(crate) fc1: (DenseMatrix, Vec<f32>),
    pub(crate) fc2: (DenseMatrix, Vec<f32>),
}

/// The vision tower and connector with their weights, on the CPU.
pub struct VisionEncoder {
    pub(crate) config: VisionConfig,
    pub(crate) patch: (DenseMatrix, Vec<f32>),
    pub(crate) positions: Vec<f32>,
    pub(crate) layers: Vec<Layer>,
    pub(crate) post_ln: (Vec<f32>, Vec<f32>),
    pub(crate) projection: DenseMatrix,
}

impl std::fmt::Debug for VisionEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VisionEncoder")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

#[derive(serde::Deserialize)]
struct HfVision {
    image_size: usize,
    patch_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    #[serde(default = "default_eps")]
    layer_norm_eps: f32,
    #[serde(default)]
    hidden_act: Option<String>,
}

fn default_eps() -> f32 {
    1e-6
}

#[derive(serde::Deserialize)]
struct HfText {
    hidden_size: usize,
}

#[derive(serde::Deserialize)]
struct HfVlm {
    vision_config: HfVision,
    text_config: HfText,
    #[serde(default = "default_scale")]
    scale_factor: usize,
}

fn default_scale() -> usize {
    2
}

/// `data` (whole 32-element blocks) as MX `format` with mx-quant's default options: (scales,
/// packed codes). The one quantizer of the vision weights, for the CPU reference
/// ([`VisionEncoder::with_mx_weights`]) and the GPU kernels alike.
pub(crate) fn quantize_mx(
    format: mx_quant::ElemFormat,
    data: &[f32],
) -> Result<(Vec<u8>, Vec<u8>), mx_quant::Error> {
    let mut scales = vec![0u8; data.len() / 32];
    let mut packed = vec![0u8; mx_quant::layout::packed_len(format, data.len())];
    mx_quant::bulk::quantize(format, Default::default(), data, &mut scales, &mut packed)?;
    Ok((scales, packed))
}

impl VisionEncoder {
    /// Loads `dir/config.json` and `dir/*.safetensors` (SmolVLM naming).
    pub fn open(dir: &Path) -> Result<VisionEncoder, VisionError> {
        let config_path = dir.join("config.json");
        let text = crate::model::read_text_capped(
            &config_path,
            "JSON config",
            crate::model::MAX_CONFIG_BYTES,
        )
        .map_err(|e| file_error(&config_path, e.to_string()))?;
        let hf: HfVlm = serde_json::from_str(&text).map_err(|e| {
            file_error(
                &config_path,
                format!("not a SmolVLM config (vision_config, text_config): {e}"),
            )
        })?;
        if let Some(act) = hf.vision_config.hidden_act.as_deref()
            && act != "gelu_pytorch_tanh"
        {
            return Err(file_error(
                &config_path,
                format!("vision hidden_act {act}: gelu_pytorch_tanh only"),
            ));
        }
        let config = VisionConfig {
            image_size: hf.vision_config.image_size,
            patch_size: hf.vision_config.patch_size,
            hidden: hf.vision_config.hidden_size,
            intermediate: hf.vision_config.intermediate_size,
            layers: hf.vision_config.num_hidden_layers,
            heads: hf.vision_config.num_attention_heads,
            layer_norm_eps: hf.vision_config.layer_norm_eps,
            scale_factor: hf.scale_factor,
            text_hidden: hf.text_config.hidden_size,
        };
        config.validate(&config_path)?;
        let tensors = Tensors::open(dir)?;
        VisionEncoder::assemble(config, &|name, len| {
            tensors.get(&Naming::Hf.name(name), len)
        })
    }

    /// Opens a SmolVLM checkpoint directory ([`VisionEncoder::open`]) or an mmproj GGUF file
    /// ([`VisionEncoder::open_mmproj`]).
    pub fn open_path(path: &Path) -> Result<VisionEncoder, VisionError> {
        if path.is_dir() {
            VisionEncoder::open(path)
        } else {
            VisionEncoder::open_mmproj(path)
        }
    }

    /// Loads a llama.cpp multimodal projector file (`mmproj-*.gguf`, projector type
    /// `idefics3`: SmolVLM's tower and connector under llama.cpp's CLIP names, `v.blk.N.*`,
    /// `mm.model.fc.weight`), f32, f16 or bf16 tensors, hyperparameters from the `clip.vision.*`
    /// keys. The text model's hidden size is the projector's output width.
    pub fn open_mmproj(path: &Path) -> Result<VisionEncoder, VisionError> {
        let file = crate::model::gguf::GgufFile::open(path)?;
        let bad = |what: String| file_error(path, what);
        let text = |key: &str| file.get(key).and_then(|v| v.as_str());
        match text("general.architecture") {
            Some("clip") => {}
            other => {
                return Err(bad(format!(
                    "not a multimodal projector (mmproj) file: general.architecture is {}, \
                     expected \"clip\"",
                    other.map_or("missing".to_string(), |a| format!("{a:?}"))
                )));
            }
        }
        if let Some(kind) = text("clip.projector_type").or(text("clip.vision.projector_type"))
            && kind != "idefics3"
        {
            return Err(bad(format!(
                "projector type {kind:?}: only idefics3 (SmolVLM) mmproj files are supported"
            )));
        }
        let int = |key: &str| -> Result<usize, VisionError> {
            file.get(key)
                .and_then(|v| v.as_int())
                .and_then(|v| usize::try_from(v).ok())
                .ok_or_else(|| bad(format!("metadata {key} is missing or not a size")))
        };
        let proj = "mm.model.fc.weight";
        let (text_hidden, _) = crate::model::TensorSource::shape(&file, proj).ok_or_else(|| {
            VisionError::Load(LoadError::TensorMissing {
                tensor: proj.to_string(),
            })
        })?;
        let config = VisionConfig {
            image_size: int("clip.vision.image_size")?,
            patch_size: int("clip.vision.patch_size")?,
            hidden: int("clip.vision.embedding_length")?,
            intermediate: int("clip.vision.feed_forward_length")?,
            layers: int("clip.vision.block_count")?,
            heads: int("clip.vision.attention.head_count")?,
            layer_norm_eps: file
                .get("clip.vision.attention.layer_norm_epsilon")
                .and_then(|v| v.as_f32())
                .unwrap_or(1e-6),
            scale_factor: int("clip.vision.projector.scale_factor").unwrap_or(2),
            text_hidden,
        };
        config.validate(path)?;
        let get = |name: &str, len: usize| -> Result<Vec<f32>, VisionError> {
            let gguf_name = Naming::Mmproj.name(name);
            let (rows, cols) =
                crate::model::TensorSource::shape(&file, &gguf_name).ok_or_else(|| {
                    VisionError::Load(LoadError::TensorMissing {
                        tensor: gguf_name.clone(),
                    })
                })?;
            if rows.checked_mul(cols) != Some(len) {
                return Err(bad(format!(
                    "{gguf_name} has {rows} x {cols} elements, the config needs {len}"
                )));
            }
            let mut out = vec![0f32; len];
            crate::model::TensorSource::read_rows(&file, &gguf_name, 0..rows, &mut out)?;
            Ok(out)
        };
        VisionEncoder::assemble(config, &get)
    }

    /// Builds the encoder from `get(logical name, element count)` (names as [`Naming`] spells
    /// them for Hugging Face files).
    fn assemble(
        config: VisionConfig,
        get: &TensorReader<'_>,
    ) -> Result<VisionEncoder, VisionError> {
        let c = &config;
        let h = c.hidden;
        let pp = 3 * c.patch_size * c.patch_size;
        let mat = |name: &str, rows: usize, cols: usize| -> Result<DenseMatrix, VisionError> {
            let data = get(name, rows * cols)?;
            Ok(DenseMatrix::new(rows, cols, data).expect("sized rows * cols"))
        };
        let vec = |name: &str, len: usize| get(name, len);
        let v = "model.vision_model";
        let mut layers = Vec::with_capacity(c.layers);
        for i in 0..c.layers {
            let l = format!("{v}.encoder.layers.{i}");
            let lin = |n: &str, rows, cols| -> Result<(DenseMatrix, Vec<f32>), VisionError> {
                Ok((
                    mat(&format!("{l}.{n}.weight"), rows, cols)?,
                    vec(&format!("{l}.{n}.bias"), rows)?,
                ))
            };
            let ln = |n: &str| -> Result<(Vec<f32>, Vec<f32>), VisionError> {
                Ok((
                    vec(&format!("{l}.{n}.weight"), h)?,
                    vec(&format!("{l}.{n}.bias"), h)?,
                ))
            };
            layers.push(Layer {
                ln1: ln("layer_norm1")?,
                q: lin("self_attn.q_proj", h, h)?,
                k: lin("self_attn.k_proj", h, h)?,
                v: lin("self_attn.v_proj", h, h)?,
                o: lin("self_attn.out_proj", h, h)?,
                ln2: ln("layer_norm2")?,
                fc1: lin("mlp.fc1", c.intermediate, h)?,
                fc2: lin("mlp.fc2", h, c.intermediate)?,
            });
        }
        let f2 = c.scale_factor * c.scale_factor;
        Ok(VisionEncoder {
            patch: (
                mat(&format!("{v}.embeddings.patch_embedding.weight"), h, pp)?,
                vec(&format!("{v}.embeddings.patch_embedding.bias"), h)?,
            ),
            positions: vec(
                &format!("{v}.embeddings.position_embedding.weight"),
                c.patches_per_side().pow(2) * h,
            )?,
            layers,
            post_ln: (
                vec(&format!("{v}.post_layernorm.weight"), h)?,
                vec(&format!("{v}.post_layernorm.bias"), h)?,
            ),
            projection: mat(
                "model.connector.modality_projection.proj.weight",
                c.text_hidden,
                h * f2,
            )?,
            config,
        })
    }

    /// This encoder with every GEMM weight whose rows are whole MX blocks (a multiple of 32
    /// columns) rounded through `format`: quantized with mx-quant's default options (the spec's
    /// FLOOR scale, ties to even) and decoded back. The values are exactly those the GPU
    /// encoder decodes from its MX weights ([`crate::vision_gpu::GpuVisionOptions::mx_weights`]),
    /// so this is the CPU reference for that path, and the CPU encoder's view of MX weights
    /// (held here as f32: the CPU GEMMs do not read MX).
    pub fn with_mx_weights(
        &self,
        format: mx_quant::ElemFormat,
    ) -> Result<VisionEncoder, VisionError> {
        self.map_weights(|data, cols| {
            if !cols.is_multiple_of(32) {
                return Ok(data.to_vec());
            }
            let mx_error = |e: mx_quant::Error| VisionError::Input(format!("MX weights: {e}"));
            let (scales, packed) = quantize_mx(format, data).map_err(mx_error)?;
            let mut back = vec![0f32; data.len()];
            mx_quant::bulk::dequantize(format, &scales, &packed, &mut back).map_err(mx_error)?;
            Ok(back)
        })
    }

    /// This encoder with the GEMM weights the f16-weight GPU kernel reads (those with a
    /// multiple of 4 columns) rounded to f16: its CPU reference.
    pub fn with_f16_weights(&self) -> VisionEncoder {
        let rounded = self.map_weights(|data, cols| {
            Ok(if cols.is_multiple_of(4) {
                data.iter()
                    .map(|&v| half::f16::from_f32(v).to_f32())
                    .collect()
            } else {
                data.to_vec()
            })
        });
        rounded.expect("rounding to f16 cannot fail")
    }

    /// This encoder with every GEMM weight matrix replaced by `round(values, columns)`.
    fn map_weights(
        &self,
        round: impl Fn(&[f32], usize) -> Result<Vec<f32>, VisionError>,
    ) -> Result<VisionEncoder, VisionError> {
        let matrix = |m: &DenseMatrix| -> Result<DenseMatrix, VisionError> {
            let (rows, cols) = m.shape();
            let data = round(m.data(), cols)?;
            Ok(DenseMatrix::new(rows, cols, data).expect("same shape"))
        };
        let linear =
            |(w, b): &(DenseMatrix, Vec<f32>)| Ok::<_, VisionError>((matrix(w)?, b.clone()));
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(Layer {
                    ln1: l.ln1.clone(),
                    q: linear(&l.q)?,
                    k: linear(&l.k)?,
                    v: linear(&l.v)?,
                    o: linear(&l.o)?,
                    ln2: l.ln2.clone(),
                    fc1: linear(&l.fc1)?,
                    fc2: linear(&l.fc2)?,
                })
            })
            .collect::<Result<Vec<_>, VisionError>>()?;
        Ok(VisionEncoder {
            config: self.config.clone(),
            patch: linear(&self.patch)?,
            positions: self.positions.clone(),
            layers,
            post_ln: self.post_ln.clone(),
            projection: matrix(&self.projection)?,
        })
    }

    /// A tower of `config`'s shape with seeded random weights (normal-ish, std 0.02; norms at 1):
    /// for benchmarks and tests that need the real sizes without a checkpoint.
    pub fn random(config: VisionConfig, seed: u64) -> Result<VisionEncoder, VisionError> {
        config.validate(Path::new("<random>"))?;
        let mut state = seed | 1;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // Sum of four uniforms: roughly normal, std ~0.02.
            (0..4)
                .map(|i| ((state >> (16 * i)) & 0xffff) as f32 / 65535.0 - 0.5)
                .sum::<f32>()
                * 0.035
        };
        let mut vec = |len: usize| (0..len).map(|_| next()).collect::<Vec<f32>>();
        let c = &config;
        let h = c.hidden;
        let mut mat = |rows: usize, cols: usize| {
            DenseMatrix::new(rows, cols, vec(rows * cols)).expect("sized rows * cols")
        };
        let pp = 3 * c.patch_size * c.patch_size;
        let patch = (mat(h, pp), vec![0.0; h]);
        let positions = (0..c.patches_per_side().pow(2) * h)
            .map(|i| ((i % 97) as f32 - 48.0) * 0.001)
            .collect();
        let layers = (0..c.layers)
            .map(|_| Layer {
                ln1: (vec![1.0; h], vec![0.0; h]),
                q: (mat(h, h), vec![0.0; h]),
                k: (mat(h, h), vec![0.0; h]),
                v: (mat(h, h), vec![0.0; h]),
                o: (mat(h, h), vec![0.0; h]),
                ln2: (vec![1.0; h], vec![0.0; h]),
                fc1: (mat(c.intermediate, h), vec![0.0; c.intermediate]),
                fc2: (mat(h, c.intermediate), vec![0.0; h]),
            })
            .collect();
        let f2 = c.scale_factor * c.scale_factor;
        let projection = mat(c.text_hidden, h * f2);
        Ok(VisionEncoder {
            patch,
            positions,
            layers,
            post_ln: (vec![1.0; h], vec![0.0; h]),
            projection,
            config,
        })
    }

    /// The same tower for square images of `image_size` pixels, its learned position grid
    /// carried to the new patch grid by `how`. The native size returns an identical copy.
    ///
    /// # Errors
    /// [`VisionError::File`] when `image_size` is not a multiple of the patch size or its patch
    /// grid does not divide by the connector's scale factor.
    pub fn resized(
        &self,
        image_size: usize,
        how: PositionResampling,
    ) -> Result<VisionEncoder, VisionError> {
        let config = VisionConfig {
            image_size,
            ..self.config.clone()
        };
        config.validate(Path::new("<resized>"))?;
        let (from, to, h) = (
            self.config.patches_per_side(),
            config.patches_per_side(),
            self.config.hidden,
        );
        let positions = if from == to {
            self.positions.clone()
        } else {
            match how {
                PositionResampling::Bucket => bucket_positions(&self.positions, from, to, h),
                PositionResampling::Bicubic => bicubic_positions(&self.positions, from, to, h),
            }
        };
        Ok(VisionEncoder {
            config,
            patch: self.patch.clone(),
            positions,
            layers: self.layers.clone(),
            post_ln: self.post_ln.clone(),
            projection: self.projection.clone(),
        })
    }

    /// Floating-point operations of one image (multiply-adds count two): what TFLOP/s figures
    /// are computed from.
    pub fn flops(&self) -> f64 {
        let c = &self.config;
        let n = c.patches_per_side().pow(2) as f64;
        let (h, i) = (c.hidden as f64, c.intermediate as f64);
        let per_layer = 2.0 * n * (4.0 * h * h + 2.0 * h * i) + 4.0 * n * n * h;
        let patch = 2.0 * n * h * (3 * c.patch_size * c.patch_size) as f64;
        let f2 = (c.scale_factor * c.scale_factor) as f64;
        let connector = 2.0 * (n / f2) * (h * f2) * c.text_hidden as f64;
        patch + c.layers as f64 * per_layer + connector
    }

    /// The shape.
    pub fn config(&self) -> &VisionConfig {
        &self.config
    }

    /// The tower's last hidden state (after the post-LayerNorm), `patches x hidden`, for one
    /// normalised image `3 x image_size x image_size` (CHW, as the ISP writes it).
    pub fn vision(&self, pixels: &[f32]) -> Result<Vec<f32>, VisionError> {
        let c = &self.config;
        let (s, p, h) = (c.image_size, c.patch_size, c.hidden);
        if pixels.len() != 3 * s * s {
            return Err(VisionError::Input(format!(
                "the image must be 3x{s}x{s} = {} values (other sizes need position interpolation, not built yet), got {}",
                3 * s * s,
                pixels.len()
            )));
        }
        let side = c.patches_per_side();
        let n = side * side;
        // Patches flattened as the conv weight is: [channel][ky][kx].
        let mut patches = vec![0f32; n * 3 * p * p];
        for (t, patch) in patches.chunks_exact_mut(3 * p * p).enumerate() {
            let (py, px) = (t / side, t % side);
            for ch in 0..3 {
                for ky in 0..p {
                    let src = ch * s * s + (py * p + ky) * s + px * p;
                    patch[(ch * p + ky) * p..(ch * p + ky + 1) * p]
                        .copy_from_slice(&pixels[src..src + p]);
                }
            }
        }
        let mut x = linear(&self.patch, &patches, n);
        for (xi, pos) in x.iter_mut().zip(&self.positions) {
            *xi += pos;
        }
        let heads = c.heads;
        let hd = h / heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let mut normed = vec![0f32; n * h];
        for l in &self.layers {
            layer_norm(&x, &l.ln1, c.layer_norm_eps, h, &mut normed);
            let (q, k, v) = (
                linear(&l.q, &normed, n),
                linear(&l.k, &normed, n),
                linear(&l.v, &normed, n),
            );
            let mut attn = vec![0f32; n * h];
            let mut scores = vec![0f32; n];
            for head in 0..heads {
                for i in 0..n {
                    let qi = &q[i * h + head * hd..i * h + (head + 1) * hd];
                    for (j, s) in scores.iter_mut().enumerate() {
                        *s = npu_hal::kernels::dot(
                            qi,
                            &k[j * h + head * hd..j * h + (head + 1) * hd],
                        ) * scale;
                    }
                    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                    let mut sum = 0.0;
                    for s in scores.iter_mut() {
                        *s = (*s - max).exp();
                        sum += *s;
                    }
                    let out = &mut attn[i * h + head * hd..i * h + (head + 1) * hd];
                    for (j, &w) in scores.iter().enumerate() {
                        let w = w / sum;
                        for (o, &vv) in out
                            .iter_mut()
                            .zip(&v[j * h + head * hd..j * h + (head + 1) * hd])
                        {
                            *o += w * vv;
                        }
                    }
                }
            }
            let o = linear(&l.o, &attn, n);
            add(&mut x, &o);
            layer_norm(&x, &l.ln2, c.layer_norm_eps, h, &mut normed);
            let mut mid = linear(&l.fc1, &normed, n);
            for m in &mut mid {
                *m = gelu_tanh(*m);
            }
            let down = linear(&l.fc2, &mid, n);
            add(&mut x, &down);
        }
        let mut out = vec![0f32; n * h];
        layer_norm(&x, &self.post_ln, c.layer_norm_eps, h, &mut out);
        Ok(out)
    }

    /// The connector: pixel shuffle then projection, `image_tokens x text_hidden`.
    pub fn connect(&self, vision: &[f32]) -> Vec<f32> {
        let c = &self.config;
        let (side, d, f) = (c.patches_per_side(), c.hidden, c.scale_factor);
        let out_side = side / f;
        let width = d * f * f;
        let mut shuffled = vec![0f32; out_side * out_side * width];
        for hp in 0..out_side {
            for wp in 0..out_side {
                let row =
                    &mut shuffled[(hp * out_side + wp) * width..(hp * out_side + wp + 1) * width];
                for (k, dst) in row.iter_mut().enumerate() {
                    let h = hp * f + k / (d * f);
                    let j = k % (d * f);
                    let w = wp * f + j / d;
                    *dst = vision[(h * side + w) * d + j % d];
                }
            }
        }
        let tokens = out_side * out_side;
        let mut out = vec![0f32; tokens * c.text_hidden];
        let mut ys: Vec<&mut [f32]> = out.chunks_mut(c.text_hidden).collect();
        self.projection
            .gemm_rows(&shuffled, 0..c.text_hidden, &mut ys);
        out
    }

    /// Image pixels to the text model's embedding space: [`VisionEncoder::vision`] then
    /// [`VisionEncoder::connect`].
    pub fn encode(&self, pixels: &[f32]) -> Result<Vec<f32>, VisionError> {
        Ok(self.connect(&self.vision(pixels)?))
    }
}

fn linear((w, b): &(DenseMatrix, Vec<f32>), x: &[f32], tokens: usize) -> Vec<f32> {
    let rows = b.len();
    let mut out = vec![0f32; tokens * rows];
    {
        let mut ys: Vec<&mut [f32]> = out.chunks_mut(rows).collect();
        w.gemm_rows(x, 0..rows, &mut ys);
    }
    for row in out.chunks_exact_mut(rows) {
        add(row, b);
    }
    out
}

fn add(acc: &mut [f32], x: &[f32]) {
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += v;
    }
}

fn layer_norm(x: &[f32], (w, b): &(Vec<f32>, Vec<f32>), eps: f32, width: usize, out: &mut [f32]) {
    for (src, dst) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        let mean = src.iter().map(|&v| f64::from(v)).sum::<f64>() / width as f64;
        let var = src
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / width as f64;
        let inv = 1.0 / (var + f64::from(eps)).sqrt();
        for i in 0..width {
            dst[i] = ((f64::from(src[i]) - mean) * inv) as f32 * w[i] + b[i];
        }
    }
}

/// `gelu_pytorch_tanh`: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    0.5 * x * (1.0 + (C * (x + 0.044_715 * x * x * x)).tanh())
}

/// The safetensors files of a directory, mapped, with every tensor read as f32 on request.
/// Reads a tensor by logical name as exactly that many f32 values.
type TensorReader<'a> = dyn Fn(&str, usize) -> Result<Vec<f32>, VisionError> + 'a;

/// How a file spells the tower's tensor names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Naming {
    /// Hugging Face SmolVLM: `model.vision_model.*`, `model.connector.*` (the logical names).
    Hf,
    /// llama.cpp's mmproj GGUF: `v.*`, `mm.model.fc.*` (gguf-py's tensor map for MMPROJ).
    Mmproj,
}

impl Naming {
    /// The file's name for logical (Hugging Face) tensor `name`.
    fn name(self, name: &str) -> String {
        if self == Naming::Hf {
            return name.to_string();
        }
        let (stem, suffix) = name.rsplit_once('.').unwrap_or((name, ""));
        let mapped = if let Some(rest) = stem.strip_prefix("model.vision_model.encoder.layers.") {
            let (layer, part) = rest.split_once('.').unwrap_or((rest, ""));
            let part = match part {
                "layer_norm1" => "ln1",
                "layer_norm2" => "ln2",
                "self_attn.q_proj" => "attn_q",
                "self_attn.k_proj" => "attn_k",
                "self_attn.v_proj" => "attn_v",
                "self_attn.out_proj" => "attn_out",
                "mlp.fc1" => "ffn_up",
                "mlp.fc2" => "ffn_down",
                other => other,
            };
            format!("v.blk.{layer}.{part}")
        } else {
            match stem {
                "model.vision_model.embeddings.patch_embedding" => "v.patch_embd".into(),
                "model.vision_model.embeddings.position_embedding" => "v.position_embd".into(),
                "model.vision_model.post_layernorm" => "v.post_ln".into(),
                "model.connector.modality_projection.proj" => "mm.model.fc".into(),
                other => other.to_string(),
            }
        };
        format!("{mapped}.{suffix}")
    }
}

struct Tensors {
    maps: Vec<(std::path::PathBuf, memmap2::Mmap)>,
    index: HashMap<String, usize>,
}

impl Tensors {
    fn open(dir: &Path) -> Result<Tensors, VisionError> {
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .map_err(|e| file_error(dir, format!("list: {e}")))?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        files.sort();
        let mut maps = Vec::new();
        let mut index = HashMap::new();
        for path in files {
            let map = crate::model::map_file(&path)?;
            let st = safetensors::SafeTensors::deserialize(&map[..])
                .map_err(|e| file_error(&path, format!("not valid safetensors: {e}")))?;
            for name in st.names() {
                index.insert(name.to_string(), maps.len());
            }
            maps.push((path, map));
        }
        Ok(Tensors { maps, index })
    }

    /// Tensor `name` as `len` f32 values; its element count must be `len`.
    fn get(&self, name: &str, len: usize) -> Result<Vec<f32>, VisionError> {
        let missing = || {
            VisionError::Load(LoadError::TensorMissing {
                tensor: name.to_string(),
            })
        };
        let &i = self.index.get(name).ok_or_else(missing)?;
        let (path, map) = &self.maps[i];
        let bad = |what: String| file_error(path, format!("{name}: {what}"));
        let st = safetensors::SafeTensors::deserialize(&map[..]).map_err(|e| bad(e.to_string()))?;
        let t = st.tensor(name).map_err(|e| bad(e.to_string()))?;
        let count: usize = t.shape().iter().product();
        if count != len {
            return Err(bad(format!("has {count} elements, the config needs {len}")));
        }
        let data = t.data();
        Ok(match t.dtype() {
            safetensors::Dtype::F32 => data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            safetensors::Dtype::F16 => data
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            safetensors::Dtype::BF16 => data
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => return Err(bad(format!("dtype {other:?}; f32, f16 or bf16 only"))),
        })
    }
}
