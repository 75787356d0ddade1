"""Dispatch: the frozen tables of `tuning_db/`, bucket mapping, lookup and fallback.

Imports neither optuna nor torch: the runtime uses it on any host."""

from .buckets import BUCKET_FIELDS, LENGTHS, DocProfile, bucket_label, bucket_of, ceil_pow2, floor_pow2
from .defaults import Group, default_variants, group_key, plan_groups, spec_hashes
from .table import (TABLE_FORMAT, Decision, Dispatcher, TableError, decide, gpu_slug, installed_expectation,
                    load_table, lookup, table_path, untuned_table, write_table)

__all__ = ["BUCKET_FIELDS", "LENGTHS", "DocProfile", "bucket_label", "bucket_of", "ceil_pow2", "floor_pow2", "Group",
           "default_variants", "group_key", "plan_groups", "spec_hashes", "TABLE_FORMAT", "Decision", "Dispatcher",
           "TableError", "decide", "gpu_slug", "installed_expectation", "load_table", "lookup", "table_path",
           "untuned_table", "write_table"]
