"""``tokenmill proxy``: an OpenAI-compatible front for any upstream serving engine, observed
as tokenmill observes its own (a request row and a trace per request)."""
