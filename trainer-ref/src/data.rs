//! The corpus, its tokens (bytes, or a pretrained model's tokenizer), and the packed sequences a step trains on.
//!
//! Documents are packed end to end, each closed by the end-of-document token, into one token stream per split,
//! cut into windows of `seq_len` inputs (each with one more token for the last target). Sequence `i` of a split
//! is window `(i · stride) mod windows`, `stride` a fixed number coprime to the window count: every epoch visits
//! every window once, in an order that scatters neighbouring text over the run (consecutive windows of one
//! region, such as the Jargon File's index, would otherwise make whole batches alike). A sequence is a pure
//! function of its index, so the data position a checkpoint records is the number of sequences consumed, and
//! resuming from it reads exactly the sequences an uninterrupted run would.

use std::io::Read;
use std::path::Path;

use crate::error::{Result, TrainError};

/// The built-in corpus: the Jargon File 4.4.7 (public domain; see `trainer-ref/data/README.md`).
const JARGON_GZ: &[u8] = include_bytes!("../data/jargon.txt.gz");

/// The byte tokenizer's end-of-document token (after the 256 byte values).
pub const EOT: u32 = 256;
/// Tokens of the byte tokenizer.
pub const BYTE_VOCAB: usize = 257;

/// How text becomes token ids: the built-in byte tokenizer, or a pretrained model's (a `tokenizer.json`, or
/// the vocabulary a GGUF file carries) with its end-of-sequence token closing each document.
#[derive(Debug, Clone)]
pub enum TextTokenizer {
    /// Bytes, with [`EOT`] after the 256 byte values.
    Bytes,
    /// A Hugging Face tokenizer.
    Pretrained {
        /// The tokenizer.
        tokenizer: Box<tokenizers::Tokenizer>,
        /// The token that closes a document (the model's end-of-sequence token).
        eot: u32,
    },
}

impl TextTokenizer {
    /// `text` as token ids (no special tokens added).
    ///
    /// Errors: the tokenizer fails on the text.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            TextTokenizer::Bytes => Ok(encode(text)),
            TextTokenizer::Pretrained { tokenizer, .. } => {
                tokenizer.encode(text, false).map(|e| e.get_ids().to_vec()).map_err(|e| TrainError::Tokenizer {
                    context: "the tokenizer failed on the corpus".into(),
                    detail: e.to_string(),
                })
            }
        }
    }

    /// Checks that a model of `vocab` tokens has an embedding for every id this tokenizer makes of text: the byte
    /// tokenizer's [`BYTE_VOCAB`] (256 bytes and [`EOT`]). Called where text goes through it (the corpus of a
    /// training run, a text file given to `longctx eval`), not for every recipe: ids read from a file, or made by
    /// a pretrained model's tokenizer, are the model's own and are checked against its vocabulary where they are
    /// used.
    ///
    /// Errors: [`TrainError::InvalidField`] naming `model.vocab`, for the byte tokenizer and a smaller vocabulary.
    pub fn check_vocab(&self, vocab: usize) -> Result<()> {
        match self {
            TextTokenizer::Bytes if vocab < BYTE_VOCAB => Err(TrainError::InvalidField {
                field: "model.vocab".into(),
                detail: format!(
                    "{vocab} is below the byte tokenizer's {BYTE_VOCAB} tokens, which read this text (no pretrained \
                     tokenizer was given)"
                ),
            }),
            _ => Ok(()),
        }
    }

    /// The end-of-document token.
    pub fn eot(&self) -> u32 {
        match self {
            TextTokenizer::Bytes => EOT,
            TextTokenizer::Pretrained { eot, .. } => *eot,
        }
    }
}

