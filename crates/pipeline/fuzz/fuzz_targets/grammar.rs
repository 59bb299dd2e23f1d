//! Constrained-decoding grammars from untrusted text: the first byte picks a JSON schema or a
//! regular expression; the rest is compiled against a small byte vocabulary, and a few tokens
//! are advanced and masked.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pipeline::grammar::{Grammar, TokenVocab};

fn vocab() -> TokenVocab {
    let mut tokens: Vec<Option<Vec<u8>>> = (0u8..=255).map(|b| Some(vec![b])).collect();
    for t in ["{\"", "\":", "true", "null", "\"a\"", "[1,", "]}", "  "] {
        tokens.push(Some(t.as_bytes().to_vec()));
    }
    tokens.push(None);
    let eos = tokens.len() as u32 - 1;
    TokenVocab::new(tokens, &[eos])
}

fuzz_target!(|data: &[u8]| {
    let Some((&kind, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let vocab = vocab();
    let grammar = if kind % 2 == 0 {
        let Ok(schema) = serde_json::from_str::<serde_json::Value>(text) else {
            return;
        };
        Grammar::json_schema(&schema, &vocab)
    } else {
        Grammar::regex(text, &vocab)
    };
    let Ok(grammar) = grammar else {
        return;
    };
    let mut logits = vec![0.0f32; vocab.len()];
    let mut state = grammar.start();
    for step in 0..8u32 {
        let _ = grammar.mask(state, &mut logits);
        let Ok(allowed) = grammar.allowed_tokens(state) else {
            return;
        };
        let Some(&token) = allowed.get(step as usize % allowed.len().max(1)) else {
            return;
        };
        match grammar.advance(state, token) {
            Ok(next) => state = next,
            Err(_) => return,
        }
    }
});
