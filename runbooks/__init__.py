"""One Markdown runbook per diagnosis rule (``<rule_id>.md``), shipped as package data."""
