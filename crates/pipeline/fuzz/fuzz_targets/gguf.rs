//! A GGUF file from untrusted bytes: the header, metadata and tensor table, then the model
//! config and the tokenizer built from them, and the first row of every tensor (dequantized, a
//! block rotation undone). Any outcome but a panic, an abort or a hang is fine.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pipeline::model::TensorSource;
use pipeline::model::gguf::GgufFile;
use pipeline::model::tokenizer::Tokenizer;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes("fuzz.gguf", data.to_vec()) else {
        return;
    };
    for info in file.tensors() {
        let (rows, cols) = info.shape();
        if rows > 0 && cols <= 1 << 16 {
            let mut row = vec![0f32; cols];
            let name = info.name.strip_suffix(".weight").unwrap_or(&info.name);
            let _ = file.read_rows(name, 0..1, &mut row);
        }
    }
    let _ = file.recorded_policy();
    if let Ok(config) = file.model_config() {
        let _ = pipeline::model::check_llama_tensors(&config, &file);
    }
    if let Ok(tokenizer) = Tokenizer::from_gguf(&file) {
        let _ = tokenizer.encode("fuzz <|im_start|>", true);
        let _ = tokenizer.apply_chat_template(&[("user", "hi")], true);
    }
});
