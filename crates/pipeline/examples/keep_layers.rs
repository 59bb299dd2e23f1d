//! Writes a GGUF model cut to its first N blocks: the same embedding, final norm, output head
//! and tokenizer, fewer layers. The result drafts for the full model (`pipeline generate
//! --draft CUT.gguf`): a layer-skip, self-speculative draft that needs no second model.
//!
//! ```text
//! cargo run --release -p pipeline --example keep_layers -- MODEL.gguf N OUT.gguf
//! ```
//!
//! fixtures/tiny-llama/draft-1layer.gguf was made by it from fixtures/tiny-llama/tiny.gguf
//! with N = 1.

use std::path::PathBuf;

use pipeline::model::gguf::{self, GgufFile, OutTensor, Value};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model, keep, out] = args.as_slice() else {
        return Err("usage: keep_layers MODEL.gguf N OUT.gguf".into());
    };
    let keep: u32 = keep.parse().map_err(|e| format!("N {keep:?}: {e}"))?;
    let source = GgufFile::open(&PathBuf::from(model))?;
    let arch = match source
        .metadata()
        .find(|(k, _)| *k == "general.architecture")
    {
        Some((_, Value::String(a))) => a.clone(),
        _ => return Err(format!("{model} names no general.architecture").into()),
    };
    let count_key = format!("{arch}.block_count");
    let layers = match source.metadata().find(|(k, _)| *k == count_key) {
        Some((_, Value::U32(n))) => *n,
        _ => return Err(format!("{model} has no u32 {count_key}").into()),
    };
    if keep == 0 || keep >= layers {
        return Err(format!(
            "N must be between 1 and {} (the model has {layers})",
            layers - 1
        )
        .into());
    }
    let metadata: Vec<(String, Value)> = source
        .metadata()
        .map(|(k, v)| {
            let v = if k == count_key {
                Value::U32(keep)
            } else {
                v.clone()
            };
            (k.to_string(), v)
        })
        .collect();
    // `blk.N.` tensors past the kept blocks are left out; everything else is copied as stored.
    let kept = |name: &str| match name.strip_prefix("blk.").and_then(|r| r.split('.').next()) {
        Some(layer) => layer.parse::<u32>().is_ok_and(|l| l < keep),
        None => true,
    };
    let tensors: Vec<OutTensor> = source
        .tensors()
        .iter()
        .filter(|t| kept(&t.name))
        .map(|t| OutTensor {
            name: t.name.clone(),
            dims: t.dims.clone(),
            type_id: t.ggml_type.id(),
            data: source.tensor_data(t).to_vec(),
        })
        .collect();
    gguf::write(&PathBuf::from(out), &metadata, &tensors)?;
    println!(
        "wrote {out}: {keep} of {layers} blocks, {} tensors",
        tensors.len()
    );
    Ok(())
}
