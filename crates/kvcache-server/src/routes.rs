//! The HTTP endpoints: OpenAI's chat completions, completions and models, and
//! `/health` and `/metrics`.

use std::convert::Infallible;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{header, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use futures_util::stream::{self, Stream};
use kvcache_engine::sampling::TokenLogprobs;
use kvcache_models::tokenizer::{Message, Role};
use kvcache_models::Tokenizer;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tower_http::request_id::{PropagateRequestIdLayer, SetRequestIdLayer};

use crate::access::{self, AccessRecord};
use crate::config::ApiKey;
use crate::error::ApiError;
use crate::generation::{
    check, refuse_unsupported_chat, refuse_unsupported_completion, refuse_vllm_extensions, Checked, Endpoint,
    Generation, Piece,
};
use crate::openai::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatLogprobs, ChatMessage, ChatRequest, ChatTokenLogprob,
    ChatTopLogprob, Completion, CompletionChoice, CompletionLogprobs, CompletionRequest, Delta, Health,
    MessageContent, ModelCard, ModelList, Prompt, Unhealthy, Usage, CHAT_COMPLETION, CHAT_COMPLETION_CHUNK,
    TEXT_COMPLETION,
};
use crate::AppState;

/// The server's routes over `state`, inside their middleware, outermost
/// first: tower-http's request-id layers (`x-request-id`), the access log
/// ([`access::layer`]), OpenAI-style JSON for axum's own refusals
/// (`json_errors`), and the key and body guard (`guard`).
///
/// The body's limit and timeout stay the guard's own, not tower-http's
/// `RequestBodyLimitLayer` and `TimeoutLayer`: a refused body is read and
/// dropped for a moment before the answer (so that a client still sending
/// it reads a 413 rather than a reset connection) and the answer says
/// `Connection: close` when it could not be; the limit layer answers
/// without reading. The timeout bounds the whole body, as a slow client
/// drips it; `TimeoutLayer` would bound the answer too (cutting long
/// generations), and `RequestBodyTimeoutLayer` only the gaps between
/// chunks. The accept loop's own timeouts are in [`crate::connections`].
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|uri: Uri| async move { ApiError::not_found(uri.path()) })
        .layer(axum::middleware::from_fn_with_state(state.clone(), guard))
        .layer(axum::middleware::from_fn(json_errors))
        .layer(axum::middleware::from_fn_with_state(
            state.metrics.clone(),
            access::layer,
        ))
        // The request id: a client's usable one kept, else a new one, set on
        // the request (its access line names it) and on the response.
        .layer(PropagateRequestIdLayer::new(access::REQUEST_ID.clone()))
        .layer(SetRequestIdLayer::new(
            access::REQUEST_ID.clone(),
            access::NewRequestId,
        ))
        .layer(axum::middleware::map_request(access::drop_unusable_id))
        .with_state(state)
}

/// The tenant a request's API key names: the namespace prefix of its key,
/// `None` when the server takes no keys.
#[derive(Debug, Clone, Default)]
pub struct Tenant(pub Option<String>);

/// Before any handler: the API key of a `/v1` request when keys are
/// configured (401 otherwise; `/health` and `/metrics` stay open), then the
/// whole body, read within `body_timeout` (408) and `body_limit` (413).
///
/// A refusal leaves the connection usable or closes it: the body of a
/// refused request is read and dropped (within a bound) so that the next
/// request on a keep-alive connection starts where it should, and when it
/// cannot be (too large, too slow), the answer says `Connection: close`.
async fn guard(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let (mut parts, body) = request.into_parts();
    let record = parts
        .extensions
        .get::<AccessRecord>()
        .cloned()
        .unwrap_or_default();
    let mut stream = body.into_data_stream();
    let limit = state.config.body_limit;
    let mut tenant = Tenant(None);
    if !state.config.api_keys.is_empty() && parts.uri.path().starts_with("/v1") {
        let key = match authenticate(&state.config.api_keys, &parts.headers) {
            Ok(key) => key,
            Err(error) => {
                let drained = linger(&mut stream, limit).await;
                return refuse(error, !drained);
            }
        };
        record.tenant(&key.tenant.clone().unwrap_or_else(|| key.namespace()));
        tenant = Tenant(Some(key.namespace()));
    }
    parts.extensions.insert(tenant);
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    use futures_util::StreamExt;
    if declared.is_some_and(|n| n > limit as u64) {
        let drained = linger(&mut stream, limit).await;
        return refuse(ApiError::too_large(limit), !drained);
    }
    let read = async {
        let mut bytes = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk =
                chunk.map_err(|e| ApiError::invalid(None, format!("Could not read the body: {e}")))?;
            if bytes.len() + chunk.len() > limit {
                return Err(ApiError::too_large(limit));
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(bytes)
    };
    let bytes = match tokio::time::timeout(state.config.body_timeout, read).await {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(e)) if e.status == StatusCode::PAYLOAD_TOO_LARGE => {
            let drained = linger(&mut stream, limit).await;
            return refuse(e, !drained);
        }
        // The body is broken or cut short: nothing more to read on this
        // connection.
        Ok(Err(e)) => return refuse(e, true),
        Err(_) => return refuse(ApiError::body_timeout(state.config.body_timeout), true),
    };
    next.run(Request::from_parts(parts, Body::from(bytes))).await
}

