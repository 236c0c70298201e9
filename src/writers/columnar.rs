//! Columnar shards: records become typed Arrow record batches on the caller's thread, and a
//! thread of its own hands them to the format's file writer (Parquet today), so reading and
//! encoding overlap as they do for gzip.
//!
//! The dataset's types map onto Arrow types once, here, for every columnar format:
//!
//! | dataset type | Arrow type |
//! |---|---|
//! | key, `string` | Utf8 |
//! | `integer` | Int64 |
//! | `number` with `precision`/`scale` | Decimal128(precision, scale), exact |
//! | `number` without | Utf8: the number's text as stored |
//! | `boolean` | Boolean |
//! | `timestamp` | Timestamp(µs, "UTC") |
//! | `json` | Utf8 with the `arrow.json` extension: the JSON text, keys sorted |
//!
//! A value that its column's type cannot hold exactly is never converted into something else:
//! the shard fails with [`DoesNotFit`].
//!
//! Batches are cut by the data alone (rows and bytes), never by timing, so the writer sees the
//! same batches on every run and its bytes follow.

use std::io::{self, Write};
use std::sync::Arc;

use arrow_array::builder::{
    BooleanBuilder, Decimal128Builder, Int64Builder, StringBuilder, TimestampMicrosecondBuilder,
};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field, Schema, SchemaRef, TimeUnit};
use serde::{Deserialize, Serialize};
use time::format_description::well_known::Rfc3339;

use super::cell::Fields;
use super::pipe::Pipe;
use super::{HashingWriter, OutputColumn, ShardSpec};
use crate::dataset::Cell;
use crate::dataset::ColumnType;

/// A batch is cut at this many rows ...
const BATCH_ROWS: usize = 8192;
/// ... or once its text reaches this many bytes (records may be up to 1 MiB each).
const BATCH_BYTES: usize = 4 << 20;
/// Batches queued between the builder and the writer thread.
const BATCHES_IN_FLIGHT: usize = 2;

/// Field metadata naming the dataset type of a column whose Arrow type does not say it.
pub const TYPE_METADATA: &str = "exportd.type";

/// A file format's writer of Arrow batches into the output it was started with.
pub trait BatchWriter: Send {
    fn write(&mut self, batch: &RecordBatch) -> io::Result<()>;
    /// Ends the file (its footer) and returns each column's statistics as the footer has them.
    fn finish(self: Box<Self>) -> io::Result<Vec<ColumnStats>>;
}

/// Starts a format's writer for one shard of `spec`, with batches of `schema`, writing to `out`
/// as its bytes are ready (a row group streams out as it is flushed, never copied whole).
pub type BatchWriterStart =
    for<'w> fn(&ShardSpec, SchemaRef, &'w mut (dyn Write + Send)) -> io::Result<Box<dyn BatchWriter + 'w>>;

/// One column's statistics over a whole shard file: the smallest and largest value (in the
/// column's order, as the manifest renders values: numbers and booleans as JSON, decimals and
/// timestamps as text) and how many values are null.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ColumnStats {
    pub column: String,
    pub min: Option<serde_json::Value>,
    pub max: Option<serde_json::Value>,
    pub null_count: u64,
    /// `false` when the file keeps a shortened bound (long text: a prefix for the minimum, a
    /// greater prefix for the maximum).
    pub min_exact: bool,
    pub max_exact: bool,
}

/// A column as a self-describing file declares it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileColumn {
    pub name: String,
    /// The file format's type, e.g. `INT64`, `BYTE_ARRAY (STRING)`, `INT64 (DECIMAL(18,2))`.
    #[serde(rename = "type")]
    pub ty: String,
    pub nullable: bool,
}

/// A value its column's type cannot hold exactly. Its text names the column and the rule, never
/// the value (it is logged); `key` is the record's, for the export's error detail.
#[derive(Debug)]
pub struct DoesNotFit {
    pub column: String,
    pub declared: String,
    pub reason: String,
    pub key: String,
}

