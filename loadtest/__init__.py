"""Load tests: an open-loop benchmark (``python -m loadtest.bench``) and a
locustfile (``locust -f loadtest/locustfile.py``)."""
