-- The warehouse's two tables for Amazon Athena: external tables over the Parquet objects the
-- controllers write (tables/v2/{accounts,jobs}/billed_on=YYYY-MM-DD/{job}.parquet), with partition
-- projection, so a new day is queryable at once (no MSCK REPAIR, no crawler). Replace
-- s3://BUCKET/ with the fleet's bucket (`--bucket`, FLEET_BUCKET) and the start day with the day
-- of the first job.
--
-- Upgrading from the first tables (tables/accounts/, tables/jobs/, money at two places): drop them
-- first, `IF NOT EXISTS` would keep them as they were (dropping an external table keeps its data):
--   DROP TABLE IF EXISTS fleet_accounts; DROP TABLE IF EXISTS fleet_jobs;
-- then `initiator warehouse backfill` writes tables/v2/ for the earlier jobs from their reports.

CREATE EXTERNAL TABLE IF NOT EXISTS fleet_accounts (
  job_id      string,
  account_id  string,
  currency    string,
  `count`     bigint,
  gross       decimal(38,4),
  fees        decimal(38,4),
  net         decimal(38,4),
  status      string,
  finished_at timestamp
)
PARTITIONED BY (billed_on string)
STORED AS PARQUET
LOCATION 's3://BUCKET/tables/v2/accounts/'
TBLPROPERTIES (
  'projection.enabled' = 'true',
  'projection.billed_on.type' = 'date',
  'projection.billed_on.format' = 'yyyy-MM-dd',
  'projection.billed_on.range' = '2026-01-01,NOW',
  'projection.billed_on.interval' = '1',
  'projection.billed_on.interval.unit' = 'DAYS',
  'storage.location.template' = 's3://BUCKET/tables/v2/accounts/billed_on=${billed_on}/'
);

CREATE EXTERNAL TABLE IF NOT EXISTS fleet_jobs (
  job_id        string,
  status        string,
  submitted     bigint,
  accepted      bigint,
  rejected      bigint,
  processed     bigint,
  failed        bigint,
  duplicates    bigint,
  failed_chunks array<int>,
  requests      bigint,
  cost_usd      decimal(38,8),
  submitted_at  timestamp,
  finished_at   timestamp,
  files         array<string>,
  note          string,
  completes     string
)
PARTITIONED BY (billed_on string)
STORED AS PARQUET
LOCATION 's3://BUCKET/tables/v2/jobs/'
TBLPROPERTIES (
  'projection.enabled' = 'true',
  'projection.billed_on.type' = 'date',
  'projection.billed_on.format' = 'yyyy-MM-dd',
  'projection.billed_on.range' = '2026-01-01,NOW',
  'projection.billed_on.interval' = '1',
  'projection.billed_on.interval.unit' = 'DAYS',
  'storage.location.template' = 's3://BUCKET/tables/v2/jobs/billed_on=${billed_on}/'
);

-- Per account and currency, per day (a day's partition read alone when the WHERE names it).
SELECT billed_on, account_id, currency,
       sum("count") AS transactions, sum(gross) AS gross, sum(fees) AS fees, sum(net) AS net
FROM fleet_accounts
WHERE billed_on BETWEEN '2026-11-01' AND '2026-11-30'
GROUP BY billed_on, account_id, currency
ORDER BY billed_on, account_id, currency;

-- Fees per currency per day, billed jobs only once each: every job has one object per table.
SELECT billed_on, currency, sum(fees) AS fees
FROM fleet_accounts
GROUP BY billed_on, currency
ORDER BY billed_on, currency;
