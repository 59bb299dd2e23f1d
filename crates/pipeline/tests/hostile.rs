//! Hostile inputs, tried as a user would: small files that declare absurd sizes or loop, given to
//! the `pipeline` binary. Each must end in a named error within 20 s under a 2 GiB address-space
//! limit: never a signal (an abort, a crash), a hang or an allocation that the limit stops.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The address-space limit each run gets (`ulimit -v`, KiB).
const ADDRESS_SPACE_KIB: u64 = 2 << 20;
const TIME_LIMIT: Duration = Duration::from_secs(20);

mod common;

fn fixture(rel: &str) -> PathBuf {
    common::fixtures().join(rel)
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("hostile");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// Runs `pipeline ARGS` under the limits; returns stderr after checking it failed with an exit
/// code (not a signal) in time, and that stderr names the problem (`expect`, any of them).
/// Runs `pipeline ARGS` under the address-space and time limits, checking it ended in time.
fn run_limited(args: &[&str]) -> std::process::Output {
    let start = Instant::now();
    let mut quoted = String::new();
    for a in args {
        quoted.push_str(&format!(" '{}'", a.replace('\'', r"'\''")));
    }
    let script = format!(
        "ulimit -v {ADDRESS_SPACE_KIB}; exec timeout -s KILL {} '{}'{quoted}",
        TIME_LIMIT.as_secs(),
        env!("CARGO_BIN_EXE_pipeline")
    );
    let out = Command::new("sh").args(["-c", &script]).output().unwrap();
    let elapsed = start.elapsed();
    assert!(
        elapsed < TIME_LIMIT,
        "{args:?} ran {elapsed:?} (past the {TIME_LIMIT:?} limit): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn refuses(args: &[&str], expect: &[&str]) -> String {
    let out = run_limited(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let code = out.status.code();
    assert!(
        code.is_some_and(|c| c != 0 && c != 137 && c != 124),
        "{args:?} ended with {:?} (a signal, a kill or success), not a named error: {stderr}",
        out.status
    );
    assert!(
        !stderr.contains("memory allocation of") && !stderr.contains("panicked"),
        "{args:?} aborted or panicked: {stderr}"
    );
    assert!(
        expect.iter().any(|e| stderr.contains(e)),
        "{args:?}: stderr names none of {expect:?}: {stderr}"
    );
    stderr
}

/// `pipeline isp` on the file at `source`, writing `out` in the scratch folder: as [`refuses`].
fn isp_refuses(source: &std::path::Path, out: &str, expect: &[&str]) -> String {
    refuses(
        &[
            "isp",
            "--source",
            &format!("file:{}", source.display()),
            "--out",
            scratch(out).to_str().unwrap(),
        ],
        expect,
    )
}

/// The tiny GGUF with `llama.block_count` rewritten to `value`.
fn gguf_with_block_count(value: u32) -> PathBuf {
    let mut bytes = std::fs::read(fixture("tiny-llama/tiny.gguf")).unwrap();
    let key = b"llama.block_count";
    let at = bytes
        .windows(key.len())
        .position(|w| w == key)
        .expect("the fixture names its block count")
        + key.len();
    assert_eq!(&bytes[at..at + 4], &4u32.to_le_bytes(), "a u32 value");
    bytes[at + 4..at + 8].copy_from_slice(&value.to_le_bytes());
    let path = scratch(&format!("blocks-{value:x}.gguf"));
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn a_gguf_declaring_four_billion_layers_is_a_named_error() {
    let path = gguf_with_block_count(u32::MAX);
    refuses(
        &[
            "generate",
            "--model",
            path.to_str().unwrap(),
            "--cache-dir",
            scratch("cache").to_str().unwrap(),
            "--prompt",
            "x",
            "--max-tokens",
            "1",
        ],
        &["blk.2", "missing", "tensor"],
    );
}

#[test]
fn a_gguf_whose_array_outgrows_the_file_is_a_named_error() {
    // A header, one metadata entry: an array of u8 declaring 2^40 elements.
    let mut bytes = b"GGUF".to_vec();
    bytes.extend(3u32.to_le_bytes());
    bytes.extend(0u64.to_le_bytes()); // tensors
    bytes.extend(1u64.to_le_bytes()); // metadata entries
    let key = b"tokenizer.ggml.token_type";
    bytes.extend((key.len() as u64).to_le_bytes());
    bytes.extend(key);
    bytes.extend(9u32.to_le_bytes()); // array
    bytes.extend(0u32.to_le_bytes()); // of u8
    bytes.extend((1u64 << 40).to_le_bytes());
    bytes.extend(vec![1u8; 1 << 20]);
    let path = scratch("huge-array.gguf");
    std::fs::write(&path, bytes).unwrap();
    refuses(
        &[
            "generate",
            "--model",
            path.to_str().unwrap(),
            "--prompt",
            "x",
        ],
        &["fit in the rest of the file"],
    );
}

/// 24 nested arrays: 500 bytes of schema that once asked the old regex converter for gigabytes.
/// llguidance compiles it as a grammar: the run completes within the limits.
#[test]
fn a_json_schema_of_nested_arrays_runs_within_bounds() {
    let mut schema = serde_json::json!({"type": "integer"});
    for _ in 0..24 {
        schema = serde_json::json!({"type": "array", "items": schema});
    }
    let path = scratch("nested.schema.json");
    std::fs::write(&path, schema.to_string()).unwrap();
    let model = common::tiny_vlm("hostile-tiny");
    let out = run_limited(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--cache-dir",
        scratch("cache").to_str().unwrap(),
        "--prompt",
        "x",
        "--max-tokens",
        "8",
        "--json-schema",
        path.to_str().unwrap(),
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.trim_start().starts_with('['), "{text}");
}

/// A model directory whose chat template loops without end: `generate --chat` runs out of the
/// template's fuel and says so.
#[test]
fn a_looping_chat_template_is_a_named_error() {
    let dir = common::tiny_vlm("hostile-looping-template");
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    )
    .unwrap();
    refuses(
        &[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--cache-dir",
            scratch("cache").to_str().unwrap(),
            "--prompt",
            "x",
            "--chat",
        ],
        &["fuel"],
    );
}

/// A Lark grammar that is not one is a named error.
#[test]
fn a_broken_lark_grammar_is_a_named_error() {
    let path = scratch("broken.lark");
    std::fs::write(&path, "start: (((\n").unwrap();
    let model = common::tiny_vlm("hostile-tiny");
    refuses(
        &[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--cache-dir",
            scratch("cache").to_str().unwrap(),
            "--prompt",
            "x",
            "--grammar",
            path.to_str().unwrap(),
        ],
        &["Lark grammar does not compile"],
    );
}

#[test]
fn a_y4m_header_declaring_a_huge_frame_is_a_named_error() {
    let path = scratch("huge.y4m");
    std::fs::write(
        &path,
        b"YUV4MPEG2 W100000 H100000 F30:1 C420jpeg\nFRAME\n\x10\x10",
    )
    .unwrap();
    isp_refuses(&path, "huge.png", &["larger than the 256 MiB limit"]);
}

/// One frame in 1.1e19 seconds: the second frame's timestamp overflowed `Duration` and
/// panicked (`cargo xtask fuzz` in CI, 2026-12-07).
#[test]
fn a_y4m_header_declaring_an_absurd_frame_rate_is_a_named_error() {
    let path = scratch("slow.y4m");
    let mut data = b"YUV4MPEG2 W8 H4 F1:11111111111111111111 C420jpeg\n".to_vec();
    for _ in 0..3 {
        data.extend_from_slice(b"FRAME\n");
        data.extend_from_slice(&[16; 48]);
    }
    std::fs::write(&path, data).unwrap();
    isp_refuses(
        &path,
        "slow.png",
        &[
            "frame rate F1:11111111111111111111",
            "outside the supported frame rates",
        ],
    );
}

#[test]
fn a_png_header_declaring_a_huge_image_is_a_named_error() {
    // A PNG signature and an IHDR chunk claiming 100000x100000 RGB8, then nothing.
    let mut ihdr = b"IHDR".to_vec();
    ihdr.extend(100_000u32.to_be_bytes());
    ihdr.extend(100_000u32.to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]);
    let crc = crc32(&ihdr);
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    png.extend(13u32.to_be_bytes());
    png.extend(&ihdr);
    png.extend(crc.to_be_bytes());
    let path = scratch("huge.png");
    std::fs::write(&path, png).unwrap();
    isp_refuses(&path, "huge-out.png", &["larger than", "limit"]);
}

#[test]
fn an_oversized_config_json_is_a_named_error() {
    let dir = scratch("big-config");
    std::fs::create_dir_all(&dir).unwrap();
    let mut config = b"{\"pad\": \"".to_vec();
    config.extend(vec![b'x'; 17 << 20]);
    config.extend(b"\"}");
    std::fs::write(dir.join("config.json"), config).unwrap();
    refuses(
        &[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            "x",
        ],
        &["over the", "limit"],
    );
}

#[test]
fn an_npy_declaring_a_huge_shape_is_a_named_error() {
    let header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000, 3, 64, 64), }";
    let mut npy = b"\x93NUMPY\x01\x00".to_vec();
    let padded = format!("{header:<118}\n");
    npy.extend((padded.len() as u16).to_le_bytes());
    npy.extend(padded.as_bytes());
    npy.extend(vec![0u8; 3 * 64 * 64 * 4]);
    let path = scratch("huge.npy");
    std::fs::write(&path, npy).unwrap();
    let vlm = fixture("tiny-smolvlm/hf");
    refuses(
        &[
            "encode",
            "--vlm",
            vlm.to_str().unwrap(),
            "--pixels",
            path.to_str().unwrap(),
            "--backend",
            "cpu",
            "--out",
            scratch("out.npy").to_str().unwrap(),
        ],
        &["shape", "the tower takes"],
    );
}

/// CRC-32 (ISO-HDLC), as PNG chunks carry it.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = 0xFFFF_FFFFu32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// Found by `cargo xtask fuzz` (target `npy`): a 150-byte version-3 .npy whose header length
/// field asks for 3 GB, and 300 bytes of nested brackets that kept npyz's header parser busy
/// past the 20 s limit. Both are refused from their headers, at once.
#[test]
fn fuzz_found_npy_headers_are_named_errors() {
    let seeds = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/npy");
    for (file, expect) in [
        ("regression-huge-header.npy", "header claims"),
        ("regression-nested-brackets.npy", "header"),
    ] {
        let bytes = std::fs::read(seeds.join(file)).unwrap();
        let start = Instant::now();
        let err = pipeline::npy::parse_pixels_npy(&bytes, 16).unwrap_err();
        assert!(err.contains(expect), "{file}: {err}");
        assert!(start.elapsed() < Duration::from_secs(1), "{file}");
    }
    // The layout numpy writes still reads.
    let good = std::fs::read(seeds.join("pixels.npy")).unwrap();
    assert_eq!(
        pipeline::npy::parse_pixels_npy(&good, 16).unwrap().len(),
        768
    );
}
