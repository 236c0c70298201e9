"""Reads a Parquet export with tools nobody at exportd wrote (DuckDB and pyarrow) and checks it
against a CSV export of the same rows and against its own manifest.

Usage: check.py DIR, where DIR holds manifest.json (of the Parquet export), the shard files it
names, and export.csv (the CSV export's whole file, decompressed). Prints what it checked;
exits 1 with the first difference.
"""

import csv
import datetime
import decimal
import json
import pathlib
import sys

import duckdb
import pyarrow.parquet as pq

# What docs/contract.md promises: dataset type -> (Parquet physical type, logical type).
EXPECTED_TYPES = {
    "string": ("BYTE_ARRAY", "String"),
    "integer": ("INT64", "None"),
    "boolean": ("BOOLEAN", "None"),
    "timestamp": ("INT64", "Timestamp(isAdjustedToUTC=true, timeUnit=microseconds, is_from_converted_type=false, force_set_converted_type=false)"),
    "json": ("BYTE_ARRAY", "JSON"),
}


def fail(message):
    print(f"parquet check FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def expected_type(column):
    if column["type"] == "number" and "precision" in column:
        precision, scale = column["precision"], column.get("scale", 0)
        physical = "INT32" if precision <= 9 else "INT64" if precision <= 18 else "FIXED_LEN_BYTE_ARRAY"
        return physical, f"Decimal(precision={precision}, scale={scale})"
    if column["type"] == "number":
        return "BYTE_ARRAY", "String"
    return EXPECTED_TYPES[column["type"]]


def utc(text):
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(datetime.timezone.utc)


def same(column, value, cell):
    """Whether Parquet's typed `value` is what the CSV export wrote as `cell`."""
    if value is None:
        return cell == ""
    kind = column["type"]
    if kind == "integer":
        return int(cell) == value
    if kind == "number" and "precision" in column:
        return decimal.Decimal(cell) == value
    if kind == "boolean":
        return cell == ("true" if value else "false")
    if kind == "timestamp":
        return utc(cell) == value
    if kind == "json":
        parsed = json.loads(value)
        for text in candidates(cell):
            if text == parsed if isinstance(parsed, str) else loads(text) == parsed:
                return True  # CSV writes a JSON string's text, other JSON as JSON
        return False
    # Text: verbatim in Parquet; CSV may have prefixed `'` against formula injection.
    return cell in (value, "'" + value)


def candidates(cell):
    """The CSV cell, and without the `'` it may have gained against formula injection."""
    return [cell, cell[1:]] if cell.startswith("'") else [cell]


def loads(text):
    try:
        return json.loads(text)
    except ValueError:
        return None


def statistic(column, value, upper):
    """A footer statistic as the manifest renders it."""
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as cut:  # a JSON bound cut inside a character
            return value[:cut.start].decode("utf-8") + ("\U0010FFFF" if upper else "")
    if isinstance(value, decimal.Decimal):
        return value
    if isinstance(value, datetime.datetime):
        return value.astimezone(datetime.timezone.utc) if value.tzinfo else value.replace(tzinfo=datetime.timezone.utc)
    return value


def manifest_statistic(column, value):
    if value is None:
        return None
    if column["type"] == "number" and "precision" in column:
        return decimal.Decimal(value)
    if column["type"] == "timestamp":
        return utc(value)
    return value


def main(folder):
    folder = pathlib.Path(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    columns = manifest["columns"]
    names = [c["name"] for c in columns]
    paths = [str(folder / s["name"]) for s in manifest["shards"]]

    # The schema every shard declares, against the documented mapping and the manifest.
    for path in paths:
        schema = pq.ParquetFile(path).schema
        for i, column in enumerate(columns):
            leaf = schema.column(i)
            got = (leaf.physical_type, str(leaf.logical_type))
            if leaf.name != column["name"] or got != expected_type(column):
                fail(f"{path}: column {i} is {leaf.name} {got}, expected {column['name']} {expected_type(column)}")
            declared = manifest["file_schema"][i]
            if declared["nullable"] != (leaf.max_definition_level == 1):
                fail(f"{path}: column {leaf.name} nullability differs from the manifest")
    print(f"schema: {len(paths)} shard files declare {len(columns)} columns as documented")

    # pyarrow, shard by shard: rows, key order, footer statistics and metadata as the manifest says.
    rows = []
    for shard, path in zip(manifest["shards"], paths):
        table = pq.read_table(path)
        if table.num_rows != shard["rows"]:
            fail(f"{path}: {table.num_rows} rows, the manifest says {shard['rows']}")
        rows.extend(tuple(r[n] for n in names) for r in table.to_pylist())
        meta = pq.ParquetFile(path).metadata
        kv = {k.decode(): v.decode() for k, v in (meta.metadata or {}).items()}
        for key, expected in [("exportd.export_id", manifest["export_id"]), ("exportd.dataset", manifest["dataset"]),
                              ("exportd.snapshot_watermark", manifest.get("snapshot_watermark"))]:
            if kv.get(key) != expected:
                fail(f"{path}: key-value metadata {key} is {kv.get(key)!r}, expected {expected!r}")
        for i, column in enumerate(columns):
            lows, highs, nulls = [], [], 0
            for g in range(meta.num_row_groups):
                stats = meta.row_group(g).column(i).statistics
                if stats is None:
                    fail(f"{path}: no statistics for {column['name']} in row group {g}")
                nulls += stats.null_count
                if stats.has_min_max:
                    lows.append(statistic(column, stats.min, False))
                    highs.append(statistic(column, stats.max, True))
            footer = (min(lows) if lows else None, max(highs) if highs else None, nulls)
            listed = next(s for s in shard["stats"] if s["column"] == column["name"])
            expected = (manifest_statistic(column, listed["min"]), manifest_statistic(column, listed["max"]), listed["null_count"])
            if footer != expected:
                fail(f"{path}: statistics of {column['name']}: footer {footer}, manifest {expected}")
    keys = [r[0] for r in rows]
    if keys != sorted(keys, key=lambda k: k.encode()):
        fail("rows are not in key order")
    print(f"pyarrow: {len(rows)} rows in key order; footer statistics and metadata equal the manifest's")

    # DuckDB over all shards at once: the same rows as pyarrow.
    con = duckdb.connect()
    listed = ", ".join(f"'{p}'" for p in paths)
    duck = con.execute(f"SELECT * FROM read_parquet([{listed}])").fetchall()
    if len(duck) != len(rows):
        fail(f"DuckDB reads {len(duck)} rows, pyarrow {len(rows)}")
    for a, b in zip(duck, rows):
        for column, x, y in zip(columns, a, b):
            if column["type"] == "json":
                x, y = (None if v is None else json.loads(v) for v in (x, y))
            if column["type"] == "timestamp" and x is not None:
                x = x.astimezone(datetime.timezone.utc)
            if x != y:
                fail(f"DuckDB and pyarrow differ in {column['name']} of {a[0]}: {x!r} vs {y!r}")
    print(f"duckdb: read_parquet over {len(paths)} shards returns the same {len(duck)} rows")

    # The CSV export of the same rows: same keys, same order, same values, typed.
    with open(folder / "export.csv", newline="", encoding="utf-8-sig") as f:
        table = list(csv.reader(f))
    if table[0] != names:
        fail(f"CSV header {table[0]} is not {names}")
    if len(table) - 1 != len(rows):
        fail(f"CSV has {len(table) - 1} rows, Parquet {len(rows)}")
    for row, cells in zip(rows, table[1:]):
        for column, value, cell in zip(columns, row, cells):
            if not same(column, value, cell):
                fail(f"{column['name']} of {row[0]!r}: Parquet {value!r}, CSV {cell!r}")
    print(f"csv: the CSV export of the same snapshot has the same {len(rows)} rows, value for value")


if __name__ == "__main__":
    main(sys.argv[1])
