//! vLLM's extension fields (issue 33): those the server implements change
//! the answer as vLLM's do (`ignore_eos`, `min_tokens`, `top_k`, `min_p`,
//! `stop_token_ids`, `seed`), and every other one is refused with a 400
//! naming it unless it has its default value; none is silently ignored.

mod common;

use common::{chat_body, post, tokenizer, Server};
use serde_json::{json, Value};

const MODEL: &str = "SmolLM2-135M-Instruct";

/// A chat request whose greedy answer is short, with `extra` fields.
fn chat(extra: Value) -> Value {
    chat_body("What is the capital of France?", 64, extra)
}

/// The answer's text, finish reason and completion tokens.
async fn answer(server: &Server, extra: Value) -> (String, String, u64) {
    let (status, body) = post(server, "/v1/chat/completions", &chat(extra)).await;
    assert_eq!(status, 200, "{body}");
    let choice = &body["choices"][0];
    (
        choice["message"]["content"].as_str().unwrap().to_string(),
        choice["finish_reason"].as_str().unwrap().to_string(),
        body["usage"]["completion_tokens"].as_u64().unwrap(),
    )
}

#[tokio::test]
async fn ignore_eos_runs_to_max_tokens_past_the_end_of_turn() {
    let Some(server) = Server::start(&[]) else { return };
    let (plain, reason, tokens) = answer(&server, json!({})).await;
    // The greedy answer ends on its own, well before max_tokens.
    assert_eq!(reason, "stop");
    assert!(tokens < 40 && !plain.is_empty(), "{tokens} tokens: {plain:?}");

    let (text, reason, tokens) = answer(&server, json!({"ignore_eos": true, "max_tokens": 48})).await;
    assert_eq!((reason.as_str(), tokens), ("length", 48));
    // The same greedy tokens up to the end of turn, then more.
    assert!(text.starts_with(&plain) && text.len() > plain.len(), "{text:?}");
    // `false` is the default: the plain answer.
    let (text, reason, _) = answer(&server, json!({"ignore_eos": false})).await;
    assert_eq!((text, reason.as_str()), (plain, "stop"));
}

#[tokio::test]
async fn min_tokens_holds_back_the_end() {
    let Some(server) = Server::start(&[]) else { return };
    let (plain, _, tokens) = answer(&server, json!({})).await;
    let min_tokens = tokens + 6;
    let (text, reason, held) = answer(&server, json!({"min_tokens": min_tokens})).await;
    assert!(
        held > min_tokens,
        "{held} tokens, min_tokens {min_tokens}: {text:?}"
    );
    if reason == "stop" {
        assert!(held < 64);
    } else {
        assert_eq!((reason.as_str(), held), ("length", 64));
    }
    assert!(text.starts_with(&plain) && text.len() > plain.len(), "{text:?}");

    // A stop sequence in the plain answer's text does not end it before
    // min_tokens either.
    let word = plain.split_whitespace().next().unwrap().to_string();
    let (cut, reason, _) = answer(&server, json!({"stop": [word]})).await;
    assert_eq!(reason, "stop");
    assert!(!cut.contains(&word), "{cut:?}");
    let (text, _, held) = answer(&server, json!({"stop": [word], "min_tokens": min_tokens})).await;
    assert!(held >= min_tokens, "{held} tokens: {text:?}");
    assert!(text.starts_with(&plain), "{text:?}");

    // More than max_tokens: refused.
    let (status, body) = post(&server, "/v1/chat/completions", &chat(json!({"min_tokens": 65}))).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "min_tokens");
}

#[tokio::test]
async fn top_k_of_one_is_greedy_and_a_seed_repeats_its_answer() {
    let Some(server) = Server::start(&[]) else { return };
    let (greedy, _, _) = answer(&server, json!({})).await;
    let story = |extra: Value| {
        let mut extra = extra;
        extra["messages"] = json!([{"role": "user", "content": "Tell me a story about a cat."}]);
        extra["max_tokens"] = json!(24);
        extra
    };
    for seed in [1, 2] {
        let (text, _, _) = answer(&server, json!({"top_k": 1, "temperature": 1.0, "seed": seed})).await;
        assert_eq!(text, greedy, "seed {seed}");
    }
    let hot = |seed: u64| story(json!({"temperature": 1.0, "seed": seed}));
    let (a, _, _) = answer(&server, hot(7)).await;
    let (b, _, _) = answer(&server, hot(7)).await;
    assert_eq!(a, b, "the same seed, the same answer");
    let mut others = Vec::new();
    for seed in [8, 9, 10] {
        others.push(answer(&server, hot(seed)).await.0);
    }
    assert!(
        others.iter().any(|o| *o != a),
        "other seeds change it: {others:?}"
    );
    // min_p 1 keeps the most likely token only: greedy too.
    let (text, _, _) = answer(&server, json!({"min_p": 1.0, "temperature": 1.0, "seed": 3})).await;
    assert_eq!(text, greedy);
}

