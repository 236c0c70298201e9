//! CSV cell rendering with formula-injection escaping (OWASP "CSV injection").

use std::borrow::Cow;

use crate::dataset::Cell;
use crate::dataset::ColumnType;

/// Characters that make spreadsheet software treat a cell as a formula, including the
/// full-width look-alikes some spreadsheets normalise.
const FORMULA_TRIGGERS: &[char] = &['=', '+', '-', '@', '＝', '＋', '－', '＠'];

/// Characters a spreadsheet may skip before it decides a cell is a formula: whitespace,
/// controls (`\x1f`, `\x7f`…) and invisible format characters (soft hyphen, zero-width space,
/// BOM, bidirectional marks and isolates, Arabic letter mark, Mongolian vowel separator…).
fn invisible(c: char) -> bool {
    c.is_whitespace()
        || c.is_control()
        || matches!(c,
            '\u{00AD}' | '\u{0600}'..='\u{0605}' | '\u{061C}' | '\u{06DD}' | '\u{070F}' | '\u{180E}'
            | '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2060}'..='\u{2064}'
            | '\u{2066}'..='\u{206F}' | '\u{FEFF}' | '\u{FFF9}'..='\u{FFFB}')
}

/// Prefixes `'` to text a spreadsheet would run as a formula: the first visible character is a
/// trigger, or the text starts with tab, CR or LF.
pub fn escape_formula(text: &str) -> Cow<'_, str> {
    let starts_with_control = text.starts_with(['\t', '\r', '\n']);
    let first_visible = text.chars().find(|c| !invisible(*c));
    if starts_with_control || first_visible.is_some_and(|c| FORMULA_TRIGGERS.contains(&c)) {
        Cow::Owned(format!("'{text}"))
    } else {
        Cow::Borrowed(text)
    }
}

/// The CSV text of one cell of a column of type `ty`. Numbers of numeric columns are written as
/// stored (`-3.5` is data, not a formula); every other text is escaped. Null is empty.
pub fn csv_cell<'a>(cell: &'a Cell<'a>, ty: ColumnType) -> Cow<'a, str> {
    match cell {
        Cell::Null => Cow::Borrowed(""),
        Cell::Number(text) if ty.is_numeric() => Cow::Borrowed(text),
        Cell::Number(text) => escape_formula(text),
        Cell::String(text) => escape_formula(text),
        Cell::Bool(b) => Cow::Borrowed(if *b { "true" } else { "false" }),
        Cell::Json(value) => Cow::Owned(escape_formula(&value.to_string()).into_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_are_escaped_by_the_rules() {
        use ColumnType::*;
        // Inputs are JSON text, as stored.
        let cases: &[(&str, ColumnType, &str)] = &[
            (r#""plain""#, String, "plain"),
            (r#""=SUM(A1:A2)""#, String, "'=SUM(A1:A2)"),
            (r#""+1 555 0100""#, String, "'+1 555 0100"),
            (r#""-2+3""#, String, "'-2+3"),
            (r#""@SUM(A1)""#, String, "'@SUM(A1)"),
            (r#""  =1+1""#, String, "'  =1+1"),
            (r#""\tcell""#, String, "'\tcell"),
            (r#""\rcell""#, String, "'\rcell"),
            (r#""\ncell""#, String, "'\ncell"),
            (r#""＝1+1""#, String, "'＝1+1"),
            (r#""＋1""#, String, "'＋1"),
            (r#""－1""#, String, "'－1"),
            (r#""＠x""#, String, "'＠x"),
            (r#""a=b""#, String, "a=b"),
            (r#""say \"hi\", ok""#, String, "say \"hi\", ok"),
            (r#""line1\nline2""#, String, "line1\nline2"),
            (r#"-3.5"#, Number, "-3.5"),
            (r#"-7"#, Integer, "-7"),
            (r#"0.1"#, Number, "0.1"),
            (r#""-3.5""#, String, "'-3.5"),
            (r#"true"#, Boolean, "true"),
            (r#"null"#, String, ""),
            (r#"-1"#, Json, "'-1"),
            (r#"{"b": 1, "a": "x"}"#, Json, "{\"a\":\"x\",\"b\":1}"),
            (r#""2026-11-30T10:00:00Z""#, Timestamp, "2026-11-30T10:00:00Z"),
            (r#""""#, String, ""),
        ];
        for (json, ty, expected) in cases {
            let cell = Cell::parse(json).unwrap();
            assert_eq!(csv_cell(&cell, *ty), *expected, "{json} as {ty:?}");
        }
        assert_eq!(csv_cell(&Cell::Number("-3.50"), Number), "-3.50", "stored digits are kept");
    }

    #[test]
    fn invisible_characters_before_a_trigger_do_not_hide_it() {
        for lead in ['\u{200B}', '\u{FEFF}', '\u{202E}', '\u{2066}', '\u{061C}', '\u{00AD}', '\u{180E}', '\x1f', '\x7f']
        {
            for trigger in ['=', '+', '-', '@'] {
                let text = format!("{lead}{lead} {trigger}HYPERLINK(\"x\")");
                assert_eq!(escape_formula(&text), format!("'{text}"), "{:?}", lead);
            }
            let harmless = format!("{lead}hello");
            assert_eq!(escape_formula(&harmless), harmless, "{:?}", lead);
        }
    }
}