/// The key a request's `Authorization` header names: `Bearer KEY`, the
/// scheme in any case (RFC 7235), the key compared in full against every
/// configured one whatever matches, so the time taken says nothing about
/// how close a wrong key came.
fn authenticate<'k>(keys: &'k [ApiKey], headers: &axum::http::HeaderMap) -> Result<&'k ApiKey, ApiError> {
    let sent = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, key) = v.trim().split_once(char::is_whitespace)?;
            scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
        });
    let Some(sent) = sent else {
        return Err(ApiError::unauthorized(
            "You didn't provide an API key (Authorization: Bearer KEY)",
        ));
    };
    let mut found = None;
    for key in keys {
        if constant_time_eq(key.key.as_bytes(), sent.as_bytes()) {
            found = Some(key);
        }
    }
    found.ok_or_else(|| ApiError::unauthorized("Incorrect API key provided"))
}

/// `error` as a response, with `Connection: close` when `close` (what is
/// left of the request's body was not read: the connection cannot carry
/// another request).
fn refuse(error: ApiError, close: bool) -> Response {
    let mut response = error.into_response();
    if close {
        response
            .headers_mut()
            .insert(header::CONNECTION, header::HeaderValue::from_static("close"));
    }
    response
}

/// Reads and drops what is left of a refused request's body, up to four
/// times the limit and for at most a second, so that a client still writing
/// it reads the answer rather than a broken connection (a lingering close,
/// as web servers do); whether the body was read to its end.
async fn linger(stream: &mut axum::body::BodyDataStream, limit: usize) -> bool {
    use futures_util::StreamExt;
    let drain = async {
        let mut dropped = 0usize;
        loop {
            match stream.next().await {
                None => return true,
                Some(Err(_)) => return false,
                Some(Ok(chunk)) => {
                    dropped += chunk.len();
                    if dropped > 4 * limit {
                        return false;
                    }
                }
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(1), drain)
        .await
        .unwrap_or(false)
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for (i, &x) in a.iter().enumerate() {
        diff |= usize::from(x ^ b.get(i).copied().unwrap_or(!x));
    }
    diff == 0
}

/// Answers that axum makes on its own (405, a rejected body) get OpenAI's
/// JSON error body like every other refusal.
async fn json_errors(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let (parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, 1 << 16).await.unwrap_or_default();
    let message = match String::from_utf8_lossy(&text).trim() {
        "" => status.canonical_reason().unwrap_or("error").to_string(),
        t => t.to_string(),
    };
    let mut error = ApiError::invalid(None, message);
    error.status = status;
    if status.is_server_error() {
        error.kind = "server_error";
    }
    let mut out = error.into_response();
    for name in [header::ALLOW, header::RETRY_AFTER] {
        if let Some(v) = parts.headers.get(&name) {
            out.headers_mut().insert(name, v.clone());
        }
    }
    out
}

/// Puts the request under its key's tenant. The salt is checked as the
/// client sent it (1 to 128 bytes, the usual characters); under a key the
/// namespace is the key's prefix, then `:` and the SHA-256 of the salt in
/// hex when the request sent one (98 bytes whatever the salt, so a salt of
/// the full 128 bytes fits under a key as it does without one). Salts of two
/// keys never meet, and requests without a salt are kept apart too.
fn apply_tenant(tenant: &Tenant, salt: &mut Option<String>) -> Result<(), ApiError> {
    kvcache_api::Namespace::from_salt(salt.as_deref())
        .map_err(|e| ApiError::invalid(Some("cache_salt"), e.to_string()))?;
    if let Some(prefix) = &tenant.0 {
        *salt = Some(match salt.take() {
            Some(s) => {
                use sha2::{Digest, Sha256};
                format!(
                    "{prefix}:{}",
                    kvcache_api::host::hex(&Sha256::digest(s.as_bytes()))
                )
            }
            None => prefix.clone(),
        });
    }
    Ok(())
}

/// Parses a JSON body, answering malformed JSON and wrong types with a 400.
fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::invalid(None, format!("Invalid request body: {e}")))
}

