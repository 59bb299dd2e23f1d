//! A chat template from untrusted text (a model file carries it), rendered under its budget.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(source) = std::str::from_utf8(data) else {
        return;
    };
    let _ = pipeline::model::tokenizer::render_chat_template(
        source,
        &[("system", "be brief"), ("user", "hello"), ("assistant", "hi")],
        true,
        "<s>",
        "</s>",
    );
});
