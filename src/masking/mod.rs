//! Column policies: what a partner receives of each column of a dataset — all of it, nothing
//! (`drop`), always null, the first characters, or a keyed hash it can join on but not reverse.
//!
//! Declared per partner and dataset in the tenant file and checked at start-up; applied in one
//! place, to a value on its way to a partner: [`mask_cell`]. Files get it through the writers'
//! field reader (each output column carries its rule), feed pages through [`ColumnPolicy::record`].
//! A policy's fingerprint is frozen into every export and cursor cut under it, so once the
//! policy changes, old files and cursors are refused like those of a changed row filter.

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::{Map, Value};

pub use crate::dataset::{ColumnHasher, ColumnRule, HashPads, MAX_TRUNCATE};

use crate::dataset::{Cell, ColumnName, DatasetSchema, OutputColumn};
use crate::records::KeyOrder;

/// One partner's rules for one dataset, checked against its schema.
#[derive(Debug, Clone)]
pub struct ColumnPolicy {
    key_column: ColumnName,
    /// By column name; the key column's only possible rule is `hash`.
    rules: BTreeMap<ColumnName, ColumnRule>,
    /// The partner's key, when a rule hashes.
    hasher: Option<ColumnHasher>,
    fingerprint: String,
}

/// What an export's manifest says of the policy its files were cut under.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicySummary {
    pub fingerprint: String,
    pub columns: BTreeMap<String, String>,
}

impl ColumnPolicy {
    /// Checks `rules` against `schema`; an error names the column (the map key) and the reason.
    /// `hasher` is the partner's key, required when a rule hashes.
    pub fn new(
        schema: &DatasetSchema,
        rules: BTreeMap<ColumnName, ColumnRule>,
        hasher: Option<ColumnHasher>,
    ) -> Result<ColumnPolicy, (ColumnName, String)> {
        for (name, rule) in &rules {
            if *name == schema.key_column {
                if *rule != ColumnRule::Hash {
                    let why = format!("the key column `{name}` can only be hashed (every row needs a key)");
                    return Err((name.clone(), why));
                }
                continue;
            }
            let column = schema
                .column(name.as_str())
                .ok_or_else(|| (name.clone(), format!("dataset `{}` has no column `{name}`", schema.name)))?;
            if let Some(why) = rule.refusal(column) {
                return Err((name.clone(), why));
            }
        }
        let hasher = if rules.values().any(|r| *r == ColumnRule::Hash) {
            let Some(hasher) = hasher else {
                let (name, _) = rules.iter().find(|(_, r)| **r == ColumnRule::Hash).expect("found above");
                let why = "a `hash` rule needs the tenant's `[masking]` secret (or secret_env)".to_owned();
                return Err((name.clone(), why));
            };
            Some(hasher)
        } else {
            None
        };
        let key_id = hasher.as_ref().map(ColumnHasher::key_id);
        let declared = serde_json::json!({"rules": rules, "key_id": key_id});
        let fingerprint = crate::dataset::sha256_hex(declared.to_string().as_bytes())[..16].to_owned();
        Ok(ColumnPolicy { key_column: schema.key_column.clone(), rules, hasher, fingerprint })
    }

    /// Identifies the rules and the partner's hash key (never the key itself).
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    pub fn rule(&self, column: &str) -> Option<ColumnRule> {
        self.rules.get(column).copied()
    }

    pub fn hasher(&self) -> Option<&ColumnHasher> {
        self.hasher.as_ref()
    }

    /// Whether the partner receives hashed keys (in rows, tombstones, manifests).
    pub fn hashes_keys(&self) -> bool {
        self.rules.contains_key(&self.key_column)
    }

