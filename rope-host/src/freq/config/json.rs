//! The JSON text of a `rope_scaling` object read into its entries: one object whose values
//! are `null`, booleans, numbers, strings or arrays of numbers (RFC 8259's grammar for each).
//! Numbers without a fraction or exponent that fit an `i64` are [`ConfigValue::Int`], the rest
//! [`ConfigValue::Float`]. Anything else (nested objects, arrays of other values, a repeated key,
//! text after the object) is refused: no `rope_scaling` family reads such a value.

use super::ConfigValue;
use crate::error::{Error, Result, invalid};

/// The entries of the JSON object `text`, in order.
///
/// # Errors
/// [`Error::Invalid`] naming `scaling`, with the byte offset, for text outside the grammar.
pub(super) fn object(text: &str) -> Result<Vec<(String, ConfigValue)>> {
    let mut p = Parser {
        bytes: text.as_bytes(),
        at: 0,
    };
    let mut entries: Vec<(String, ConfigValue)> = Vec::new();
    p.require(b'{')?;
    if !p.eat(b'}') {
        loop {
            let key = p.string()?;
            p.require(b':')?;
            let value = p.value(&key)?;
            if entries.iter().any(|(k, _)| *k == key) {
                return Err(p.error(&format!("the key {key:?} repeats")));
            }
            entries.push((key, value));
            if p.eat(b'}') {
                break;
            }
            p.require(b',')?;
        }
    }
    p.skip_space();
    if p.at != p.bytes.len() {
        return Err(p.error("text follows the object"));
    }
    Ok(entries)
}

struct Parser<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Parser<'_> {
    fn error(&self, what: &str) -> Error {
        invalid(
            "scaling",
            format!(
                "not a JSON object of numbers, strings, booleans, nulls and arrays of numbers: {what} at byte {}",
                self.at
            ),
        )
    }

    /// The bytes not read yet.
    fn rest(&self) -> &[u8] {
        self.bytes.get(self.at..).unwrap_or_default()
    }

    fn skip_space(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.bytes.get(self.at) {
            self.at += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.skip_space();
        self.bytes.get(self.at).copied()
    }

    /// Consumes `b` (after white space) if it comes next.
    fn eat(&mut self, b: u8) -> bool {
        let next = self.peek() == Some(b);
        if next {
            self.at += 1;
        }
        next
    }

    /// Consumes `b` (after white space), or fails.
    fn require(&mut self, b: u8) -> Result<()> {
        if self.eat(b) {
            Ok(())
        } else {
            Err(self.error(&format!("expected '{}'", char::from(b))))
        }
    }

    fn value(&mut self, key: &str) -> Result<ConfigValue> {
        match self.peek() {
            Some(b'n') => self.word("null", ConfigValue::Null),
            Some(b't') => self.word("true", ConfigValue::Bool(true)),
            Some(b'f') => self.word("false", ConfigValue::Bool(false)),
            Some(b'"') => Ok(ConfigValue::Str(self.string()?)),
            Some(b'[') => {
                self.at += 1;
                let mut list = Vec::new();
                if !self.eat(b']') {
                    loop {
                        match self.number()? {
                            ConfigValue::Int(i) => list.push(i as f64),
                            ConfigValue::Float(x) => list.push(x),
                            _ => return Err(self.error(&format!("{key:?} holds a non-number"))),
                        }
                        if self.eat(b']') {
                            break;
                        }
                        self.require(b',')?;
                    }
                }
                Ok(ConfigValue::List(list))
            }
            Some(b'-' | b'0'..=b'9') => self.number(),
            _ => Err(self.error(&format!("{key:?} has an unsupported value"))),
        }
    }

    fn word(&mut self, word: &str, value: ConfigValue) -> Result<ConfigValue> {
        if self.rest().starts_with(word.as_bytes()) {
            self.at += word.len();
            Ok(value)
        } else {
            Err(self.error("unknown literal"))
        }
    }

    /// A number: `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`.
    fn number(&mut self) -> Result<ConfigValue> {
        self.skip_space();
        let start = self.at;
        let digits = |p: &mut Self| {
            let from = p.at;
            while p.bytes.get(p.at).is_some_and(u8::is_ascii_digit) {
                p.at += 1;
            }
            p.at > from
        };
        if self.bytes.get(self.at) == Some(&b'-') {
            self.at += 1;
        }
        let int_start = self.at;
        let leading_zero = self.bytes.get(self.at) == Some(&b'0');
        if !digits(self) || (leading_zero && self.at - int_start > 1) {
            return Err(self.error("malformed number"));
        }
        let mut integral = true;
        if self.bytes.get(self.at) == Some(&b'.') {
            self.at += 1;
            integral = false;
            if !digits(self) {
                return Err(self.error("malformed number"));
            }
        }
        if let Some(b'e' | b'E') = self.bytes.get(self.at) {
            self.at += 1;
            integral = false;
            if let Some(b'+' | b'-') = self.bytes.get(self.at) {
                self.at += 1;
            }
            if !digits(self) {
                return Err(self.error("malformed number"));
            }
        }
        let lexeme = self
            .bytes
            .get(start..self.at)
            .and_then(|l| std::str::from_utf8(l).ok())
            .unwrap_or_default();
        if integral && let Ok(i) = lexeme.parse::<i64>() {
            return Ok(ConfigValue::Int(i));
        }
        lexeme
            .parse::<f64>()
            .map(ConfigValue::Float)
            .map_err(|_| self.error("malformed number"))
    }

    /// A string, its escapes decoded.
    fn string(&mut self) -> Result<String> {
        if self.peek() != Some(b'"') {
            return Err(self.error("expected a string"));
        }
        self.at += 1;
        let mut out = String::new();
        loop {
            let rest = self.rest();
            let plain = rest
                .iter()
                .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
                .ok_or_else(|| self.error("unterminated string"))?;
            let text = rest.get(..plain).unwrap_or_default();
            out.push_str(std::str::from_utf8(text).map_err(|_| self.error("invalid UTF-8"))?);
            self.at += plain;
            match self.bytes.get(self.at).copied().unwrap_or_default() {
                b'"' => {
                    self.at += 1;
                    return Ok(out);
                }
                b'\\' => {
                    let escape = self.bytes.get(self.at + 1).copied();
                    self.at += 2;
                    let c = match escape {
                        Some(b'"') => '"',
                        Some(b'\\') => '\\',
                        Some(b'/') => '/',
                        Some(b'b') => '\u{8}',
                        Some(b'f') => '\u{c}',
                        Some(b'n') => '\n',
                        Some(b'r') => '\r',
                        Some(b't') => '\t',
                        Some(b'u') => self.unicode_escape()?,
                        _ => return Err(self.error("unknown escape")),
                    };
                    out.push(c);
                }
                _ => return Err(self.error("control character in a string")),
            }
        }
    }

    /// The character of a `\u` escape whose `u` was just consumed (a surrogate pair takes two).
    fn unicode_escape(&mut self) -> Result<char> {
        let hex = |p: &mut Self| -> Result<u32> {
            let digits = p
                .bytes
                .get(p.at..p.at + 4)
                .and_then(|d| std::str::from_utf8(d).ok())
                .and_then(|d| u32::from_str_radix(d, 16).ok())
                .ok_or_else(|| p.error("malformed \\u escape"))?;
            p.at += 4;
            Ok(digits)
        };
        let first = hex(self)?;
        let code = if (0xd800..0xdc00).contains(&first) {
            if !self.rest().starts_with(b"\\u") {
                return Err(self.error("unpaired surrogate"));
            }
            self.at += 2;
            let second = hex(self)?;
            if !(0xdc00..0xe000).contains(&second) {
                return Err(self.error("unpaired surrogate"));
            }
            0x10000 + ((first - 0xd800) << 10) + (second - 0xdc00)
        } else {
            first
        };
        char::from_u32(code).ok_or_else(|| self.error("unpaired surrogate"))
    }
}

