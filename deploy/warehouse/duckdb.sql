-- The warehouse's tables in DuckDB, straight from S3 (its httpfs extension: `INSTALL httpfs` where
-- DuckDB may download it, or from PyPI with duckdb-extension-httpfs, see requirements.txt).
-- Credentials from the usual AWS chain (CREDENTIAL_CHAIN), or given as KEY_ID/SECRET.
-- Run: duckdb -c ".read deploy/warehouse/duckdb.sql" after replacing BUCKET.
LOAD httpfs;
CREATE OR REPLACE SECRET fleet (TYPE s3, PROVIDER credential_chain);
-- LocalStack instead: CREATE OR REPLACE SECRET fleet (TYPE s3, KEY_ID 'test', SECRET 'test',
--   REGION 'us-east-1', ENDPOINT 'localhost:4566', URL_STYLE 'path', USE_SSL false);

CREATE OR REPLACE VIEW fleet_accounts AS
  SELECT * FROM read_parquet('s3://BUCKET/tables/v2/accounts/*/*.parquet', hive_partitioning = true);
CREATE OR REPLACE VIEW fleet_jobs AS
  SELECT * FROM read_parquet('s3://BUCKET/tables/v2/jobs/*/*.parquet', hive_partitioning = true);

-- Per account and currency, per day.
SELECT billed_on, account_id, currency,
       sum("count") AS transactions, sum(gross) AS gross, sum(fees) AS fees, sum(net) AS net
FROM fleet_accounts
GROUP BY ALL
ORDER BY ALL;
