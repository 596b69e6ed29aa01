//! One request's way through the server: its options checked and turned
//! into a [`Job`], then the engine's events for it turned into pieces of the
//! answer. The text is the engine's (whole UTF-8 characters, control tokens
//! left out, stop sequences cut): the server renders what it is told.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::Instant;

use kvcache_api::Namespace;
use kvcache_engine::sampling::{Sampler, SamplingOptions, SamplingParams, TokenLogprobs};
use tokio::sync::mpsc;

use crate::access::AccessRecord;
use crate::error::ApiError;
use crate::openai::{ChatRequest, CompletionRequest, GenerationOptions, Usage};
use crate::worker::{Job, JobEvent};
use crate::AppState;

/// Most stop sequences a request may give (OpenAI's limit).
const MAX_STOPS: usize = 4;

/// A request's options, checked.
#[derive(Debug, Clone)]
pub struct Checked {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Bias, penalties and log-probabilities.
    pub options: SamplingOptions,
    /// Stop sequences.
    pub stops: Vec<String>,
    /// Generate past the end-of-turn tokens.
    pub ignore_eos: bool,
    /// Tokens generated before a stop may end the answer.
    pub min_tokens: usize,
    /// More tokens that end the answer.
    pub stop_token_ids: Vec<u32>,
    /// The tenant's namespace.
    pub namespace: Namespace,
    /// Stream as server-sent events.
    pub stream: bool,
    /// Send a usage chunk at the end of a stream.
    pub include_usage: bool,
}

/// A 400 naming `param`: it would change the answer and is not implemented.
fn unsupported(param: &str, what: &str) -> ApiError {
    ApiError::invalid(Some(param), format!("{what} is not supported by this server"))
        .with_code("unsupported_parameter")
}

fn is_empty_list(v: &serde_json::Value) -> bool {
    v.is_null() || v.as_array().is_some_and(Vec::is_empty)
}

fn is_none_choice(v: &serde_json::Value) -> bool {
    v.is_null() || v.as_str() == Some("none")
}

/// Refuses the chat fields that would change the answer but are not
/// implemented, naming the first one found.
pub fn refuse_unsupported_chat(req: &ChatRequest) -> Result<(), ApiError> {
    if let Some(f) = &req.response_format {
        if !(f.is_null() || f.get("type").and_then(|t| t.as_str()) == Some("text")) {
            return Err(unsupported(
                "response_format",
                "A response_format other than text",
            ));
        }
    }
    if req.tools.as_ref().is_some_and(|v| !is_empty_list(v)) {
        return Err(unsupported("tools", "Tool calling"));
    }
    if req.tool_choice.as_ref().is_some_and(|v| !is_none_choice(v)) {
        return Err(unsupported("tool_choice", "Tool calling"));
    }
    if req.functions.as_ref().is_some_and(|v| !is_empty_list(v)) {
        return Err(unsupported("functions", "Function calling"));
    }
    if req.function_call.as_ref().is_some_and(|v| !is_none_choice(v)) {
        return Err(unsupported("function_call", "Function calling"));
    }
    if let Some(m) = &req.modalities {
        let text_only = m.is_null() || *m == serde_json::json!(["text"]);
        if !text_only {
            return Err(unsupported("modalities", "Output other than text"));
        }
    }
    if req.audio.as_ref().is_some_and(|a| !a.is_null()) {
        return Err(unsupported("audio", "Audio output"));
    }
    if req.top_logprobs.is_some() && req.logprobs != Some(true) {
        return Err(ApiError::invalid(
            Some("top_logprobs"),
            "top_logprobs requires logprobs to be true",
        ));
    }
    Ok(())
}

/// Which API a request came through: some of vLLM's extensions belong to
/// one of them only, or have another default there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completion,
}

