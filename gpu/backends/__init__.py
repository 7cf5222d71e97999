"""The backends a worker can run: in its own process (``simulated``,
``transformers``, the team's ``python:`` code) or a server it calls with
the whole batch (``http:``, ``kserve-v2:``, ``openai:``). The worker's
command makes the one a spec names (``cli/serving.py``)."""
