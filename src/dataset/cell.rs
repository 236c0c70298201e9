//! One field value of a record, as cheap as its JSON text allows.

use std::borrow::Cow;

/// A field value, as cheap as the text allows.
#[derive(Debug, PartialEq)]
pub enum Cell<'a> {
    Null,
    Bool(bool),
    /// A JSON number exactly as stored (PostgreSQL's numeric text, e.g. `-3.50`).
    Number(&'a str),
    String(Cow<'a, str>),
    /// An object or array.
    Json(serde_json::Value),
}

impl<'a> Cell<'a> {
    /// The cell of one JSON value's text (as the writers' field index finds it: a complete value).
    pub fn parse(text: &'a str) -> serde_json::Result<Cell<'a>> {
        Ok(match text.as_bytes().first() {
            Some(b'n') => Cell::Null,
            Some(b't') => Cell::Bool(true),
            Some(b'f') => Cell::Bool(false),
            // Without a backslash, a JSON string is exactly the text between its quotes.
            Some(b'"') if !text.contains('\\') => Cell::String(Cow::Borrowed(&text[1..text.len() - 1])),
            Some(b'"') => Cell::String(Cow::Owned(serde_json::from_str::<String>(text)?)),
            Some(b'{' | b'[') => Cell::Json(serde_json::from_str(text)?),
            _ => Cell::Number(text),
        })
    }
}