async fn chat_completions(
    State(state): State<AppState>,
    Extension(record): Extension<AccessRecord>,
    Extension(tenant): Extension<Tenant>,
    body: Bytes,
) -> Response {
    let started = Instant::now();
    let result = async {
        let mut req: ChatRequest = parse(&body)?;
        refuse_unsupported_chat(&req)?;
        refuse_vllm_extensions(&req.options.others, Endpoint::Chat)?;
        apply_tenant(&tenant, &mut req.options.cache_salt)?;
        let prompt = chat_prompt(&state, &req.messages)?;
        let logprobs = (req.logprobs == Some(true)).then(|| req.top_logprobs.unwrap_or(0) as usize);
        let checked = check(
            &state,
            &req.model,
            prompt,
            req.options,
            req.max_completion_tokens,
            logprobs,
            "messages",
        )?;
        Ok::<_, ApiError>((req.model, checked))
    }
    .await;
    match result {
        Ok((model, checked)) => respond(state, Endpoint::Chat, model, checked, started, record).await,
        Err(e) => e.into_response(),
    }
}

async fn completions(
    State(state): State<AppState>,
    Extension(record): Extension<AccessRecord>,
    Extension(tenant): Extension<Tenant>,
    body: Bytes,
) -> Response {
    let started = Instant::now();
    let result = async {
        let mut req: CompletionRequest = parse(&body)?;
        refuse_unsupported_completion(&req)?;
        refuse_vllm_extensions(&req.options.others, Endpoint::Completion)?;
        apply_tenant(&tenant, &mut req.options.cache_salt)?;
        let logprobs = req.logprobs.map(|n| n as usize);
        let prompt = match req.prompt {
            Prompt::Text(text) => encode(&state, &text)?,
            Prompt::Tokens(ids) => ids,
            Prompt::Texts(mut texts) if texts.len() == 1 => encode(&state, &texts.remove(0))?,
            Prompt::TokenLists(mut lists) if lists.len() == 1 => lists.remove(0),
            _ => {
                return Err(ApiError::invalid(
                    Some("prompt"),
                    "Exactly one prompt is supported",
                ))
            }
        };
        let checked = check(&state, &req.model, prompt, req.options, None, logprobs, "prompt")?;
        Ok::<_, ApiError>((req.model, checked))
    }
    .await;
    match result {
        Ok((model, checked)) => respond(state, Endpoint::Completion, model, checked, started, record).await,
        Err(e) => e.into_response(),
    }
}

fn encode(state: &AppState, text: &str) -> Result<Vec<u32>, ApiError> {
    state
        .tokenizer
        .encode(text)
        .map_err(|e| ApiError::invalid(Some("prompt"), e.to_string()))
}