/// UTF-8 text as byte tokens.
pub fn encode(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// Byte tokens back to text (the end-of-document token as a newline; invalid UTF-8 replaced).
pub fn decode(tokens: &[u32]) -> String {
    let bytes: Vec<u8> = tokens.iter().map(|&t| if t < 256 { t as u8 } else { b'\n' }).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// A corpus cut into documents.
#[derive(Debug, Clone)]
pub struct Corpus {
    /// The documents' texts, in order.
    pub documents: Vec<String>,
}

impl Corpus {
    /// The corpus a recipe names: `jargon`, or a UTF-8 text file.
    pub fn load(name: &str) -> Result<Corpus> {
        let text = if name == "jargon" {
            let mut s = String::new();
            flate2::read::GzDecoder::new(JARGON_GZ)
                .read_to_string(&mut s)
                .map_err(|e| TrainError::io("built-in jargon.txt.gz", e))?;
            s
        } else {
            let p = Path::new(name);
            std::fs::read_to_string(p).map_err(|e| TrainError::io(p, e))?
        };
        Ok(Corpus::from_text(&text))
    }

    /// Cuts `text` into documents at the Jargon File's entry headings (a line `   :term:`), or at blank-line
    /// pairs (`\n\n\n`) in other texts; the text before the first heading is one document.
    pub fn from_text(text: &str) -> Corpus {
        let mut documents = Vec::new();
        let mut cur = String::new();
        let headings = text.lines().any(is_heading);
        for line in text.split_inclusive('\n') {
            let cut =
                if headings { is_heading(line.trim_end_matches('\n')) } else { line == "\n" && cur.ends_with("\n\n") };
            if cut && !cur.trim().is_empty() {
                documents.push(std::mem::take(&mut cur));
            }
            cur.push_str(line);
        }
        if !cur.trim().is_empty() {
            documents.push(cur);
        }
        Corpus { documents }
    }

    /// Splits off every `every`-th document as the held-out set, in byte tokens.
    pub fn split(&self, every: usize) -> Result<(TokenStream, TokenStream)> {
        self.split_with(every, &TextTokenizer::Bytes)
    }

    /// Splits off every `every`-th document as the held-out set, tokenized by `tok`.
    pub fn split_with(&self, every: usize, tok: &TextTokenizer) -> Result<(TokenStream, TokenStream)> {
        let every = every.max(2);
        let (mut train, mut heldout) = (Vec::new(), Vec::new());
        for (i, d) in self.documents.iter().enumerate() {
            if i % every == every - 1 {
                heldout.push(d.as_str());
            } else {
                train.push(d.as_str());
            }
        }
        Ok((TokenStream::pack_with("train", &train, tok)?, TokenStream::pack_with("held-out", &heldout, tok)?))
    }
}

fn is_heading(line: &str) -> bool {
    line.len() > 5 && line.starts_with("   :") && !line.starts_with("    ") && line[4..].contains(':')
}

/// One split's documents packed into a token stream.
#[derive(Debug, Clone)]
pub struct TokenStream {
    tokens: Vec<u32>,
    /// Document index of each token (the end-of-document token belongs to the document it closes).
    docs: Vec<u32>,
    documents: usize,
}

/// One training sequence: `seq_len` inputs, their next-token targets and their document ids.
#[derive(Debug, Clone, PartialEq)]
pub struct Sequence {
    /// Input tokens.
    pub inputs: Vec<u32>,
    /// The token after each input.
    pub targets: Vec<i64>,
    /// Document of each input, numbered from 0 within the sequence.
    pub docs: Vec<u32>,
}

impl Sequence {
    /// A rank's share of the sequence: its tokens, targets and document ids at `positions` (the rank's global
    /// positions under the context-parallel partition).
    pub fn share(&self, positions: &[i64]) -> (Vec<u32>, Vec<i64>, Vec<u32>) {
        let ids = positions.iter().map(|&p| self.inputs[p as usize]).collect();
        let targets = positions.iter().map(|&p| self.targets[p as usize]).collect();
        let docs = positions.iter().map(|&p| self.docs[p as usize]).collect();
        (ids, targets, docs)
    }
}

impl TokenStream {
    /// Packs `documents` as byte tokens, each closed by [`EOT`].
    pub fn pack(name: &str, documents: &[&str]) -> Result<TokenStream> {
        Self::pack_with(name, documents, &TextTokenizer::Bytes)
    }

    /// Packs `documents` tokenized by `tok`, each closed by its end-of-document token.
    pub fn pack_with(name: &str, documents: &[&str], tok: &TextTokenizer) -> Result<TokenStream> {
        let (mut tokens, mut docs) = (Vec::new(), Vec::new());
        for (i, d) in documents.iter().enumerate() {
            let t = tok.encode(d)?;
            docs.extend(std::iter::repeat_n(i as u32, t.len() + 1));
            tokens.extend(t);
            tokens.push(tok.eot());
        }
        if tokens.len() < 2 {
            return Err(TrainError::InvalidArgument {
                name: "documents".into(),
                detail: format!("the {name} split of the corpus is empty"),
            });
        }
        Ok(TokenStream { tokens, docs, documents: documents.len() })
    }

    /// Tokens in the stream.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the stream is empty (never, once packed).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Documents packed.
    pub fn documents(&self) -> usize {
        self.documents
    }

    /// Sequence `index` of `seq_len` tokens (see the module docs).
    pub fn sequence(&self, index: u64, seq_len: usize) -> Sequence {
        let n = self.tokens.len();
        let windows = ((n - 1) / seq_len).max(1) as u64;
        let window = (index % windows) * stride(windows) % windows;
        let start = ((window as u128 * seq_len as u128) % n as u128) as usize;
        let at = |i: usize| (start + i) % n;
        let inputs: Vec<u32> = (0..seq_len).map(|i| self.tokens[at(i)]).collect();
        let targets: Vec<i64> = (0..seq_len).map(|i| self.tokens[at(i + 1)] as i64).collect();
        // Renumber from 0; a wrap round the stream starts a new document even if the ids repeat.
        let mut docs = Vec::with_capacity(seq_len);
        let (mut id, mut prev) = (0u32, self.docs[at(0)]);
        for i in 0..seq_len {
            let d = self.docs[at(i)];
            if d != prev || (i > 0 && at(i) == 0) {
                id += 1;
                prev = d;
            }
            docs.push(id);
        }
        Sequence { inputs, targets, docs }
    }
}

/// A step through `windows` windows that visits each once per epoch: near the golden ratio of the count, so
/// consecutive sequences land far apart, and coprime to it.
fn stride(windows: u64) -> u64 {
    let gcd = |mut a: u64, mut b: u64| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let mut s = ((windows as f64 * 0.618_033_988_75) as u64).max(1);
    while gcd(s, windows) != 1 {
        s += 1;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_tokenizer_needs_its_257_tokens_in_the_model() {
        let e = TextTokenizer::Bytes.check_vocab(BYTE_VOCAB - 1).unwrap_err();
        assert!(
            matches!(&e, TrainError::InvalidField { field, detail } if field == "model.vocab"
                && detail.contains("256 is below the byte tokenizer's 257 tokens")),
            "{e}"
        );
        TextTokenizer::Bytes.check_vocab(BYTE_VOCAB).unwrap();
    }

    #[test]
    fn an_epoch_visits_every_window_once() {
        for windows in [1u64, 2, 7, 12, 1000, 6561] {
            let s = stride(windows);
            let mut seen: Vec<u64> = (0..windows).map(|i| i * s % windows).collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..windows).collect::<Vec<_>>(), "{windows} windows, stride {s}");
        }
    }

    #[test]
    fn the_builtin_corpus_has_the_lexicon_as_documents() {
        let c = Corpus::load("jargon").unwrap();
        assert!(c.documents.len() > 2000, "{} documents", c.documents.len());
        assert!(c.documents.iter().any(|d| d.starts_with("   :camelCase:")));
        let (train, heldout) = c.split(20).unwrap();
        assert!(heldout.len() > 50_000 && train.len() > 15 * heldout.len(), "{} {}", train.len(), heldout.len());
    }

    #[test]
    fn a_sequence_is_a_pure_function_of_its_index_with_shifted_targets_and_document_ids() {
        let s = TokenStream::pack("t", &["ab", "cde"]).unwrap(); // a b EOT c d e EOT
        let q = s.sequence(0, 4);
        assert_eq!(q.inputs, vec![97, 98, EOT, 99]);
        assert_eq!(q.targets, vec![98, EOT as i64, 99, 100]);
        assert_eq!(q.docs, vec![0, 0, 0, 1]);
        assert_eq!(s.sequence(1, 3).inputs, vec![99, 100, 101], "the second of two windows");
        assert_eq!(s.sequence(2, 3), s.sequence(0, 3), "an epoch is every window once");
        assert_eq!(s.sequence(1, 4), s.sequence(1, 4));
        assert_eq!(decode(&q.inputs), "ab\nc");
    }
}
