//! One record's selected fields read straight from its JSON text (the export hot path): one
//! pass finds where each column's value lies, values stay slices of the text, and nothing is
//! allocated per row unless a string holds escapes or a value is an object or array.
//!
//! The text is PostgreSQL's rendering of a stored jsonb object, so it is valid JSON; the scan
//! still checks the structure it relies on and fails on anything else rather than guess.
//! serde_json's general parser validated and visited every byte of every field, selected or
//! not, and cost about a tenth of the worker's time.

use std::borrow::Cow;
use std::io;
use std::ops::Range;

use crate::dataset::Cell;
use crate::masking::ColumnMasks;

/// Finds the values of a fixed list of columns in records' JSON objects, reusing its buffers
/// from row to row.
pub struct FieldIndex {
    names: Vec<String>,
    found: Vec<Option<Range<usize>>>,
    /// A partner's column policy: every value read goes through it.
    masks: Option<ColumnMasks>,
}

/// One record's fields, as found by [`FieldIndex::read`].
pub struct Fields<'a> {
    json: &'a str,
    found: &'a [Option<Range<usize>>],
    masks: Option<&'a ColumnMasks>,
}

impl<'a> Fields<'a> {
    /// The value of column `column` (an index into the names the index was made with), as the
    /// partner receives it; an absent field is null.
    pub fn get(&self, column: usize) -> serde_json::Result<Cell<'a>> {
        let cell = match &self.found[column] {
            Some(range) => Cell::parse(&self.json[range.clone()])?,
            None => Cell::Null,
        };
        Ok(match self.masks {
            Some(masks) => masks.apply(column, cell),
            None => cell,
        })
    }
}

impl FieldIndex {
    pub fn new<'n>(names: impl IntoIterator<Item = &'n str>) -> Self {
        let names: Vec<String> = names.into_iter().map(str::to_owned).collect();
        let found = vec![None; names.len()];
        FieldIndex { names, found, masks: None }
    }

    /// Values read go through `masks` (one per name, the key's first).
    pub fn masked(self, masks: Option<ColumnMasks>) -> Self {
        FieldIndex { masks, ..self }
    }

    /// A record's key and fields, both as the partner receives them.
    pub fn read_record<'a>(&'a mut self, key: &'a str, json: &'a str) -> io::Result<(Cow<'a, str>, Fields<'a>)> {
        let fields = self.read(json)?;
        let key = match fields.masks {
            Some(masks) => masks.key(key),
            None => Cow::Borrowed(key),
        };
        Ok((key, fields))
    }

    /// Reads the top-level fields of the JSON object `json`, noting where each column's value is.
    pub fn read<'a>(&'a mut self, json: &'a str) -> io::Result<Fields<'a>> {
        self.found.iter_mut().for_each(|f| *f = None);
        self.scan(json).map_err(|at| {
            io::Error::new(io::ErrorKind::InvalidData, format!("record data is not a JSON object (byte {at})"))
        })?;
        Ok(Fields { json, found: &self.found, masks: self.masks.as_ref() })
    }

    /// The scan itself; an error is the byte offset where the text stopped making sense.
    fn scan(&mut self, json: &str) -> Result<(), usize> {
        let text = json.as_bytes();
        let mut at = expect(text, skip_space(text, 0), b'{')?;
        at = skip_space(text, at);
        if text.get(at) == Some(&b'}') {
            return end(text, at + 1);
        }
        loop {
            let key_start = at;
            let (key_end, escaped) = string_end(text, key_start)?;
            at = expect(text, skip_space(text, key_end), b':')?;
            let value_start = skip_space(text, at);
            let value_end = value_end(text, value_start)?;
            let key = &json[key_start + 1..key_end - 1];
            let column = if escaped {
                let key: String = serde_json::from_str(&json[key_start..key_end]).map_err(|_| key_start)?;
                self.names.iter().position(|name| *name == key)
            } else {
                self.names.iter().position(|name| name == key)
            };
            if let Some(column) = column {
                self.found[column] = Some(value_start..value_end);
            }
            at = skip_space(text, value_end);
            match text.get(at) {
                Some(b',') => at = skip_space(text, at + 1),
                Some(b'}') => return end(text, at + 1),
                _ => return Err(at),
            }
        }
    }
}

fn skip_space(text: &[u8], mut at: usize) -> usize {
    while text.get(at).is_some_and(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r')) {
        at += 1;
    }
    at
}

