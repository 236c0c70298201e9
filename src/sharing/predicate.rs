//! `jsonPredicateHints`: which files may hold a matching row, judged by their statistics. A file
//! is left out only when its exact bounds prove no row matches; anything this does not
//! understand (an op, a type, a column without statistics) keeps the file, so the rows a client
//! keeps never depend on it.
//!
//! A hint is the client's input: its text and its tree are bounded ([`MAX_HINT_BYTES`],
//! [`MAX_NODES`]), it is compiled once, and judging files spends at most [`BUDGET`] node visits
//! per query — past that every remaining file is kept, which is always a correct answer.

use std::cmp::Ordering;

use serde_json::Value;

use crate::writers::ColumnStats;

/// The longest hint text accepted.
pub const MAX_HINT_BYTES: usize = 64 * 1024;
/// The most nodes a hint's tree may have.
pub const MAX_NODES: usize = 1_000;
/// Node visits one query may spend judging its files (a few milliseconds of CPU).
pub const BUDGET: u64 = 2_000_000;

/// A hint compiled: its nodes as this module judges them.
#[derive(Debug, Clone, PartialEq)]
pub enum Predicate {
    And(Vec<Predicate>),
    Or(Vec<Predicate>),
    IsNull(String),
    Compare {
        op: Comparison,
        column: String,
        value: Value,
    },
    /// What is not judged (another op, type or shape): keeps every file.
    Unknown,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Comparison {
    Equal,
    Less,
    LessOrEqual,
    Greater,
    GreaterOrEqual,
}

impl Predicate {
    /// Parses and compiles the hint text, refusing an oversized or malformed one with what is
    /// wrong.
    pub fn parse(text: &str) -> Result<Predicate, String> {
        if text.len() > MAX_HINT_BYTES {
            return Err(format!("must be at most {MAX_HINT_BYTES} bytes"));
        }
        let tree: Value = serde_json::from_str(text).map_err(|_| "must be the text of a JSON predicate tree")?;
        let mut nodes = 0;
        compile(&tree, &mut nodes)
    }

    /// Which of the files (their statistics) may hold a matching row, spending at most `budget`
    /// node visits; files past the budget are kept.
    pub fn keep<'a>(&self, files: impl IntoIterator<Item = &'a [ColumnStats]>, mut budget: u64) -> Vec<bool> {
        let cost = self.nodes() as u64;
        files
            .into_iter()
            .map(|stats| {
                if budget < cost {
                    return true;
                }
                budget -= cost;
                self.may_match(stats)
            })
            .collect()
    }

    fn nodes(&self) -> usize {
        match self {
            Predicate::And(children) | Predicate::Or(children) => {
                1 + children.iter().map(Predicate::nodes).sum::<usize>()
            }
            _ => 1,
        }
    }

    /// Whether a file with `stats` may hold a row the hint matches.
    pub fn may_match(&self, stats: &[ColumnStats]) -> bool {
        match self {
            Predicate::And(children) => children.iter().all(|child| child.may_match(stats)),
            Predicate::Or(children) => children.iter().any(|child| child.may_match(stats)),
            Predicate::IsNull(column) => column_stats(column, stats).is_none_or(|s| s.null_count > 0),
            Predicate::Compare { op, column, value } => {
                let Some(stats) = column_stats(column, stats) else { return true };
                let below_min = stats.min.as_ref().filter(|_| stats.min_exact).and_then(|min| compare(value, min));
                let above_max = stats.max.as_ref().filter(|_| stats.max_exact).and_then(|max| compare(value, max));
                match op {
                    Comparison::Equal => below_min != Some(Ordering::Less) && above_max != Some(Ordering::Greater),
                    Comparison::Less => below_min.is_none_or(|o| o == Ordering::Greater),
                    Comparison::LessOrEqual => below_min != Some(Ordering::Less),
                    Comparison::Greater => above_max.is_none_or(|o| o == Ordering::Less),
                    Comparison::GreaterOrEqual => above_max != Some(Ordering::Greater),
                }
            }
            Predicate::Unknown => true,
        }
    }
}

