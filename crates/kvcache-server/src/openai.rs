//! The request and response bodies of OpenAI's chat completions and
//! completions APIs, as far as this server implements them. Known fields of
//! the wrong type are a 400; fields that would change the answer but are not
//! implemented (`response_format` other than text, `tools`, `echo`, ...) are
//! kept as raw JSON here and refused with a 400 naming them
//! ([`crate::generation::refuse_unsupported_chat`],
//! [`crate::generation::refuse_unsupported_completion`]). Of vLLM's
//! extensions, `ignore_eos`, `min_tokens`, `top_k`, `min_p`,
//! `stop_token_ids` and `cache_salt` are honoured; every other one is
//! refused with a 400 naming it unless it has its default value
//! ([`crate::generation::refuse_vllm_extensions`]). Other unknown fields
//! (`user`, `metadata`, `store`, `service_tier`, ...) do not change the
//! answer and are ignored.

use serde::{Deserialize, Serialize};

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The model to use.
    pub model: String,
    /// The conversation so far.
    pub messages: Vec<ChatMessage>,
    /// The shared generation options.
    #[serde(flatten)]
    pub options: GenerationOptions,
    /// Newer name of `max_tokens`.
    pub max_completion_tokens: Option<u64>,
    /// Return the log-probability of each generated token.
    pub logprobs: Option<bool>,
    /// With `logprobs`: this many most likely alternatives per token (0..=20).
    pub top_logprobs: Option<u32>,
    /// Not implemented unless `{"type": "text"}`.
    pub response_format: Option<serde_json::Value>,
    /// Not implemented (400 unless empty).
    pub tools: Option<serde_json::Value>,
    /// Not implemented (400 unless `none`).
    pub tool_choice: Option<serde_json::Value>,
    /// Not implemented (400 unless empty).
    pub functions: Option<serde_json::Value>,
    /// Not implemented (400 unless `none`).
    pub function_call: Option<serde_json::Value>,
    /// Not implemented (400 unless `["text"]`).
    pub modalities: Option<serde_json::Value>,
    /// Not implemented (400).
    pub audio: Option<serde_json::Value>,
}

/// One message of a chat.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    /// `system`, `developer`, `user` or `assistant`.
    pub role: String,
    /// Text, or text parts.
    #[serde(default)]
    pub content: Option<MessageContent>,
}

/// A message's content: a string or a list of parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Parts; only text parts are accepted.
    Parts(Vec<ContentPart>),
}

/// One part of a message's content.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// The part's type (`text`).
    #[serde(rename = "type")]
    pub kind: String,
    /// Its text.
    #[serde(default)]
    pub text: Option<String>,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The model to use.
    pub model: String,
    /// Text or token ids (one prompt).
    pub prompt: Prompt,
    /// The shared generation options.
    #[serde(flatten)]
    pub options: GenerationOptions,
    /// Return the log-probability of each generated token and of this many
    /// most likely alternatives (0..=5).
    pub logprobs: Option<u32>,
    /// Not implemented (400 when true).
    pub echo: Option<bool>,
    /// Not implemented (400 unless empty).
    pub suffix: Option<String>,
    /// Not implemented (400 unless 1).
    pub best_of: Option<u32>,
}

/// A completion prompt in any of OpenAI's four shapes.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// One text.
    Text(String),
    /// One prompt as token ids.
    Tokens(Vec<u32>),
    /// Several texts (only one is accepted).
    Texts(Vec<String>),
    /// Several token-id prompts (only one is accepted).
    TokenLists(Vec<Vec<u32>>),
}

