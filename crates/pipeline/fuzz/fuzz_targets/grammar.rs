//! Constrained-decoding grammars from untrusted text: the first byte picks a JSON schema, a
//! regular expression or a Lark grammar; the rest is compiled against a small byte vocabulary,
//! and a few tokens are masked and advanced.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use pipeline::grammar::{Grammar, TokenVocab};

fn vocab() -> &'static TokenVocab {
    static VOCAB: OnceLock<TokenVocab> = OnceLock::new();
    VOCAB.get_or_init(|| {
        let mut tokens: Vec<Option<Vec<u8>>> = (0u8..=255).map(|b| Some(vec![b])).collect();
        for t in ["{\"", "\": ", "true", "null", "\"a\"", "[1, ", "]}", "  "] {
            tokens.push(Some(t.as_bytes().to_vec()));
        }
        tokens.push(None);
        let eos = tokens.len() as u32 - 1;
        TokenVocab::new(tokens, &[eos])
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&kind, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let vocab = vocab();
    let grammar = match kind % 3 {
        0 => {
            let Ok(schema) = serde_json::from_str::<serde_json::Value>(text) else {
                return;
            };
            Grammar::json_schema(&schema, vocab)
        }
        1 => Grammar::regex(text, vocab),
        _ => Grammar::lark(text, vocab),
    };
    let Ok(grammar) = grammar else {
        return;
    };
    let mut state = grammar.start();
    for step in 0..8usize {
        let Ok(allowed) = grammar.allowed_tokens(&mut state) else {
            return;
        };
        let Some(&token) = allowed.get(step % allowed.len().max(1)) else {
            return;
        };
        if grammar.advance(&mut state, token).is_err() {
            return;
        }
    }
});
