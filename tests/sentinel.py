"""A Redis primary, a replica and three sentinels on free ports: the
smallest deployment that survives the loss of its primary."""

import subprocess
from pathlib import Path

import redis
from infergate.base.ports import free_port
from infergate.redis_server import RedisServer, find_redis_server

from tests.helpers import wait_for

SERVICE = "infergate"


class SentinelSet:
    def __init__(self, tmp: Path, down_after_ms: int = 1000) -> None:
        self.primary = RedisServer().start()
        self.replica = RedisServer(
            args=("--replicaof", "127.0.0.1", str(self.primary.port))
        ).start()
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen[bytes]] = []
        for i, port in enumerate(self.sentinel_ports):
            conf = tmp / f"sentinel-{i}.conf"  # a sentinel rewrites its own file
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {tmp}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary.port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n"
                f"sentinel failover-timeout {SERVICE} 10000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            self.sentinels.append(
                subprocess.Popen(
                    [find_redis_server(), str(conf), "--sentinel"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        self.url = (
            "redis+sentinel://"
            + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
            + f"/{SERVICE}/0"
        )
        wait_for(self.replicating, 20, "the replica to sync")
        wait_for(self.sentinels_agree, 30, "the sentinels to find the replica and each other")

    def replicating(self) -> bool:
        info = self._client(self.replica.port).info("replication")
        return bool(info.get("master_link_status") == "up")

    def sentinels_agree(self) -> bool:
        for port in self.sentinel_ports:
            try:
                state = self._client(port).sentinel_master(SERVICE)
            except redis.RedisError:
                return False
            if int(state["num-slaves"]) < 1 or int(state["num-other-sentinels"]) < 2:
                return False
        return True

    def primary_port(self) -> int:
        """The port of the primary as the sentinels see it now."""
        _, port = self._client(self.sentinel_ports[0]).sentinel_get_master_addr_by_name(SERVICE)
        return int(port)

    def client(self) -> redis.Redis:
        """A client of the current primary."""
        return self._client(self.primary_port())

    @staticmethod
    def _client(port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)

    def close(self) -> None:
        for proc in self.sentinels:
            proc.terminate()
        for proc in self.sentinels:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.replica.close()
        self.primary.close()