/// Options both endpoints share.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct GenerationOptions {
    /// Most tokens to generate.
    pub max_tokens: Option<u64>,
    /// 0 (greedy) to 2.
    pub temperature: Option<f32>,
    /// Nucleus sampling mass, in (0, 1].
    pub top_p: Option<f32>,
    /// Seed for reproducible sampling.
    pub seed: Option<i64>,
    /// Stop sequences: a string or up to 4 strings.
    pub stop: Option<Stop>,
    /// Stream the answer as server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Choices to generate; only 1 is supported.
    pub n: Option<u32>,
    /// The tenant's cache salt (vLLM's field): prefixes are shared only between
    /// requests with the same salt.
    pub cache_salt: Option<String>,
    /// Subtracted once from the logit of every token already generated (-2..=2).
    pub presence_penalty: Option<f32>,
    /// Subtracted from a token's logit per time it was generated (-2..=2).
    pub frequency_penalty: Option<f32>,
    /// Token id (as a string) to a bias in -100..=100 added to its logit.
    pub logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
    /// vLLM's: generate past the end-of-turn tokens (only `stop`,
    /// `stop_token_ids` and the length end the answer).
    pub ignore_eos: Option<bool>,
    /// vLLM's: tokens generated before a stop token or a stop sequence may
    /// end the answer (at most `max_tokens`).
    pub min_tokens: Option<u64>,
    /// vLLM's: sample among this many most likely tokens; -1 or 0: all.
    pub top_k: Option<i64>,
    /// vLLM's: sample among tokens at least this fraction (0..=1) as likely
    /// as the most likely one.
    pub min_p: Option<f32>,
    /// vLLM's: more tokens that end the answer, their text left out.
    pub stop_token_ids: Option<Vec<u32>>,
    /// Every field no struct here names: vLLM's other extensions, refused
    /// unless at their defaults ([`crate::generation::refuse_vllm_extensions`]),
    /// and OpenAI's that do not change the answer (`user`, `metadata`, ...),
    /// ignored.
    #[serde(flatten)]
    pub others: serde_json::Map<String, serde_json::Value>,
}

/// `stop`: one string or several.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop sequence.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl Stop {
    /// The stop sequences as a list.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` and no choices.
    #[serde(default)]
    pub include_usage: bool,
}

/// Token counts of a request (fields in alphabetical order, as on the wire:
/// see the response bodies below).
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct Usage {
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Of the prompt tokens, how many came from the cache.
    pub prompt_tokens_details: PromptTokensDetails,
    /// Their sum.
    pub total_tokens: usize,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose keys and values were reused from earlier requests.
    pub cached_tokens: usize,
}

impl Usage {
    /// Usage of a request of `prompt` tokens, `completion` generated, `cached` reused.
    pub fn new(prompt: usize, completion: usize, cached: usize) -> Self {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: cached,
            },
        }
    }
}

// The response bodies. serde_json writes an object's fields in their
// declaration order; these were written through `serde_json::json!`, whose
// maps sort their keys, so every struct declares its fields in alphabetical
// order and the bytes on the wire stay what they were. Log-probabilities are
// `f64` for the same reason: an `f32` would be written in its own shortest
// form, not the `f64` one clients have seen.

/// The object a whole chat answer is.
pub const CHAT_COMPLETION: &str = "chat.completion";
/// The object a streamed chat chunk is.
pub const CHAT_COMPLETION_CHUNK: &str = "chat.completion.chunk";
/// The object a completion and its chunks are.
pub const TEXT_COMPLETION: &str = "text_completion";

/// A whole answer, or one streamed chunk of it: `choices` of the endpoint's
/// kind ([`ChatChoice`], [`ChatChunkChoice`] or [`CompletionChoice`]).
#[derive(Debug, Clone, Serialize)]
pub struct Completion<'a, C> {
    /// The choices: one, or none in a stream's usage chunk.
    pub choices: Vec<C>,
    /// Unix seconds when the request arrived.
    pub created: u64,
    /// The answer's id (`chatcmpl-...` or `cmpl-...`).
    pub id: &'a str,
    /// The model that answered.
    pub model: &'a str,
    /// [`CHAT_COMPLETION`], [`CHAT_COMPLETION_CHUNK`] or [`TEXT_COMPLETION`].
    pub object: &'static str,
    /// Token counts: always in a whole answer, in a stream only in its
    /// usage chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// The one choice of a whole chat answer.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    /// `stop` or `length`.
    pub finish_reason: &'static str,
    /// Always 0 (`n` is 1).
    pub index: u32,
    /// The tokens' log-probabilities, `null` unless asked for.
    pub logprobs: Option<ChatLogprobs>,
    /// The assistant's message.
    pub message: AssistantMessage,
}

/// The answer of a chat.
#[derive(Debug, Clone, Serialize)]
pub struct AssistantMessage {
    /// The answer's text.
    pub content: String,
    /// `assistant`.
    pub role: &'static str,
}

