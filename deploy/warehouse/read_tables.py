#!/usr/bin/env python3
"""Reads the warehouse's tables from S3 with readers no one here wrote, and prints what they found as
JSON: pyarrow's dataset API (Hive partitioning) and DuckDB (read_parquet over httpfs), each summing
the accounts table per account and currency (over all days, and per day), and pyarrow listing the
jobs table's rows.

    read_tables.py --bucket BUCKET [--jobs ID,ID,...]

S3 is reached as the fleet reaches it: AWS_ENDPOINT_URL (LocalStack: http://127.0.0.1:4566),
AWS_REGION, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY. Money is printed as decimal strings, exact.
"""

import argparse
import json
import os
import sys
from decimal import Decimal
from urllib.parse import urlparse


def pyarrow_read(bucket, jobs):
    import pyarrow.compute as pc
    import pyarrow.dataset as ds
    from pyarrow import fs

    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    kw = {"region": os.environ.get("AWS_REGION", "us-east-1")}
    if endpoint:
        u = urlparse(endpoint)
        kw.update(endpoint_override=u.netloc, scheme=u.scheme or "https")
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        kw.update(access_key=os.environ["AWS_ACCESS_KEY_ID"], secret_key=os.environ["AWS_SECRET_ACCESS_KEY"])
    s3 = fs.S3FileSystem(**kw)

    def table(name):
        d = ds.dataset(f"{bucket}/tables/v2/{name}", format="parquet", partitioning="hive", filesystem=s3)
        flt = pc.field("job_id").isin(jobs) if jobs else None
        return d.to_table(filter=flt), d.schema

    accounts, schema = table("accounts")
    sums, per_day = {}, {}
    for r in accounts.to_pylist():
        day = str(r["billed_on"])
        for key, into in (((r["account_id"], r["currency"]), sums), ((day, r["account_id"], r["currency"]), per_day)):
            t = into.setdefault(key, [0, Decimal(0), Decimal(0), Decimal(0)])
            t[0] += r["count"]
            t[1] += r["gross"]
            t[2] += r["fees"]
            t[3] += r["net"]
    jobs_t, jobs_schema = table("jobs")
    rows = []
    for r in jobs_t.to_pylist():
        rows.append({
            "job_id": r["job_id"],
            "status": r["status"],
            "billed_on": str(r["billed_on"]),
            "counts": [r["submitted"], r["accepted"], r["rejected"], r["processed"], r["failed"], r.get("duplicates")],
            "failed_chunks": r["failed_chunks"],
            "requests": r["requests"],
            "cost_usd": None if r["cost_usd"] is None else str(r["cost_usd"]),
            "submitted_at": r["submitted_at"].isoformat(),
            "finished_at": r["finished_at"].isoformat(),
            "files": r["files"],
            "note": r["note"],
        })
    return {
        "schema": {f.name: str(f.type) for f in schema},
        "jobs_schema": {f.name: str(f.type) for f in jobs_schema},
        "rows": accounts.num_rows,
        "accounts": sorted([a, c, *map(str, t)] for (a, c), t in sums.items()),
        "per_day": sorted([d, a, c, *map(str, t)] for (d, a, c), t in per_day.items()),
        "jobs": sorted(rows, key=lambda r: r["job_id"]),
    }


# The recipe's query (deploy/warehouse/duckdb.sql), per account and currency, per day.
PER_DAY = """
SELECT billed_on, account_id, currency,
       sum("count") AS transactions, sum(gross) AS gross, sum(fees) AS fees, sum(net) AS net
FROM read_parquet('s3://{bucket}/tables/v2/accounts/*/*.parquet', hive_partitioning = true)
{where}
GROUP BY ALL
ORDER BY ALL
"""


def duckdb_read(bucket, jobs):
    import duckdb

    con = duckdb.connect()
    con.sql("LOAD httpfs")
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    opts = [f"REGION '{os.environ.get('AWS_REGION', 'us-east-1')}'"]
    if endpoint:
        u = urlparse(endpoint)
        opts += [f"ENDPOINT '{u.netloc}'", "URL_STYLE 'path'", f"USE_SSL {'true' if u.scheme == 'https' else 'false'}"]
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        opts += [f"KEY_ID '{os.environ['AWS_ACCESS_KEY_ID']}'", f"SECRET '{os.environ['AWS_SECRET_ACCESS_KEY']}'"]
    con.sql(f"CREATE SECRET fleet (TYPE s3, {', '.join(opts)})")
    where = ""
    if jobs:
        where = "WHERE job_id IN (" + ", ".join("'" + j.replace("'", "''") + "'" for j in jobs) + ")"
    per_day = con.sql(PER_DAY.format(bucket=bucket, where=where)).fetchall()
    sums = {}
    for day, a, c, n, g, f, net in per_day:
        t = sums.setdefault((a, c), [0, Decimal(0), Decimal(0), Decimal(0)])
        t[0] += n
        t[1] += g
        t[2] += f
        t[3] += net
    types = con.sql(f"DESCRIBE SELECT * FROM read_parquet('s3://{bucket}/tables/v2/accounts/*/*.parquet', hive_partitioning = true)").fetchall()
    return {
        "types": {name: ty for name, ty, *_ in types},
        "per_day": [[str(d), a, c, str(n), str(g), str(f), str(net)] for d, a, c, n, g, f, net in per_day],
        "accounts": sorted([a, c, *map(str, t)] for (a, c), t in sums.items()),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bucket", required=True)
    p.add_argument("--jobs", default="", help="only these jobs (comma-separated ids)")
    p.add_argument("--no-duckdb", action="store_true")
    a = p.parse_args()
    jobs = [j for j in a.jobs.split(",") if j]
    out = {"pyarrow": pyarrow_read(a.bucket, jobs)}
    if not a.no_duckdb:
        out["duckdb"] = duckdb_read(a.bucket, jobs)
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