impl std::fmt::Display for DoesNotFit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "column `{}` ({}): {}", self.column, self.declared, self.reason)
    }
}

impl std::error::Error for DoesNotFit {}

impl DoesNotFit {
    /// The `DoesNotFit` somewhere in `error`'s chain.
    pub fn find(error: &anyhow::Error) -> Option<&DoesNotFit> {
        error.chain().find_map(|cause| {
            let io = cause.downcast_ref::<io::Error>()?;
            io.get_ref()?.downcast_ref::<DoesNotFit>()
        })
    }
}

/// The Arrow schema of a shard of `columns`.
pub fn arrow_schema(columns: &[OutputColumn]) -> io::Result<SchemaRef> {
    let fields: Vec<Field> = columns.iter().map(arrow_field).collect::<io::Result<_>>()?;
    Ok(Arc::new(Schema::new(fields)))
}

fn arrow_field(column: &OutputColumn) -> io::Result<Field> {
    let nullable = !column.required;
    let field = match (column.ty, column.decimal()) {
        (ColumnType::String, _) => Field::new(&column.name, DataType::Utf8, nullable),
        (ColumnType::Integer, _) => Field::new(&column.name, DataType::Int64, nullable),
        (ColumnType::Number, Some((precision, scale))) => {
            Field::new(&column.name, DataType::Decimal128(precision, scale as i8), nullable)
        }
        (ColumnType::Number, None) => Field::new(&column.name, DataType::Utf8, nullable)
            .with_metadata(std::collections::HashMap::from([(TYPE_METADATA.to_owned(), "number".to_owned())])),
        (ColumnType::Boolean, _) => Field::new(&column.name, DataType::Boolean, nullable),
        (ColumnType::Timestamp, _) => {
            Field::new(&column.name, DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())), nullable)
        }
        (ColumnType::Json, _) => Field::new(&column.name, DataType::Utf8, nullable)
            .with_extension_type(arrow_schema::extension::Json::default()),
    };
    Ok(field)
}

/// One column's values of the batch being built.
enum Values {
    /// Text as it is (string columns, the key, undeclared numbers, JSON text).
    Text(StringBuilder),
    Integer(Int64Builder),
    Decimal {
        values: Decimal128Builder,
        precision: u8,
        scale: u8,
    },
    Boolean(BooleanBuilder),
    Timestamp(TimestampMicrosecondBuilder),
}

impl Values {
    fn new(column: &OutputColumn) -> io::Result<Values> {
        Ok(match (column.ty, column.decimal()) {
            (ColumnType::Integer, _) => Values::Integer(Int64Builder::new()),
            (ColumnType::Number, Some((precision, scale))) => Values::Decimal {
                values: Decimal128Builder::new()
                    .with_precision_and_scale(precision, scale as i8)
                    .map_err(io::Error::other)?,
                precision,
                scale,
            },
            (ColumnType::Boolean, _) => Values::Boolean(BooleanBuilder::new()),
            (ColumnType::Timestamp, _) => Values::Timestamp(TimestampMicrosecondBuilder::new().with_timezone("UTC")),
            _ => Values::Text(StringBuilder::new()),
        })
    }

    fn finish(&mut self) -> ArrayRef {
        match self {
            Values::Text(b) => Arc::new(b.finish()),
            Values::Integer(b) => Arc::new(b.finish()),
            Values::Decimal { values, .. } => Arc::new(values.finish()),
            Values::Boolean(b) => Arc::new(b.finish()),
            Values::Timestamp(b) => Arc::new(b.finish()),
        }
    }
}

/// Builds record batches of a fixed schema from records' fields.
pub struct BatchBuilder {
    schema: SchemaRef,
    columns: Vec<OutputColumn>,
    values: Vec<Values>,
    rows: usize,
    bytes: usize,
}

