"""``tokenmill export prometheus-rules|grafana``: the rule table as Prometheus alerting rules,
and a Grafana dashboard over the same ``tokenmill_`` metrics.

The root ``tokenmill`` command finds :data:`app` here by name and imports this module for help
too: the rule table (and with it DuckDB) is imported when a command runs. Bad input (an
unwritable ``--out``, a bad label or metric name) prints one ``error:`` line, exit 2.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from tokenmill.telemetry.cli import fail

app = typer.Typer(
    help="Export the rule table as Prometheus alerting rules, or a Grafana dashboard.",
    no_args_is_help=True,
    add_completion=False,
)

OutOption = Annotated[
    Path | None,
    typer.Option("--out", "-o", help="The file to write (default: standard output)."),
]


def _write(text: str, out: Path | None) -> None:
    """``text`` to ``out``, or to stdout; an unwritable path is one ``error:`` line, exit 2."""
    if out is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as exc:
        fail(f"cannot write {out}: {exc.strerror or exc}")


@app.command("prometheus-rules")
def prometheus_rules(
    out: OutOption = None,
    runbook_base_url: Annotated[
        str,
        typer.Option(
            help="Prefix of each alert's runbook_url (e.g. https://github.com/ORG/tokenmill/"
            "blob/main/); default: the repository path runbooks/<rule_id>.md.",
        ),
    ] = "",
    group_by: Annotated[
        str,
        typer.Option(
            metavar="LABELS",
            help="Comma-separated labels every series is aggregated by (add instance for "
            "per-replica alerts).",
        ),
    ] = "model_name",
    client_ttft_metric: Annotated[
        str | None,
        typer.Option(
            metavar="NAME",
            help="A scraped client-side TTFT histogram in seconds, carrying the --group-by "
            "labels: exports the client/server TTFT gap alert too.",
        ),
    ] = None,
    findings: Annotated[
        bool,
        typer.Option(
            "--findings/--no-findings",
            help="Also write the tokenmill-findings group: an alert per rule that fires while "
            "the live diagnosis loop holds its finding open (tokenmill_finding_active == 1), "
            "per instance.",
        ),
    ] = True,
) -> None:
    """Write Prometheus alerting rules for the rules the tokenmill_ metrics can express.

    Exported: TTFT up with ITL flat (queueing), TTFT up from a slow prefill, KV pressure with preemptions, overload (queue growth), KV blocks held while idle, an error spike, and the client/server TTFT gap when --client-ttft-metric names a client-side histogram. Each alert carries its rule_id and a severity, links its runbook and uses the rule table's own thresholds.

    Not exported: the rules that read per-request or per-step rows only the trace store holds (prompt lengths, step make-up, block hashes, throttle reasons, the engine's config); run tokenmill diagnose on a dump for those. The file's header comment lists both sets. Check it with promtool check rules.

    Findings (a third group, unless --no-findings): for every rule, TokenmillFinding<Rule> (e.g. TokenmillFindingTtftQueueing) fires while the live diagnosis loop of a serve, proxy or collect holds that rule's finding open, and resolves when the loop resolves it; one alert per instance, labelled rule_id and source=live_diagnosis, with the severity the loop graded; the finding's evidence is at GET /v1/findings on that instance.
    """

    from .alerts import ExportError, Options, render

    labels = tuple(x.strip() for x in group_by.split(",") if x.strip())
    opts = Options(
        runbook_base_url=runbook_base_url,
        group_by=labels,
        client_ttft_metric=client_ttft_metric,
        findings=findings,
    )
    try:
        text = render(opts)
    except ExportError as exc:
        fail(str(exc))
    _write(text, out)


@app.command("grafana")
def grafana(
    out: OutOption = None,
    title: Annotated[str, typer.Option(help="The dashboard's title.")] = "tokenmill Overview",
) -> None:
    """Write a Grafana dashboard (JSON) over the tokenmill_ metrics: the console's Overview.

    TTFT and ITL p50/p99, throughput, error rate, KV usage, running and waiting requests, queue and prefill time against TTFT, preemptions, errors by type, prefix-cache hits and the firing tokenmill alerts; variables for the Prometheus data source and model_name.
    """

    from .grafana import render

    _write(render(title), out)
