"""tokenmill.dashboard: the Streamlit operations console over a trace store, a dump or a live
server (``tokenmill dashboard``). ``data`` holds every query; ``app.py`` and ``views/`` (the pages) draw."""