/// The one choice of a streamed chat chunk.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunkChoice<'a> {
    /// What the chunk adds.
    pub delta: Delta<'a>,
    /// Set in the last chunk only.
    pub finish_reason: Option<&'static str>,
    /// Always 0.
    pub index: u32,
    /// The log-probabilities of the chunk's tokens, `null` unless asked for.
    pub logprobs: Option<ChatLogprobs>,
}

/// What a streamed chat chunk adds: the role first (with empty content),
/// then text, then nothing (the chunk with the finish reason).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Delta<'a> {
    /// Text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<&'a str>,
    /// `assistant`, in the first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
}

/// The one choice of a completion or of one of its streamed chunks.
#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice<'a> {
    /// `stop` or `length`; in a stream, set in the last chunk only.
    pub finish_reason: Option<&'static str>,
    /// Always 0.
    pub index: u32,
    /// The tokens' log-probabilities, `null` unless asked for.
    pub logprobs: Option<CompletionLogprobs>,
    /// The text (in a stream: the chunk's).
    pub text: std::borrow::Cow<'a, str>,
}

/// Chat's `logprobs`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatLogprobs {
    /// One per token.
    pub content: Vec<ChatTokenLogprob>,
    /// Always `null`.
    pub refusal: Option<String>,
}

/// One token of chat's `logprobs.content`.
#[derive(Debug, Clone, Serialize)]
pub struct ChatTokenLogprob {
    /// The token's bytes.
    pub bytes: Vec<u8>,
    /// Its log-probability.
    pub logprob: f64,
    /// The token as text (split characters escaped).
    pub token: String,
    /// The most likely alternatives, most likely first.
    pub top_logprobs: Vec<ChatTopLogprob>,
}

/// One alternative of [`ChatTokenLogprob::top_logprobs`].
#[derive(Debug, Clone, Serialize)]
pub struct ChatTopLogprob {
    /// The token's bytes.
    pub bytes: Vec<u8>,
    /// Its log-probability.
    pub logprob: f64,
    /// The token as text.
    pub token: String,
}

/// Completions' (legacy) `logprobs`: one entry per token in each list.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CompletionLogprobs {
    /// Characters of the answer before each token.
    pub text_offset: Vec<usize>,
    /// Each token's log-probability.
    pub token_logprobs: Vec<f64>,
    /// The tokens as text (`bytes:` and escapes for split characters).
    pub tokens: Vec<String>,
    /// The most likely alternatives of each, token to log-probability.
    pub top_logprobs: Vec<std::collections::BTreeMap<String, f64>>,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelList<'a> {
    /// The models served: one.
    pub data: Vec<ModelCard<'a>>,
    /// `list`.
    pub object: &'static str,
}

/// One model, as `GET /v1/models/{id}` answers it.
#[derive(Debug, Clone, Serialize)]
pub struct ModelCard<'a> {
    /// Always 0.
    pub created: u64,
    /// The model's name.
    pub id: &'a str,
    /// `model`.
    pub object: &'static str,
    /// `kvcache-rs`.
    pub owned_by: &'static str,
}

impl<'a> ModelCard<'a> {
    /// The card of the model served as `id`.
    pub fn new(id: &'a str) -> Self {
        ModelCard {
            created: 0,
            id,
            object: "model",
            owned_by: "kvcache-rs",
        }
    }
}

/// `GET /health` while the engine runs.
#[derive(Debug, Clone, Serialize)]
pub struct Health {
    /// Requests holding a sequence.
    pub active: usize,
    /// Cells held by at least one sequence.
    pub cells_in_use: usize,
    /// `ok`.
    pub status: &'static str,
}

/// `GET /health` once the engine thread has ended (with 503).
#[derive(Debug, Clone, Serialize)]
pub struct Unhealthy {
    /// Why.
    pub error: &'static str,
    /// `unavailable`.
    pub status: &'static str,
}

/// An error's body: `{"error": {...}}`.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorBody<'a> {
    /// The error.
    pub error: ErrorDetail<'a>,
}

/// What an [`ErrorBody`] says.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorDetail<'a> {
    /// A machine-readable code, or `null`.
    pub code: Option<&'a str>,
    /// What went wrong, for a person.
    pub message: &'a str,
    /// The request field at fault, or `null`.
    pub param: Option<&'a str>,
    /// OpenAI's error type.
    #[serde(rename = "type")]
    pub kind: &'a str,
}