    /// The order this partner receives records in: by the hashed key it sees when its keys are
    /// hashed (the real key's order would let it undo the hash from row positions alone).
    pub fn key_order(&self) -> KeyOrder<'_> {
        match (&self.hasher, self.hashes_keys()) {
            (Some(hasher), true) => KeyOrder::Hashed(hasher),
            _ => KeyOrder::Key,
        }
    }

    pub fn summary(&self) -> PolicySummary {
        PolicySummary {
            fingerprint: self.fingerprint.clone(),
            columns: self.rules.iter().map(|(c, r)| (c.to_string(), r.to_string())).collect(),
        }
    }

    /// A column as this partner receives it: `None` when dropped; a masked column says so and
    /// is nullable; a hashed one is text.
    pub fn output_column(&self, column: OutputColumn) -> Option<OutputColumn> {
        let rule = self.rules.get(column.name.as_str()).copied();
        match rule {
            None => Some(column),
            Some(ColumnRule::Drop) => None,
            Some(ColumnRule::Hash) if column.name == self.key_column.as_str() => {
                Some(OutputColumn { masked: Some(ColumnRule::Hash), ..column })
            }
            Some(rule) => Some(OutputColumn {
                ty: match rule {
                    ColumnRule::Hash => crate::dataset::ColumnType::String,
                    _ => column.ty,
                },
                required: false,
                precision: None,
                scale: None,
                masked: Some(rule),
                ..column
            }),
        }
    }

    /// A record key as this partner receives it.
    pub fn key<'a>(&self, key: &'a str) -> Cow<'a, str> {
        match (&self.hasher, self.hashes_keys()) {
            (Some(hasher), true) => Cow::Owned(hasher.hash(key.as_bytes())),
            _ => Cow::Borrowed(key),
        }
    }

    /// A record's JSON object (a feed page's `data`) as this partner receives it.
    pub fn record(&self, data: &str) -> serde_json::Result<String> {
        let mut record: Map<String, Value> = serde_json::from_str(data)?;
        for (column, rule) in &self.rules {
            if *column == self.key_column {
                continue;
            }
            if *rule == ColumnRule::Drop {
                record.remove(column.as_str());
            } else if let Some(value) = record.get_mut(column.as_str()) {
                let text = value.to_string();
                *value = cell_value(mask_cell(*rule, Cell::parse(&text)?, self.hasher.as_ref()))?;
            }
        }
        serde_json::to_string(&record)
    }
}

/// A value as a partner under `rule` receives it. A hash rule without a key yields null (the
/// policy's constructor makes that impossible; a writer refuses such a spec up front).
pub fn mask_cell<'a>(rule: ColumnRule, cell: Cell<'a>, hasher: Option<&ColumnHasher>) -> Cell<'a> {
    match (rule, cell) {
        (_, Cell::Null) | (ColumnRule::Drop | ColumnRule::Null, _) => Cell::Null,
        (ColumnRule::Truncate(n), Cell::String(text)) => Cell::String(truncate(text, n)),
        (ColumnRule::Truncate(n), other) => Cell::String(truncate(Cow::Owned(text_of(&other).into_owned()), n)),
        (ColumnRule::Hash, other) => match hasher {
            Some(hasher) => Cell::String(Cow::Owned(hasher.hash(text_of(&other).as_bytes()))),
            None => Cell::Null,
        },
    }
}

/// The text a rule works on: a string's characters, a number's digits as stored, `true` or
/// `false`, an object's or array's compact JSON with sorted keys.
fn text_of<'a>(cell: &'a Cell<'_>) -> Cow<'a, str> {
    match cell {
        Cell::Null => Cow::Borrowed(""),
        Cell::Bool(b) => Cow::Borrowed(if *b { "true" } else { "false" }),
        Cell::Number(text) => Cow::Borrowed(text),
        Cell::String(text) => Cow::Borrowed(text),
        Cell::Json(value) => Cow::Owned(value.to_string()),
    }
}