#[cfg(test)]
mod tests {
    use super::{ConfigValue, object};

    #[test]
    fn a_rope_scaling_object_reads_into_its_entries_in_order() {
        let e = object(
            r#" { "rope_type" : "yarn", "factor": 40, "mscale": 1.0, "beta_fast": null,
                 "truncate": false, "short_factor": [1, 1.5e0, -2], "long_factor": [],
                 "name": "a\"b\\c\u00e9\ud83d\ude00" } "#,
        )
        .expect("valid");
        let want = vec![
            ("rope_type", ConfigValue::Str("yarn".into())),
            ("factor", ConfigValue::Int(40)),
            ("mscale", ConfigValue::Float(1.0)),
            ("beta_fast", ConfigValue::Null),
            ("truncate", ConfigValue::Bool(false)),
            ("short_factor", ConfigValue::List(vec![1.0, 1.5, -2.0])),
            ("long_factor", ConfigValue::List(vec![])),
            ("name", ConfigValue::Str("a\"b\\c\u{e9}\u{1f600}".into())),
        ];
        let got: Vec<(&str, ConfigValue)> =
            e.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        assert_eq!(got, want);
        assert_eq!(object("{}").expect("empty"), vec![]);
        // Integers beyond i64 are floats.
        assert_eq!(
            object(r#"{"x": 9223372036854775808}"#).expect("valid")[0].1,
            ConfigValue::Float(9.223_372_036_854_776e18)
        );
    }

    #[test]
    fn text_outside_the_grammar_is_refused_naming_scaling() {
        for bad in [
            "",
            "[]",
            r#"{"a": 1"#,
            r#"{"a": 1,}"#,
            r#"{"a": {"b": 1}}"#,
            r#"{"a": ["x"]}"#,
            r#"{"a": [[1]]}"#,
            r#"{"a": 01}"#,
            r#"{"a": -}"#,
            r#"{"a": 1.}"#,
            r#"{"a": 1e}"#,
            r#"{"a": .5}"#,
            r#"{"a": nul}"#,
            r#"{"a": "\x"}"#,
            r#"{"a": "\ud800"}"#,
            "{\"a\": \"tab\there\"}",
            r#"{"a": 1, "a": 2}"#,
            r#"{"a": 1} x"#,
            r#"{a: 1}"#,
        ] {
            let e = object(bad).expect_err(bad);
            assert!(
                e.to_string().starts_with("scaling: not a JSON object"),
                "{bad:?}: {e}"
            );
        }
    }
}
