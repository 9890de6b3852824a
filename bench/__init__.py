"""``tokenmill bench``: an async streaming load generator for OpenAI-compatible servers.

Modules: :mod:`.workload` (what to send), :mod:`.phases` (when: phases and arrival times),
:mod:`.client` (sending and clocking), :mod:`.report` (metrics, table, JSON), :mod:`.record`
(client timings into a trace store), :mod:`.cli` (the command's logic).
"""