/// vLLM's extension fields this server does not implement, each with the
/// values that leave the answer as it is (`null` always does): a request
/// that gives one any other value is refused with a 400 naming it. The
/// endpoint, where given, is the only one vLLM reads the field on.
const VLLM_REFUSED: &[(&str, Option<Endpoint>, &[&str])] = &[
    ("use_beam_search", None, &["false"]),
    ("best_of", Some(Endpoint::Chat), &["1"]),
    ("length_penalty", None, &["1"]),
    ("repetition_penalty", None, &["1"]),
    ("include_stop_str_in_output", None, &["false"]),
    ("skip_special_tokens", None, &["true"]),
    ("spaces_between_special_tokens", None, &["true"]),
    ("truncate_prompt_tokens", None, &[]),
    ("prompt_logprobs", None, &[]),
    ("bad_words", None, &["[]"]),
    ("allowed_token_ids", None, &[]),
    ("logits_processors", None, &[]),
    ("return_tokens_as_token_ids", None, &["false"]),
    ("return_token_ids", None, &["false"]),
    ("guided_json", None, &[]),
    ("guided_regex", None, &[]),
    ("guided_choice", None, &[]),
    ("guided_grammar", None, &[]),
    ("guided_decoding_backend", None, &[]),
    ("guided_whitespace_pattern", None, &[]),
    ("structured_outputs", None, &[]),
    ("priority", None, &["0"]),
    ("request_id", None, &[]),
    ("mm_processor_kwargs", None, &[]),
    ("kv_transfer_params", None, &[]),
    ("vllm_xargs", None, &[]),
    ("add_special_tokens", Some(Endpoint::Chat), &["false"]),
    ("add_special_tokens", Some(Endpoint::Completion), &["true"]),
    ("echo", Some(Endpoint::Chat), &["false"]),
    ("add_generation_prompt", Some(Endpoint::Chat), &["true"]),
    ("continue_final_message", Some(Endpoint::Chat), &["false"]),
    ("documents", Some(Endpoint::Chat), &[]),
    ("chat_template", Some(Endpoint::Chat), &[]),
    ("chat_template_kwargs", Some(Endpoint::Chat), &[]),
    ("media_io_kwargs", Some(Endpoint::Chat), &[]),
    (
        "response_format",
        Some(Endpoint::Completion),
        &[r#"{"type":"text"}"#],
    ),
    ("prompt_embeds", Some(Endpoint::Completion), &[]),
];

/// Whether `value` is one of `defaults` (JSON texts; numbers compared as
/// numbers, so `1` and `1.0` are one value) or `null`.
fn is_default(value: &serde_json::Value, defaults: &[&str]) -> bool {
    value.is_null()
        || defaults.iter().any(|d| {
            let d: serde_json::Value = serde_json::from_str(d).expect("a JSON default");
            match (value.as_f64(), d.as_f64()) {
                (Some(a), Some(b)) => a == b,
                _ => *value == d,
            }
        })
}

/// Refuses vLLM's extension fields this server does not implement
/// (the table `VLLM_REFUSED`) unless at their defaults, naming the first one found;
/// `others` are the request's fields no struct names.
pub fn refuse_vllm_extensions(
    others: &serde_json::Map<String, serde_json::Value>,
    endpoint: Endpoint,
) -> Result<(), ApiError> {
    for &(name, only, defaults) in VLLM_REFUSED {
        if only.is_some_and(|e| e != endpoint) {
            continue;
        }
        if let Some(value) = others.get(name).filter(|v| !is_default(v, defaults)) {
            let default = match defaults.first() {
                Some(d) => format!("{d} or null"),
                None => "null".to_string(),
            };
            return Err(ApiError::invalid(
                Some(name),
                format!(
                    "{name} = {value} is not supported by this server (a vLLM extension it does not \
                     implement; only {default} is accepted)"
                ),
            )
            .with_code("unsupported_parameter"));
        }
    }
    Ok(())
}

/// Refuses the completions fields that would change the answer but are not
/// implemented, naming the first one found.
pub fn refuse_unsupported_completion(req: &CompletionRequest) -> Result<(), ApiError> {
    if req.echo == Some(true) {
        return Err(unsupported("echo", "echo"));
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(unsupported("suffix", "suffix"));
    }
    if req.best_of.is_some_and(|n| n != 1) {
        return Err(unsupported("best_of", "best_of other than 1"));
    }
    if req.logprobs.is_some_and(|n| n > 5) {
        return Err(ApiError::invalid(Some("logprobs"), "logprobs must lie in 0..=5"));
    }
    Ok(())
}

/// Checks `options` for a prompt of `prompt` tokens served under `model`;
/// `logprobs` asks for the tokens' log-probabilities and this many
/// alternatives; `prompt_param` names the prompt's field in errors.
pub fn check(
    state: &AppState,
    model: &str,
    prompt: Vec<u32>,
    options: GenerationOptions,
    max_tokens: Option<u64>,
    logprobs: Option<usize>,
    prompt_param: &str,
) -> Result<Checked, ApiError> {
    if model != state.config.model_name {
        return Err(ApiError::unknown_model(model));
    }
    if prompt.is_empty() {
        return Err(ApiError::invalid(Some("prompt"), "The prompt is empty"));
    }
    let vocab = state.tokenizer.vocab_size() as u32;
    if let Some(bad) = prompt.iter().find(|&&t| t >= vocab) {
        return Err(ApiError::invalid(
            Some("prompt"),
            format!("Token id {bad} is outside the vocabulary of {vocab} tokens"),
        ));
    }
    let context = state.config.context;
    // One position is left for the first generated token.
    if prompt.len() + 1 > context {
        return Err(ApiError::invalid(
            Some(prompt_param),
            format!(
                "This model's maximum context length is {context} tokens; the prompt has {} tokens",
                prompt.len()
            ),
        )
        .with_code("context_length_exceeded"));
    }
    if options.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid(Some("n"), "Only n = 1 is supported"));
    }
    let max_tokens = match max_tokens.or(options.max_tokens) {
        Some(0) => {
            return Err(ApiError::invalid(
                Some("max_tokens"),
                "max_tokens must be at least 1",
            ))
        }
        Some(n) => {
            let n = usize::try_from(n).unwrap_or(usize::MAX);
            if n > context - prompt.len() {
                return Err(ApiError::invalid(
                    Some("max_tokens"),
                    format!(
                        "This model's maximum context length is {context} tokens; the prompt has {} \
                         tokens and max_tokens asks for {n} more",
                        prompt.len()
                    ),
                )
                .with_code("context_length_exceeded"));
            }
            n
        }
        // Not given: the default, within the context.
        None => state.config.default_max_tokens.min(context - prompt.len()),
    };
    let sampling = SamplingParams {
        temperature: options.temperature.unwrap_or(1.0),
        top_p: options.top_p.unwrap_or(1.0),
        seed: options.seed.map(|s| s as u64),
    };
    if let Err(e) = sampling.validate() {
        let param = if (0.0..=2.0).contains(&sampling.temperature) {
            "top_p"
        } else {
            "temperature"
        };
        return Err(ApiError::invalid(Some(param), e.to_string()));
    }
    let mut logit_bias = Vec::new();
    for (key, value) in options.logit_bias.iter().flatten() {
        let token = key.parse::<u32>().ok().filter(|&t| t < vocab).ok_or_else(|| {
            ApiError::invalid(
                Some("logit_bias"),
                format!("logit_bias key `{key}` is not a token id below {vocab}"),
            )
        })?;
        let bias = value
            .as_f64()
            .filter(|b| (-100.0..=100.0).contains(b))
            .ok_or_else(|| {
                ApiError::invalid(
                    Some("logit_bias"),
                    format!("logit_bias of token {key} must be a number in -100..=100"),
                )
            })?;
        logit_bias.push((token, bias as f32));
    }
    let top_k = match options.top_k {
        None | Some(-1) | Some(0) => None,
        Some(k) if k > 0 => Some(usize::try_from(k).unwrap_or(usize::MAX)),
        Some(k) => {
            return Err(ApiError::invalid(
                Some("top_k"),
                format!("top_k {k} must be -1 or 0 (every token) or at least 1"),
            ))
        }
    };
    let min_p = options.min_p.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(ApiError::invalid(
            Some("min_p"),
            format!("min_p {min_p} must lie in 0..=1"),
        ));
    }
    let sampling_options = SamplingOptions {
        presence_penalty: options.presence_penalty.unwrap_or(0.0),
        frequency_penalty: options.frequency_penalty.unwrap_or(0.0),
        logit_bias,
        logprobs,
        top_k,
        min_p,
    };
    for (param, v) in [
        ("presence_penalty", sampling_options.presence_penalty),
        ("frequency_penalty", sampling_options.frequency_penalty),
    ] {
        if !(-2.0..=2.0).contains(&v) {
            return Err(ApiError::invalid(
                Some(param),
                format!("{param} {v} must lie in -2..=2"),
            ));
        }
    }
    if let Err(e) = sampling_options.validate() {
        let param = if sampling_options.logit_bias.is_empty() {
            "top_logprobs"
        } else {
            "logit_bias"
        };
        return Err(ApiError::invalid(Some(param), e.to_string()));
    }
    let stops = options.stop.map(|s| s.into_vec()).unwrap_or_default();
    if stops.len() > MAX_STOPS {
        return Err(ApiError::invalid(
            Some("stop"),
            format!("At most {MAX_STOPS} stop sequences"),
        ));
    }
    if let Some(i) = stops.iter().position(String::is_empty) {
        return Err(ApiError::invalid(
            Some("stop"),
            format!("stop sequence {i} is empty: an empty string would match before any text"),
        ));
    }
    let min_tokens = usize::try_from(options.min_tokens.unwrap_or(0)).unwrap_or(usize::MAX);
    if min_tokens > max_tokens {
        return Err(ApiError::invalid(
            Some("min_tokens"),
            format!("min_tokens {min_tokens} must not exceed max_tokens {max_tokens}"),
        ));
    }
    let stop_token_ids = options.stop_token_ids.unwrap_or_default();
    if let Some(bad) = stop_token_ids.iter().find(|&&t| t >= vocab) {
        return Err(ApiError::invalid(
            Some("stop_token_ids"),
            format!("Token id {bad} is outside the vocabulary of {vocab} tokens"),
        ));
    }
    let namespace = Namespace::from_salt(options.cache_salt.as_deref())
        .map_err(|e| ApiError::invalid(Some("cache_salt"), e.to_string()))?;
    Ok(Checked {
        ignore_eos: options.ignore_eos.unwrap_or(false),
        min_tokens,
        stop_token_ids,
        max_tokens,
        prompt,
        sampling,
        options: sampling_options,
        stops,
        namespace,
        stream: options.stream,
        include_usage: options.stream_options.is_some_and(|o| o.include_usage),
    })
}

