#!/usr/bin/env bash
# Makes (once) the Python environment of the warehouse's readers (pyarrow, DuckDB with httpfs, all
# from PyPI) and prints its python's path. WAREHOUSE_VENV overrides where it lives.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
venv=${WAREHOUSE_VENV:-$HOME/.cache/billing-fleet/warehouse-venv}
stamp="$venv/.requirements"
if ! cmp -s "$here/requirements.txt" "$stamp" 2>/dev/null; then
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$here/requirements.txt" >&2
  # DuckDB's httpfs from its PyPI package into DuckDB's extension directory (no download at run time).
  "$venv/bin/python" -c 'import duckdb_extensions; duckdb_extensions.import_extension("httpfs")' >&2
  cp "$here/requirements.txt" "$stamp"
fi
echo "$venv/bin/python"
