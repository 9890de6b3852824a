"""``tokenmill diagnose --baseline BEFORE AFTER [--fail-on-regression PCT]``: open both dumps,
compare them (:mod:`.compare`), print the report (:mod:`.compare_report`).

Exit codes: 0 the report was printed (no regression, or the runs were not comparable: the
report says so and does not gate, because a traffic or host difference is no evidence against
the engine; the JSON's ``verdict`` lets a stricter gate fail on ``not_comparable``); 1 with
``--fail-on-regression PCT``, the runs were comparable and a gated metric is worse by more than
PCT %; 2 bad input (one ``error:`` line: a missing or foreign file, a dump of another schema
version, an empty dump, more than one AFTER).
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from rich.console import Console


def run_compare(
    baseline: Path | None,
    after: Path | list[Path] | None,
    *,
    db: Path | None = None,
    url: str | None = None,
    api_key: str | None = None,
    since: str | None = None,
    window: str = "10s",
    fmt: str = "text",
    fail_on: str | None = None,
    fail_on_regression: float | None = None,
    console: Console | None = None,
) -> int:
    """Compare BEFORE (``baseline``) with AFTER (one dump, ``--db`` or ``--url``); returns the
    exit code. ``since`` cuts each dump to its own last 30s/10m/… (counted from its latest
    row); ``window`` is the diagnoses' signal window.

    Raises:
        DiagnoseInputError: bad flags or input (one line).
    """
    import duckdb

    from tokenmill.telemetry.dump import (
        DumpError,
        duration_ns,
        latest_ns,
        open_dump,
        parse_duration,
    )

    from .cli import DiagnoseInputError, _fetch
    from .compare import DEFAULT_REGRESSION_PCT, CompareError, compare, measure
    from .compare_report import print_text, to_json, to_markdown
    from .signals import NoTraffic

    console = console or Console(emoji=False)
    if baseline is None:
        raise DiagnoseInputError("--fail-on-regression needs --baseline BEFORE")
    afters = [after] if isinstance(after, Path) else list(after or [])
    if len(afters) > 1:
        raise DiagnoseInputError(
            f"with --baseline give exactly one AFTER dump, not {len(afters)} (a fleet compares "
            "one replica at a time)"
        )
    if sum(x is not None for x in (afters[0] if afters else None, db, url)) != 1:
        raise DiagnoseInputError("with --baseline give exactly one AFTER: DUMP, --db or --url")
    if fail_on is not None:
        raise DiagnoseInputError(
            "--fail-on gates a diagnosis; with --baseline use --fail-on-regression PCT"
        )
    if fmt not in ("text", "json", "markdown"):
        raise DiagnoseInputError(f"--format must be text, json or markdown, not {fmt!r}")
    if fail_on_regression is not None and not fail_on_regression >= 0:
        raise DiagnoseInputError(
            f"--fail-on-regression must be 0 or more, not {fail_on_regression}"
        )
    try:
        window_s = parse_duration(window)
        since_d = duration_ns(since) if since is not None else None
    except ValueError as exc:
        raise DiagnoseInputError(f"--window/--since: {exc}") from None

    with contextlib.ExitStack() as stack:
        if url is not None:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "live.duckdb"
            _fetch(url, tmp, api_key=api_key)
            after_path, after_label = tmp, url
        else:
            after_path = afters[0] if afters else db
            after_label = str(after_path)
        runs = []
        for role, path, label in (
            ("--baseline", baseline, str(baseline)),
            ("AFTER", after_path, after_label),
        ):
            try:
                con = open_dump(path, verify=False)
            except DumpError as exc:
                raise DiagnoseInputError(f"{role}: {exc}") from None
            stack.callback(con.close)
            try:
                since_ns = latest_ns(con) - since_d if since_d else None
                runs.append(measure(con, label=label, since_ns=since_ns, window_s=window_s))
            except (CompareError, NoTraffic) as exc:
                raise DiagnoseInputError(f"{role} {label}: {exc}") from None
            except duckdb.Error as exc:
                msg = str(exc).strip()
                first = msg.splitlines()[0] if msg else type(exc).__name__
                raise DiagnoseInputError(
                    f"{role} {label}: cannot read the store ({first})"
                ) from None
    threshold = DEFAULT_REGRESSION_PCT if fail_on_regression is None else fail_on_regression
    comparison = compare(runs[0], runs[1], threshold_pct=threshold)
    if fmt == "json":
        text = to_json(comparison)
        console.print_json(text) if console.is_terminal else print(text)
    elif fmt == "markdown":
        print(to_markdown(comparison), end="")
    else:
        print_text(comparison, console)
    return 1 if fail_on_regression is not None and comparison.verdict == "regression" else 0