/// The prompt of `messages` in the model's chat template (ChatML for
/// SmolLM2, Gemma's turns for Gemma 3), ending with the assistant's turn
/// opened; each message's content is plain text. Roles map to the engine's
/// (`developer` is a system message); what a system message becomes is the
/// template's choice, and a chat it cannot express is a 400.
fn chat_prompt(state: &AppState, messages: &[ChatMessage]) -> Result<Vec<u32>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(Some("messages"), "messages must not be empty"));
    }
    let mut chat = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let role = match m.role.as_str() {
            "system" | "developer" => Role::System,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            other => {
                return Err(ApiError::invalid(
                    Some(&format!("messages[{i}].role")),
                    format!("Unsupported role `{other}`"),
                ))
            }
        };
        let content = match &m.content {
            None if role == Role::Assistant => String::new(),
            None => {
                return Err(ApiError::invalid(
                    Some(&format!("messages[{i}].content")),
                    format!("messages[{i}] has no content"),
                ))
            }
            Some(MessageContent::Text(text)) => text.clone(),
            Some(MessageContent::Parts(parts)) => {
                let mut text = String::new();
                for part in parts {
                    match (part.kind.as_str(), &part.text) {
                        ("text", Some(t)) => text.push_str(t),
                        _ => {
                            return Err(ApiError::invalid(
                                Some(&format!("messages[{i}].content")),
                                format!("Unsupported content part `{}`", part.kind),
                            ))
                        }
                    }
                }
                text
            }
        };
        chat.push(Message::new(role, content));
    }
    // Built as ids, never as text: a message that writes `<|im_end|>` or
    // `<end_of_turn>` gets those characters as text, not the template's
    // control tokens (no injected turn).
    state
        .tokenizer
        .chat_ids(&chat, true)
        .map_err(|e| ApiError::invalid(Some("messages"), e.to_string()))
}

/// What every response carries: id, creation time and model.
#[derive(Debug, Clone)]
struct Header {
    kind: Endpoint,
    id: String,
    created: u64,
    model: String,
}

impl Header {
    fn new(kind: Endpoint, model: String) -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let prefix = match kind {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completion => "cmpl",
        };
        Header {
            kind,
            id: format!("{prefix}-{created:x}{n:06x}"),
            created,
            model,
        }
    }

    /// The whole answer of a non-streamed request.
    fn complete(
        &self,
        text: String,
        finish_reason: &'static str,
        usage: Usage,
        logprobs: Option<Rendered>,
    ) -> Response {
        match self.kind {
            Endpoint::Chat => Json(Completion {
                choices: vec![ChatChoice {
                    finish_reason,
                    index: 0,
                    logprobs: logprobs.and_then(Rendered::chat),
                    message: AssistantMessage {
                        content: text,
                        role: "assistant",
                    },
                }],
                ..self.body(CHAT_COMPLETION, Some(usage))
            })
            .into_response(),
            Endpoint::Completion => Json(Completion {
                choices: vec![CompletionChoice {
                    finish_reason: Some(finish_reason),
                    index: 0,
                    logprobs: logprobs.and_then(Rendered::completion),
                    text: text.into(),
                }],
                ..self.body(TEXT_COMPLETION, Some(usage))
            })
            .into_response(),
        }
    }

    /// A body of `object` with no choices yet.
    fn body<C>(&self, object: &'static str, usage: Option<Usage>) -> Completion<'_, C> {
        Completion {
            choices: Vec::new(),
            created: self.created,
            id: &self.id,
            model: &self.model,
            object,
            usage,
        }
    }

    /// One streamed chunk: `text` (or the role, first), `finish_reason` and
    /// the log-probabilities of its tokens (`null` when not asked for).
    fn chunk(
        &self,
        text: Option<&str>,
        first: bool,
        finish_reason: Option<&'static str>,
        logprobs: Option<Rendered>,
    ) -> SseEvent {
        match self.kind {
            Endpoint::Chat => {
                let delta = match (first, text) {
                    (true, _) => Delta {
                        content: Some(""),
                        role: Some("assistant"),
                    },
                    (false, content) => Delta { content, role: None },
                };
                data(&Completion {
                    choices: vec![ChatChunkChoice {
                        delta,
                        finish_reason,
                        index: 0,
                        logprobs: logprobs.and_then(Rendered::chat),
                    }],
                    ..self.body(CHAT_COMPLETION_CHUNK, None)
                })
            }
            Endpoint::Completion => data(&Completion {
                choices: vec![CompletionChoice {
                    finish_reason,
                    index: 0,
                    logprobs: logprobs.and_then(Rendered::completion),
                    text: text.unwrap_or("").into(),
                }],
                ..self.body(TEXT_COMPLETION, None)
            }),
        }
    }

    /// The last streamed chunk when usage was asked for: no choices.
    fn usage_chunk(&self, usage: Usage) -> SseEvent {
        match self.kind {
            Endpoint::Chat => data(&self.body::<ChatChunkChoice>(CHAT_COMPLETION_CHUNK, Some(usage))),
            Endpoint::Completion => data(&self.body::<CompletionChoice>(TEXT_COMPLETION, Some(usage))),
        }
    }
}

