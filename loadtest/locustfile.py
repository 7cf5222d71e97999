"""Locust users for infergate: 70% free, 25% paid, 5% enterprise, each with
its tier's key from the JSON file that ``infergate up --keys-out`` writes.

    INFERGATE_KEYS=keys.json locust -f loadtest/locustfile.py --host http://127.0.0.1:8000

Locust is closed-loop (each user waits for its answer); for latency under a
fixed arrival rate use ``python -m loadtest.bench``.
"""

import itertools
import json
import os
from typing import Any

from locust import HttpUser, between, task

_KEYS: dict[str, str] = json.loads(open(os.environ.get("INFERGATE_KEYS", "keys.json")).read())  # noqa: SIM115
_counter = itertools.count()


class _TierUser(HttpUser):
    abstract = True
    tier = "free"
    wait_time = between(0.05, 0.2)

    def on_start(self) -> None:
        self.headers = {"Authorization": "Bearer " + _KEYS[self.tier]}

    @task
    def infer(self) -> None:
        text = f"locust-{self.tier}-{next(_counter)}"
        with self.client.post(
            "/v1/inference",
            json={"input": text},
            headers=self.headers,
            name=f"/v1/inference [{self.tier}]",
            catch_response=True,
        ) as resp:
            body: dict[str, Any] = resp.json() if resp.content else {}
            if resp.status_code == 200 and text not in body.get("output", ""):
                resp.failure("the output does not belong to this request")
            elif resp.status_code != 200:
                resp.failure(f"{resp.status_code} {body.get('error', {}).get('code', '')}")


class FreeUser(_TierUser):
    tier = "free"
    weight = 70


class PaidUser(_TierUser):
    tier = "paid"
    weight = 25


class EnterpriseUser(_TierUser):
    tier = "enterprise"
    weight = 5
