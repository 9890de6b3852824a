"""tokenmill.diagnose: signals over the trace store, the rule set, findings and the report."""
