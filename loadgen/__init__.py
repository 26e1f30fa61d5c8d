"""splitserve.loadgen: the user-facing benchmark, ``splitserve bench serve|compare``.

Workloads (``workloads``), an open-loop load against any OpenAI-compatible server
(``serve``), its metrics (``metrics``: TTFT, TPOT, ITL, goodput) and plots
(``plots``), several setups side by side (``compare``), and the profile a
cluster's planner is fitted to (``profiling``, for ``splitserve plan``). The
studies in ``splitserve.bench`` use it; it imports nothing from them.
"""