#[tokio::test]
async fn stop_token_ids_end_the_answer_at_that_token() {
    let Some(server) = Server::start(&[]) else { return };
    let (plain, _, tokens) = answer(&server, json!({})).await;
    let ids = tokenizer().encode_plain(&plain).unwrap();
    // The answer's second token as a stop token: the answer ends where it
    // first comes, its text left out.
    let (text, reason, n) = answer(&server, json!({"stop_token_ids": [ids[1]]})).await;
    assert_eq!(reason, "stop");
    assert!(n < tokens && text.len() < plain.len(), "{n} tokens: {text:?}");
    assert!(plain.starts_with(&text), "{text:?}");
}

#[tokio::test]
async fn other_vllm_fields_are_refused_by_name_unless_default() {
    let Some(server) = Server::start(&[]) else { return };
    let refused_on_both = [
        ("use_beam_search", json!(true)),
        ("length_penalty", json!(0.5)),
        ("repetition_penalty", json!(1.2)),
        ("include_stop_str_in_output", json!(true)),
        ("skip_special_tokens", json!(false)),
        ("spaces_between_special_tokens", json!(false)),
        ("truncate_prompt_tokens", json!(8)),
        ("prompt_logprobs", json!(1)),
        ("bad_words", json!(["sea"])),
        ("allowed_token_ids", json!([1, 2])),
        ("guided_json", json!({"type": "object"})),
        ("guided_regex", json!("[a-z]+")),
        ("guided_choice", json!(["a", "b"])),
        ("guided_grammar", json!("root ::= \"a\"")),
        ("structured_outputs", json!({"regex": "a"})),
        ("priority", json!(1)),
        ("return_tokens_as_token_ids", json!(true)),
    ];
    let refused_on_chat = [
        ("best_of", json!(2)),
        ("echo", json!(true)),
        ("add_generation_prompt", json!(false)),
        ("continue_final_message", json!(true)),
        ("documents", json!([{"text": "a"}])),
        ("chat_template", json!("{{ messages }}")),
        ("chat_template_kwargs", json!({"x": 1})),
        ("add_special_tokens", json!(true)),
    ];
    let refused_on_completions = [
        ("add_special_tokens", json!(false)),
        ("response_format", json!({"type": "json_object"})),
    ];
    let completion = |field: &str, value: &Value| json!({"model": MODEL, "prompt": "The sea", "max_tokens": 2, field: value});
    let check = |path: &'static str, field: &'static str, body: Value| {
        let server = &server;
        async move {
            let (status, body) = post(server, path, &body).await;
            assert_eq!(status, 400, "{path} {field}: {body}");
            assert_eq!(body["error"]["param"], field, "{path}: {body}");
            assert!(
                body["error"]["message"].as_str().unwrap().contains(field),
                "{path}: {body}"
            );
            assert_eq!(body["error"]["code"], "unsupported_parameter");
        }
    };
    for (field, value) in refused_on_both {
        check("/v1/chat/completions", field, chat(json!({field: value.clone()}))).await;
        check("/v1/completions", field, completion(field, &value)).await;
    }
    for (field, value) in refused_on_chat {
        check("/v1/chat/completions", field, chat(json!({field: value}))).await;
    }
    for (field, value) in refused_on_completions {
        check("/v1/completions", field, completion(field, &value)).await;
    }
    // Their defaults are accepted, and change nothing.
    let (plain, _, _) = answer(&server, json!({})).await;
    let defaults = json!({
        "use_beam_search": false, "length_penalty": 1, "repetition_penalty": 1.0,
        "include_stop_str_in_output": false, "skip_special_tokens": true,
        "spaces_between_special_tokens": true, "truncate_prompt_tokens": null,
        "guided_json": null, "priority": 0, "best_of": 1, "echo": false,
        "add_generation_prompt": true, "continue_final_message": false,
        "add_special_tokens": false, "top_k": -1, "min_p": 0, "min_tokens": 0,
        "stop_token_ids": [],
    });
    let (text, _, _) = answer(&server, defaults).await;
    assert_eq!(text, plain);
    let (status, body) = post(
        &server,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "The sea", "max_tokens": 2,
                "add_special_tokens": true, "response_format": {"type": "text"}}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    // Out of range: a 400 naming the field.
    for (field, value) in [
        ("top_k", json!(-2)),
        ("min_p", json!(1.5)),
        ("stop_token_ids", json!([1 << 30])),
    ] {
        let (status, body) = post(&server, "/v1/chat/completions", &chat(json!({field: value}))).await;
        assert_eq!(status, 400, "{field}: {body}");
        assert_eq!(body["error"]["param"], field);
    }
}
