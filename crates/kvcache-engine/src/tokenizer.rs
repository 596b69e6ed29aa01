//! SmolLM2's tokenizer, rebuilt from the vocabulary and merges embedded in the
//! GGUF (GPT-2 byte-level BPE, digits split one by one, no prefix space), and the
//! ChatML chat template.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper, Tokenizer};

use crate::{EngineError, Result};

/// GGUF token type of control tokens (`<|im_start|>` and friends).
const TOKEN_TYPE_CONTROL: i32 = 3;

/// A byte-level BPE tokenizer that understands ChatML's special tokens.
#[derive(Clone)]
pub struct ChatTokenizer {
    inner: Tokenizer,
    bos: u32,
    eos: u32,
    vocab_size: usize,
}

impl std::fmt::Debug for ChatTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

fn tok_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Tokenizer(e.to_string())
}

impl ChatTokenizer {
    /// Builds the tokenizer from a GGUF header's `tokenizer.ggml.*` keys.
    pub fn from_gguf_metadata(md: &HashMap<String, Value>) -> Result<Self> {
        let get = |key: &str| {
            md.get(key)
                .ok_or_else(|| EngineError::Format(format!("missing metadata key {key}")))
        };
        let model = get("tokenizer.ggml.model")?.to_string().map_err(tok_err)?;
        if model != "gpt2" {
            return Err(EngineError::Format(format!(
                "tokenizer model {model:?} is not GPT-2 byte-level BPE"
            )));
        }
        let strings = |key: &str| -> Result<Vec<String>> {
            get(key)?
                .to_vec()
                .map_err(tok_err)?
                .iter()
                .map(|v| v.to_string().cloned().map_err(tok_err))
                .collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?;
        let types: Vec<i32> = match md.get("tokenizer.ggml.token_type") {
            Some(v) => v
                .to_vec()
                .map_err(tok_err)?
                .iter()
                .map(|t| t.to_i32().map_err(tok_err))
                .collect::<Result<_>>()?,
            None => vec![1; tokens.len()],
        };
        let id_of = |key: &str| -> Result<u32> { get(key)?.to_u32().map_err(tok_err) };
        let bos = id_of("tokenizer.ggml.bos_token_id")?;
        let eos = id_of("tokenizer.ggml.eos_token_id")?;
        let specials: Vec<String> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &t)| t == TOKEN_TYPE_CONTROL)
            .map(|(s, _)| s.clone())
            .collect();
        Self::from_parts(tokens, &merges, &specials, bos, eos)
    }

    /// Builds the tokenizer from its parts: `tokens[id]` is the byte-level string
    /// of token `id`, each merge is `"left right"`, `specials` are matched verbatim
    /// in the input before BPE runs.
    pub fn from_parts(
        tokens: Vec<String>,
        merges: &[String],
        specials: &[String],
        bos: u32,
        eos: u32,
    ) -> Result<Self> {
        let vocab_size = tokens.len();
        let vocab: ahash::AHashMap<String, u32> = tokens.into_iter().zip(0u32..).collect();
        let merges = merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| EngineError::Format(format!("merge {m:?} has no space")))
            })
            .collect::<Result<Vec<_>>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(tok_err)?;
        let mut inner = Tokenizer::new(bpe);
        let pre: Vec<PreTokenizerWrapper> =
            vec![Digits::new(true).into(), ByteLevel::new(false, true, true).into()];
        inner.with_pre_tokenizer(Some(Sequence::new(pre)));
        inner.with_decoder(Some(ByteLevel::default()));
        inner
            .add_special_tokens(specials.iter().map(|s| AddedToken::from(s.clone(), true)))
            .map_err(tok_err)?;
        Ok(ChatTokenizer {
            inner,
            bos,
            eos,
            vocab_size,
        })
    }

    /// Token ids of `text`; special tokens written in the text (`<|im_start|>`)
    /// become their ids. Adds nothing at the start or end.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .inner
            .encode_fast(text, false)
            .map_err(tok_err)?
            .get_ids()
            .to_vec())
    }

    /// Token ids of a chat of one user message, ending with the assistant's
    /// turn opened: what a model is prompted with to answer `user`.
    pub fn encode_user(&self, user: &str) -> Result<Vec<u32>> {
        self.encode(&chatml(&[Message::new(Role::User, user)], true))
    }

    /// The text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(tok_err)
    }

    /// The beginning-of-sequence id (`<|im_start|>` for SmolLM2).
    pub fn bos_token_id(&self) -> u32 {
        self.bos
    }

    /// The end-of-sequence id (`<|im_end|>` for SmolLM2).
    pub fn eos_token_id(&self) -> u32 {
        self.eos
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }
}

/// Who speaks a chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The system prompt.
    System,
    /// The user.
    User,
    /// The model.
    Assistant,
}

impl Role {
    /// The role's name in ChatML.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Who speaks.
    pub role: Role,
    /// What is said.
    pub content: String,
}

impl Message {
    /// A message of `role` saying `content`.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Message {
            role,
            content: content.into(),
        }
    }
}

/// SmolLM2's default system prompt, used when a chat starts without one.
pub const DEFAULT_SYSTEM_PROMPT: &str =
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

/// Renders `messages` with SmolLM2's ChatML template:
/// `<|im_start|>{role}\n{content}<|im_end|>\n` per message (with the default
/// system prompt first when the chat has none), then `<|im_start|>assistant\n`
/// when `add_generation_prompt`.
///
/// ```
/// use kvcache_engine::tokenizer::{chatml, Message, Role};
///
/// let text = chatml(&[Message::new(Role::System, "Be brief."), Message::new(Role::User, "Hi")], true);
/// assert_eq!(
///     text,
///     "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
/// );
/// ```
pub fn chatml(messages: &[Message], add_generation_prompt: bool) -> String {
    let mut out = String::new();
    if messages.first().is_none_or(|m| m.role != Role::System) {
        push_message(&mut out, Role::System, DEFAULT_SYSTEM_PROMPT);
    }
    for m in messages {
        push_message(&mut out, m.role, &m.content);
    }
    if add_generation_prompt {
        out.push_str("<|im_start|>assistant\n");
    }
    out
}

fn push_message(out: &mut String, role: Role, content: &str) {
    out.push_str("<|im_start|>");
    out.push_str(role.as_str());
    out.push('\n');
    out.push_str(content);
    out.push_str("<|im_end|>\n");
}
