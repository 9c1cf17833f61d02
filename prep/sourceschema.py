"""The source's own columns and their types, as a metadata.parquet records them.

The metadata stage reads only the columns it needs from a source (URL, caption, labels, id) into
one fixed schema, so the file alone cannot show that the source changed shape - a renamed or
retyped column, a new one. It therefore keeps the source's `[[name, Arrow type], ...]` in the
file's metadata under `SOURCE_COLUMNS_KEY`; the data-change report compares it night to night.
"""

# tested by: tests/prep/test_delta.py

from __future__ import annotations

import json

import pyarrow as pa

SOURCE_COLUMNS_KEY = b"clipms.source_columns"


def with_source_columns(table: pa.Table, source: pa.Schema) -> pa.Table:
    """`table` carrying the source's columns and types in its metadata."""
    columns = [[field.name, str(field.type)] for field in source]
    return table.replace_schema_metadata({SOURCE_COLUMNS_KEY: json.dumps(columns).encode()})


def source_columns(schema: pa.Schema) -> list[list[str]] | None:
    """The source's [[name, type], ...] a metadata file records (None: not recorded, e.g. a file
    written before they were)."""
    raw = (schema.metadata or {}).get(SOURCE_COLUMNS_KEY)
    return None if raw is None else json.loads(raw)


def kept_metadata(table: pa.Table) -> dict[bytes, bytes] | None:
    """The part of `table`'s metadata a metadata file keeps (the source's columns), or None."""
    kept = {k: v for k, v in (table.schema.metadata or {}).items() if k == SOURCE_COLUMNS_KEY}
    return kept or None
