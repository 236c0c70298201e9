//! JSON Lines: one object per record, its keys sorted whatever the column order, values as
//! canonical JSON (numbers exactly as stored).

use std::io;

use super::Codec;
use super::OutputColumn;
use super::cell::Fields;
use super::format::{FormatSpec, Framing, RowEncoder};
use crate::dataset::Cell;

pub const SPEC: FormatSpec = FormatSpec {
    name: "jsonl",
    extension: "jsonl.gz",
    content_type: "application/gzip",
    compression: "gzip",
    framing: Framing::Gzip(|columns| Box::new(JsonlEncoder::new(columns))),
    codec: Codec::ZlibRs3,
};

struct JsonlEncoder {
    columns: Vec<OutputColumn>,
    /// Column indexes in the order of their names.
    sorted: Vec<usize>,
}

impl JsonlEncoder {
    fn new(columns: &[OutputColumn]) -> Self {
        let mut sorted: Vec<usize> = (0..columns.len()).collect();
        sorted.sort_by(|&a, &b| columns[a].name.cmp(&columns[b].name));
        JsonlEncoder { columns: columns.to_vec(), sorted }
    }
}

impl RowEncoder for JsonlEncoder {
    fn head(&mut self) -> io::Result<Vec<u8>> {
        Ok(Vec::new())
    }

    fn encode(&mut self, key: &str, fields: &Fields<'_>, line: &mut Vec<u8>) -> io::Result<()> {
        line.push(b'{');
        for (n, &i) in self.sorted.iter().enumerate() {
            if n > 0 {
                line.push(b',');
            }
            let column = &self.columns[i];
            serde_json::to_writer(&mut *line, &column.name)?;
            line.push(b':');
            if i == 0 {
                serde_json::to_writer(&mut *line, key)?; // the key column is always first
            } else {
                write_json(line, &fields.get(i)?)?;
            }
        }
        line.extend_from_slice(b"}\n");
        Ok(())
    }
}

/// A cell as canonical JSON: strings re-escaped by serde_json, numbers as stored, objects and
/// arrays compact with sorted keys.
fn write_json(out: &mut Vec<u8>, cell: &Cell<'_>) -> io::Result<()> {
    match cell {
        Cell::Null => out.extend_from_slice(b"null"),
        Cell::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
        Cell::Number(text) => out.extend_from_slice(text.as_bytes()),
        Cell::String(text) => serde_json::to_writer(&mut *out, text)?,
        Cell::Json(value) => serde_json::to_writer(&mut *out, value)?,
    }
    Ok(())
}