/// What a generation yields.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// More text, and the log-probabilities of the tokens that made it (when
    /// asked for; a piece may carry tokens whose text came earlier or is
    /// held back).
    Text(String, Vec<TokenLogprobs>),
    /// The end: why, and the token counts.
    End {
        /// `stop` or `length`.
        finish_reason: &'static str,
        /// Token counts.
        usage: Usage,
    },
}

/// A request running on the engine; dropping it cancels it there.
pub struct Generation {
    events: Option<mpsc::UnboundedReceiver<JobEvent>>,
    state: AppState,
    prompt_tokens: usize,
    /// Tokens generated so far, those the text leaves out too.
    completion_tokens: usize,
    started: Instant,
    cached_tokens: usize,
    pending: VecDeque<Piece>,
    ended: bool,
    /// Log-probabilities of tokens whose text has not come yet.
    logprobs: Vec<TokenLogprobs>,
    /// Where the access log line learns the request's counts.
    record: AccessRecord,
}

impl std::fmt::Debug for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generation")
            .field("prompt_tokens", &self.prompt_tokens)
            .field("completion_tokens", &self.completion_tokens)
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

impl Generation {
    /// Submits `checked` to the engine; refuses with 503 when the queue is full.
    pub fn start(
        state: &AppState,
        checked: Checked,
        started: Instant,
        record: AccessRecord,
    ) -> Result<Generation, ApiError> {
        record.prompt(checked.prompt.len());
        let limit = state.config.max_sequences + state.config.max_queue;
        let in_flight = state.metrics.in_flight.fetch_add(1, Ordering::SeqCst);
        if in_flight >= limit {
            state.metrics.in_flight.fetch_sub(1, Ordering::SeqCst);
            state.metrics.overloaded.fetch_add(1, Ordering::Relaxed);
            return Err(ApiError::overloaded(in_flight));
        }
        // From here on, `Drop` gives the in-flight place back.
        let (tx, rx) = mpsc::unbounded_channel();
        let generation = Generation {
            events: Some(rx),
            state: state.clone(),
            prompt_tokens: checked.prompt.len(),
            completion_tokens: 0,
            started,
            cached_tokens: 0,
            pending: VecDeque::new(),
            ended: false,
            logprobs: Vec::new(),
            record,
        };
        let sampler = Sampler::with_options(checked.sampling, checked.options)
            .map_err(|e| ApiError::invalid(None, e.to_string()))?;
        let job = Job {
            prompt: checked.prompt,
            max_tokens: checked.max_tokens,
            namespace: checked.namespace,
            stop: checked.stops,
            ignore_eos: checked.ignore_eos,
            min_tokens: checked.min_tokens,
            stop_token_ids: checked.stop_token_ids,
            sampler,
            events: tx,
        };
        if !state.worker.submit(job) {
            tracing::error!("a request came after the engine thread had stopped");
            return Err(ApiError::internal("The engine has stopped"));
        }
        state.metrics.requests.fetch_add(1, Ordering::Relaxed);
        Ok(generation)
    }