impl BatchBuilder {
    pub fn new(columns: &[OutputColumn], schema: SchemaRef) -> io::Result<Self> {
        let values = columns.iter().map(Values::new).collect::<io::Result<_>>()?;
        Ok(BatchBuilder { schema, columns: columns.to_vec(), values, rows: 0, bytes: 0 })
    }

    /// Appends one record, or none of it: every value is converted before any is appended, so
    /// a refused record leaves the batch as it was (an estimate's sample skips it and goes on).
    pub fn push(&mut self, key: &str, fields: &Fields<'_>) -> io::Result<()> {
        let mut row = Vec::with_capacity(self.columns.len());
        for (i, column) in self.columns.iter().enumerate() {
            // The key column is always first.
            let cell = if i == 0 { Cell::String(key.into()) } else { fields.get(i)? };
            let value = convert(&self.values[i], cell, column).map_err(|reason| {
                let unfit = DoesNotFit {
                    column: column.name.clone(),
                    declared: declared(column),
                    reason: reason.to_owned(),
                    key: key.to_owned(),
                };
                io::Error::new(io::ErrorKind::InvalidData, unfit)
            })?;
            row.push(value);
        }
        for (values, value) in self.values.iter_mut().zip(row) {
            self.bytes += value.append_to(values);
        }
        self.rows += 1;
        Ok(())
    }

    /// Whether the batch should be cut now.
    pub fn is_full(&self) -> bool {
        self.rows >= BATCH_ROWS || self.bytes >= BATCH_BYTES
    }

    /// The batch so far, if it has rows; the builder starts a new one.
    pub fn take(&mut self) -> io::Result<Option<RecordBatch>> {
        if self.rows == 0 {
            return Ok(None);
        }
        let arrays = self.values.iter_mut().map(Values::finish).collect();
        (self.rows, self.bytes) = (0, 0);
        RecordBatch::try_new(self.schema.clone(), arrays).map(Some).map_err(io::Error::other)
    }
}

/// The column's type as the error names it.
fn declared(column: &OutputColumn) -> String {
    let ty = format!("{:?}", column.ty).to_lowercase();
    match column.decimal() {
        Some((precision, scale)) => format!("{ty} as DECIMAL({precision},{scale})"),
        None if column.required => format!("{ty}, required"),
        None => ty,
    }
}

/// One converted value, ready to append to its column.
enum Converted<'a> {
    Null,
    Text(std::borrow::Cow<'a, str>),
    Integer(i64),
    Decimal(i128),
    Boolean(bool),
    Timestamp(i64),
}

impl Converted<'_> {
    /// Appends to `values` (the column it was converted for); returns the bytes it adds.
    fn append_to(self, values: &mut Values) -> usize {
        match (self, values) {
            (Converted::Null, Values::Text(b)) => b.append_null(),
            (Converted::Null, Values::Integer(b)) => b.append_null(),
            (Converted::Null, Values::Decimal { values, .. }) => values.append_null(),
            (Converted::Null, Values::Boolean(b)) => b.append_null(),
            (Converted::Null, Values::Timestamp(b)) => b.append_null(),
            (Converted::Text(text), Values::Text(b)) => {
                b.append_value(&text);
                return text.len();
            }
            (Converted::Integer(v), Values::Integer(b)) => b.append_value(v),
            (Converted::Decimal(v), Values::Decimal { values, .. }) => values.append_value(v),
            (Converted::Boolean(v), Values::Boolean(b)) => b.append_value(v),
            (Converted::Timestamp(v), Values::Timestamp(b)) => b.append_value(v),
            _ => unreachable!("a value is converted for its own column"),
        }
        8
    }
}

