//! Parameters that change the answer (issue 24, item 2): log-probabilities,
//! penalties and logit bias do what OpenAI says they do; what is not
//! implemented is refused with a 400 naming the parameter; greedy answers
//! without them are unchanged.

mod common;

use common::{chat_body, post, tokenizer, Server};
use kvcache_models::tokenizer::ChatTokenizer;
use serde_json::{json, Value};

const MODEL: &str = "SmolLM2-135M-Instruct";

fn chat(extra: Value) -> Value {
    chat_body("Write one sentence about the sea.", 12, extra)
}

fn the_one_token(t: &ChatTokenizer, text: &str) -> u32 {
    let ids = t.encode_plain(text).unwrap();
    assert_eq!(ids.len(), 1, "{text:?} is {ids:?}");
    ids[0]
}

#[tokio::test]
async fn chat_logprobs_match_the_greedy_answer_and_are_ordered() {
    let Some(server) = Server::start(&[]) else { return };
    let (status, plain) = post(&server, "/v1/chat/completions", &chat(json!({}))).await;
    assert_eq!(status, 200, "{plain}");
    assert!(plain["choices"][0]["logprobs"].is_null());
    let (status, with) = post(
        &server,
        "/v1/chat/completions",
        &chat(json!({"logprobs": true, "top_logprobs": 3})),
    )
    .await;
    assert_eq!(status, 200, "{with}");
    let text = with["choices"][0]["message"]["content"].as_str().unwrap();
    // Asking for log-probabilities changes nothing in a greedy answer.
    assert_eq!(text, plain["choices"][0]["message"]["content"].as_str().unwrap());
    let content = with["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert!(!content.is_empty());
    let mut joined = Vec::new();
    for entry in content {
        let lp = entry["logprob"].as_f64().unwrap();
        assert!(lp <= 0.0 && lp > -50.0, "{entry}");
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{entry}");
        // Greedy: the picked token is the most likely one.
        assert_eq!(top[0]["token"], entry["token"], "{entry}");
        assert!((top[0]["logprob"].as_f64().unwrap() - lp).abs() < 1e-6);
        assert!(top
            .windows(2)
            .all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64()));
        let bytes: Vec<u8> = entry["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        joined.extend(bytes);
    }
    // The tokens' bytes make up the answer (the end-of-turn token is not in it).
    assert_eq!(String::from_utf8(joined).unwrap(), text);

    // Streamed: the same entries, spread over the chunks.
    let (status, _) = post(&server, "/v1/chat/completions", &chat(json!({"top_logprobs": 2}))).await;
    assert_eq!(status, 400, "top_logprobs without logprobs");
    let body = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", server.base))
        .json(&chat(json!({"logprobs": true, "stream": true})))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let streamed: Vec<Value> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .flat_map(|c| {
            c["choices"][0]["logprobs"]["content"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    let tokens = |v: &[Value]| v.iter().map(|e| e["token"].clone()).collect::<Vec<_>>();
    assert_eq!(tokens(&streamed), tokens(content));
}

#[tokio::test]
async fn completions_logprobs_have_the_legacy_shape() {
    let Some(server) = Server::start(&[]) else { return };
    let body = json!({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 5,
                      "temperature": 0, "logprobs": 2});
    let (status, answer) = post(&server, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{answer}");
    let lp = &answer["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap();
    let n = tokens.len();
    assert!(n > 0);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), n);
    assert_eq!(lp["top_logprobs"].as_array().unwrap().len(), n);
    assert!(lp["top_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t.as_object().unwrap().len() <= 2 && !t.as_object().unwrap().is_empty()));
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap())
        .collect();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
    let text: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(text, answer["choices"][0]["text"].as_str().unwrap());
    let (status, e) = post(
        &server,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "x", "logprobs": 6}),
    )
    .await;
    assert_eq!((status, e["error"]["param"].as_str()), (400, Some("logprobs")));
}

#[tokio::test]
async fn logit_bias_and_frequency_penalty_steer_the_tokens() {
    let Some(server) = Server::start(&[]) else { return };
    let t = tokenizer();
    let (the, sea) = (the_one_token(&t, " the"), the_one_token(&t, " sea"));
    let bias = json!({ the.to_string(): 100, sea.to_string(): 100 });
    let run = |extra: Value| {
        let body = chat(json!({"logit_bias": bias, "max_tokens": 16, "logprobs": true}));
        let mut body = body;
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    let ids = |answer: &Value| -> Vec<u32> {
        answer["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                let bytes: Vec<u8> = e["bytes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|b| b.as_u64().unwrap() as u8)
                    .collect();
                the_one_token(&t, std::str::from_utf8(&bytes).unwrap())
            })
            .collect()
    };
    // +100 on two tokens: every pick is one of them.
    let (status, biased) = post(&server, "/v1/chat/completions", &run(json!({"top_logprobs": 2}))).await;
    assert_eq!(status, 200, "{biased}");
    let picks = ids(&biased);
    assert_eq!(picks.len(), 16);
    assert!(picks.iter().all(|p| [the, sea].contains(p)), "{picks:?}");
    // Their logprob is that of the biased row: nearly all the mass.
    let first = biased["choices"][0]["logprobs"]["content"][0]["logprob"]
        .as_f64()
        .unwrap();
    assert!(first > -1.0, "{first}");
    // lp(" the") - lp(" sea") at step `i`, from the top two alternatives.
    let gap = |answer: &Value, i: usize| -> f64 {
        let top = answer["choices"][0]["logprobs"]["content"][i]["top_logprobs"]
            .as_array()
            .unwrap()
            .clone();
        let lp = |word: &str| {
            top.iter()
                .find(|e| e["token"] == word)
                .unwrap_or_else(|| panic!("{word:?} not in {top:?}"))["logprob"]
                .as_f64()
                .unwrap()
        };
        lp(" the") - lp(" sea")
    };
    // A penalty of 2 lowers the token picked first by exactly 2 at the next
    // step (frequency: per use; presence: once), as the reported
    // log-probabilities of the changed row show; the first step is untouched.
    let sign = if picks[0] == the { 1.0 } else { -1.0 };
    for penalty in ["frequency_penalty", "presence_penalty"] {
        let (status, penalized) = post(
            &server,
            "/v1/chat/completions",
            &run(json!({ penalty: 2.0, "top_logprobs": 2 })),
        )
        .await;
        assert_eq!(status, 200, "{penalized}");
        assert_eq!(ids(&penalized)[0], picks[0]);
        assert!((gap(&penalized, 0) - gap(&biased, 0)).abs() < 1e-3);
        let shift = gap(&penalized, 1) - gap(&biased, 1);
        assert!((shift + 2.0 * sign).abs() < 1e-2, "{penalty}: {shift}");
    }
    // -100 bans the greedy answer's first token.
    let (_, plain) = post(&server, "/v1/chat/completions", &chat(json!({"logprobs": true}))).await;
    let first = ids(&plain)[0];
    let (_, banned) = post(
        &server,
        "/v1/chat/completions",
        &chat(json!({"logprobs": true, "logit_bias": { first.to_string(): -100 }})),
    )
    .await;
    assert_ne!(ids(&banned)[0], first);
}

#[tokio::test]
async fn parameters_out_of_range_or_not_implemented_are_400_naming_them() {
    let Some(server) = Server::start(&[]) else { return };
    let cases = [
        (json!({"presence_penalty": 2.5}), "presence_penalty"),
        (json!({"frequency_penalty": -3}), "frequency_penalty"),
        (json!({"logit_bias": {"abc": 1}}), "logit_bias"),
        (json!({"logit_bias": {"999999": 1}}), "logit_bias"),
        (json!({"logit_bias": {"5": 101}}), "logit_bias"),
        (json!({"logit_bias": {"5": "x"}}), "logit_bias"),
        (json!({"logprobs": true, "top_logprobs": 21}), "top_logprobs"),
        (
            json!({"response_format": {"type": "json_object"}}),
            "response_format",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f"}}]}),
            "tools",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (json!({"functions": [{"name": "f"}]}), "functions"),
        (json!({"n": 2}), "n"),
        (json!({"modalities": ["text", "audio"]}), "modalities"),
    ];
    for (extra, param) in cases {
        let (status, e) = post(&server, "/v1/chat/completions", &chat(extra.clone())).await;
        assert_eq!(status, 400, "{extra}: {e}");
        assert_eq!(e["error"]["param"], param, "{extra}: {e}");
        assert_eq!(e["error"]["type"], "invalid_request_error");
    }
    let completion = |extra: Value| {
        let mut body = json!({"model": MODEL, "prompt": "Hello", "max_tokens": 2});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    for (extra, param) in [
        (json!({"echo": true}), "echo"),
        (json!({"suffix": "end"}), "suffix"),
        (json!({"best_of": 3}), "best_of"),
    ] {
        let (status, e) = post(&server, "/v1/completions", &completion(extra.clone())).await;
        assert_eq!(
            (status, &e["error"]["param"]),
            (400, &json!(param)),
            "{extra}: {e}"
        );
    }
    // Their neutral values are accepted, as are fields that change nothing.
    for extra in [
        json!({"response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "n": 1,
               "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "user": "u",
               "metadata": {"a": "b"}, "store": false}),
    ] {
        let (status, e) = post(&server, "/v1/chat/completions", &chat(extra)).await;
        assert_eq!(status, 200, "{e}");
    }
    let (status, e) = post(
        &server,
        "/v1/completions",
        &completion(json!({"echo": false, "suffix": "", "best_of": 1})),
    )
    .await;
    assert_eq!(status, 200, "{e}");
}

/// A legacy token as bytes: `bytes:` and `\xNN` escapes (printable ASCII as
/// itself) for a token that is not whole UTF-8, else its text.
fn legacy_bytes(token: &str) -> Vec<u8> {
    let Some(escaped) = token.strip_prefix("bytes:") else {
        return token.as_bytes().to_vec();
    };
    let mut out = Vec::new();
    let b = escaped.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && b.get(i + 1) == Some(&b'x') {
            out.push(u8::from_str_radix(&escaped[i + 2..i + 4], 16).unwrap());
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

/// The legacy log-probabilities of `answer` add up to its text: the tokens'
/// bytes joined are the text's, and each `text_offset` is the number of
/// whole characters before the token.
fn assert_logprobs_make_the_text(answer: &Value) {
    let choice = &answer["choices"][0];
    let text = choice["text"].as_str().unwrap();
    let lp = &choice["logprobs"];
    let tokens: Vec<Vec<u8>> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| legacy_bytes(t.as_str().unwrap()))
        .collect();
    assert_eq!(tokens.concat(), text.as_bytes(), "{answer}");
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap())
        .collect();
    assert_eq!(offsets.len(), tokens.len());
    let mut start = 0;
    for (token, &offset) in tokens.iter().zip(&offsets) {
        let mut whole = start;
        while !text.is_char_boundary(whole) {
            whole -= 1;
        }
        assert_eq!(offset, text[..whole].chars().count() as u64, "{answer}");
        start += token.len();
    }
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), tokens.len());
}

#[tokio::test]
async fn legacy_logprobs_tokens_join_to_the_text() {
    let Some(server) = Server::start(&[]) else { return };
    // Emoji split across tokens (SmolLM2 writes 😀 as two byte tokens).
    let body = json!({"model": MODEL, "prompt": "Smile 😀 ok 😀 ok 😀 ok 😀 ok", "max_tokens": 12,
                      "temperature": 0, "logprobs": 1});
    let (status, answer) = post(&server, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{answer}");
    let text = answer["choices"][0]["text"].as_str().unwrap();
    assert!(text.contains('😀'), "{answer}");
    let tokens = answer["choices"][0]["logprobs"]["tokens"].as_array().unwrap();
    assert!(
        tokens.iter().any(|t| t.as_str().unwrap().starts_with("bytes:")),
        "no split character: {answer}"
    );
    assert_logprobs_make_the_text(&answer);
    // Streamed: the chunks' tokens and offsets continue one another.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = reqwest::Client::new()
        .post(format!("{}/v1/completions", server.base))
        .json(&streamed)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let mut joined = json!({"choices": [{"text": "", "logprobs": {"tokens": [], "text_offset": [], "token_logprobs": []}}]});
    for data in events.lines().filter_map(|l| l.strip_prefix("data: ")) {
        let Ok(chunk) = serde_json::from_str::<Value>(data) else {
            continue;
        };
        let choice = &chunk["choices"][0];
        let text = format!(
            "{}{}",
            joined["choices"][0]["text"].as_str().unwrap(),
            choice["text"].as_str().unwrap_or("")
        );
        joined["choices"][0]["text"] = json!(text);
        if let Some(lp) = choice["logprobs"].as_object() {
            for key in ["tokens", "text_offset", "token_logprobs"] {
                let more = lp[key].as_array().unwrap().clone();
                joined["choices"][0]["logprobs"][key]
                    .as_array_mut()
                    .unwrap()
                    .extend(more);
            }
        }
    }
    assert_eq!(joined["choices"][0]["text"], answer["choices"][0]["text"]);
    assert_logprobs_make_the_text(&joined);

    // Control tokens: forced `<|im_start|>` never shows in the text, so not in the tokens either.
    let t = tokenizer();
    let im_start = t.encode("<|im_start|>").unwrap()[0];
    let body = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0,
                      "logprobs": 0, "logit_bias": { im_start.to_string(): 100 }});
    let (status, answer) = post(&server, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["usage"]["completion_tokens"], 4);
    assert_logprobs_make_the_text(&answer);
    // In chat the same: every entry's bytes joined are the content.
    let (status, answer) = post(
        &server,
        "/v1/chat/completions",
        &chat(json!({"logprobs": true, "logit_bias": { im_start.to_string(): 100 }, "max_tokens": 3})),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let content = answer["choices"][0]["message"]["content"].as_str().unwrap();
    let bytes: Vec<u8> = answer["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|e| {
            e["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8)
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(bytes, content.as_bytes(), "{answer}");
}

#[tokio::test]
async fn an_empty_stop_sequence_is_a_400_naming_stop() {
    let Some(server) = Server::start(&[]) else { return };
    for (path, mut body) in [
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
        ),
        ("/v1/chat/completions", chat(json!({"max_tokens": 2}))),
    ] {
        for stop in [json!(""), json!(["a", ""])] {
            for stream in [false, true] {
                body["stop"] = stop.clone();
                body["stream"] = json!(stream);
                let (status, e) = post(&server, path, &body).await;
                assert_eq!(status, 400, "{path} {stop} stream {stream}: {e}");
                assert_eq!(e["error"]["param"], "stop", "{e}");
                assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
            }
        }
        // A real stop sequence still works.
        body["stop"] = json!(["\n\n"]);
        body["stream"] = json!(false);
        let (status, e) = post(&server, path, &body).await;
        assert_eq!(status, 200, "{e}");
    }
}
