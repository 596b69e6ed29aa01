//! The text of a request's answer, built token by token as the engine picks
//! them: an incremental detokenizer (vLLM's, with a prefix and a read
//! offset) and the request's stop sequences, cut once and only here.
//!
//! Each [`Detokenizer::push`] decodes a short window of the latest tokens
//! instead of the whole answer, so an answer of `n` tokens costs `O(n)`
//! decoding, not `O(n²)`:
//!
//! - `prefix..read` are the tokens of the text last handed out in full, kept
//!   as context; `read..` the tokens whose text is not (all) handed out yet.
//! - A push decodes `prefix..` and hands out what it adds to the decoding of
//!   `prefix..read`. When that ends in an incomplete UTF-8 character (the one
//!   replacement character `U+FFFD` a lossy decoding ends in then), the
//!   character's bytes are held until a later token completes it, and only
//!   the text before it goes out; otherwise everything goes out, the offsets
//!   move up to the end, and the tokens before `prefix` are dropped.
//!
//! The text handed out is then held back while it ends in what could be the
//! start of a stop sequence; a stop sequence found ends the text right before
//! it, and nothing after it is ever handed out. A request with a minimum
//! length matches its stop sequences only in the text handed out from its
//! `min_tokens`-th token on ([`Detokenizer::matching_from`], vLLM's rule). Control tokens (the template's
//! turn markers, `<eos>`) never show: the tokenizer's
//! [`decode_text`](Tokenizer::decode_text) leaves them out, and the engine
//! asks [`Detokenizer::is_control`] to leave them out of log-probabilities too.

use std::sync::Arc;

use kvcache_models::Tokenizer;

use crate::sampling::TokenLogprobs;

/// What `U+FFFD` a lossy decoding ends in: bytes of a character not yet complete.
const INCOMPLETE: char = '\u{fffd}';

/// The tokenizer could not decode a request's tokens.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot decode the text of token {token}: {message}")]
pub struct DecodeError {
    /// The token whose text was being decoded.
    pub token: u32,
    /// The tokenizer's error.
    pub message: String,
}

/// What one [`Detokenizer::push`] adds to the answer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pushed {
    /// The new text, complete characters only, never any part of a stop
    /// sequence or anything after one.
    pub text: String,
    /// The index of the stop sequence this token completed (the earliest in
    /// the text; the lowest index of those starting there): the answer ends
    /// right before it.
    pub stop: Option<usize>,
}

/// What a generated token shows of the answer ([`Detokenizer::token`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Shown {
    /// The text it adds.
    pub text: String,
    /// The stop sequence it completed, if any: the answer ends.
    pub stop: Option<usize>,
    /// Its log-probabilities, unless the text leaves it out.
    pub logprobs: Option<TokenLogprobs>,
}

impl Shown {
    /// A token of a request whose text nobody tells (an engine without a
    /// tokenizer): no text, its log-probabilities as they are.
    pub fn untold(logprobs: Option<TokenLogprobs>) -> Self {
        Shown {
            logprobs,
            ..Shown::default()
        }
    }
}

/// One request's answer as text (see the [module](self)).
#[derive(Debug)]
pub struct Detokenizer {
    tokenizer: Arc<dyn Tokenizer>,
    /// The tokens from `prefix` on (earlier ones are dropped).
    window: Vec<u32>,
    /// Where the tokens not yet handed out start in `window`.
    read: usize,
    /// The decoding of `window[..read]`: text already handed out.
    prefix_text: String,
    /// Bytes of the text of `window[read..]` already handed out (those
    /// before an incomplete character at its end).
    sent: usize,
    stops: StopMatcher,
    /// Tokens pushed so far.
    pushed: usize,
    /// The token from which on stop sequences are matched (1-based; 0 and 1:
    /// from the first).
    match_from: usize,
}

impl Detokenizer {
    /// The text of an answer of `tokenizer`'s tokens that ends before the
    /// first of `stops` (empty ones are ignored).
    pub fn new(tokenizer: Arc<dyn Tokenizer>, stops: Vec<String>) -> Self {
        Detokenizer {
            tokenizer,
            window: Vec::new(),
            read: 0,
            prefix_text: String::new(),
            sent: 0,
            stops: StopMatcher::new(stops),
            pushed: 0,
            match_from: 0,
        }
    }

    /// Matches the stop sequences only in the text handed out from the
    /// `min_tokens`-th token on: a stop sequence that starts earlier is not
    /// one.
    pub fn matching_from(mut self, min_tokens: usize) -> Self {
        self.match_from = min_tokens;
        self
    }

    /// Whether stop sequences are matched in the text of the token pushed last.
    fn matching(&self) -> bool {
        self.pushed >= self.match_from
    }

