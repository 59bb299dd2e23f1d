//! A safetensors model directory from untrusted bytes: the input is split into `config.json`
//! and `model.safetensors` (the first two bytes give the config's length), written to a scratch
//! directory and opened as a model, tensors checked against the config.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let split = usize::from(u16::from_le_bytes([data[0], data[1]])).min(data.len() - 2);
    let (config, weights) = data[2..].split_at(split);
    let dir = std::env::temp_dir().join(format!("pipeline-fuzz-st-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    if std::fs::write(dir.join("config.json"), config).is_err()
        || std::fs::write(dir.join("model.safetensors"), weights).is_err()
    {
        return;
    }
    let _ = pipeline::model::open_model(&dir);
});
