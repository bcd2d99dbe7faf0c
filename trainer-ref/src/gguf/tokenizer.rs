//! The tokenizer a GGUF file carries in its metadata (`tokenizer.ggml.*`), rebuilt as a Hugging Face
//! `tokenizers` tokenizer.
//!
//! Byte-level BPE (`tokenizer.ggml.model = "gpt2"`, what GPT-2, Llama 3, SmolLM and most recent models use):
//! the vocabulary is the token list (already spelt in GPT-2's byte alphabet), the merges are
//! `tokenizer.ggml.merges`, and the text is split before merging as llama.cpp splits it for the file's
//! `tokenizer.ggml.pre`: GPT-2's pattern by default, each digit alone first for `smollm` (as SmolLM's own
//! `tokenizer.json` does), the Llama 3 pattern for `llama-bpe`/`llama3`. Tokens marked as control
//! (`token_type` 3) are special tokens, matched whole. SentencePiece vocabularies (`llama`) are not rebuilt:
//! such a model evaluates on token ids (`.npy`).

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

use super::container::{GgufFile, Value};
use crate::error::Result;

/// Llama 3's split pattern (llama.cpp's `LLAMA_VOCAB_PRE_TYPE_LLAMA3`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn strings<'a>(f: &'a GgufFile, key: &str) -> Result<Vec<&'a str>> {
    let arr = f.get(key)?.as_array().ok_or_else(|| f.bad(format!("metadata `{key}` is not an array")))?;
    arr.iter()
        .enumerate()
        .map(|(i, v)| v.as_str().ok_or_else(|| f.bad(format!("metadata `{key}`[{i}] is not a string"))))
        .collect()
}

/// The file's tokenizer, or `Ok(None)` when it carries none.
///
/// Errors: a tokenizer model other than byte-level BPE, a pre-tokenizer type this does not know, or
/// malformed vocabulary or merges (naming the key and index).
pub fn from_gguf(f: &GgufFile) -> Result<Option<Tokenizer>> {
    let Some(model) = f.metadata.get("tokenizer.ggml.model") else { return Ok(None) };
    let model = model.as_str().unwrap_or("?");
    if model != "gpt2" {
        return Err(f.bad(format!(
            "tokenizer.ggml.model = `{model}`: only byte-level BPE (`gpt2`) vocabularies are rebuilt; \
             evaluate on token ids in a .npy file instead"
        )));
    }
    let tokens = strings(f, "tokenizer.ggml.tokens")?;
    let merges = strings(f, "tokenizer.ggml.merges")?;
    let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.to_string(), i as u32)).collect();
    let merges = merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| f.bad(format!("metadata `tokenizer.ggml.merges`[{i}] = `{m}` is not two tokens")))
        })
        .collect::<Result<Vec<_>>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| f.bad(format!("tokenizer.ggml.*: the BPE model does not build: {e}")))?;
    let pre = f.metadata.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or("default");
    let byte_level = |regex| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, regex));
    let pre_tokenizer = match pre {
        "default" | "gpt2" | "gpt-2" => byte_level(true),
        "smollm" => PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            byte_level(true),
        ])),
        "llama3" | "llama-v3" | "llama-bpe" => {
            let split = Split::new(SplitPattern::Regex(LLAMA3_SPLIT.into()), SplitDelimiterBehavior::Isolated, false)
                .map_err(|e| f.bad(format!("the Llama 3 split pattern does not compile: {e}")))?;
            PreTokenizerWrapper::Sequence(Sequence::new(vec![PreTokenizerWrapper::Split(split), byte_level(false)]))
        }
        other => {
            return Err(f.bad(format!(
                "tokenizer.ggml.pre = `{other}`: unknown pre-tokenizer (known: gpt2, smollm, llama-bpe); \
                 evaluate on token ids in a .npy file instead"
            )))
        }
    };
    let mut tok = Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(pre_tokenizer));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    if let Some(types) = f.metadata.get("tokenizer.ggml.token_type").and_then(Value::as_array) {
        let control: Vec<AddedToken> = types
            .iter()
            .zip(&tokens)
            .filter(|(t, _)| t.as_u64() == Some(3))
            .map(|(_, s)| AddedToken::from(s.to_string(), true))
            .collect();
        tok.add_special_tokens(&control);
    }
    Ok(Some(tok))
}
