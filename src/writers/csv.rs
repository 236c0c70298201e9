//! CSV: a BOM, the header row, every field quoted, CRLF line ends, cells escaped against
//! formula injection (see [`super::escape`]).

use std::io;

use csv_core::{QuoteStyle, Terminator, WriteResult};

use super::Codec;
use super::OutputColumn;
use super::cell::Fields;
use super::escape::{csv_cell, escape_formula};
use super::format::{FormatSpec, Framing, RowEncoder};

pub const SPEC: FormatSpec = FormatSpec {
    name: "csv",
    extension: "csv.gz",
    content_type: "application/gzip",
    compression: "gzip",
    framing: Framing::Gzip(|columns| Box::new(CsvEncoder::new(columns))),
    codec: Codec::ZlibRs3,
};

const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

struct CsvEncoder {
    columns: Vec<OutputColumn>,
    writer: csv_core::Writer,
    scratch: Box<[u8; 4096]>,
}

impl CsvEncoder {
    fn new(columns: &[OutputColumn]) -> Self {
        let writer =
            csv_core::WriterBuilder::new().quote_style(QuoteStyle::Always).terminator(Terminator::CRLF).build();
        CsvEncoder { columns: columns.to_vec(), writer, scratch: Box::new([0; 4096]) }
    }
}

/// Writes one record of `fields` to `line`, through `scratch`.
fn write_record<'a>(
    writer: &mut csv_core::Writer,
    scratch: &mut [u8],
    fields: impl IntoIterator<Item = &'a [u8]>,
    line: &mut Vec<u8>,
) {
    for (n, field) in fields.into_iter().enumerate() {
        if n > 0 {
            write_delimiter(writer, scratch, line);
        }
        write_field(writer, scratch, field, line);
    }
    write_terminator(writer, scratch, line);
}

fn write_field(writer: &mut csv_core::Writer, scratch: &mut [u8], mut field: &[u8], line: &mut Vec<u8>) {
    loop {
        let (result, read, written) = writer.field(field, scratch);
        line.extend_from_slice(&scratch[..written]);
        field = &field[read..];
        if result == WriteResult::InputEmpty {
            return;
        }
    }
}

fn write_delimiter(writer: &mut csv_core::Writer, scratch: &mut [u8], line: &mut Vec<u8>) {
    let (_, written) = writer.delimiter(scratch);
    line.extend_from_slice(&scratch[..written]);
}

fn write_terminator(writer: &mut csv_core::Writer, scratch: &mut [u8], line: &mut Vec<u8>) {
    let (_, written) = writer.terminator(scratch);
    line.extend_from_slice(&scratch[..written]);
}

impl RowEncoder for CsvEncoder {
    fn head(&mut self) -> io::Result<Vec<u8>> {
        let mut head = UTF8_BOM.to_vec();
        let names = self.columns.iter().map(|c| c.name.as_bytes());
        write_record(&mut self.writer, &mut self.scratch[..], names, &mut head);
        Ok(head)
    }

    /// Cell by cell straight into `line`: no per-row collections on the export hot path. (On an
    /// error the caller discards `line` with the shard.)
    fn encode(&mut self, key: &str, fields: &Fields<'_>, line: &mut Vec<u8>) -> io::Result<()> {
        let (writer, scratch) = (&mut self.writer, &mut self.scratch[..]);
        write_field(writer, scratch, escape_formula(key).as_bytes(), line);
        for (i, column) in self.columns.iter().enumerate().skip(1) {
            // the key column is always first
            let cell = fields.get(i)?;
            write_delimiter(writer, scratch, line);
            write_field(writer, scratch, csv_cell(&cell, column.ty).as_bytes(), line);
        }
        write_terminator(writer, scratch, line);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::ColumnType;
    use crate::writers::cell::FieldIndex;

    /// The same record through the csv crate's own writer, with the same settings.
    fn reference(fields: &[&str]) -> Vec<u8> {
        let mut writer = ::csv::WriterBuilder::new()
            .quote_style(::csv::QuoteStyle::Always)
            .terminator(::csv::Terminator::CRLF)
            .from_writer(Vec::new());
        writer.write_record(fields).unwrap();
        writer.into_inner().unwrap()
    }

    #[test]
    fn records_match_the_csv_crate_byte_for_byte_even_past_the_scratch_buffer() {
        let long = format!("{}\"quoted\"\r\n{}", "a".repeat(5000), "\"".repeat(3000));
        let columns = [("id", ColumnType::String), ("body", ColumnType::String), ("n", ColumnType::Number)]
            .map(|(name, ty)| OutputColumn { ty, ..OutputColumn::key(name) });
        let mut encoder = CsvEncoder::new(&columns);
        assert_eq!(encoder.head().unwrap(), [UTF8_BOM, &reference(&["id", "body", "n"])].concat());
        let data = serde_json::json!({"body": long, "n": 12.5}).to_string();
        let mut line = Vec::new();
        let mut index = FieldIndex::new(columns.iter().map(|c| c.name.as_str()));
        encoder.encode("k,1", &index.read(&data).unwrap(), &mut line).unwrap();
        assert_eq!(String::from_utf8(line).unwrap(), String::from_utf8(reference(&["k,1", &long, "12.5"])).unwrap());
    }
}