/// Compiles `node`, checking the protocol's form (ops with `children`, columns with a `name`,
/// literals with a `value`) and counting nodes against [`MAX_NODES`].
fn compile(node: &Value, nodes: &mut usize) -> Result<Predicate, String> {
    *nodes += 1;
    if *nodes > MAX_NODES {
        return Err(format!("must have at most {MAX_NODES} nodes"));
    }
    let op = node.get("op").and_then(Value::as_str).ok_or("every node needs an `op`")?;
    match op {
        "column" if node.get("name").is_some_and(Value::is_string) => return Ok(Predicate::Unknown),
        "column" => return Err("a `column` node needs a `name`".to_owned()),
        "literal" if node.get("value").is_some() => return Ok(Predicate::Unknown),
        "literal" => return Err("a `literal` node needs a `value`".to_owned()),
        _ => {}
    }
    let children = node.get("children").and_then(Value::as_array).ok_or(format!("`{op}` needs `children`"))?;
    let compiled = children.iter().map(|child| compile(child, nodes)).collect::<Result<Vec<_>, _>>()?;
    let comparison = match op {
        "and" => return Ok(Predicate::And(compiled)),
        "or" => return Ok(Predicate::Or(compiled)),
        "isNull" => {
            return Ok(match children.as_slice() {
                [column] => column_name(column).map_or(Predicate::Unknown, Predicate::IsNull),
                _ => Predicate::Unknown,
            });
        }
        "equal" => Comparison::Equal,
        "lessThan" => Comparison::Less,
        "lessThanOrEqual" => Comparison::LessOrEqual,
        "greaterThan" => Comparison::Greater,
        "greaterThanOrEqual" => Comparison::GreaterOrEqual,
        _ => return Ok(Predicate::Unknown),
    };
    Ok(match children.as_slice() {
        [column, literal] => match (column_name(column), literal_value(literal)) {
            (Some(column), Some(value)) => Predicate::Compare { op: comparison, column, value },
            _ => Predicate::Unknown,
        },
        _ => Predicate::Unknown,
    })
}

fn column_name(node: &Value) -> Option<String> {
    if node.get("op").and_then(Value::as_str) != Some("column") {
        return None;
    }
    node.get("name").and_then(Value::as_str).map(str::to_owned)
}

fn column_stats<'a>(name: &str, stats: &'a [ColumnStats]) -> Option<&'a ColumnStats> {
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

    fn may_match(hint: &Value, stats: &[ColumnStats]) -> bool {
        Predicate::parse(&hint.to_string()).unwrap().may_match(stats)
    }

    fn check(hint: &Value) -> Result<Predicate, String> {
        Predicate::parse(&hint.to_string())
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

    #[test]
    fn oversized_hints_are_refused_and_judging_stops_at_the_budget() {
        let leaf = compare_hint("equal", "id", "t-300", "string");
        let null = json!({"op": "isNull", "children": [{"op": "column", "name": "a"}]});
        let wide = json!({"op": "or", "children": vec![null; MAX_NODES / 2 + 1]});
        assert!(wide.to_string().len() < MAX_HINT_BYTES);
        assert!(check(&wide).unwrap_err().contains("nodes"), "{} leaves of 2 nodes each", MAX_NODES / 2 + 1);
        let long = format!("{{\"op\": \"and\", \"children\": [], \"pad\": \"{}\"}}", "x".repeat(MAX_HINT_BYTES));
        assert!(Predicate::parse(&long).unwrap_err().contains("bytes"));
        // Within the budget the file is left out; past it, kept.
        let hint = Predicate::parse(&leaf.to_string()).unwrap();
        let s = stats();
        let files = [s.as_slice(), s.as_slice(), s.as_slice()];
        assert_eq!(hint.keep(files, BUDGET), vec![false, false, false]);
        assert_eq!(hint.keep(files, 1), vec![false, true, true], "one visit per file, then kept");
    }
}