/// A choice's log-probabilities as its endpoint writes them.
#[derive(Debug, Clone)]
enum Rendered {
    Chat(ChatLogprobs),
    Completion(CompletionLogprobs),
}

impl Rendered {
    fn chat(self) -> Option<ChatLogprobs> {
        match self {
            Rendered::Chat(l) => Some(l),
            Rendered::Completion(_) => None,
        }
    }

    fn completion(self) -> Option<CompletionLogprobs> {
        match self {
            Rendered::Completion(l) => Some(l),
            Rendered::Chat(_) => None,
        }
    }
}

/// Log-probabilities as the API of `kind` writes them, token by token as a
/// stream hands them out.
///
/// They add up to the answer's text: the engine gives no log-probabilities
/// for a token the text leaves out (a control token such as `<|im_start|>`
/// forced by a bias, the end-of-turn token), so the tokens' bytes, joined,
/// are the text's bytes. A token that is not whole UTF-8 on its own (part of a character
/// split across tokens) is written as OpenAI writes it: in completions'
/// `tokens` and `top_logprobs` as `bytes:` and its bytes escaped (`\xf0\x9f`;
/// printable ASCII as itself), in chat's `token` as the escaped bytes, its
/// `bytes` exact. Completions' `text_offset` counts characters of the text
/// before the token; one that continues a split character has the offset of
/// that character.
#[derive(Debug, Clone)]
struct Logprobs {
    kind: Endpoint,
    tokenizer: std::sync::Arc<dyn Tokenizer>,
    /// Characters of the answer before the next token.
    chars: usize,
    /// The bytes of a character not yet complete at the end of the tokens so far.
    tail: Vec<u8>,
}

/// `bytes` escaped: printable ASCII (but `\\`) as itself, every other byte as `\xNN`.
fn escape_bytes(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(bytes.len() * 4);
    for &b in bytes {
        if (0x20..0x7f).contains(&b) && b != b'\\' {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "\\x{b:02x}");
        }
    }
    out
}

/// Characters in `bytes` as a lossy UTF-8 decoding counts them (one per
/// invalid sequence), leaving an incomplete character at the end in
/// `bytes`.
fn take_chars(bytes: &mut Vec<u8>) -> usize {
    let mut chars = 0;
    loop {
        match std::str::from_utf8(bytes) {
            Ok(text) => {
                chars += text.chars().count();
                bytes.clear();
                return chars;
            }
            Err(e) => {
                let valid = e.valid_up_to();
                chars += std::str::from_utf8(&bytes[..valid]).map_or(0, |t| t.chars().count());
                match e.error_len() {
                    // Cut short at the end: wait for the rest.
                    None => {
                        bytes.drain(..valid);
                        return chars;
                    }
                    // Invalid: one replacement character.
                    Some(n) => {
                        chars += 1;
                        bytes.drain(..valid + n);
                    }
                }
            }
        }
    }
}

impl Logprobs {
    fn new(kind: Endpoint, tokenizer: std::sync::Arc<dyn Tokenizer>) -> Self {
        Logprobs {
            kind,
            tokenizer,
            chars: 0,
            tail: Vec::new(),
        }
    }

    /// Token `id` as the API writes it, and its bytes.
    fn token(&self, id: u32) -> (String, Vec<u8>) {
        let bytes = self.tokenizer.token_bytes(id);
        let text = match std::str::from_utf8(&bytes) {
            Ok(text) => text.to_owned(),
            Err(_) if self.kind == Endpoint::Completion => format!("bytes:{}", escape_bytes(&bytes)),
            Err(_) => escape_bytes(&bytes),
        };
        (text, bytes)
    }