    /// The next piece; `None` after the end.
    pub async fn next(&mut self) -> Option<Result<Piece, ApiError>> {
        loop {
            if let Some(piece) = self.pending.pop_front() {
                return Some(Ok(piece));
            }
            if self.ended {
                return None;
            }
            let event = match self.events.as_mut() {
                Some(events) => events.recv().await,
                None => None,
            };
            match event {
                None => {
                    self.ended = true;
                    return Some(Err(ApiError::internal("The engine dropped the request")));
                }
                Some(JobEvent::Started {
                    cached_tokens,
                    waited,
                }) => {
                    self.cached_tokens = cached_tokens;
                    self.state.metrics.observe_queue_wait(waited);
                }
                Some(JobEvent::Token { text, logprobs }) => self.token(text, logprobs),
                Some(JobEvent::Finished { reason }) => self.end(reason.openai()),
                Some(JobEvent::Failed(message)) => {
                    self.ended = true;
                    return Some(Err(ApiError::internal(message)));
                }
            }
        }
    }

    /// A generated token: counted, and its text queued with the
    /// log-probabilities of the tokens that made it (a token whose text is
    /// held back hands its log-probabilities on to the next piece).
    fn token(&mut self, text: String, logprobs: Option<TokenLogprobs>) {
        if self.completion_tokens == 0 {
            let ttft = self.started.elapsed();
            self.state.metrics.observe_ttft(ttft);
            self.record.first_token(ttft);
        }
        self.completion_tokens += 1;
        self.record.generated(self.completion_tokens);
        self.logprobs.extend(logprobs);
        if !text.is_empty() {
            let logprobs = std::mem::take(&mut self.logprobs);
            self.pending.push_back(Piece::Text(text, logprobs));
        }
    }

    /// Ends the answer: the log-probabilities not yet handed out, then the end.
    fn end(&mut self, finish_reason: &'static str) {
        if !self.logprobs.is_empty() {
            let logprobs = std::mem::take(&mut self.logprobs);
            self.pending.push_back(Piece::Text(String::new(), logprobs));
        }
        self.ended = true;
        let usage = Usage::new(self.prompt_tokens, self.completion_tokens, self.cached_tokens);
        self.record.finished(&usage, finish_reason);
        self.pending.push_back(Piece::End { finish_reason, usage });
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        self.state.metrics.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}
