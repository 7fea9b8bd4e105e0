//! Byte-level BPE tokenizer read from a GGUF file.
//!
//! The vocabulary, merges, token types and special token ids come from the
//! `tokenizer.ggml.*` keys; the BPE itself is the Hugging Face `tokenizers`
//! crate's, built in memory. The pre-tokenizer follows `tokenizer.ggml.pre`:
//!
//! | `pre`                               | pre-tokenizer                                                   |
//! | ----------------------------------- | --------------------------------------------------------------- |
//! | `smollm`                            | each digit alone, then the GPT-2 byte-level regex, no prefix space |
//! | `gpt2`                              | the GPT-2 byte-level regex, no prefix space                     |
//! | `llama-bpe`, `llama3`, `llama-v3`   | the Llama 3 split regex, then byte-level (merges ignored for whole-word tokens) |
//!
//! Control and unknown tokens (`tokenizer.ggml.token_type` 3 and 2) are
//! matched in the text as special tokens, user-defined tokens (type 4) as
//! added tokens — as llama.cpp does with `parse_special = true`. `encode`
//! adds no BOS.
//!
//! Decoding maps each id to its bytes (the inverse of GPT-2's byte-to-unicode
//! table for normal tokens, the text itself for control and user-defined
//! tokens) and joins them; [`StreamDecoder`] does the same one token at a
//! time, holding back a UTF-8 sequence that is split across tokens.

use std::collections::HashMap;

use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::error::EngineError;
pub use crate::error::TokenizerError;
use crate::gguf::GgufFile;