    /// The `logprobs` of a choice holding the tokens of `lps`.
    fn render(&mut self, lps: &[TokenLogprobs]) -> Rendered {
        match self.kind {
            Endpoint::Chat => {
                let content = lps
                    .iter()
                    .map(|lp| {
                        let (token, bytes) = self.token(lp.token);
                        let top_logprobs = lp
                            .top
                            .iter()
                            .map(|&(id, logprob)| {
                                let (token, bytes) = self.token(id);
                                ChatTopLogprob {
                                    bytes,
                                    logprob: f64::from(logprob),
                                    token,
                                }
                            })
                            .collect();
                        ChatTokenLogprob {
                            bytes,
                            logprob: f64::from(lp.logprob),
                            token,
                            top_logprobs,
                        }
                    })
                    .collect();
                Rendered::Chat(ChatLogprobs {
                    content,
                    refusal: None,
                })
            }
            Endpoint::Completion => {
                let mut out = CompletionLogprobs::default();
                for lp in lps {
                    let (token, bytes) = self.token(lp.token);
                    out.text_offset.push(self.chars);
                    self.tail.extend_from_slice(&bytes);
                    self.chars += take_chars(&mut self.tail);
                    out.tokens.push(token);
                    out.token_logprobs.push(f64::from(lp.logprob));
                    let alternatives = lp
                        .top
                        .iter()
                        .map(|&(id, l)| (self.token(id).0, f64::from(l)))
                        .collect();
                    out.top_logprobs.push(alternatives);
                }
                Rendered::Completion(out)
            }
        }
    }
}

async fn respond(
    state: AppState,
    kind: Endpoint,
    model: String,
    checked: Checked,
    started: Instant,
    record: AccessRecord,
) -> Response {
    let (stream, include_usage) = (checked.stream, checked.include_usage);
    let logprobs = checked
        .options
        .logprobs
        .is_some()
        .then(|| Logprobs::new(kind, state.tokenizer.clone()));
    let generation = match Generation::start(&state, checked, started, record.clone()) {
        Ok(g) => g,
        Err(e) => return e.into_response(),
    };
    let header = Header::new(kind, model);
    if stream {
        return Sse::new(sse_events(header, generation, include_usage, logprobs, record))
            .keep_alive(KeepAlive::default())
            .into_response();
    }
    let mut generation = generation;
    let mut text = String::new();
    let mut lps = Vec::new();
    while let Some(piece) = generation.next().await {
        match piece {
            Ok(Piece::Text(t, l)) => {
                text.push_str(&t);
                lps.extend(l);
            }
            Ok(Piece::End { finish_reason, usage }) => {
                let logprobs = logprobs.map(|mut l| l.render(&lps));
                return header.complete(text, finish_reason, usage, logprobs);
            }
            Err(e) => {
                tracing::error!(error = %e.message, "a request failed on the engine");
                return e.into_response();
            }
        }
    }
    ApiError::internal("The request ended without an answer").into_response()
}

/// The server-sent events of a streamed answer: a first chunk (the role, for
/// chat), one per text piece, one with the finish reason, the usage when
/// asked, then `[DONE]`. Dropping the stream (the client went away) drops the
/// generation, which cancels it on the engine.
fn sse_events(
    header: Header,
    generation: Generation,
    include_usage: bool,
    logprobs: Option<Logprobs>,
    record: AccessRecord,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    struct Streaming {
        header: Header,
        generation: Generation,
        include_usage: bool,
        logprobs: Option<Logprobs>,
        queue: std::collections::VecDeque<SseEvent>,
        done: bool,
        record: AccessRecord,
    }
    let mut queue = std::collections::VecDeque::new();
    if header.kind == Endpoint::Chat {
        queue.push_back(header.chunk(None, true, None, None));
    }
    let start = Streaming {
        header,
        generation,
        include_usage,
        logprobs,
        queue,
        done: false,
        record,
    };
    stream::unfold(start, |mut s| async move {
        loop {
            if let Some(event) = s.queue.pop_front() {
                return Some((Ok(event), s));
            }
            if s.done {
                return None;
            }
            match s.generation.next().await {
                Some(Ok(Piece::Text(t, l))) => {
                    let logprobs = s.logprobs.as_mut().map(|r| r.render(&l));
                    s.queue.push_back(s.header.chunk(Some(&t), false, None, logprobs));
                }
                Some(Ok(Piece::End { finish_reason, usage })) => {
                    s.queue
                        .push_back(s.header.chunk(None, false, Some(finish_reason), None));
                    if s.include_usage {
                        s.queue.push_back(s.header.usage_chunk(usage));
                    }
                    s.queue.push_back(SseEvent::default().data("[DONE]"));
                    s.done = true;
                }
                Some(Err(e)) => {
                    tracing::error!(error = %e.message, "a streamed request failed on the engine");
                    s.record.refused(&e);
                    s.queue.push_back(data(&e.body()));
                    s.done = true;
                }
                None => s.done = true,
            }
        }
    })
}