    /// Adds the next generated `token`: the text it completes, and the stop
    /// sequence it completes if any. After a stop, nothing more.
    pub fn push(&mut self, token: u32) -> Result<Pushed, DecodeError> {
        if self.stops.stopped {
            return Ok(Pushed::default());
        }
        self.window.push(token);
        self.pushed += 1;
        let text = self.decode(token, false)?;
        if !self.matching() {
            return Ok(Pushed { text, stop: None });
        }
        Ok(self.stops.push(&text))
    }

    /// Ends the answer (a stop token or the length ended it): the text still
    /// held, an incomplete character at the end as `U+FFFD` (as a decoding
    /// of the whole answer writes it), then what was held for stop
    /// sequences. Empty after a stop.
    pub fn finish(&mut self) -> Result<String, DecodeError> {
        if self.stops.stopped {
            return Ok(String::new());
        }
        let last = self.window.last().copied().unwrap_or_default();
        let text = self.decode(last, true)?;
        if !self.matching() {
            return Ok(text);
        }
        let pushed = self.stops.push(&text);
        let mut out = pushed.text;
        if pushed.stop.is_none() {
            out.push_str(&self.stops.finish());
        }
        Ok(out)
    }

    /// What the engine's generated `token`, with `logprobs` when asked for,
    /// shows: a stop token (`stop_token`) adds nothing of its own and ends
    /// the answer, as does the `last` token; their text is what was still
    /// held. Stop and control tokens carry no log-probabilities.
    pub fn token(
        &mut self,
        token: u32,
        stop_token: bool,
        last: bool,
        logprobs: Option<TokenLogprobs>,
    ) -> Result<Shown, DecodeError> {
        if stop_token {
            return Ok(Shown {
                text: self.finish()?,
                stop: None,
                logprobs: None,
            });
        }
        let Pushed { mut text, stop } = self.push(token)?;
        if stop.is_none() && last {
            text.push_str(&self.finish()?);
        }
        let logprobs = match logprobs {
            Some(lp) if !self.is_control(token)? => Some(lp),
            _ => None,
        };
        Ok(Shown { text, stop, logprobs })
    }

    /// Whether `token` is a control token: one that stands for bytes (its
    /// written form) but that the answer's text leaves out.
    pub fn is_control(&self, token: u32) -> Result<bool, DecodeError> {
        let text = self
            .tokenizer
            .decode_text(&[token])
            .map_err(|e| decode_error(token, e))?;
        Ok(text.is_empty() && !self.tokenizer.token_bytes(token).is_empty())
    }

    /// The text the window adds past `prefix_text` not handed out yet:
    /// all of it, moving the offsets up, unless it ends in an incomplete
    /// character (and not `force`): then what comes before that character.
    fn decode(&mut self, token: u32, force: bool) -> Result<String, DecodeError> {
        let text = self
            .tokenizer
            .decode_text(&self.window)
            .map_err(|e| decode_error(token, e))?;
        let unaligned = |what: &str| DecodeError {
            token,
            message: format!("the decoding of the latest tokens {text:?} {what}"),
        };
        let new = text
            .strip_prefix(self.prefix_text.as_str())
            .ok_or_else(|| unaligned("does not continue the text handed out"))?;
        let complete = force || !new.ends_with(INCOMPLETE);
        let ready = if complete {
            new
        } else {
            &new[..new.len() - INCOMPLETE.len_utf8()]
        };
        let out = ready
            .get(self.sent..)
            .ok_or_else(|| unaligned("lost text already handed out"))?
            .to_string();
        if complete {
            // The new prefix is the old read offset: drop what lies before it.
            self.prefix_text = new.to_string();
            self.window.drain(..self.read);
            self.read = self.window.len();
            self.sent = 0;
        } else {
            self.sent = ready.len();
        }
        Ok(out)
    }
}

fn decode_error(token: u32, e: impl std::fmt::Display) -> DecodeError {
    DecodeError {
        token,
        message: e.to_string(),
    }
}

