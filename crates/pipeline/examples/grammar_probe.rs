//! Loads a model's tokenizer and shows what a JSON-schema grammar allows and what masking
//! costs on its real vocabulary: the tokens allowed at a few points of a document and the
//! median time of one mask step there (one thread).
//!
//! `cargo run --release -p pipeline --example grammar_probe -- MODEL.gguf [SCHEMA.json]`
//! (without a schema file, a small person record with a name, an age and optional tags).

use std::time::{Duration, Instant};

use pipeline::grammar::{Grammar, TokenVocab};
use pipeline::model::gguf::GgufFile;
use pipeline::model::tokenizer::Tokenizer;

/// Mask steps timed per point of the document.
const ROUNDS: usize = 200;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, model, rest @ ..] = args.as_slice() else {
        return Err("usage: grammar_probe MODEL.gguf [SCHEMA.json]".into());
    };
    let schema: serde_json::Value = match rest.first() {
        Some(path) => serde_json::from_str(&std::fs::read_to_string(path)?)?,
        None => serde_json::json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "age": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}
            },
            "required": ["name", "age"]
        }),
    };

    let file = GgufFile::open(model.as_ref())?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let t = Instant::now();
    let vocab = TokenVocab::from_tokenizer(&tokenizer)?;
    println!("vocabulary built in {:.1?}: {vocab:?}", t.elapsed());
    // The bytes a grammar walks must be what decoding prints, wherever they are whole UTF-8.
    let (mut utf8, mut agree) = (0, 0);
    for id in 0..vocab.len() as u32 {
        if let Some(text) = vocab
            .token_bytes(id)
            .and_then(|b| std::str::from_utf8(b).ok())
        {
            utf8 += 1;
            agree += usize::from(tokenizer.decode(&[id])? == text);
        }
    }
    println!("token bytes agree with decode for {agree} of {utf8} tokens whose bytes are UTF-8");
    if agree != utf8 {
        return Err("token bytes disagree with the tokenizer's decode".into());
    }

    let t = Instant::now();
    let grammar = Grammar::json_schema(&schema, &vocab)?;
    println!("grammar ({grammar:?}) compiled in {:.1?}", t.elapsed());

    // Points of a document: (text so far, what it shows).
    let points = [
        ("", "start"),
        ("{", "after {"),
        ("{\"name\"", "after a key"),
        ("{\"name\": \"Ada Lov", "inside a string"),
        ("{\"name\": \"Ada\", \"age\": 3", "inside an integer"),
        ("{\"name\": \"Ada\", \"age\": 36}", "complete"),
    ];
    let mut logits = vec![0f32; vocab.len()];
    println!(
        "\n{:<20} {:>8} {:>10} {:>10}  examples",
        "point", "allowed", "median", "max"
    );
    for (text, what) in points {
        let mut state = grammar.start();
        grammar
            .advance_text(&mut state, text.as_bytes())
            .map_err(|e| format!("{text:?} is not a prefix the grammar allows: {e}"))?;
        let mut times: Vec<Duration> = (0..ROUNDS)
            .map(|_| {
                logits.fill(0.0);
                // A fresh copy per step: the parser may keep the mask of its state.
                let mut fresh = state.clone();
                let t = Instant::now();
                let allowed = grammar.mask(&mut fresh, &mut logits);
                let elapsed = t.elapsed();
                std::hint::black_box(allowed.ok());
                elapsed
            })
            .collect();
        times.sort();
        let allowed = grammar.allowed_tokens(&mut state)?;
        let examples: Vec<String> = allowed
            .iter()
            .take(8)
            .map(|&id| match vocab.token_bytes(id) {
                Some(bytes) => format!("{:?}", String::from_utf8_lossy(bytes)),
                None => format!("<id {id}>"),
            })
            .collect();
        println!(
            "{what:<20} {:>8} {:>10.1?} {:>10.1?}  {}{}",
            allowed.len(),
            times[ROUNDS / 2],
            times[ROUNDS - 1],
            examples.join(" "),
            if allowed.len() > 8 { " ..." } else { "" }
        );
    }
    Ok(())
}
