"""``infergate usage``: what each key used (GET /v1/admin/usage), or with
``--budgets`` each key's budgets spent and left (GET /v1/admin/budgets), as
a table, CSV (for billing) or the endpoint's JSON.

Reads a gateway's endpoint with an admin key (``--admin-key``, or the
``INFERGATE_ADMIN_KEY`` environment variable, so the secret stays out of the
process list), and prints one line per key (or per key and hour or day),
most first.
"""

import argparse
import csv
import io
import json
import os
import signal
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

# The whole call, however slowly a server answers; and the most it may send.
DEADLINE_S = 30
MAX_BYTES = 16 * 1024 * 1024

COLUMNS = (
    ("key_id", "KEY"),
    ("tier", "TIER"),
    ("requests", "REQUESTS"),
    ("input_chars", "INPUT CHARS"),
    ("input_tokens", "IN TOKENS"),
    ("output_tokens", "OUT TOKENS"),
    ("gpu_ms", "GPU MS"),
    ("refused", "REFUSED"),
)
PERIOD = ("period", "PERIOD")
BUDGET_COLUMNS = (
    ("key_id", "KEY"),
    ("tier", "TIER"),
    ("unit", "UNIT"),
    ("period", "PERIOD"),
    ("budget", "BUDGET"),
    ("spent", "SPENT"),
    ("left", "LEFT"),
    ("ends", "ENDS"),
)
FORMATS = ("table", "csv", "json")


def add_parser(sub: Any) -> None:
    usage = sub.add_parser(
        "usage", help="what each key used: requests, characters, tokens, GPU time, refusals"
    )
    usage.add_argument("--url", default="http://127.0.0.1:8000", help="a gateway")
    usage.add_argument("--admin-key", default=None, help="default: $INFERGATE_ADMIN_KEY")
    usage.add_argument("--key-id", default=None, help="one key only")
    usage.add_argument(
        "--since", default=None, help="epoch seconds or ISO 8601 (default: a day ago)"
    )
    usage.add_argument(
        "--sort",
        default="gpu_ms",
        help="gpu_ms, requests, input_chars, input_tokens, output_tokens or refused (most first)",
    )
    usage.add_argument(
        "--by",
        default="all",
        choices=("all", "hour", "day"),
        help="a row per key, or per key and hour or UTC day (for billing)",
    )
    usage.add_argument(
        "--format", default="table", choices=FORMATS, help="table, csv, or the endpoint's JSON"
    )
    usage.add_argument(
        "--budgets",
        action="store_true",
        help="each key's budgets in their current periods: spent and left",
    )
    # (the flag before --format: the same as --format json)
    usage.add_argument("--json", action="store_true", help=argparse.SUPPRESS)


def run(args: Any) -> int:
    secret = args.admin_key or os.environ.get("INFERGATE_ADMIN_KEY")
    if not secret:
        print(
            "infergate usage: give an admin key (--admin-key or INFERGATE_ADMIN_KEY)",
            file=sys.stderr,
        )
        return 2
    query = {} if args.budgets else {"sort": args.sort, "by": args.by}
    query |= {k: v for k, v in (("key_id", args.key_id), ("since", args.since)) if v}
    path = "/v1/admin/budgets?" if args.budgets else "/v1/admin/usage?"
    url = args.url.rstrip("/") + path + urllib.parse.urlencode(query)
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {secret}"})
    # (a redirect is not followed: it would carry the admin key to wherever it points)
    opener = urllib.request.build_opener(_NoRedirect)
    signal.signal(signal.SIGALRM, _too_slow)
    signal.alarm(DEADLINE_S)
    try:
        with opener.open(request, timeout=10) as response:
            body = response.read(MAX_BYTES + 1)
        if len(body) > MAX_BYTES:
            raise ValueError(f"the answer is over {MAX_BYTES} bytes")
        report = _report(json.loads(body))
    except urllib.error.HTTPError as exc:
        where = (
            f" (to {exc.headers.get('Location')!r}, not followed)" if 300 <= exc.code < 400 else ""
        )
        print(f"infergate usage: {exc.code} {_message(exc.read(4096))}{where}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError, ValueError, RecursionError) as exc:
        print(f"infergate usage: cannot read {args.url}: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.alarm(0)
    periodic = args.by != "all"
    if args.json or args.format == "json":
        print(json.dumps(report, indent=2))
    elif args.budgets:
        rows = report["keys"] if args.format == "csv" else [_to_ms(row) for row in report["keys"]]
        title = f"budgets at {report.get('at')}"
        text = _csv(BUDGET_COLUMNS, rows) if args.format == "csv" else None
        print(text or _table(title, BUDGET_COLUMNS, rows, 4, "(no key has a budget)"))
    elif args.format == "csv":
        print(as_csv(report, periodic))
    else:
        print(table(report, periodic))
    return 0


def _too_slow(signum: int, frame: object) -> None:
    raise TimeoutError(f"no whole answer within {DEADLINE_S} s")


def _report(value: Any) -> dict[str, Any]:
    """The endpoint's answer, or ValueError if it is not one."""
    if not (isinstance(value, dict) and isinstance(value.get("keys"), list)):
        raise ValueError("not a usage report")
    if not all(isinstance(row, dict) for row in value["keys"]):
        raise ValueError("not a usage report")
    return value


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def table(report: dict[str, Any], periodic: bool = False) -> str:
    columns = (PERIOD, *COLUMNS) if periodic else COLUMNS
    title = f"usage from {report.get('since')} to {report.get('until')}"
    left = 3 if periodic else 2  # (the names left-aligned, the numbers right)
    return _table(title, columns, report.get("keys", []), left, "(no usage in that time)")


def _table(
    title: str,
    columns: tuple[tuple[str, str], ...],
    report_rows: list[dict[str, Any]],
    left: int,
    empty: str,
) -> str:
    """A title, then the columns' heads and a line a row: the first
    ``left`` columns left-aligned, the rest right."""
    rows = [[_cell(row.get(field)) for field, _ in columns] for row in report_rows]
    heads = [head for _, head in columns]
    widths = [max(len(c) for c in col) for col in zip(heads, *rows, strict=False)]
    lines = [title]
    for cells in [heads, *rows]:
        lines.append(
            "  ".join(
                c.ljust(w) if i < left else c.rjust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            ).rstrip()
        )
    if not rows:
        lines.append(empty)
    return "\n".join(lines)


def as_csv(report: dict[str, Any], periodic: bool = False) -> str:
    """One line per row, the fields' names first (with a period first when
    ``periodic``); numbers as they are, and a text that a spreadsheet would
    run as a formula quoted with a ' first."""
    columns = (PERIOD, *COLUMNS) if periodic else COLUMNS
    return _csv(columns, report.get("keys", []))


def _csv(columns: tuple[tuple[str, str], ...], rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([field for field, _ in columns])
    for row in rows:
        writer.writerow([_csv_cell(row.get(field)) for field, _ in columns])
    return out.getvalue().rstrip("\n")


def _to_ms(row: dict[str, Any]) -> dict[str, Any]:
    """A budget's row for the table: GPU seconds to the millisecond."""
    if row.get("unit") != "gpu_seconds":
        return row
    seconds = {k: row[k] for k in ("budget", "spent", "left") if isinstance(row.get(k), float)}
    return {**row, **{k: f"{v:,.3f}" for k, v in seconds.items()}}


def _csv_cell(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    text = "" if value is None else str(value)
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    # (never a control character to the terminal: a key id is anyone's text)
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(value))


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace")