/// The Llama 3 pre-tokenizer regex (`llama-bpe`).
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A token's type (`tokenizer.ggml.token_type`, llama.cpp's `llama_token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenType {
    /// 0: not specified (treated as normal).
    Undefined,
    /// 1: an ordinary vocabulary entry.
    Normal,
    /// 2: the unknown token.
    Unknown,
    /// 3: a control token (`<|im_start|>`): special, parsed in text.
    Control,
    /// 4: a user-defined token: matched in text as a whole.
    UserDefined,
    /// 5: unused.
    Unused,
    /// 6: a raw byte `<0xNN>`.
    Byte,
}

impl TokenType {
    fn from_id(id: i32) -> Option<TokenType> {
        Some(match id {
            0 => TokenType::Undefined,
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => return None,
        })
    }
}

/// Which pre-tokenizer a GGUF asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pre {
    SmolLm,
    Gpt2,
    Llama3,
}

impl Pre {
    fn from_name(name: &str) -> Option<Pre> {
        Some(match name {
            "smollm" => Pre::SmolLm,
            "gpt2" => Pre::Gpt2,
            "llama-bpe" | "llama3" | "llama-v3" => Pre::Llama3,
            _ => return None,
        })
    }

    fn build(self) -> Result<PreTokenizerWrapper, String> {
        let byte_level = |use_regex| ByteLevel::new(false, true, use_regex);
        Ok(match self {
            Pre::SmolLm => PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                PreTokenizerWrapper::ByteLevel(byte_level(true)),
            ])),
            Pre::Gpt2 => PreTokenizerWrapper::ByteLevel(byte_level(true)),
            Pre::Llama3 => {
                let split = Split::new(
                    SplitPattern::Regex(LLAMA3_REGEX.to_owned()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .map_err(|e| format!("the Llama 3 split regex does not compile: {e}"))?;
                PreTokenizerWrapper::Sequence(Sequence::new(vec![
                    PreTokenizerWrapper::Split(split),
                    PreTokenizerWrapper::ByteLevel(byte_level(false)),
                ]))
            }
        })
    }
}

/// Pre-tokenizer names [`Tokenizer::from_gguf`] accepts.
pub const SUPPORTED_PRE: &[&str] = &["smollm", "gpt2", "llama-bpe", "llama3", "llama-v3"];

/// A byte-level BPE tokenizer built from a GGUF file's vocabulary.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    tokens: Vec<String>,
    types: Vec<TokenType>,
    /// The bytes each id decodes to.
    pieces: Vec<Vec<u8>>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.tokens.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

/// GPT-2's byte-to-unicode table: byte `b` is written as `BYTE_CHARS[b]` in
/// byte-level vocabularies.
fn byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or('\u{FFFD}');
            next += 1;
            c
        };
    }
    table
}

fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}

impl Tokenizer {
    /// Builds the tokenizer described by `gguf`'s `tokenizer.ggml.*` keys.
    ///
    /// # Errors
    /// [`TokenizerError::Unsupported`] for a tokenizer model other than
    /// `gpt2` (byte-level BPE) or a pre-tokenizer not in [`SUPPORTED_PRE`];
    /// [`TokenizerError::Invalid`] when the vocabulary, merges, types or
    /// special ids disagree; a [`GgufError`](crate::gguf::GgufError) for a
    /// missing or mistyped key.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Tokenizer, EngineError> {
        let path = gguf.path();
        let unsupported = |what: String| {
            EngineError::from(TokenizerError::Unsupported {
                path: path.to_path_buf(),
                what,
            })
        };
        let invalid = |what: String| {
            EngineError::from(TokenizerError::Invalid {
                path: path.to_path_buf(),
                what,
            })
        };

        let model = gguf.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(unsupported(format!(
                "tokenizer.ggml.model = '{model}'; only 'gpt2' (byte-level BPE) is supported{}",
                if model == "llama" {
                    " ('llama' is SentencePiece)"
                } else {
                    ""
                }
            )));
        }
        let pre_name = gguf.get_str_opt("tokenizer.ggml.pre")?.unwrap_or("default");
        let pre = Pre::from_name(pre_name).ok_or_else(|| {
            unsupported(format!(
                "tokenizer.ggml.pre = '{pre_name}'; supported: {}",
                SUPPORTED_PRE.join(", ")
            ))
        })?;

        let tokens = gguf.get_string_array("tokenizer.ggml.tokens")?.to_vec();
        let n = tokens.len();
        if n == 0 || u32::try_from(n).is_err() {
            return Err(invalid(format!(
                "tokenizer.ggml.tokens has {n} entries (allowed 1..=4294967295)"
            )));
        }
        let types = match gguf.get("tokenizer.ggml.token_type") {
            None => vec![TokenType::Normal; n],
            Some(_) => {
                let raw = gguf.get_i32_array("tokenizer.ggml.token_type")?;
                if raw.len() != n {
                    return Err(invalid(format!(
                        "tokenizer.ggml.token_type has {} entries but tokenizer.ggml.tokens has {n}",
                        raw.len()
                    )));
                }
                raw.iter()
                    .enumerate()
                    .map(|(i, &t)| {
                        TokenType::from_id(t).ok_or_else(|| {
                            invalid(format!(
                                "tokenizer.ggml.token_type[{i}] = {t} (allowed 0..=6)"
                            ))
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
        };
        let merges = gguf
            .get_string_array("tokenizer.ggml.merges")?
            .iter()
            .enumerate()
            .map(|(i, m)| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_owned(), b.to_owned()))
                    .ok_or_else(|| {
                        invalid(format!(
                            "tokenizer.ggml.merges[{i}] = {m:?} is not two tokens separated by a space"
                        ))
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;

        let special_id = |key: &str| -> Result<Option<u32>, EngineError> {
            match gguf.get_u32_opt(key)? {
                Some(id) if id as usize >= n => Err(invalid(format!(
                    "{key} = {id} is outside the vocabulary of {n} tokens"
                ))),
                other => Ok(other),
            }
        };
        let bos = special_id("tokenizer.ggml.bos_token_id")?;
        let eos = special_id("tokenizer.ggml.eos_token_id")?;
        let eot = special_id("tokenizer.ggml.eot_token_id")?;
        let unk = special_id("tokenizer.ggml.unknown_token_id")?;
        let pad = special_id("tokenizer.ggml.padding_token_id")?;
        let add_bos = gguf
            .get_bool_opt("tokenizer.ggml.add_bos_token")?
            .unwrap_or(false);

        let mut vocab = Vocab::with_capacity(n);
        for (id, t) in tokens.iter().enumerate() {
            vocab.entry(t.clone()).or_insert(id as u32);
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(pre == Pre::Llama3)
            .build()
            .map_err(|e| invalid(format!("the BPE model cannot be built: {e}")))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(pre.build().map_err(&invalid)?));
        let added: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter_map(|(t, ty)| match ty {
                TokenType::Control | TokenType::Unknown => {
                    Some(AddedToken::from(t.clone(), true).normalized(false))
                }
                TokenType::UserDefined => {
                    Some(AddedToken::from(t.clone(), false).normalized(false))
                }
                _ => None,
            })
            .collect();
        inner.add_special_tokens(&added);

        let chars = byte_chars();
        let char_byte: HashMap<char, u8> = chars
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        let pieces = tokens
            .iter()
            .zip(&types)
            .map(|(t, ty)| match ty {
                TokenType::Control | TokenType::Unknown | TokenType::UserDefined => {
                    t.as_bytes().to_vec()
                }
                TokenType::Byte => parse_byte_token(t)
                    .map(|b| vec![b])
                    .unwrap_or_else(|| t.as_bytes().to_vec()),
                TokenType::Normal | TokenType::Undefined | TokenType::Unused => {
                    let mut out = Vec::with_capacity(t.len());
                    for c in t.chars() {
                        match char_byte.get(&c) {
                            Some(&b) => out.push(b),
                            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                        }
                    }
                    out
                }
            })
            .collect();

        Ok(Tokenizer {
            inner,
            tokens,
            types,
            pieces,
            bos,
            eos,
            eot,
            unk,
            pad,
            add_bos,
        })
    }

    /// Token ids of `text`. No BOS is added; special tokens written in the
    /// text (`<|im_start|>`) become their ids.
    ///
    /// # Errors
    /// [`TokenizerError::Encode`] when the BPE implementation fails.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.inner
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError::Encode {
                text_len: text.len(),
                reason: e.to_string(),
            })
    }

    /// The text of `ids` (special tokens rendered as their text). Bytes that
    /// do not form valid UTF-8, and ids outside the vocabulary, become U+FFFD.
    #[must_use]
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.decode_piece(id).unwrap_or("\u{FFFD}".as_bytes()));
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The raw bytes token `id` stands for (possibly part of a UTF-8
    /// sequence), or `None` outside the vocabulary.
    #[must_use]
    pub fn decode_piece(&self, id: u32) -> Option<&[u8]> {
        self.pieces.get(id as usize).map(Vec::as_slice)
    }

    /// A decoder that turns ids into text one at a time.
    #[must_use]
    pub fn stream_decoder(&self) -> StreamDecoder {
        StreamDecoder::default()
    }

    /// Number of tokens in the vocabulary.
    #[must_use]
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The vocabulary entry of `id` as stored in the file (byte-level
    /// encoded: a space is `Ġ`).
    #[must_use]
    pub fn token_str(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The id of the vocabulary entry `token` (as stored in the file).
    #[must_use]
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The type of token `id`.
    #[must_use]
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    /// `tokenizer.ggml.bos_token_id`.
    #[must_use]
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// `tokenizer.ggml.eos_token_id`.
    #[must_use]
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// `tokenizer.ggml.unknown_token_id`.
    #[must_use]
    pub fn unk_id(&self) -> Option<u32> {
        self.unk
    }

    /// `tokenizer.ggml.padding_token_id`.
    #[must_use]
    pub fn pad_id(&self) -> Option<u32> {
        self.pad
    }

    /// Whether generation should stop at `id` (the EOS or end-of-turn token).
    #[must_use]
    pub fn is_end_of_generation(&self, id: u32) -> bool {
        Some(id) == self.eos || Some(id) == self.eot
    }

    /// `tokenizer.ggml.add_bos_token` (false when absent): whether a prompt
    /// should start with BOS. [`Tokenizer::encode`] never adds it itself.
    #[must_use]
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }
}

/// Turns token ids into text incrementally: each [`StreamDecoder::push`]
/// returns the text that is complete so far, holding back the start of a
/// UTF-8 sequence whose remaining bytes are in later tokens. The
/// concatenation of every `push` and the final [`StreamDecoder::finish`]
/// equals [`Tokenizer::decode`] of all the ids.
#[derive(Debug, Clone, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    /// Adds token `id` and returns the newly complete text.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        self.push_bytes(tokenizer.decode_piece(id).unwrap_or("\u{FFFD}".as_bytes()))
    }

    /// Adds raw bytes and returns the newly complete text.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    // `valid` is valid UTF-8 by construction.
                    out.push_str(std::str::from_utf8(valid).unwrap_or_default());
                    match e.error_len() {
                        // An invalid sequence: one U+FFFD, as from_utf8_lossy does.
                        Some(len) => {
                            out.push('\u{FFFD}');
                            rest = &after[len..];
                        }
                        // An incomplete sequence at the end: wait for more bytes.
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }

    /// Ends the stream: an incomplete sequence still held back becomes U+FFFD.
    #[must_use]
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
}
