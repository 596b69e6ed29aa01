//! Just enough JSON to read cargo's `--message-format=json` lines (xtask has
//! no serde): objects, arrays, strings, numbers, booleans and null.

use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Bool(bool),
    Number(f64),
    String(String),
    Array(Vec<Value>),
    Object(BTreeMap<String, Value>),
}

impl Value {
    /// The member `key` of an object (`None` for anything else).
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Object(members) => members.get(key),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> &[Value] {
        match self {
            Value::Array(items) => items,
            _ => &[],
        }
    }
}

/// Parses one JSON document; `None` if it is not valid JSON.
pub fn parse(text: &str) -> Option<Value> {
    let mut parser = Parser {
        bytes: text.as_bytes(),
        pos: 0,
    };
    let value = parser.value()?;
    parser.skip_ws();
    (parser.pos == parser.bytes.len()).then_some(value)
}

struct Parser<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl Parser<'_> {
    fn skip_ws(&mut self) {
        while self.bytes.get(self.pos).is_some_and(u8::is_ascii_whitespace) {
            self.pos += 1;
        }
    }

    fn eat(&mut self, byte: u8) -> Option<()> {
        self.skip_ws();
        (self.bytes.get(self.pos) == Some(&byte)).then(|| self.pos += 1)
    }

    fn literal(&mut self, word: &str, value: Value) -> Option<Value> {
        let end = self.pos + word.len();
        (self.bytes.get(self.pos..end) == Some(word.as_bytes())).then(|| {
            self.pos = end;
            value
        })
    }

    fn value(&mut self) -> Option<Value> {
        self.skip_ws();
        match *self.bytes.get(self.pos)? {
            b'{' => self.object(),
            b'[' => self.array(),
            b'"' => self.string().map(Value::String),
            b't' => self.literal("true", Value::Bool(true)),
            b'f' => self.literal("false", Value::Bool(false)),
            b'n' => self.literal("null", Value::Null),
            _ => self.number(),
        }
    }

    fn object(&mut self) -> Option<Value> {
        self.eat(b'{')?;
        let mut members = BTreeMap::new();
        if self.eat(b'}').is_some() {
            return Some(Value::Object(members));
        }
        loop {
            self.skip_ws();
            let key = self.string()?;
            self.eat(b':')?;
            let value = self.value()?;
            members.insert(key, value);
            if self.eat(b',').is_none() {
                self.eat(b'}')?;
                return Some(Value::Object(members));
            }
        }
    }

    fn array(&mut self) -> Option<Value> {
        self.eat(b'[')?;
        let mut items = Vec::new();
        if self.eat(b']').is_some() {
            return Some(Value::Array(items));
        }
        loop {
            items.push(self.value()?);
            if self.eat(b',').is_none() {
                self.eat(b']')?;
                return Some(Value::Array(items));
            }
        }
    }

    fn number(&mut self) -> Option<Value> {
        let start = self.pos;
        while self
            .bytes
            .get(self.pos)
            .is_some_and(|b| b.is_ascii_digit() || b"+-.eE".contains(b))
        {
            self.pos += 1;
        }
        let text = std::str::from_utf8(&self.bytes[start..self.pos]).ok()?;
        text.parse().ok().map(Value::Number)
    }

    fn hex4(&mut self) -> Option<u32> {
        let digits = self.bytes.get(self.pos..self.pos + 4)?;
        self.pos += 4;
        u32::from_str_radix(std::str::from_utf8(digits).ok()?, 16).ok()
    }

    fn string(&mut self) -> Option<String> {
        if self.bytes.get(self.pos) != Some(&b'"') {
            return None;
        }
        self.pos += 1;
        let mut out = Vec::new();
        loop {
            let byte = *self.bytes.get(self.pos)?;
            self.pos += 1;
            match byte {
                b'"' => return String::from_utf8(out).ok(),
                b'\\' => {
                    let escape = *self.bytes.get(self.pos)?;
                    self.pos += 1;
                    let c = match escape {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => {
                            let high = self.hex4()?;
                            let code = if (0xD800..0xDC00).contains(&high) {
                                if self.bytes.get(self.pos..self.pos + 2) != Some(b"\\u") {
                                    return None;
                                }
                                self.pos += 2;
                                let low = self.hex4()?;
                                0x10000 + ((high - 0xD800) << 10) + (low.checked_sub(0xDC00)?)
                            } else {
                                high
                            };
                            char::from_u32(code)?
                        }
                        _ => return None,
                    };
                    let mut buf = [0u8; 4];
                    out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
                _ => out.push(byte),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cargo_artifact_line_is_read() {
        let line = r#"{"reason":"compiler-artifact","package_id":"path+file:///w/crates/kvcache-causal#0.1.0","target":{"kind":["test"],"crate_types":["bin"],"name":"rope","test":true},"profile":{"opt_level":"3","test":true},"filenames":["/t/rope-1"],"executable":"/t/a \"b\"\u00e9/rope-1","fresh":false,"n":-1.5e3}"#;
        let value = parse(line).unwrap();
        assert_eq!(
            value.get("reason").and_then(Value::as_str),
            Some("compiler-artifact")
        );
        let target = value.get("target").unwrap();
        assert_eq!(
            target.get("kind").unwrap().as_array(),
            &[Value::String("test".into())]
        );
        assert_eq!(
            value
                .get("profile")
                .and_then(|p| p.get("test"))
                .and_then(Value::as_bool),
            Some(true)
        );
        assert_eq!(
            value.get("executable").and_then(Value::as_str),
            Some("/t/a \"b\"é/rope-1")
        );
        assert_eq!(value.get("n"), Some(&Value::Number(-1500.0)));
        assert_eq!(
            parse(r#"{"executable":null}"#).unwrap().get("executable"),
            Some(&Value::Null)
        );
    }

    #[test]
    fn broken_json_is_refused() {
        for text in ["", "{", r#"{"a":}"#, r#"["a",]"#, r#""\q""#, "nul", "{} x"] {
            assert_eq!(parse(text), None, "{text:?}");
        }
        assert_eq!(parse(r#""\ud83d\ude00""#), Some(Value::String("😀".into())));
    }
}
