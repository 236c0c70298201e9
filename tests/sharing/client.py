"""Reads a share of exportd with the official Delta Sharing connector (delta-sharing, pandas),
which nobody at exportd wrote, and compares what it gets with Parquet files exportd published.

Usage: client.py PLAN, where PLAN is a JSON file:
  {"profile": "<profile file>",
   "tables": ["share.schema.table", ...],            # exactly what list_all_tables() must give
   "loads": [{"table": "share.schema.table", "version": null | N, "key": "id",
              "expected": ["<parquet file>", ...]}],  # the rows load_as_pandas must return
   "changes": [{"table": "share.schema.table", "start": A, "end": B, "key": "id",
                "base": ["<parquet file>", ...],       # version A-1 (empty when A = 0)
                "expected": ["<parquet file>", ...],  # version B
                "kinds": {"insert": N, ...}}],        # optional: rows of each _change_type

   "missing": ["share.schema.table", ...],           # tables whose load must fail
   "duckdb": [{"urls": ["<file URL>", ...],          # optional: DuckDB (httpfs) reads the URLs
               "expected": ["<parquet file>", ...]}]} # ... and gets exactly these files' rows
A change check applies load_table_changes_as_pandas(start, end) to the base, version by version
(deletes, then inserts, by key), and compares the result with version B.
Prints what it checked; exits 1 with the first difference.
"""

import json
import sys

import delta_sharing
import pandas as pd
import pyarrow.parquet as pq


def fail(message):
    print(f"sharing check FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def main():
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    profile = plan["profile"]
    client = delta_sharing.SharingClient(profile)
    listed = sorted(f"{t.share}.{t.schema}.{t.name}" for t in client.list_all_tables())
    if listed != sorted(plan["tables"]):
        fail(f"list_all_tables() gave {listed}, expected {sorted(plan['tables'])}")
    print(f"ok: list_all_tables() lists exactly {listed}")

    for load in plan["loads"]:
        url = f"{profile}#{load['table']}"
        version = load["version"]
        got = delta_sharing.load_as_pandas(url, version=version) if version is not None else delta_sharing.load_as_pandas(url)
        frames = [pq.read_table(path).to_pandas() for path in load["expected"]]
        expected = pd.concat(frames, ignore_index=True) if frames else got.iloc[0:0]
        key = load["key"]
        got = got.sort_values(key).reset_index(drop=True)
        expected = expected.sort_values(key).reset_index(drop=True)
        if list(got.columns) != list(expected.columns):
            fail(f"{load['table']} v{version}: columns {list(got.columns)} != {list(expected.columns)}")
        try:
            pd.testing.assert_frame_equal(got, expected, check_dtype=True)
        except AssertionError as e:
            fail(f"{load['table']} v{version}: {e}")
        print(f"ok: load_as_pandas({load['table']}, version={version}) = the export's {len(expected)} rows, typed ({dict(got.dtypes.astype(str))})")

    for check in plan.get("changes", []):
        check_changes(profile, check)

    for check in plan.get("duckdb", []):
        check_duckdb(check)

    for table in plan.get("missing", []):
        try:
            delta_sharing.load_as_pandas(f"{profile}#{table}")
        except Exception as e:  # the connector raises requests' HTTPError with the server's body
            if "RESOURCE_DOES_NOT_EXIST" not in str(e) and "404" not in str(e):
                fail(f"{table}: refused, but not as missing: {e}")
            print(f"ok: {table} is refused as missing")
            continue
        fail(f"{table} loaded, but it is not in the share")


def records(frame, key):
    """The rows of a frame by key, as plain values (NaN and None alike)."""
    frame = frame.astype(object).where(frame.notna(), None)
    return {row[key]: row for row in frame.to_dict("records")}


def read(paths):
    return pd.concat([pq.read_table(path).to_pandas() for path in paths], ignore_index=True) if paths else None


def check_changes(profile, check):
    table, key = check["table"], check["key"]
    changes = delta_sharing.load_table_changes_as_pandas(
        f"{profile}#{table}", starting_version=check["start"], ending_version=check["end"])
    for column in ("_change_type", "_commit_version", "_commit_timestamp"):
        if column not in changes.columns:
            fail(f"{table} changes: no {column} column ({list(changes.columns)})")
    expected = read(check["expected"])
    base = read(check["base"])
    rows = records(base, key) if base is not None else {}
    columns = list(expected.columns)
    kinds = {}
    for version in sorted(changes["_commit_version"].unique()):
        batch = changes[changes["_commit_version"] == version]
        for kind in batch["_change_type"].unique():
            kinds[kind] = kinds.get(kind, 0) + int((batch["_change_type"] == kind).sum())
        for row in records(batch[batch["_change_type"].isin(["delete", "update_preimage"])], key).values():
            rows.pop(row[key], None)
        for row in records(batch[batch["_change_type"].isin(["insert", "update_postimage"])], key).values():
            rows[row[key]] = {c: row[c] for c in columns}
    if "kinds" in check and kinds != check["kinds"]:
        fail(f"{table} changes {check['start']}..{check['end']}: change types {kinds}, expected {check['kinds']}")
    got = {k: {c: v[c] for c in columns} for k, v in rows.items()}
    want = {k: {c: v[c] for c in columns} for k, v in records(expected, key).items()}
    if got != want:
        missing = sorted(set(want) - set(got))[:5]
        extra = sorted(set(got) - set(want))[:5]
        differ = sorted(k for k in set(got) & set(want) if got[k] != want[k])[:5]
        fail(f"{table} changes {check['start']}..{check['end']} applied to the base differ from version "
             f"{check['end']}: missing {missing}, extra {extra}, different {differ}")
    print(f"ok: load_table_changes_as_pandas({table}, {check['start']}, {check['end']}) applied to version "
          f"{check['start'] - 1} gives version {check['end']} ({len(want)} rows; changes {kinds})")


def check_duckdb(check):
    """DuckDB reads the signed file URLs over HTTP (HEAD, then ranges) with its httpfs extension,
    loaded from the duckdb-ext-httpfs wheel (no download), and finds the rows of the local files."""
    import glob
    import os

    import duckdb

    extension = glob.glob(os.path.join(os.path.dirname(duckdb.__file__), "..", "duckdb_ext", "extensions",
                                       "*", "*", "httpfs.duckdb_extension"))
    if not extension:
        fail("no httpfs extension from duckdb-ext-httpfs")
    con = duckdb.connect()
    con.execute(f"LOAD '{extension[0]}'")
    remote = f"read_parquet({check['urls']!r})"
    local = f"read_parquet({check['expected']!r})"
    counts = con.execute(f"SELECT (SELECT count(*) FROM {remote}), (SELECT count(*) FROM {local})").fetchone()
    differ = con.execute(f"SELECT count(*) FROM ((SELECT * FROM {remote} EXCEPT ALL SELECT * FROM {local}) "
                         f"UNION ALL (SELECT * FROM {local} EXCEPT ALL SELECT * FROM {remote}))").fetchone()[0]
    if counts[0] != counts[1] or differ != 0:
        fail(f"DuckDB read {counts[0]} rows from the URLs, the files hold {counts[1]}; {differ} rows differ")
    print(f"ok: DuckDB {duckdb.__version__} read_parquet of {len(check['urls'])} signed URLs = the files' {counts[1]} rows")


if __name__ == "__main__":
    main()
