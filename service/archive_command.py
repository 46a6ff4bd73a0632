"""`foreshock archive compact|prune`: merge the archive's small files, drop its old dates.

The work is service/archive_maintenance.py's; this is the command an operator's cron job runs, configured
like every command (`[archive]` in the TOML config,
FORESHOCK_ARCHIVE_<KEY>, flags; foreshock/config.py). docs/service.md, "The archive", has both.
"""

from __future__ import annotations

import sys

from foreshock import config
from foreshock.service.command import ARCHIVE_CHECKS
from foreshock.service.command import DEFAULTS as SERVE_DEFAULTS

KEEP_DAYS_MAX = 36_500

# `archive` and `file_bytes` default to [serve]'s archive and archive_file_bytes (_settings): a config
# file names the archive and its file size once for the service and its cron jobs.
DEFAULTS = {
    "archive": "",                 # the archive's directory or URI, as `foreshock serve --archive` writes it
    "file_bytes": SERVE_DEFAULTS["archive_file_bytes"],   # the size compacted files are grouped to
    "settle_seconds": 3600.0,      # a date is compacted once it ended this long ago (UTC): late rows are in
    "keep_days": 0,                # a date is dropped once all its rows are older than this; 0: kept forever
    "table_keep_days": [],         # TABLE=DAYS for a table kept otherwise (incidents=0, decisions=365)
}
CHECKS = {
    "file_bytes": ARCHIVE_CHECKS["archive_file_bytes"],
    "settle_seconds": config.between(0, 30 * 86_400),
    "keep_days": config.between(0, KEEP_DAYS_MAX),
}


def register(subparsers) -> None:
    p = subparsers.add_parser("archive", help="compact and prune the archive of `foreshock serve --archive`",
                              description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="archive_command", metavar="SUBCOMMAND")
    c = sub.add_parser("compact", help="merge the small files of each closed date into files of --file-bytes")
    p_ = sub.add_parser("prune", help="drop the dates older than the days each table keeps")
    for q in (c, p_):
        q.add_argument("--archive", metavar="DIR_OR_URI",
                       help="the archive (default: [serve] archive of the config file)")
        q.add_argument("--dry-run", action="store_true", help="say what it would do, and do nothing")
    c.add_argument("--file-bytes", type=int,
                   help="size of the compacted files (default: [serve] archive_file_bytes, 128 MiB)")
    c.add_argument("--settle-seconds", type=float,
                   help="compact a date once it ended this long ago, UTC (3600)")
    p_.add_argument("--keep-days", type=int, help="drop a date once all its rows are older than this (0: never)")
    p_.add_argument("--table-keep-days", metavar="TABLE=DAYS", action="append",
                    help="days kept for one table instead of --keep-days (repeatable; 0: forever)")
    c.set_defaults(run=run_compact)
    p_.set_defaults(run=run_prune)


def _settings(args, file_data) -> dict:
    serve = config.resolve("serve", SERVE_DEFAULTS, file_data=file_data)
    defaults = {**DEFAULTS, "archive": serve["archive"], "file_bytes": serve["archive_file_bytes"]}
    flags = {k: getattr(args, k, None) for k in DEFAULTS}
    cfg = config.resolve("archive", defaults, file_data=file_data, flags=flags, checks=CHECKS)
    if not cfg["archive"]:
        raise config.ConfigError("archive: none given (--archive DIR_OR_URI, or archive in [archive] or [serve])")
    return cfg


def table_keep_days(items: list[str], tables) -> dict[str, int]:
    """TABLE=DAYS items -> {table: days}; ConfigError naming the item that is not one."""
    out: dict[str, int] = {}
    for item in items:
        table, sep, days = item.partition("=")
        table = table.strip()
        if not sep or table not in tables:
            raise config.ConfigError(f"table_keep_days {item!r}: must be TABLE=DAYS, TABLE one of "
                                     f"{', '.join(sorted(tables))}")
        try:
            n = int(days)
        except ValueError:
            n = -1
        if not 0 <= n <= KEEP_DAYS_MAX:
            raise config.ConfigError(f"table_keep_days {item!r}: DAYS must be a whole number in [0, {KEEP_DAYS_MAX}]")
        if table in out:
            raise config.ConfigError(f"table_keep_days {item!r}: table {table} given twice")
        out[table] = n
    return out


def _said(summary, dry_run: bool, what: str) -> str:
    s = summary
    line = (f"foreshock archive {what}{' (dry run)' if dry_run else ''}: {s.dates} dates, "
            f"{s.files_before} files")
    if what == "compact":
        line += f" -> {s.files_after}"
    line += f", {s.bytes_before / (1 << 20):,.1f} MiB"
    if what == "compact":
        line += f" -> {s.bytes_after / (1 << 20):,.1f} MiB"
    line += f" in {s.seconds:.2f} s"
    if s.finished or s.undone:
        line += f"; interrupted compactions finished {s.finished}, undone {s.undone}"
    if s.errors:
        line += f"; {s.errors} failed (the log names them)"
    return line


def _finish(summary, dry_run: bool, what: str) -> int:
    for skipped in summary.skipped:
        print(f"foreshock archive {what}: left {skipped}", file=sys.stderr)
    print(_said(summary, dry_run, what), flush=True)
    return 1 if summary.errors else 0


def run_compact(args, file_data) -> int:
    import pyarrow as pa

    from foreshock.service.archive_maintenance import MaintenanceError, compact

    cfg = _settings(args, file_data)
    try:
        summary = compact(cfg["archive"], file_bytes=cfg["file_bytes"], settle_seconds=cfg["settle_seconds"],
                          dry_run=args.dry_run)
    except MaintenanceError as exc:
        print(f"foreshock archive compact: {exc}", file=sys.stderr)
        return 2
    except (OSError, pa.ArrowException) as exc:   # storage that fails while the dates are listed
        print(f"foreshock archive compact: archive {cfg['archive']!r}: {exc}", file=sys.stderr)
        return 1
    return _finish(summary, args.dry_run, "compact")


def run_prune(args, file_data) -> int:
    import pyarrow as pa

    from foreshock import schema as sch
    from foreshock.service.archive import DECISIONS
    from foreshock.service.archive_maintenance import MaintenanceError, prune

    cfg = _settings(args, file_data)
    per_table = table_keep_days(cfg["table_keep_days"], {*sch.TABLES, DECISIONS})
    if not cfg["keep_days"] and not any(per_table.values()):
        print("foreshock archive prune: nothing to drop: keep_days is 0 (keep forever) and no table_keep_days "
              "sets days", flush=True)
        return 0
    try:
        summary = prune(cfg["archive"], keep_days=cfg["keep_days"], table_keep_days=per_table, dry_run=args.dry_run)
    except MaintenanceError as exc:
        print(f"foreshock archive prune: {exc}", file=sys.stderr)
        return 2
    except (OSError, pa.ArrowException) as exc:   # storage that fails while the dates are listed
        print(f"foreshock archive prune: archive {cfg['archive']!r}: {exc}", file=sys.stderr)
        return 1
    return _finish(summary, args.dry_run, "prune")