/// The first `n` characters.
fn truncate(text: Cow<'_, str>, n: u32) -> Cow<'_, str> {
    match text.char_indices().nth(n as usize) {
        None => text,
        Some((at, _)) => match text {
            Cow::Borrowed(text) => Cow::Borrowed(&text[..at]),
            Cow::Owned(mut text) => {
                text.truncate(at);
                Cow::Owned(text)
            }
        },
    }
}

fn cell_value(cell: Cell<'_>) -> serde_json::Result<Value> {
    Ok(match cell {
        Cell::Null => Value::Null,
        Cell::Bool(b) => Value::Bool(b),
        Cell::Number(text) => serde_json::from_str(text)?,
        Cell::String(text) => Value::String(text.into_owned()),
        Cell::Json(value) => value,
    })
}

/// The rules of an export's output columns, applied to each value the writers read.
#[derive(Debug, Clone)]
pub struct ColumnMasks {
    rules: Vec<Option<ColumnRule>>,
    hasher: Option<ColumnHasher>,
}

impl ColumnMasks {
    /// The masks of `columns` (the key first), or `None` when no column is masked. Refuses a
    /// hash rule without a key.
    pub fn of(columns: &[OutputColumn], hasher: Option<&ColumnHasher>) -> Result<Option<ColumnMasks>, String> {
        // A retired column (see `OutputColumn::retired`) reads like a nulled one.
        let rules: Vec<Option<ColumnRule>> =
            columns.iter().map(|c| if c.retired { Some(ColumnRule::Null) } else { c.masked }).collect();
        if rules.iter().all(Option::is_none) {
            return Ok(None);
        }
        if hasher.is_none() && rules.contains(&Some(ColumnRule::Hash)) {
            return Err("a hashed column needs the partner's hash key".into());
        }
        Ok(Some(ColumnMasks { rules, hasher: hasher.cloned() }))
    }

    /// Column `column`'s value as the partner receives it.
    pub fn apply<'a>(&self, column: usize, cell: Cell<'a>) -> Cell<'a> {
        match self.rules.get(column).copied().flatten() {
            Some(rule) => mask_cell(rule, cell, self.hasher.as_ref()),
            None => cell,
        }
    }

    /// The record key as the partner receives it (the key column is column 0).
    pub fn key<'a>(&self, key: &'a str) -> Cow<'a, str> {
        match (self.rules.first().copied().flatten(), &self.hasher) {
            (Some(ColumnRule::Hash), Some(hasher)) => Cow::Owned(hasher.hash(key.as_bytes())),
            _ => Cow::Borrowed(key),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::ColumnType;

    fn schema() -> DatasetSchema {
        toml::from_str(
            "name='t'\nkey_column='id'\n[[columns]]\nname='email'\ntype='string'\nrequired=true\n\
             [[columns]]\nname='n'\ntype='integer'\n[[columns]]\nname='ok'\ntype='boolean'\n\
             [[columns]]\nname='tags'\ntype='json'\n\
             [[columns]]\nname='amount'\ntype='number'\nprecision=12\nscale=2",
        )
        .unwrap()
    }

    fn rules(pairs: &[(&str, &str)]) -> BTreeMap<ColumnName, ColumnRule> {
        pairs.iter().map(|(c, r)| (ColumnName::parse(c).unwrap(), r.parse().unwrap())).collect()
    }

    fn hasher(principal: &str) -> ColumnHasher {
        ColumnHasher::derive(b"0123456789abcdef0123456789abcdef", "acme", principal)
    }

    #[test]
    fn policies_are_checked_against_the_schema() {
        let refused = |pairs: &[(&str, &str)], h: Option<ColumnHasher>| {
            ColumnPolicy::new(&schema(), rules(pairs), h).unwrap_err().0.to_string()
        };
        assert_eq!(refused(&[("nope", "drop")], None), "nope");
        assert_eq!(refused(&[("id", "drop")], None), "id");
        assert_eq!(refused(&[("n", "truncate(3)")], None), "n");
        assert_eq!(refused(&[("ok", "hash")], Some(hasher("p"))), "ok");
        assert_eq!(refused(&[("email", "hash")], None), "email", "no key");
        let policy = ColumnPolicy::new(&schema(), rules(&[("id", "hash"), ("n", "drop")]), Some(hasher("p"))).unwrap();
        assert!(policy.hashes_keys());
    }

    #[test]
    fn fingerprints_follow_the_rules_and_the_partner_key() {
        let fp = |pairs: &[(&str, &str)], p: &str| {
            ColumnPolicy::new(&schema(), rules(pairs), Some(hasher(p))).unwrap().fingerprint().to_owned()
        };
        assert_eq!(fp(&[("email", "hash")], "p"), fp(&[("email", "hash")], "p"));
        assert_ne!(fp(&[("email", "hash")], "p"), fp(&[("email", "hash")], "q"));
        assert_ne!(fp(&[("email", "hash")], "p"), fp(&[("email", "null")], "p"));
        assert_eq!(fp(&[("email", "drop")], "p"), fp(&[("email", "drop")], "q"), "no hash: the key plays no part");
    }

    #[test]
    fn cells_are_masked_by_their_rule() {
        let h = hasher("p");
        let cell = |text: &'static str| Cell::parse(text).unwrap();
        let masked = |rule: &str, text: &'static str| mask_cell(rule.parse().unwrap(), cell(text), Some(&h));
        assert_eq!(masked("null", r#""x""#), Cell::Null);
        assert_eq!(masked("truncate(3)", r#""héllo""#), Cell::String("hél".into()));
        assert_eq!(masked("truncate(9)", r#""héllo""#), Cell::String("héllo".into()));
        assert_eq!(masked("truncate(2)", r#""a\"bc""#), Cell::String("a\"".into()));
        assert_eq!(masked("hash", "null"), Cell::Null, "null stays null");
        let Cell::String(hashed) = masked("hash", r#""a@b.example""#) else { panic!() };
        assert_eq!(hashed.len(), 32);
        assert!(hashed.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(masked("hash", r#""42""#), masked("hash", "42"), "a value's text is hashed");
        let other = mask_cell(ColumnRule::Hash, cell(r#""a@b.example""#), Some(&hasher("q")));
        assert_ne!(other, Cell::String(hashed.clone()), "another partner, another hash");
    }

    #[test]
    fn feed_records_get_the_same_values_as_files() {
        let h = hasher("p");
        let policy = ColumnPolicy::new(
            &schema(),
            rules(&[("id", "hash"), ("email", "hash"), ("tags", "drop")]),
            Some(h.clone()),
        )
        .unwrap();
        let record = policy.record(r#"{"n": 7, "tags": [1], "email": "a@b.example"}"#).unwrap();
        let expected = h.hash(b"a@b.example");
        assert_eq!(record, format!(r#"{{"email":"{expected}","n":7}}"#));
        assert_eq!(policy.key("t-1"), h.hash(b"t-1"));
    }

    #[test]
    fn the_policy_answers_for_each_column_and_orders_by_the_key_it_serves() {
        let h = hasher("p");
        let same_key = |got: Option<&ColumnHasher>| got.map(|k| k.hash(b"x")) == Some(h.hash(b"x"));
        let columns =
            ColumnPolicy::new(&schema(), rules(&[("email", "hash"), ("n", "drop")]), Some(h.clone())).unwrap();
        assert_eq!(columns.rule("email"), Some(ColumnRule::Hash));
        assert_eq!(columns.rule("n"), Some(ColumnRule::Drop));
        assert_eq!(columns.rule("ok"), None);
        assert!(same_key(columns.hasher()), "the partner's key");
        assert!(!columns.hashes_keys());
        assert!(matches!(columns.key_order(), KeyOrder::Key), "keys not hashed: the key's own order");
        assert!(matches!(columns.key("t-1"), Cow::Borrowed("t-1")));
        let summary = columns.summary();
        assert_eq!(summary.fingerprint, columns.fingerprint());
        let declared = [("email", "hash"), ("n", "drop")].map(|(c, r)| (c.to_owned(), r.to_owned()));
        assert_eq!(summary.columns, BTreeMap::from(declared));

        let keys = ColumnPolicy::new(&schema(), rules(&[("id", "hash")]), Some(h.clone())).unwrap();
        assert!(keys.hashes_keys());
        let KeyOrder::Hashed(ordered_by) = keys.key_order() else { panic!("hashed keys come in hashed order") };
        assert!(same_key(Some(ordered_by)));
        assert_eq!(keys.key("t-1"), h.hash(b"t-1"));

        let nothing_hashed = ColumnPolicy::new(&schema(), rules(&[("n", "null")]), Some(h.clone())).unwrap();
        assert!(nothing_hashed.hasher().is_none(), "no hash rule: the key is not kept");
    }

    #[test]
    fn each_column_is_described_as_the_partner_receives_it() {
        let schema = schema();
        let all = [("id", "hash"), ("email", "truncate(3)"), ("amount", "hash"), ("n", "null"), ("ok", "drop")];
        let policy = ColumnPolicy::new(&schema, rules(&all), Some(hasher("p"))).unwrap();
        let of = |name: &str| OutputColumn::of(schema.column(name).unwrap());
        let masked = |name: &str, ty, rule| OutputColumn {
            ty,
            required: false,
            precision: None,
            scale: None,
            masked: Some(rule),
            ..of(name)
        };
        let key = OutputColumn::key("id");
        let hashed_key = OutputColumn { masked: Some(ColumnRule::Hash), ..key.clone() };
        assert_eq!(policy.output_column(key), Some(hashed_key), "the key stays required text");
        assert_eq!(policy.output_column(of("ok")), None, "dropped");
        assert_eq!(policy.output_column(of("tags")), Some(of("tags")), "no rule: as declared");
        let email = masked("email", ColumnType::String, ColumnRule::Truncate(3));
        assert_eq!(policy.output_column(of("email")), Some(email), "nullable once masked");
        assert_eq!(policy.output_column(of("n")), Some(masked("n", ColumnType::Integer, ColumnRule::Null)));
        let amount = masked("amount", ColumnType::String, ColumnRule::Hash);
        assert_eq!(policy.output_column(of("amount")), Some(amount), "a hashed decimal is text");
    }

    #[test]
    fn an_exports_masks_follow_its_output_columns() {
        let h = hasher("p");
        let of = |name: &str| OutputColumn::of(schema().column(name).unwrap());
        let plain = [OutputColumn::key("id"), of("n")];
        assert!(ColumnMasks::of(&plain, Some(&h)).unwrap().is_none(), "nothing masked: no masks");

        let mut retired = of("email");
        retired.retire();
        let hashed_key = OutputColumn { masked: Some(ColumnRule::Hash), ..OutputColumn::key("id") };
        let columns = [hashed_key, retired.clone(), of("n")];
        assert!(ColumnMasks::of(&columns, None).is_err(), "a hashed column needs the key");
        let masks = ColumnMasks::of(&columns, Some(&h)).unwrap().expect("masks");
        assert_eq!(masks.key("t-1"), h.hash(b"t-1"));
        assert_eq!(masks.apply(1, Cell::String("a@b.example".into())), Cell::Null, "a retired column reads as null");
        assert_eq!(masks.apply(2, Cell::Number("7")), Cell::Number("7"));

        let masks = ColumnMasks::of(&[OutputColumn::key("id"), retired], Some(&h)).unwrap().expect("masks");
        assert!(matches!(masks.key("t-1"), Cow::Borrowed("t-1")), "a key not hashed is the key");
    }
}