/// The offset after `byte` at `at`.
fn expect(text: &[u8], at: usize, byte: u8) -> Result<usize, usize> {
    if text.get(at) == Some(&byte) { Ok(at + 1) } else { Err(at) }
}

/// Nothing but whitespace may follow the object.
fn end(text: &[u8], at: usize) -> Result<(), usize> {
    let rest = skip_space(text, at);
    if rest == text.len() { Ok(()) } else { Err(rest) }
}

/// The offset after the string starting at `at`, and whether it holds escapes.
fn string_end(text: &[u8], at: usize) -> Result<(usize, bool), usize> {
    if text.get(at) != Some(&b'"') {
        return Err(at);
    }
    let (mut from, mut escaped) = (at + 1, false);
    loop {
        let found = text.get(from..).and_then(|rest| memchr::memchr2(b'"', b'\\', rest)).ok_or(at)?;
        let hit = from + found;
        if text[hit] == b'"' {
            return Ok((hit + 1, escaped));
        }
        escaped = true;
        from = hit + 2; // the backslash and the character it escapes
    }
}

/// The offset after the JSON value starting at `at`.
fn value_end(text: &[u8], at: usize) -> Result<usize, usize> {
    match text.get(at) {
        Some(b'"') => Ok(string_end(text, at)?.0),
        Some(b'{' | b'[') => nested_end(text, at),
        Some(_) => scalar_end(text, at),
        None => Err(at),
    }
}

/// The end of an object or array: brackets matched, strings skipped (the contents are checked
/// when the cell is parsed; only `json` columns and odd records have them). At most 128 levels
/// deep, serde_json's limit too.
fn nested_end(text: &[u8], at: usize) -> Result<usize, usize> {
    // One bit per open level: 1 for an object, 0 for an array.
    let (mut open, mut depth) = (0u128, 0u32);
    let mut i = at;
    while let Some(&byte) = text.get(i) {
        match byte {
            b'"' => {
                i = string_end(text, i)?.0;
                continue;
            }
            b'{' | b'[' if depth < 128 => {
                open = (open << 1) | u128::from(byte == b'{');
                depth += 1;
            }
            b'{' | b'[' => return Err(i),
            b'}' | b']' => {
                if (open & 1 == 1) != (byte == b'}') {
                    return Err(i);
                }
                open >>= 1;
                depth -= 1;
                if depth == 0 {
                    return Ok(i + 1);
                }
            }
            _ => {}
        }
        i += 1;
    }
    Err(at)
}

