//! One column's rule as written in a tenant file and recorded on the columns of an export:
//! `drop`, `null`, `truncate(n)` or `hash`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::schema::{Column, ColumnType};

/// The most characters `truncate(n)` may keep (beyond that it hides nothing).
pub const MAX_TRUNCATE: u32 = 1_000_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColumnRule {
    /// The column is not there at all: not in files, feed pages, schemas or filters.
    Drop,
    /// The column is there, always null.
    Null,
    /// Only the first n characters (Unicode scalar values) of the text.
    Truncate(u32),
    /// HMAC-SHA256 of the value's text with the partner's own key, its first 128 bits as 32
    /// lowercase hex digits:
    /// equal values give equal hashes for one partner (it can join), different ones for every
    /// other partner.
    Hash,
}

impl ColumnRule {
    /// Why this rule cannot apply to a column of type `ty` (`None`: it can).
    pub fn refusal(self, column: &Column) -> Option<String> {
        match (self, column.ty) {
            (ColumnRule::Truncate(_), ty) if ty != ColumnType::String => {
                Some(format!("truncate applies to string columns, and `{}` is a {ty:?} column", column.name))
            }
            (ColumnRule::Hash, ColumnType::Boolean) => Some(format!(
                "a hash of a boolean hides nothing (two values); use `drop` or `null` for `{}`",
                column.name
            )),
            _ => None,
        }
    }
}

impl fmt::Display for ColumnRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ColumnRule::Drop => f.write_str("drop"),
            ColumnRule::Null => f.write_str("null"),
            ColumnRule::Truncate(n) => write!(f, "truncate({n})"),
            ColumnRule::Hash => f.write_str("hash"),
        }
    }
}

impl FromStr for ColumnRule {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let unknown = || format!("`{text}` is not a column rule (drop, null, truncate(n) or hash)");
        match text {
            "drop" => Ok(ColumnRule::Drop),
            "null" => Ok(ColumnRule::Null),
            "hash" => Ok(ColumnRule::Hash),
            _ => {
                let n = text.strip_prefix("truncate(").and_then(|rest| rest.strip_suffix(')')).ok_or_else(unknown)?;
                match n.parse::<u32>() {
                    Ok(n) if (1..=MAX_TRUNCATE).contains(&n) => Ok(ColumnRule::Truncate(n)),
                    _ => Err(format!("truncate keeps 1 to {MAX_TRUNCATE} characters, not `{n}`")),
                }
            }
        }
    }
}

impl Serialize for ColumnRule {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ColumnRule {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_read_and_write_as_written_in_tenant_files() {
        for text in ["drop", "null", "hash", "truncate(1)", "truncate(20)"] {
            assert_eq!(text.parse::<ColumnRule>().unwrap().to_string(), text);
        }
        for bad in ["", "Hash", "truncate", "truncate()", "truncate(0)", "truncate(-1)", "truncate(2000000)", "mask"] {
            assert!(bad.parse::<ColumnRule>().is_err(), "{bad:?} accepted");
        }
    }
}