/// Stop sequences matched on text handed out in pieces: a piece is let out
/// once it cannot be part of a stop sequence; the held tail is at most one
/// byte shorter than the longest stop, so matching costs the piece's length.
#[derive(Debug, Clone, Default)]
struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopMatcher {
    fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stopped: false,
        }
    }

    /// Adds `text`: what may be shown now, and the stop found if any.
    fn push(&mut self, text: &str) -> Pushed {
        if self.stopped {
            return Pushed::default();
        }
        if self.stops.is_empty() {
            return Pushed {
                text: text.to_string(),
                stop: None,
            };
        }
        self.held.push_str(text);
        let first = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| self.held.find(s.as_str()).map(|at| (at, i)))
            .min();
        if let Some((at, i)) = first {
            self.stopped = true;
            let text = self.held[..at].to_string();
            self.held.clear();
            return Pushed { text, stop: Some(i) };
        }
        // Hold back the longest tail that is a proper prefix of some stop.
        let hold = self
            .stops
            .iter()
            .map(|s| longest_suffix_prefix(&self.held, s))
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - hold;
        let text = self.held[..cut].to_string();
        self.held.drain(..cut);
        Pushed { text, stop: None }
    }

    /// The text still held back, once the answer ended without a stop.
    fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`,
/// cut on character boundaries.
fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    let longest = (stop.len() - 1).min(text.len());
    (1..=longest)
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n)
                && stop.as_bytes().starts_with(&text.as_bytes()[text.len() - n..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(stops: &[&str]) -> StopMatcher {
        StopMatcher::new(stops.iter().map(|s| s.to_string()).collect())
    }

    /// Token 0 is `a`; 1 and 2 are the two bytes of `é`.
    #[derive(Debug)]
    struct SplitE;

    impl Tokenizer for SplitE {
        fn encode(&self, _: &str) -> kvcache_models::Result<Vec<u32>> {
            Ok(Vec::new())
        }
        fn chat_ids(
            &self,
            _: &[kvcache_models::tokenizer::Message],
            _: bool,
        ) -> kvcache_models::Result<Vec<u32>> {
            Ok(Vec::new())
        }
        fn decode(&self, ids: &[u32]) -> kvcache_models::Result<String> {
            let bytes: Vec<u8> = ids.iter().flat_map(|&t| self.token_bytes(t)).collect();
            Ok(String::from_utf8_lossy(&bytes).into_owned())
        }
        fn decode_text(&self, ids: &[u32]) -> kvcache_models::Result<String> {
            self.decode(ids)
        }
        fn token_bytes(&self, id: u32) -> Vec<u8> {
            vec![[b'a', 0xc3, 0xa9][id as usize]]
        }
        fn eos_token_id(&self) -> u32 {
            0
        }
        fn end_of_turn_ids(&self) -> Vec<u32> {
            Vec::new()
        }
        fn vocab_size(&self) -> usize {
            3
        }
    }

    #[test]
    fn stop_sequences_are_matched_from_the_min_tokens_th_token_on() {
        let tokens = |stops: &[&str], min: usize, ids: &[u32]| -> Vec<Pushed> {
            let stops = stops.iter().map(|s| s.to_string()).collect();
            let mut text = Detokenizer::new(Arc::new(SplitE), stops).matching_from(min);
            ids.iter().map(|&id| text.push(id).unwrap()).collect()
        };
        let pushed = |text: &str, stop: Option<usize>| Pushed {
            text: text.into(),
            stop,
        };
        // `a` stops the text only from the third token on.
        assert_eq!(
            tokens(&["a"], 3, &[0, 0, 0, 0]),
            [
                pushed("a", None),
                pushed("a", None),
                pushed("", Some(0)),
                pushed("", None)
            ]
        );
        // An `é` split over tokens 2 and 3 completes at the third: matched.
        assert_eq!(
            tokens(&["é"], 3, &[1, 2, 1, 2]),
            [
                pushed("", None),
                pushed("é", None),
                pushed("", None),
                pushed("", Some(0))
            ]
        );
        // Without a minimum, from the first.
        assert_eq!(tokens(&["a"], 0, &[0]), [pushed("", Some(0))]);
        // A length end before the minimum tells everything, stops unmatched.
        let mut text = Detokenizer::new(Arc::new(SplitE), vec!["a".into()]).matching_from(5);
        assert_eq!(text.push(0).unwrap(), pushed("a", None));
        assert_eq!(text.token(0, false, true, None).unwrap().text, "a");
    }

    #[test]
    fn a_stop_sequence_across_pieces_is_cut_once() {
        let mut stop = matcher(&["END", ""]);
        assert_eq!(stop.push("hello E").text, "hello ");
        assert_eq!(stop.push("N"), Pushed::default());
        assert_eq!(
            stop.push("D and more"),
            Pushed {
                text: String::new(),
                stop: Some(0)
            }
        );
        assert_eq!(stop.push("x"), Pushed::default());
        assert_eq!(stop.finish(), "");
    }

    #[test]
    fn held_text_is_released_when_it_cannot_stop() {
        let mut stop = matcher(&["ab"]);
        assert_eq!(stop.push("xa").text, "x");
        assert_eq!(stop.push("c").text, "ac");
        assert_eq!(stop.push("é a").text, "é ");
        assert_eq!(stop.finish(), "a");
    }

    #[test]
    fn the_earliest_stop_wins_then_the_lowest_index() {
        let mut stop = matcher(&["cd", "bc", "b"]);
        assert_eq!(
            stop.push("abcd"),
            Pushed {
                text: "a".into(),
                stop: Some(1)
            }
        );
    }
}