/// `value` as one server-sent event's data.
fn data(value: &impl Serialize) -> SseEvent {
    SseEvent::default().data(serde_json::to_string(value).expect("a response body serializes"))
}

async fn models(State(state): State<AppState>) -> Response {
    Json(ModelList {
        data: vec![ModelCard::new(&state.config.model_name)],
        object: "list",
    })
    .into_response()
}

async fn model(State(state): State<AppState>, Path(id): Path<String>) -> Response {
    if id != state.config.model_name {
        return ApiError::unknown_model(&id).into_response();
    }
    Json(ModelCard::new(&id)).into_response()
}

/// 200 while the engine thread runs; 503 once it has ended (the process
/// still answers HTTP but can generate nothing: restart it).
async fn health(State(state): State<AppState>) -> Response {
    if !state.worker.is_running() {
        let body = Unhealthy {
            error: "the engine thread has stopped",
            status: "unavailable",
        };
        return (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
    }
    let g = state.worker.gauges();
    Json(Health {
        active: g.active,
        cells_in_use: g.cells_in_use,
        status: "ok",
    })
    .into_response()
}

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let store = state.worker.store_stats();
    let text = state.metrics.render(&state.worker.gauges(), store.as_ref());
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        text,
    )
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kvcache_models::ChatTokenizer;

    use super::*;
    use crate::{ServerConfig, Worker};

    fn state(worker: Worker) -> AppState {
        let tokenizer = ChatTokenizer::from_parts(vec!["a".into()], &[], &[], 0, 0).unwrap();
        AppState {
            worker,
            tokenizer: Arc::new(tokenizer),
            config: Arc::new(ServerConfig::default()),
            metrics: Arc::default(),
        }
    }

    #[test]
    fn split_characters_are_escaped_and_counted_once_whole() {
        assert_eq!(escape_bytes(b"a \\\xf0\x9f"), "a \\x5c\\xf0\\x9f");
        // 😀 (4 bytes) split 2 + 2, then "é" and an invalid byte.
        let mut tail = vec![0xf0, 0x9f];
        assert_eq!((take_chars(&mut tail), tail.len()), (0, 2));
        tail.extend_from_slice(&[0x98, 0x80]);
        assert_eq!((take_chars(&mut tail), tail.len()), (1, 0));
        tail.extend_from_slice("é".as_bytes());
        tail.push(0xff);
        tail.push(b'x');
        assert_eq!((take_chars(&mut tail), tail.len()), (3, 0));
    }

    #[tokio::test]
    async fn a_usable_request_id_comes_back_and_another_is_replaced() {
        use tower_service::Service;
        let mut app = router(state(Worker::stopped()));
        for (sent, kept) in [
            (Some("client-1.a"), true),
            (Some("has space"), false),
            (None, false),
        ] {
            let mut request = axum::http::Request::get("/health");
            if let Some(id) = sent {
                request = request.header("x-request-id", id);
            }
            let response = app.call(request.body(Body::empty()).unwrap()).await.unwrap();
            let id = response.headers()["x-request-id"].to_str().unwrap();
            if kept {
                assert_eq!(Some(id), sent);
            } else {
                assert!(id.starts_with("req-"), "{sent:?} -> {id}");
            }
        }
    }

    #[tokio::test]
    async fn health_is_503_once_the_engine_thread_has_ended() {
        let response = health(State(state(Worker::stopped()))).await;
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        let body = axum::body::to_bytes(response.into_body(), 1 << 16).await.unwrap();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["status"], "unavailable");
    }
}
