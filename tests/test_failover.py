"""Redis Sentinel: a real failover under load. A primary, a replica and
three sentinels; the stack reaches Redis only through the sentinels; the
primary is killed with SIGKILL while requests flow. Service resumes on the
promoted replica by itself, no request waits past its deadline, every 200
carries its own output, and the lists are clean afterwards. The requests
that failed across the failover are counted and printed (run with -s)."""

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import aiohttp
from infergate.gpu.backends.simulated import sim_output

from tests.helpers import SECRETS, Cluster, assert_redis_clean, policy_yaml, redis_clean, wait_for
from tests.sentinel import SentinelSet

DEADLINE_MS = 3_000
RATE = 100
DURATION_S = 14.0
KILL_AT_S = 4.0


async def drive(urls: list[str], kill: object) -> tuple[list[dict], float]:
    records: list[dict] = []
    headers = {"Authorization": "Bearer " + SECRETS["paid"]}
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=1000), timeout=aiohttp.ClientTimeout(total=15)
    ) as session:

        async def one(i: int) -> None:
            text = f"failover-{i}"
            rec: dict = {"i": i, "text": text, "sent": time.monotonic()}
            try:
                async with session.post(
                    urls[i % len(urls)] + "/v1/inference", json={"input": text}, headers=headers
                ) as r:
                    rec["status"], rec["body"] = r.status, await r.json()
            except (aiohttp.ClientError, TimeoutError) as exc:
                rec["status"], rec["error"] = None, type(exc).__name__
            rec["took"] = time.monotonic() - rec["sent"]
            records.append(rec)

        start = time.monotonic()
        killed_at = 0.0
        tasks = []
        for i in range(int(RATE * DURATION_S)):
            due = start + i / RATE
            if not killed_at and due - start >= KILL_AT_S:
                killed_at = time.monotonic()
                await asyncio.to_thread(kill)  # type: ignore[arg-type]
            await asyncio.sleep(max(0.0, due - time.monotonic()))  # pacing: open-loop sends
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    return records, killed_at


def test_a_sentinel_failover_under_load(tmp_path: Path) -> None:
    redis_set = SentinelSet(tmp_path)
    cluster = None
    try:
        old_primary = redis_set.primary_port()
        cluster = Cluster(
            tmp_path, redis_set.url, policy_yaml(deadline_ms=DEADLINE_MS), gateways=2, workers=2
        )
        records, killed_at = asyncio.run(drive(cluster.urls, redis_set.primary.kill))
        assert redis_set.primary_port() != old_primary  # the replica was promoted

        after = [r for r in records if r["sent"] >= killed_at]
        ok_after = [r["sent"] - killed_at for r in after if r["status"] == 200]
        resumed_s = min(ok_after) if ok_after else None
        failed = [r for r in records if r["status"] != 200]
        report = {
            "sent": len(records),
            "statuses": dict(Counter(str(r["status"]) for r in records)),
            "failed": len(failed),
            "failed_codes": dict(Counter((r.get("body") or {}).get("error", {}).get("code", r.get("error")) for r in failed)),
            "resumed_after_kill_s": round(resumed_s, 2) if resumed_s is not None else None,
            "last_failure_after_kill_s": round(max((r["sent"] - killed_at for r in failed), default=0.0), 2),
            "slowest_s": round(max(r["took"] for r in records), 2),
        }  # fmt: skip
        print("\nfailover:", json.dumps(report))

        # Service resumed by itself, within seconds, and stayed up.
        assert resumed_s is not None, report
        assert resumed_s < 15, report
        late = [r for r in after if r["sent"] - killed_at > resumed_s + 5]
        assert late, report
        assert all(r["status"] == 200 for r in late), report
        # Nothing waited past its deadline; every failure was an explicit answer.
        assert max(r["took"] for r in records) < DEADLINE_MS / 1000 + 1.5, report
        assert all(r["status"] in (200, 503, 504) for r in records), report
        for r in records:
            if r["status"] == 200:
                assert r["body"]["output"] == sim_output(r["text"])
        # Before the kill, nothing failed.
        assert all(r["status"] == 200 for r in records if r["sent"] < killed_at - 0.5), report
        client = redis_set.client()
        wait_for(lambda: redis_clean(client), 15, "the lists to empty")
        assert_redis_clean(client)
    finally:
        if cluster is not None:
            cluster.stop()
        redis_set.close()
