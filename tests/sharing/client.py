"""Reads a share of exportd with the official Delta Sharing connector (delta-sharing, pandas),
which nobody at exportd wrote, and compares what it gets with Parquet files exportd published.

Usage: client.py PLAN, where PLAN is a JSON file:
  {"profile": "<profile file>",
   "tables": ["share.schema.table", ...],            # exactly what list_all_tables() must give
   "loads": [{"table": "share.schema.table", "version": null | N, "key": "id",
              "expected": ["<parquet file>", ...]}],  # the rows load_as_pandas must return
   "missing": ["share.schema.table", ...]}           # tables whose load must fail
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

    for table in plan.get("missing", []):
        try:
            delta_sharing.load_as_pandas(f"{profile}#{table}")
        except Exception as e:  # the connector raises requests' HTTPError with the server's body
            if "RESOURCE_DOES_NOT_EXIST" not in str(e) and "404" not in str(e):
                fail(f"{table}: refused, but not as missing: {e}")
            print(f"ok: {table} is refused as missing")
            continue
        fail(f"{table} loaded, but it is not in the share")


if __name__ == "__main__":
    main()
