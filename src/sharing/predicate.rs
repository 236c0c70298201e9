//! `jsonPredicateHints`: which files may hold a matching row, judged by their statistics. A file
//! is left out only when its exact bounds prove no row matches; anything this does not
//! understand (an op, a type, a column without statistics) keeps the file, so the rows a client
//! keeps never depend on it.

use std::cmp::Ordering;

use serde_json::Value;

use crate::writers::ColumnStats;

/// Checks that `hint` is a predicate tree of the protocol's form (ops with `children`, columns
/// with a `name`, literals with a `value`), naming the first node that is not.
pub fn check(hint: &Value) -> Result<(), String> {
    let op = hint.get("op").and_then(Value::as_str).ok_or("every node needs an `op`")?;
    match op {
        "column" if hint.get("name").is_some_and(Value::is_string) => Ok(()),
        "column" => Err("a `column` node needs a `name`".to_owned()),
        "literal" if hint.get("value").is_some() => Ok(()),
        "literal" => Err("a `literal` node needs a `value`".to_owned()),
        _ => {
            let children = hint.get("children").and_then(Value::as_array).ok_or(format!("`{op}` needs `children`"))?;
            children.iter().try_for_each(check)
        }
    }
}

/// Whether a file with `stats` may hold a row `hint` matches.
pub fn may_match(hint: &Value, stats: &[ColumnStats]) -> bool {
    let children = hint.get("children").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
    match hint.get("op").and_then(Value::as_str).unwrap_or_default() {
        "and" => children.iter().all(|child| may_match(child, stats)),
        "or" => children.iter().any(|child| may_match(child, stats)),
        "isNull" => match children {
            [column] => column_stats(column, stats).is_none_or(|s| s.null_count > 0),
            _ => true,
        },
        op @ ("equal" | "lessThan" | "lessThanOrEqual" | "greaterThan" | "greaterThanOrEqual") => {
            let [column, literal] = children else { return true };
            let (Some(stats), Some(value)) = (column_stats(column, stats), literal_value(literal)) else { return true };
            let below_min = stats.min.as_ref().filter(|_| stats.min_exact).and_then(|min| compare(&value, min));
            let above_max = stats.max.as_ref().filter(|_| stats.max_exact).and_then(|max| compare(&value, max));
            match op {
                "equal" => below_min != Some(Ordering::Less) && above_max != Some(Ordering::Greater),
                "lessThan" => below_min.is_none_or(|o| o == Ordering::Greater),
                "lessThanOrEqual" => below_min != Some(Ordering::Less),
                "greaterThan" => above_max.is_none_or(|o| o == Ordering::Less),
                _ => above_max != Some(Ordering::Greater),
            }
        }
        _ => true,
    }
}

fn column_stats<'a>(node: &Value, stats: &'a [ColumnStats]) -> Option<&'a ColumnStats> {
    if node.get("op").and_then(Value::as_str) != Some("column") {
        return None;
    }
    let name = node.get("name").and_then(Value::as_str)?;
    stats.iter().find(|s| s.column == name)
}

/// A literal this compares: text of a `string`, or an `int`/`long`.
fn literal_value(node: &Value) -> Option<Value> {
    if node.get("op").and_then(Value::as_str) != Some("literal") {
        return None;
    }
    let text = node.get("value")?.as_str()?;
    match node.get("valueType").and_then(Value::as_str)? {
        "string" => Some(Value::String(text.to_owned())),
        "int" | "long" => text.parse::<i64>().ok().map(Value::from),
        _ => None,
    }
}

/// `value` against a bound of the same kind (text with text, integer with integer).
fn compare(value: &Value, bound: &Value) -> Option<Ordering> {
    match (value, bound) {
        (Value::String(a), Value::String(b)) => Some(a.as_str().cmp(b.as_str())),
        (Value::Number(a), Value::Number(b)) => Some(a.as_i64()?.cmp(&b.as_i64()?)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn stats() -> Vec<ColumnStats> {
        let stat = |column: &str, min: Value, max: Value, nulls: u64| ColumnStats {
            column: column.to_owned(),
            min: Some(min),
            max: Some(max),
            null_count: nulls,
            min_exact: true,
            max_exact: true,
        };
        vec![stat("id", json!("t-100"), json!("t-199"), 0), stat("n", json!(10), json!(20), 3)]
    }

    fn compare_hint(op: &str, column: &str, value: &str, ty: &str) -> Value {
        json!({"op": op, "children": [{"op": "column", "name": column, "valueType": ty},
            {"op": "literal", "value": value, "valueType": ty}]})
    }

    #[test]
    fn files_are_left_out_only_when_their_bounds_prove_no_row_matches() {
        let s = stats();
        let cases = [
            ("equal", "id", "t-150", "string", true),
            ("equal", "id", "t-099", "string", false),
            ("equal", "id", "t-200", "string", false),
            ("lessThan", "id", "t-100", "string", false),
            ("lessThan", "id", "t-101", "string", true),
            ("lessThanOrEqual", "id", "t-100", "string", true),
            ("greaterThan", "n", "20", "long", false),
            ("greaterThan", "n", "19", "int", true),
            ("greaterThanOrEqual", "n", "21", "long", false),
            ("greaterThanOrEqual", "n", "20", "long", true),
            // What it cannot judge keeps the file.
            ("equal", "n", "2026-01-01", "date", true),
            ("equal", "missing", "x", "string", true),
            ("equal", "n", "not a number", "long", true),
        ];
        for (op, column, value, ty, expected) in cases {
            assert_eq!(may_match(&compare_hint(op, column, value, ty), &s), expected, "{op} {column} {value}");
        }
        let no_null = json!({"op": "isNull", "children": [{"op": "column", "name": "id"}]});
        assert!(!may_match(&no_null, &s));
        let outside = compare_hint("equal", "id", "t-300", "string");
        let inside = compare_hint("equal", "id", "t-150", "string");
        assert!(!may_match(&json!({"op": "and", "children": [inside.clone(), outside.clone()]}), &s));
        assert!(may_match(&json!({"op": "or", "children": [inside, outside.clone()]}), &s));
        assert!(may_match(&json!({"op": "not", "children": [outside]}), &s), "not is never judged");
    }

    #[test]
    fn malformed_trees_name_what_is_missing() {
        assert!(check(&compare_hint("equal", "id", "x", "string")).is_ok());
        assert!(check(&json!({"children": []})).unwrap_err().contains("op"));
        assert!(check(&json!({"op": "and"})).unwrap_err().contains("children"));
        assert!(check(&json!({"op": "equal", "children": [{"op": "column"}]})).unwrap_err().contains("name"));
        assert!(check(&json!({"op": "equal", "children": [{"op": "literal"}]})).unwrap_err().contains("value"));
    }
}