/// The end of `null`, `true`, `false` or a number, checked exactly: a number of a numeric
/// column is written to CSV unescaped, so nothing else may pass as one.
fn scalar_end(text: &[u8], at: usize) -> Result<usize, usize> {
    let len = text[at..].iter().position(|b| matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'));
    let end = at + len.unwrap_or(text.len() - at);
    let token = &text[at..end];
    if matches!(token, b"null" | b"true" | b"false") || is_json_number(token) { Ok(end) } else { Err(at) }
}

/// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`
fn is_json_number(token: &[u8]) -> bool {
    let digits = |from: usize| from + token[from..].iter().take_while(|b| b.is_ascii_digit()).count();
    let mut i = usize::from(token.first() == Some(&b'-'));
    match token.get(i) {
        Some(b'0') => i += 1,
        Some(b'1'..=b'9') => i = digits(i),
        _ => return false,
    }
    if token.get(i) == Some(&b'.') {
        let after = digits(i + 1);
        if after == i + 1 {
            return false;
        }
        i = after;
    }
    if matches!(token.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(token.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        let after = digits(i);
        if after == i {
            return false;
        }
        i = after;
    }
    i == token.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn index(names: &[&str]) -> FieldIndex {
        FieldIndex::new(names.iter().copied())
    }

    #[test]
    fn fields_borrow_from_the_text_and_keep_numbers_exact() {
        let text = r#"{"a": "plain", "b": "esc\"aped", "n": -3.50, "t": true, "z": null, "j": {"y": 1, "x": [2, "]"]}, "e\u0078": 1e-7}"#;
        let mut index = index(&["a", "b", "n", "t", "z", "missing", "j", "ex"]);
        let fields = index.read(text).unwrap();
        assert!(matches!(fields.get(0).unwrap(), Cell::String(Cow::Borrowed("plain"))));
        assert_eq!(fields.get(1).unwrap(), Cell::String(Cow::Owned("esc\"aped".into())));
        assert_eq!(fields.get(2).unwrap(), Cell::Number("-3.50"));
        assert_eq!(fields.get(3).unwrap(), Cell::Bool(true));
        assert_eq!(fields.get(4).unwrap(), Cell::Null);
        assert_eq!(fields.get(5).unwrap(), Cell::Null);
        assert_eq!(fields.get(6).unwrap(), Cell::Json(json!({"x": [2, "]"], "y": 1})));
        assert_eq!(fields.get(7).unwrap(), Cell::Number("1e-7"), "an escaped key is unescaped before matching");
    }

    #[test]
    fn the_index_is_reset_for_every_record() {
        let mut index = index(&["a"]);
        assert_eq!(index.read(r#"{"a": 1}"#).unwrap().get(0).unwrap(), Cell::Number("1"));
        assert_eq!(index.read(r#"{"b": 1}"#).unwrap().get(0).unwrap(), Cell::Null);
        assert_eq!(index.read("{}").unwrap().get(0).unwrap(), Cell::Null);
    }

    #[test]
    fn anything_but_one_json_object_is_refused() {
        let mut index = index(&["a"]);
        for bad in [
            "",
            "[1]",
            "1",
            r#"{"a": 1"#,
            r#"{"a" 1}"#,
            r#"{"a": 1,}"#,
            r#"{"a": 1} x"#,
            r#"{"a": "x}"#,
            r#"{"a": -}"#,
            r#"{"a": 01}"#,
            r#"{"a": 1.}"#,
            r#"{"a": 1e}"#,
            r#"{"a": =1+1}"#,
            r#"{"a": -1+1}"#,
            r#"{"a": nul}"#,
            r#"{"a": [1, {"b": 2]}"#,
            r#"{"a": [1}, "b": 2]}"#,
            r#"{"a": "\"}"#,
            r#"{a: 1}"#,
            r#"{"a": 1 "b": 2}"#,
        ] {
            assert!(index.read(bad).is_err(), "{bad:?} was accepted");
        }
        let deep = |levels: usize| format!(r#"{{"a": {}{}}}"#, "[".repeat(levels), "]".repeat(levels));
        assert!(index.read(&deep(128)).is_ok());
        assert!(index.read(&deep(129)).is_err(), "deeper than serde_json would go");
    }

    /// Every field of PostgreSQL-style renderings of varied records is found as serde_json
    /// reads it.
    #[test]
    fn the_scan_agrees_with_serde_json() {
        let records = [
            json!({}),
            json!({"s": "", "u": "Zürich 東京 \u{1F600}", "q": "\\\"", "c": "\u{1}\n\t", "n": [], "o": {}}),
            json!({"deep": {"a": [[{"b": "}{]["}]], "c": null}, "x": -0.0, "y": 1.5e300, "z": false}),
            json!({"with space": 1, "\"quoted\"": 2, "back\\slash": "\\"}),
        ];
        for record in records {
            let Value::Object(map) = &record else { unreachable!() };
            let names: Vec<&str> = map.keys().map(String::as_str).collect();
            // PostgreSQL's spacing, and serde_json's compact form.
            let spaced = serde_json::to_string_pretty(&record).unwrap();
            for text in [spaced, record.to_string()] {
                let mut index = FieldIndex::new(names.iter().copied());
                let fields = index.read(&text).unwrap();
                for (i, (_, value)) in map.iter().enumerate() {
                    let value_text = value.to_string();
                    let expected = Cell::parse(&value_text).unwrap();
                    let cell = fields.get(i).unwrap();
                    let same = match (&cell, &expected) {
                        (Cell::Number(a), Cell::Number(b)) => a.parse::<f64>().unwrap() == b.parse::<f64>().unwrap(),
                        _ => cell == expected,
                    };
                    assert!(same, "{text}: {:?} read as {cell:?}", names[i]);
                }
            }
        }
    }

    #[test]
    fn numbers_follow_the_json_grammar() {
        for good in ["0", "-0", "7", "-3.50", "12.5e10", "1E+2", "1e-2", "10"] {
            assert!(is_json_number(good.as_bytes()), "{good}");
        }
        for bad in ["", "-", "+1", "01", "1.", ".5", "1e", "1e+", "1.2.3", "0x1", "1-1", "Infinity", "NaN"] {
            assert!(!is_json_number(bad.as_bytes()), "{bad}");
        }
    }
}
