//! Prints the most likely next tokens after a prompt, with their logits: a quick way to see how
//! close a greedy decision was (e.g. when comparing weight policies or runtimes).
//!
//! `cargo run --release -p pipeline --example top_logits -- MODEL POLICY "prompt" [K]`
//! (`KV=f32` for f32 KV pages, `DUMP=FILE` to also write the logits as raw f32).

use pipeline::decoder::{DecoderOptions, WeightPolicy};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, model, policy, prompt, rest @ ..] = args.as_slice() else {
        return Err("usage: top_logits MODEL POLICY PROMPT [K]".into());
    };
    let k: usize = rest.first().map_or(Ok(5), |s| s.parse())?;
    let options = DecoderOptions {
        policy: WeightPolicy::parse(policy)?,
        kv_dtype: match std::env::var("KV").as_deref() {
            Ok("f32") => kv_paged::PageDtype::F32,
            _ => kv_paged::PageDtype::F16,
        },
        ..DecoderOptions::default()
    };
    let (mut decoder, tokenizer) = pipeline::llm::open_decoder(model.as_ref(), options, 0)?;
    let tok = tokenizer.ok_or("the model has no tokenizer")?;
    let ids = tok.encode(prompt, decoder.config().add_bos)?;
    let logits = decoder.forward_last(&ids)?;
    // DUMP=FILE writes the logits as raw little-endian f32, for comparing runtimes.
    if let Some(path) = std::env::var_os("DUMP") {
        let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(path, bytes)?;
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    for &i in order.iter().take(k) {
        println!(
            "{:>6} {:>10.4} {:?}",
            i,
            logits[i],
            tok.decode(&[i as u32])?
        );
    }
    Ok(())
}