/// `cell` as column `column` (whose values are `values`) holds it, or why it does not fit.
fn convert<'a>(values: &Values, cell: Cell<'a>, column: &OutputColumn) -> Result<Converted<'a>, &'static str> {
    if matches!(cell, Cell::Null) {
        return if column.required { Err("a required value is null or missing") } else { Ok(Converted::Null) };
    }
    match (values, cell) {
        (Values::Text(_), Cell::Number(text)) if column.ty == ColumnType::Number => {
            Ok(Converted::Text(std::borrow::Cow::Borrowed(text)))
        }
        (Values::Text(_), _) if column.ty == ColumnType::Number => Err("a value is not a number"),
        (Values::Text(_), cell) => Ok(Converted::Text(text_of(cell, column.ty))),
        (Values::Integer(_), Cell::Number(text)) => {
            let units = exact_units(text, 38, 0).map_err(|reason| {
                if reason == TOO_MANY_DIGITS { "a value is outside the INT64 range" } else { reason }
            })?;
            i64::try_from(units).map(Converted::Integer).map_err(|_| "a value is outside the INT64 range")
        }
        (Values::Decimal { precision, scale, .. }, Cell::Number(text)) => {
            exact_units(text, *precision, *scale).map(Converted::Decimal)
        }
        (Values::Boolean(_), Cell::Bool(v)) => Ok(Converted::Boolean(v)),
        (Values::Boolean(_), _) => Err("a value is not true or false"),
        (Values::Timestamp(_), Cell::String(text)) => timestamp_micros(&text).map(Converted::Timestamp),
        (Values::Timestamp(_), _) => Err("a value is not an RFC 3339 timestamp string"),
        _ => Err("a value is not a number"),
    }
}

/// The text a text column holds for `cell`: strings verbatim (no formula escaping: that is a
/// CSV concern); numbers as stored; JSON columns hold JSON text (a string value quoted).
fn text_of(cell: Cell<'_>, ty: ColumnType) -> std::borrow::Cow<'_, str> {
    use std::borrow::Cow;
    match cell {
        Cell::Null => Cow::Borrowed(""),
        Cell::String(text) if ty == ColumnType::Json => {
            Cow::Owned(serde_json::to_string(text.as_ref()).expect("strings serialize"))
        }
        Cell::String(text) => text,
        Cell::Number(text) => Cow::Borrowed(text),
        Cell::Bool(b) => Cow::Borrowed(if b { "true" } else { "false" }),
        Cell::Json(value) => Cow::Owned(value.to_string()),
    }
}

/// An RFC 3339 timestamp as microseconds since the epoch, UTC (the offset is applied; the
/// instant is kept). Digits below a microsecond do not fit: nothing is rounded or cut. Second
/// 60 and 24:00:00 are read as PostgreSQL reads them: the next second, the next day.
fn timestamp_micros(text: &str) -> Result<i64, &'static str> {
    const NOT_RFC_3339: &str = "a value is not an RFC 3339 timestamp";
    // `YYYY-MM-DDTHH:MM:SS[.fraction](Z|±HH:MM)`: the parser drops digits past the ninth, so
    // the fraction is checked here.
    let fraction = text.get(19..).and_then(|rest| rest.strip_prefix('.')).unwrap_or("");
    let digits = fraction.bytes().take_while(u8::is_ascii_digit).count();
    if fraction.as_bytes()[..digits].iter().skip(6).any(|d| *d != b'0') {
        return Err("a timestamp has digits below a microsecond");
    }
    // Second 60 or hour 24 as the moment after 59 or 23.
    let (mut normal, mut carry) = (std::borrow::Cow::Borrowed(text), time::Duration::ZERO);
    if text.get(17..19) == Some("60") {
        normal = std::borrow::Cow::Owned(format!("{}59{}", &text[..17], &text[19..]));
        carry = time::Duration::SECOND;
    } else if text.get(11..19) == Some("24:00:00") {
        normal = std::borrow::Cow::Owned(format!("{}23{}", &text[..11], &text[13..]));
        carry = time::Duration::HOUR;
    }
    let at = time::OffsetDateTime::parse(&normal, &Rfc3339).map_err(|_| NOT_RFC_3339)? + carry;
    i64::try_from(at.unix_timestamp_nanos() / 1000).map_err(|_| "a timestamp is outside the microsecond range")
}

