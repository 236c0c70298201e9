//! One record's fields read straight from its JSON text, without building a `serde_json::Value`
//! per row: keys and values stay slices of the text (the export hot path).

use std::borrow::Cow;
use std::fmt;

use serde::Deserialize;
use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

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
    pub fn parse(raw: &'a RawValue) -> serde_json::Result<Cell<'a>> {
        let text = raw.get();
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

/// The top-level fields of a record's JSON object, in the order of the text.
pub struct Fields<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

impl<'a> Fields<'a> {
    pub fn parse(json: &'a str) -> serde_json::Result<Fields<'a>> {
        serde_json::from_str(json)
    }

    /// The value of field `name`; records have a handful of fields, so a scan beats a map.
    pub fn get(&self, name: &str) -> serde_json::Result<Cell<'a>> {
        match self.0.iter().find(|(key, _)| key == name) {
            Some((_, raw)) => Cell::parse(raw),
            None => Ok(Cell::Null),
        }
    }
}

impl<'de> Deserialize<'de> for Fields<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(FieldsVisitor)
    }
}

struct FieldsVisitor;

impl<'de> Visitor<'de> for FieldsVisitor {
    type Value = Fields<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Fields<'de>, A::Error> {
        let mut fields = Vec::with_capacity(map.size_hint().unwrap_or(12));
        while let Some((key, value)) = map.next_entry::<Key<'de>, &'de RawValue>()? {
            fields.push((key.0, value));
        }
        Ok(Fields(fields))
    }
}

/// A map key, borrowed from the text unless it contains escapes.
struct Key<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string key")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_owned())))
            }
        }
        deserializer.deserialize_str(KeyVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn fields_borrow_from_the_text_and_keep_numbers_exact() {
        let text = r#"{"a": "plain", "b": "esc\"aped", "n": -3.50, "t": true, "z": null, "j": {"y": 1, "x": [2]}}"#;
        let fields = Fields::parse(text).unwrap();
        assert!(matches!(fields.get("a").unwrap(), Cell::String(Cow::Borrowed("plain"))));
        assert_eq!(fields.get("b").unwrap(), Cell::String(Cow::Owned("esc\"aped".into())));
        assert_eq!(fields.get("n").unwrap(), Cell::Number("-3.50"));
        assert_eq!(fields.get("t").unwrap(), Cell::Bool(true));
        assert_eq!(fields.get("z").unwrap(), Cell::Null);
        assert_eq!(fields.get("missing").unwrap(), Cell::Null);
        assert_eq!(fields.get("j").unwrap(), Cell::Json(json!({"x": [2], "y": 1})));
        assert!(Fields::parse("[1]").is_err());
    }
}
