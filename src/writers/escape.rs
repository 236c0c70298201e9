//! CSV cell rendering with formula-injection escaping (OWASP "CSV injection").

use std::borrow::Cow;

use serde_json::Value;

use crate::tenants::ColumnType;

/// Characters that make spreadsheet software treat a cell as a formula, including the
/// full-width look-alikes some spreadsheets normalise.
const FORMULA_TRIGGERS: &[char] = &['=', '+', '-', '@', '＝', '＋', '－', '＠'];

/// Prefixes `'` to text a spreadsheet would run as a formula: the first non-whitespace
/// character is a trigger, or the text starts with tab, CR or LF.
pub fn escape_formula(text: &str) -> Cow<'_, str> {
    let starts_with_control = text.starts_with(['\t', '\r', '\n']);
    let first_visible = text.trim_start().chars().next();
    if starts_with_control || first_visible.is_some_and(|c| FORMULA_TRIGGERS.contains(&c)) {
        Cow::Owned(format!("'{text}"))
    } else {
        Cow::Borrowed(text)
    }
}

/// The CSV text of one value of a column of type `ty`. Numbers of numeric columns stay as
/// written (`-3.5` is data, not a formula); every other text is escaped. `null` is empty.
pub fn csv_cell(value: Option<&Value>, ty: ColumnType) -> Cow<'_, str> {
    match value {
        None | Some(Value::Null) => Cow::Borrowed(""),
        Some(Value::Number(n)) if ty.is_numeric() => Cow::Owned(n.to_string()),
        Some(Value::String(s)) => escape_formula(s),
        Some(Value::Bool(b)) => Cow::Borrowed(if *b { "true" } else { "false" }),
        Some(other) => Cow::Owned(escape_formula(&other.to_string()).into_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn cells_are_escaped_by_the_rules() {
        use ColumnType::*;
        let cases: &[(Value, ColumnType, &str)] = &[
            (json!("plain"), String, "plain"),
            (json!("=SUM(A1:A2)"), String, "'=SUM(A1:A2)"),
            (json!("+1 555 0100"), String, "'+1 555 0100"),
            (json!("-2+3"), String, "'-2+3"),
            (json!("@SUM(A1)"), String, "'@SUM(A1)"),
            (json!("  =1+1"), String, "'  =1+1"),
            (json!("\tcell"), String, "'\tcell"),
            (json!("\rcell"), String, "'\rcell"),
            (json!("\ncell"), String, "'\ncell"),
            (json!("＝1+1"), String, "'＝1+1"),
            (json!("＋1"), String, "'＋1"),
            (json!("－1"), String, "'－1"),
            (json!("＠x"), String, "'＠x"),
            (json!("a=b"), String, "a=b"),
            (json!("say \"hi\", ok"), String, "say \"hi\", ok"),
            (json!("line1\nline2"), String, "line1\nline2"),
            (json!(-3.5), Number, "-3.5"),
            (json!(-7), Integer, "-7"),
            (json!(0.1), Number, "0.1"),
            (json!("-3.5"), String, "'-3.5"),
            (json!(true), Boolean, "true"),
            (json!(null), String, ""),
            (json!(-1), Json, "'-1"),
            (json!({"b": 1, "a": "x"}), Json, "{\"a\":\"x\",\"b\":1}"),
            (json!("2026-11-30T10:00:00Z"), Timestamp, "2026-11-30T10:00:00Z"),
            (json!(""), String, ""),
        ];
        for (value, ty, expected) in cases {
            assert_eq!(csv_cell(Some(value), *ty), *expected, "{value} as {ty:?}");
        }
        assert_eq!(csv_cell(None, String), "");
    }
}