/// [`exact_units`]'s refusal of a value with more digits than the precision.
const TOO_MANY_DIGITS: &str = "a value has more digits than the column's precision";

/// A JSON number's text as a count of `10^-scale`, exactly, with at most `precision` digits.
/// Trailing fractional zeros beyond the scale are fine (`12.50` fits scale 1); any other digit
/// beyond it does not fit, and nothing is rounded.
pub fn exact_units(text: &str, precision: u8, scale: u8) -> Result<i128, &'static str> {
    const NOT_A_NUMBER: &str = "a value is not a number";
    let (negative, unsigned) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exponent) = match unsigned.split_once(['e', 'E']) {
        Some((m, e)) => (m, Some(e)),
        None => (unsigned, None),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let all_digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || !all_digits(whole) || !all_digits(fraction) {
        return Err(NOT_A_NUMBER);
    }
    // An exponent beyond i64 still says which way: saturate (a zero is zero whatever it says).
    let exponent = match exponent {
        None => 0,
        Some(e) => {
            let digits = e.strip_prefix(['+', '-']).unwrap_or(e);
            if digits.is_empty() || !all_digits(digits) {
                return Err(NOT_A_NUMBER);
            }
            e.parse::<i64>().unwrap_or(if e.starts_with('-') { i64::MIN / 2 } else { i64::MAX / 2 })
        }
    };
    let digits: String = [whole, fraction].concat();
    let digits = digits.trim_start_matches('0');
    if digits.is_empty() {
        return Ok(0);
    }
    // value = digits × 10^(exponent − len(fraction)); units = value × 10^scale.
    let shift = i64::from(scale).saturating_add(exponent).saturating_sub(fraction.len() as i64);
    let significant = if shift >= 0 {
        digits
    } else {
        let dropped = usize::try_from(shift.unsigned_abs()).unwrap_or(usize::MAX);
        let cut = digits.len().saturating_sub(dropped);
        if !digits[cut..].bytes().all(|b| b == b'0') {
            return Err("a value has more digits after the point than the column's scale");
        }
        &digits[..cut]
    };
    if significant.is_empty() {
        return Ok(0);
    }
    let zeros = usize::try_from(shift.max(0)).unwrap_or(usize::MAX);
    if zeros > usize::from(precision) || significant.len() + zeros > usize::from(precision) {
        return Err(TOO_MANY_DIGITS);
    }
    let units: i128 = format!("{significant}{}", "0".repeat(zeros)).parse().map_err(|_| NOT_A_NUMBER)?;
    Ok(if negative { -units } else { units })
}

/// A shard being written as a columnar file.
pub struct ColumnarShard<W> {
    builder: BatchBuilder,
    batches: Pipe<RecordBatch, (W, WrittenFile)>,
}

/// A columnar file as written.
pub struct WrittenFile {
    pub bytes: u64,
    pub sha256: String,
    pub stats: Vec<ColumnStats>,
}

