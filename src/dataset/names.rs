//! Identifier newtypes, parsed once where they enter the system (config files, URLs, tokens).

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize};

/// Defines a string newtype that can only hold a value accepted by `$valid`.
macro_rules! identifier {
    ($(#[$doc:meta])* $name:ident, $what:literal, $valid:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            pub fn parse(raw: &str) -> Result<Self, String> {
                let valid: fn(&str) -> bool = $valid;
                if valid(raw) {
                    Ok(Self(raw.to_owned()))
                } else {
                    Err(format!("`{raw}` is not a valid {}", $what))
                }
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let raw = String::deserialize(d)?;
                Self::parse(&raw).map_err(serde::de::Error::custom)
            }
        }

        impl std::borrow::Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }
    };
}

fn is_lower_ident(s: &str, extra: &[char], max: usize) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_lowercase())
        && s.len() <= max
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || extra.contains(&c))
}

identifier!(
    /// A tenant id: lowercase letters, digits and `-`, starting with a letter, at most 63 bytes.
    TenantId,
    "tenant id (lowercase letters, digits and '-', starting with a letter)",
    |s| is_lower_ident(s, &['-'], 63)
);

identifier!(
    /// A dataset name: lowercase letters, digits and `_`, starting with a letter, at most 63 bytes.
    DatasetName,
    "dataset name (lowercase letters, digits and '_', starting with a letter)",
    |s| is_lower_ident(s, &['_'], 63)
);

identifier!(
    /// A column name: lowercase letters, digits and `_`, starting with a letter, at most 63 bytes.
    ColumnName,
    "column name (lowercase letters, digits and '_', starting with a letter)",
    |s| is_lower_ident(s, &['_'], 63)
);

identifier!(
    /// A principal id: ASCII letters, digits and `.`, `_`, `@`, `-`, starting with a letter or digit.
    PrincipalId,
    "principal id (ASCII letters, digits and '.', '_', '@', '-')",
    |s| {
        s.len() <= 128
            && s.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
            && s.chars().all(|c| c.is_ascii_alphanumeric() || ".-_@".contains(c))
    }
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_ids_are_lowercase_slugs() {
        assert!(TenantId::parse("acme").is_ok());
        assert!(TenantId::parse("acme-eu-2").is_ok());
        for bad in ["", "Acme", "2acme", "acme_eu", "ac me", "acme/..", &"a".repeat(64)] {
            assert!(TenantId::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn dataset_and_column_names_use_underscores() {
        assert!(DatasetName::parse("support_tickets").is_ok());
        assert!(DatasetName::parse("support-tickets").is_err());
        assert!(ColumnName::parse("opened_at").is_ok());
        assert!(ColumnName::parse("_x").is_err());
        assert!(ColumnName::parse("Opened").is_err());
    }

    #[test]
    fn principal_ids_allow_emails_but_not_spaces_or_slashes() {
        assert!(PrincipalId::parse("alice@acme.example").is_ok());
        assert!(PrincipalId::parse("svc.partner-1").is_ok());
        for bad in ["", "-x", "a b", "a/b", "é"] {
            assert!(PrincipalId::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn deserializing_rejects_invalid_names() {
        let err = serde_json::from_str::<TenantId>("\"Bad\"").unwrap_err();
        assert!(err.to_string().contains("not a valid tenant id"));
    }
}
