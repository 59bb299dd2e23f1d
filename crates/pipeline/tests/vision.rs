//! The CPU SigLIP tower and SmolVLM connector against Hugging Face transformers: a tiny
//! random-weight SmolVLM (fixtures/tiny-smolvlm, made by its make.py) must reproduce the vision
//! tower's last hidden state and the connector's output for the recorded image.

use std::path::PathBuf;

use pipeline::vision::VisionEncoder;

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/tiny-smolvlm")
        .join(rel)
}

fn floats(v: &serde_json::Value, key: &str) -> Vec<f32> {
    v[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// Largest |a - b| relative to the largest |b|.
fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn tower_and_connector_match_transformers() {
    let text = std::fs::read_to_string(fixture("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let enc = VisionEncoder::open(&fixture("hf")).unwrap();
    assert_eq!(enc.config().image_tokens(), 16);
    let pixels = floats(&v, "pixel_values");
    let vision = enc.vision(&pixels).unwrap();
    let rel = rel_diff(&vision, &floats(&v, "vision_last_hidden_state"));
    assert!(
        rel < 1e-5,
        "vision tower differs from transformers by {rel} (relative)"
    );
    let connector = enc.connect(&vision);
    let rel = rel_diff(&connector, &floats(&v, "connector"));
    assert!(
        rel < 1e-5,
        "connector differs from transformers by {rel} (relative)"
    );
}

#[test]
fn a_wrong_image_size_is_an_error_that_names_the_size() {
    let enc = VisionEncoder::open(&fixture("hf")).unwrap();
    let err = enc.vision(&[0.0; 3 * 32 * 32]).unwrap_err().to_string();
    assert!(err.contains("3x64x64"), "{err}");
}