impl<W: Write + Send + 'static> ColumnarShard<W> {
    pub fn start(out: W, spec: &ShardSpec, writer: BatchWriterStart) -> io::Result<Self> {
        let schema = arrow_schema(&spec.columns)?;
        let builder = BatchBuilder::new(&spec.columns, schema.clone())?;
        // A spec the writer refuses (e.g. another format's codec) fails here, not in the thread.
        drop(writer(spec, schema.clone(), &mut io::sink())?);
        let spec = spec.clone();
        let batches = Pipe::spawn(BATCHES_IN_FLIGHT, move |received| {
            let mut out = HashingWriter::new(out);
            let mut file = writer(&spec, schema, &mut out)?;
            for batch in received {
                file.write(&batch?)?;
            }
            let stats = file.finish()?;
            let (out, bytes, sha256) = out.into_parts();
            Ok((out, WrittenFile { bytes, sha256, stats }))
        });
        Ok(ColumnarShard { builder, batches })
    }

    pub fn push(&mut self, key: &str, fields: &Fields<'_>) -> io::Result<()> {
        self.builder.push(key, fields)?;
        if self.builder.is_full() {
            self.send()?;
        }
        Ok(())
    }

    fn send(&mut self) -> io::Result<()> {
        match self.builder.take()? {
            Some(batch) => self.batches.send(batch),
            None => Ok(()),
        }
    }

    /// Sends the last batch and ends the file.
    pub fn finish(mut self) -> io::Result<(W, WrittenFile)> {
        self.send()?;
        self.batches.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimals_are_exact_or_refused() {
        let fits = [
            ("0", 1, 0, 0),
            ("-3.5", 18, 2, -350),
            ("12.50", 4, 1, 125),
            ("1234567890.1234567890123", 38, 13, 12345678901234567890123),
            ("1e3", 4, 0, 1000),
            ("1.5E-2", 5, 3, 15),
            ("-0.000", 1, 0, 0),
            ("0e99999999999999999999", 3, 0, 0),
            ("00012.5", 4, 1, 125),
            ("99999999999999999999999999999999999999", 38, 0, 99999999999999999999999999999999999999),
        ];
        for (text, precision, scale, units) in fits {
            assert_eq!(exact_units(text, precision, scale), Ok(units), "{text}");
        }
        let refused = [
            ("1.25", 18, 1, "more digits after the point"),
            ("123", 2, 0, "more digits than the column's precision"),
            ("1e40", 38, 0, "more digits than the column's precision"),
            ("1e-400", 38, 2, "more digits after the point"),
            ("100000000000000000000000000000000000000", 38, 0, "precision"),
            ("12a", 10, 0, "not a number"),
            ("", 10, 0, "not a number"),
            (".5", 10, 1, "not a number"),
            ("1e9223372036854775807", 18, 2, "precision"),
            ("1e99999999999999999999", 18, 2, "precision"),
            ("1e-99999999999999999999", 18, 2, "after the point"),
            ("1e", 18, 2, "not a number"),
        ];
        for (text, precision, scale, reason) in refused {
            let err = exact_units(text, precision, scale).unwrap_err();
            assert!(err.contains(reason), "{text}: {err}");
        }
    }

    #[test]
    fn timestamps_keep_the_instant_in_utc_microseconds() {
        assert_eq!(timestamp_micros("1970-01-01T00:00:00Z"), Ok(0));
        assert_eq!(timestamp_micros("1970-01-01T01:00:00.000001+01:00"), Ok(1));
        assert_eq!(timestamp_micros("0000-01-01T00:00:00Z"), Ok(-62_167_219_200_000_000));
        assert_eq!(timestamp_micros("9999-12-31T23:59:59.999999Z"), Ok(253_402_300_799_999_999));
        assert!(timestamp_micros("2026-01-01T00:00:00.0000001Z").unwrap_err().contains("below a microsecond"));
        assert!(timestamp_micros("2026-01-01T00:00:00.1234560001Z").unwrap_err().contains("below a microsecond"));
        assert_eq!(timestamp_micros("1970-01-01T00:00:00.123456000Z"), Ok(123_456));
        assert_eq!(timestamp_micros("1969-12-31T23:59:60Z"), Ok(0), "a leap second is the next second");
        assert_eq!(timestamp_micros("1969-12-31T24:00:00Z"), Ok(0), "24:00 is the next day");
        assert_eq!(timestamp_micros("1970-01-01T00:00:60.5+00:00"), Ok(60_500_000));
        assert!(timestamp_micros("2026-01-01").unwrap_err().contains("RFC 3339"));
    }
}
