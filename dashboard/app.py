"""The console's entry script (``streamlit run``; ``tokenmill dashboard`` starts it).

Draws the shared sidebar (source, time window, SLOs), leaves the page context in
``st.session_state["tm_ctx"]`` and runs the page picked in the navigation.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from tokenmill.dashboard import ui
from tokenmill.dashboard.source import from_env, is_url

# not "pages/": a folder of that name beside the script puts Streamlit in its older MPA mode
VIEWS = Path(__file__).parent / "views"

st.set_page_config(page_title="tokenmill console", page_icon="⚙", layout="wide")
# a live source opens on Now (its open findings); a file on Overview, Now after Diagnosis
live = is_url(from_env()[0] or "")
now = st.Page(VIEWS / "now.py", title="Now", icon=":material/notifications_active:", default=live)
nav = st.navigation(
    [
        *([now] if live else []),
        st.Page(
            VIEWS / "overview.py", title="Overview", icon=":material/monitoring:", default=not live
        ),
        st.Page(VIEWS / "requests.py", title="Requests", icon=":material/list:"),
        st.Page(VIEWS / "engine.py", title="Engine", icon=":material/memory:"),
        st.Page(VIEWS / "devices.py", title="Devices", icon=":material/developer_board:"),
        st.Page(VIEWS / "errors.py", title="Errors", icon=":material/error:"),
        st.Page(VIEWS / "diagnosis.py", title="Diagnosis", icon=":material/troubleshoot:"),
        *([] if live else [now]),
        st.Page(VIEWS / "compare.py", title="Compare", icon=":material/compare_arrows:"),
        st.Page(VIEWS / "whatif.py", title="What if", icon=":material/query_stats:"),
    ]
)
st.session_state["tm_ctx"] = ui.sidebar()
nav.run()
